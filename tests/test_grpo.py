"""The GRPO loop end to end: rollout, reward, advantages, actor update, verified weight sync."""

from __future__ import annotations

import json
from pathlib import Path

from engine_core.configio import apply_overrides, load_yaml
from engine_core.plugins import load_plugins
from roles.grpo import run_grpo

RECIPE = Path(__file__).parents[1] / "engine_core" / "recipes" / "grpo_tiny.yaml"


def test_reward_rises_and_rollout_matches_the_trainer(tmp_path: Path) -> None:
    raw = apply_overrides(
        load_yaml(RECIPE), [f"output_dir={tmp_path}", "steps=150", "log_every=50"]
    )
    summary = run_grpo(raw, load_plugins())
    assert summary["reward_last10"] > 2 * summary["reward_first10"]
    assert summary["reward_last10"] > 0.4
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 150
    # weights are synced every step: the rollout's log-probs follow the trainer's
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4


def test_kl_loss_against_a_reference(tmp_path: Path) -> None:
    raw = apply_overrides(
        load_yaml(RECIPE),
        [f"output_dir={tmp_path}", "steps=3", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1"],
    )
    run_grpo(raw, load_plugins())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["actor/kl_loss"] == 0.0  # first step: policy == reference
    assert rows[-1]["actor/kl_loss"] > 0.0
