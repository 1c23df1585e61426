"""`engine-core train`: a real, short supervised run through a registered engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine_core.checkpoint import list_checkpoints
from engine_core.configio import apply_overrides, load_yaml
from engine_core.plugins import load_plugins
from engine_core_roles.jobs.cli import RECIPES
from engine_core_roles.jobs.sft import run_sft

RECIPE = RECIPES / "sft_tiny.yaml"


def test_short_run_learns_and_writes_outputs(tmp_path: Path) -> None:
    raw = apply_overrides(
        load_yaml(RECIPE),
        [f"output_dir={tmp_path}", "steps=30", "log_every=10", "engine.optim.total_steps=30"],
    )
    summary = run_sft(raw, load_plugins())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert summary["final_loss"] < 0.6 * summary["first_loss"]
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [30]


def test_bad_override_names_the_field(tmp_path: Path) -> None:
    raw = apply_overrides(
        load_yaml(RECIPE), [f"output_dir={tmp_path}", "engine.micro_batch_size=-2"]
    )
    with pytest.raises(ValidationError, match=r"engine\.micro_batch_size"):
        run_sft(raw, load_plugins())


def test_the_rl_warm_up_steps_the_lr_schedule_as_the_sft_job_does() -> None:
    """Both take :func:`supervised_step`, one step of the LR schedule with each update: after
    the RL job's warm-up of 3 steps under a 6-step LR warm-up, the next update (RL's first)
    runs at 4/6 of the rate, as the SFT job's step 4 does (not at 1/6, the first step's)."""
    from engine_core.resolve import resolve_engine_config
    from engine_core_roles.data.tasks import DigitTask
    from engine_core_roles.jobs.rl.config import RLJobConfig
    from engine_core_roles.jobs.rl.warmup import _warmup

    optim = ["engine.optim.lr=1e-2", "engine.optim.warmup_steps=6"]
    raw = apply_overrides(
        load_yaml(RECIPES / "grpo_tiny.yaml"), ["warmup_sft_steps=3", "warmup_batch_size=4", *optim]
    )
    job = RLJobConfig.model_validate(raw)
    spec, cfg = resolve_engine_config(job.engine, load_plugins(), path=("engine",))
    engine = spec.load_class()(cfg)
    engine.init_model()
    _warmup(engine, DigitTask(job.task), job)
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 4 / 6)
