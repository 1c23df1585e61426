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
