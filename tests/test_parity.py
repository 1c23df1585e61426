"""``engine-core parity``: same model, data and steps through several engines, with a verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_core.cli import main
from engine_core.errors import ConfigError
from engine_core.parity import ParityReport, write_report


def test_parity_passes_for_engines_that_agree(tmp_path: Path) -> None:
    out = tmp_path / "parity.json"
    code = main(["parity", "reference", "fsdp", "fsdp2", "--steps", "2", "--world-size", "2",
                 "--json", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["passed"] and report["baseline"] == "reference"
    assert report["world_size"] == 2
    for b in ("fsdp", "fsdp2"):
        assert len(report["losses"][b]) == len(report["grad_norms"][b]) == 2
        assert report["max_rel_loss_diff"][b] <= 1e-5
        assert report["max_abs_log_prob_diff_after"][b] <= 1e-5


BROKEN = ["parity", "reference", "example-bad-scaling", "--steps", "1", "--world-size", "2"]


@pytest.fixture(scope="module")
def broken_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """One run against the example engine that forgets DDP averages (half the grad norm on 2
    ranks): its exit code and its JSON report, shared by the tests that read or reuse them."""
    out = tmp_path_factory.mktemp("parity") / "parity.json"
    return main([*BROKEN, "--json", str(out)]), out


def test_parity_fails_for_a_broken_engine(broken_report: tuple[int, Path]) -> None:
    code, out = broken_report
    assert code == 1
    assert [p.name for p in out.parent.iterdir()] == ["parity.json"]  # no temporary file left
    report = json.loads(out.read_text())
    assert not report["passed"]
    assert report["max_rel_grad_norm_diff"]["example-bad-scaling"] == pytest.approx(0.5, rel=1e-3)
    # the first figure that diverged, and the usual cause of that pattern
    first = report["first_divergence"]["example-bad-scaling"]
    assert (first["step"], first["quantity"]) == (1, "grad norm")
    assert first["ratio"] == pytest.approx(0.5, rel=1e-3)
    assert "backward(loss * dp_size)" in first["cause"]
    assert "reference" not in report["first_divergence"]


def test_parity_runs_two_processes_by_default() -> None:
    import argparse
    import inspect

    from engine_core.cli import _parity_arguments
    from engine_core.parity import run_parity

    parser = argparse.ArgumentParser()
    _parity_arguments(parser)
    assert parser.parse_args(["reference", "fsdp"]).world_size == 2
    assert inspect.signature(run_parity).parameters["world_size"].default == 2


def _no_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("parity built models although its --json path was refused")


def test_an_existing_report_is_refused_before_any_model_is_built(
    broken_report: tuple[int, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, out = broken_report
    before = out.read_bytes()
    capsys.readouterr()
    monkeypatch.setattr("engine_core.parity.run_parity", _no_run)
    assert main([*BROKEN, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--json {out} already exists; pass --overwrite to replace it" in err, err
    assert len(err.strip().splitlines()) == 1
    assert out.read_bytes() == before


def test_an_unwritable_report_path_is_refused_before_any_model_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("engine_core.parity.run_parity", _no_run)
    blocked = tmp_path / "file"
    blocked.write_text("a file, not a folder")
    assert main([*BROKEN, "--json", str(blocked / "parity.json")]) == 2
    assert f"cannot write --json {blocked}/parity.json" in capsys.readouterr().err
    assert main([*BROKEN, "--json", str(tmp_path), "--overwrite"]) == 2
    assert f"--json {tmp_path} is a folder" in capsys.readouterr().err
    assert blocked.read_text() == "a file, not a folder"


def _report() -> ParityReport:
    report = ParityReport(["reference", "fsdp"], steps=1, world_size=1, micro_batch_size=None,
                          rtol=1e-5, atol_log_prob=1e-5)  # fmt: skip
    for b in report.backends:
        report.losses[b], report.grad_norms[b] = [2.5], [1.5]
        report.max_rel_loss_diff[b] = report.max_rel_grad_norm_diff[b] = 0.0
        report.max_abs_log_prob_diff_before[b] = report.max_abs_log_prob_diff_after[b] = 0.0
    return report


def test_overwrite_replaces_a_report_and_an_interrupted_write_keeps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "reports" / "parity.json"  # a missing folder is created
    write_report(_report(), out)
    with pytest.raises(ConfigError, match="already exists"):
        write_report(_report(), out)
    report = _report()
    report.losses["fsdp"] = [3.5]
    write_report(report, out, overwrite=True)
    assert json.loads(out.read_text())["losses"]["fsdp"] == [3.5]

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("engine_core.parity.os.replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_report(_report(), out, overwrite=True)
    assert json.loads(out.read_text())["losses"]["fsdp"] == [3.5]  # whole, and the old one
    assert [p.name for p in out.parent.iterdir()] == ["parity.json"]


def test_unknown_backend_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["parity", "reference", "no-such-engine"]) == 2
    err = capsys.readouterr().err
    assert "no-such-engine" in err and "fsdp2" in err


def test_report_prints_every_figure_whole_at_80_columns() -> None:
    from rich.console import Console

    from engine_core.parity import print_report

    backends = ["reference", "example-bad-scaling", "megatron", "fsdp2"]
    report = ParityReport(backends, steps=2, world_size=2, micro_batch_size=None, rtol=1e-5,
                          atol_log_prob=1e-5)  # fmt: skip
    for k, b in enumerate(backends):
        report.losses[b] = [2.77258872 + k, 123.45678901 + k]
        report.grad_norms[b] = [1234.56789012 + k, 0.00001234 + k]
        report.max_rel_loss_diff[b] = 1.5e-7 * (k + 1)
        report.max_rel_grad_norm_diff[b] = 0.5 * k
        report.max_abs_log_prob_diff_before[b] = 4.76e-7 * k
        report.max_abs_log_prob_diff_after[b] = 1.25e100 * k
    console = Console(width=80, record=True)
    print_report(report, console)
    out = console.export_text()
    assert max(map(len, out.splitlines())) <= 80
    figures = [f"{v:.8f}" for b in backends for v in (*report.losses[b], *report.grad_norms[b])]
    for b in backends[1:]:
        figures += [
            f"{getattr(report, field)[b]:.2e}"
            for field in ("max_rel_loss_diff", "max_rel_grad_norm_diff",
                          "max_abs_log_prob_diff_before", "max_abs_log_prob_diff_after")
        ]  # fmt: skip
    for figure in figures:
        assert figure in out, figure
    assert "FAIL: tolerances" in out
