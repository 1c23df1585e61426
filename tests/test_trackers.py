"""Trackers: a run logged to Weights & Biases (offline) and MLflow (a local file store) holds the
run's config, every metric of ``metrics.jsonl`` at its step, the decoded samples as a table and
the final summary, also across a stop and a ``--resume`` (into the same tracker runs); a
tracker that cannot start is one sentence before anything is trained, and one that fails
later is one warning."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from engine_core.errors import ConfigError, RunStopped, TrackerError
from engine_core_roles.jobs.cli import RECIPES, load_recipe
from engine_core_roles.jobs.trackers import TRACKERS_RECORD, check_trackers, mlflow_key
from tests import _wandb_records as wandb_records
from tests._forkserver import ForkServer

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

TEXT = [
    str(RECIPES / "text_tiny.yaml"),
    "engine.backend=reference",
    "steps=4",
    "warmup_sft_steps=2",
    "prompts_per_step=2",
    "trainer.samples_per_prompt=2",
    "eval.every=2",
    "eval.max_prompts=2",
    "log_every=2",
    "log_samples=2",
    "save_every=0",
    "trackers=[tensorboard,wandb,mlflow]",
]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No W&B account or server here: whatever the environment says, stay offline."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def _run(args: list[str]) -> dict[str, Any]:
    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.rl.run import run_rl_job

    with open(os.devnull, "w") as sink:
        return run_rl_job(
            load_recipe(args[0], args[1:]), load_plugins(), console=Console(file=sink)
        )


def _numbers(rows: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    return {
        r["step"]: {
            k: float(v)
            for k, v in r.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        for r in rows
    }


def _tensorboard_scalars(folder: Path) -> dict[int, dict[str, float]]:
    """The scalars of a TensorBoard folder's event files (TFRecord frames: length, its CRC,
    an ``Event``, its CRC), by step; a later file's value of a step replaces an earlier one's,
    as TensorBoard reads a resumed run."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[int, dict[str, float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            values = [v for v in event.summary.value if v.HasField("simple_value")]
            if values:
                scalars[event.step] = {v.tag: v.simple_value for v in values}
    return scalars


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_a_run_logs_the_same_metrics_to_wandb_and_mlflow_across_a_resume(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    args = [*TEXT, f"output_dir={out}"]
    # the run stops after its first step (its wall time), with a checkpoint
    with pytest.raises(RunStopped):
        _run([*args, "max_wall_time=1e-3"])
    first = json.loads((out / TRACKERS_RECORD).read_text())
    assert first["wandb"]["id"] and first["mlflow"]["run_id"]
    # ... and resumes into the same tracker runs
    summary = _run([*args, "resume=auto"])
    assert json.loads((out / TRACKERS_RECORD).read_text()) == first
    want = _numbers([json.loads(line) for line in (out / "metrics.jsonl").open()])
    assert sorted(want) == [1, 2, 3, 4]
    assert any(k.startswith("val/pass@") for k in want[2])  # a key MLflow spells otherwise

    # TensorBoard: every finite number at its step, one event a step, across both sessions
    board = _tensorboard_scalars(out / "tensorboard")
    finite = {  # TensorBoard's tags spell "@" and the like as "_"
        step: {re.sub(r"[^-/\w\.]", "_", k): v for k, v in row.items() if math.isfinite(v)}
        for step, row in want.items()
    }
    assert board.keys() == finite.keys()
    for step, row in finite.items():
        assert board[step].keys() == row.keys(), step
        assert all(board[step][k] == pytest.approx(v, rel=1e-6) for k, v in row.items()), step

    # W&B: two offline files of one run (before and after the resume)
    files = sorted((out / "wandb").glob(f"offline-run-*-{first['wandb']['id']}/run-*.wandb"))
    assert len(files) == 2, files
    logged: dict[int, dict[str, float]] = {}
    tables = []
    for path in files:
        for row in wandb_records.history(path):
            step = row.pop("_step")  # W&B's step is the run's
            if row.get("samples/_type") == "table-file":
                tables.append(step)
            numbers = {k: float(v) for k, v in row.items() if not k.startswith("samples/")}
            assert numbers.pop("step", step) == step
            twice = numbers.keys() & logged.get(step, {}).keys()
            assert not twice, f"W&B got {twice} of step {step} twice"
            logged.setdefault(step, {}).update(numbers)
    assert sorted(logged) == sorted(want)
    for step, row in want.items():
        assert logged[step].keys() == row.keys(), step
        assert all(_same(logged[step][k], v) for k, v in row.items()), (step, logged[step], row)
    assert tables == [2, 4]
    config = wandb_records.config(files[0])
    assert config["steps"] == 4 and config["trackers"] == ["tensorboard", "wandb", "mlflow"]
    assert wandb_records.summary(files[-1])["reward_last10"] == summary["reward_last10"]

    # MLflow: one run in the file store, each metric's history equal to the file's
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=first["mlflow"]["tracking_uri"])
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [first["mlflow"]["run_id"]]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["steps"] == "4" and run.data.params["engine.backend"] == "reference"
    stems = {k.rsplit("/", 1)[0] for row in want.values() for k in row if "/" in k}
    assert mlflow_key("reward", stems) == "reward/value"  # a metric and a group: a file store
    assert mlflow_key("val/pass@1") == "val/pass_at_1"
    for key in {k for row in want.values() for k in row}:
        history = client.get_metric_history(run.info.run_id, mlflow_key(key, stems))
        got = {m.step: m.value for m in history}
        expected = {step: row[key] for step, row in want.items() if key in row}
        assert got.keys() == expected.keys(), key
        assert all(_same(got[s], v) for s, v in expected.items()), (key, got, expected)
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    samples = json.loads((artifacts / "samples.json").read_text())
    steps = [row[samples["columns"].index("step")] for row in samples["data"]]
    assert steps == [2, 2, 4, 4], samples
    assert json.loads((artifacts / "summary.json").read_text())["steps"] == 4
    assert json.loads((artifacts / "config.json").read_text())["output_dir"] == str(out)


def test_a_tracker_that_cannot_start_is_one_sentence_before_training(
    tmp_path: Path, job_server: ForkServer
) -> None:
    out = tmp_path / "run"
    args = ["run", *TEXT, f"output_dir={out}", "trackers=[wandb,mlflow]"]
    bad = "mlflow.tracking_uri=nosuchscheme://host/store"
    with pytest.raises(TrackerError, match="the mlflow tracker could not start: .*nosuchscheme"):
        _run([*args[1:], bad])
    assert not (out / "metrics.jsonl").exists()  # nothing was trained or logged
    # the command: one line, the usage status (forked from the suite's job server, which has
    # imported the job's modules: tests/_forkserver.py)
    log = tmp_path / "command.log"
    code = job_server.run(
        args=[*args, bad, "steps=1"], env={"WANDB_SILENT": "true"}, log=str(log), timeout=300
    )
    stderr = log.read_text()
    assert code == 2, stderr
    said = [line for line in stderr.splitlines() if "engine-core run: error" in line]
    assert len(said) == 1 and "remove mlflow from trackers" in said[0], stderr
    assert "Traceback" not in stderr


def test_the_trackers_setting_is_checked_when_the_config_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pydantic import ValidationError

    from engine_core_roles.jobs.rl.config import RLJobConfig

    engine = {"backend": "reference"}
    with pytest.raises(ValidationError, match="named more than once"):
        RLJobConfig(engine=engine, trackers=["wandb", "wandb"])
    with pytest.raises(ValidationError, match="'tensorboard', 'wandb' or 'mlflow'"):
        RLJobConfig(engine=engine, trackers=["neptune"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'engine-core-roles\[mlflow\]'"):
        check_trackers(["tensorboard", "mlflow"])


def test_a_tracker_that_fails_mid_run_is_one_warning_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    from engine_core_roles.jobs.trackers import MlflowConfig, WandbConfig, start_trackers

    out = tmp_path / "run"
    out.mkdir()
    board, tracker = start_trackers(
        ["tensorboard", "mlflow"],
        out,
        config={"steps": 2},
        wandb=WandbConfig(),
        mlflow=MlflowConfig(),
    )
    assert (board.name, tracker.name) == ("tensorboard", "mlflow")
    board.finish(None, "finished")
    tracker.log({"step": 1, "loss": 1.0})
    shutil.rmtree(out / "mlruns")  # its store is gone
    with pytest.warns(RuntimeWarning, match="the mlflow tracker failed .* metrics.jsonl keeps"):
        tracker.log({"step": 2, "loss": 0.5})
    tracker.log({"step": 3, "loss": 0.25})  # dropped quietly: one warning in all
    tracker.finish(None, "finished")


def test_the_sft_job_logs_to_the_trackers_too(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from engine_core_roles.jobs.cli import main

    out = tmp_path / "sft"
    args = [str(RECIPES / "sft_tiny.yaml"), f"output_dir={out}", "steps=3", "trackers=[mlflow]"]
    with open(os.devnull, "w") as sink:
        saved, sys.stdout = sys.stdout, sink
        try:
            assert main(["train", *args]) == 0
        finally:
            sys.stdout = saved
    assert not (out / "tensorboard").exists()  # not asked for
    want = _numbers([json.loads(line) for line in (out / "metrics.jsonl").open()])
    record = json.loads((out / TRACKERS_RECORD).read_text())["mlflow"]
    client = MlflowClient(tracking_uri=record["tracking_uri"])
    assert client.get_run(record["run_id"]).info.status == "FINISHED"
    for key in want[1]:
        got = {m.step: m.value for m in client.get_metric_history(record["run_id"], key)}
        assert got == {step: row[key] for step, row in want.items()}, key
