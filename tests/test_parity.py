"""``engine-core parity``: same model, data and steps through several engines, with a verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_core.cli import main


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


def test_parity_fails_for_a_broken_engine(tmp_path: Path) -> None:
    # the example engine that forgets DDP averages: half the gradient norm on 2 ranks
    out = tmp_path / "parity.json"
    code = main(["parity", "reference", "example-bad-scaling", "--steps", "1", "--world-size",
                 "2", "--json", str(out)])  # fmt: skip
    assert code == 1
    report = json.loads(out.read_text())
    assert not report["passed"]
    assert report["max_rel_grad_norm_diff"]["example-bad-scaling"] == pytest.approx(0.5, rel=1e-3)


def test_unknown_backend_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["parity", "reference", "no-such-engine"]) == 2
    err = capsys.readouterr().err
    assert "no-such-engine" in err and "fsdp2" in err


def test_report_prints_every_figure_whole_at_80_columns() -> None:
    from rich.console import Console

    from engine_core.parity import ParityReport, print_report

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
