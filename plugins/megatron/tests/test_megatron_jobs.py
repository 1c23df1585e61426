"""``engine-core run`` with ``engine.backend=megatron``: GRPO as fsdp2 runs it, PPO resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_core.configio import apply_overrides, load_yaml
from engine_core.plugins import load_plugins
from engine_core_roles.jobs.cli import load_recipe
from engine_core_roles.jobs.rl.run import run_rl_job
from engine_core_roles.trainer.metrics import TIMING_KEYS

RECIPES = Path(__file__).parents[3] / "roles" / "engine_core_roles" / "recipes"
VOLATILE = set(TIMING_KEYS)


def _rows(path: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in VOLATILE}
        for line in (path / "metrics.jsonl").read_text().splitlines()
    ]


def test_grpo_on_megatron_follows_fsdp2_step_by_step(tmp_path: Path) -> None:
    runs = {}
    for backend in ("fsdp2", "megatron"):
        out = tmp_path / backend
        raw = apply_overrides(
            load_yaml(RECIPES / "grpo_tiny.yaml"),
            [f"output_dir={out}", "steps=4", f"engine.backend={backend}"],
        )
        run_rl_job(raw, load_plugins())
        runs[backend] = _rows(out)
    assert max(r["rollout/logprob_diff_max"] for r in runs["megatron"]) < 1e-5
    for a, b in zip(runs["fsdp2"], runs["megatron"], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), k


def test_ppo_with_a_megatron_critic_resumes_exactly(tmp_path: Path) -> None:
    base = apply_overrides(load_yaml(RECIPES / "ppo_tiny.yaml"), ["engine.backend=megatron"])
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    run_rl_job(
        apply_overrides(base, [f"output_dir={straight}", "steps=4", "save_every=2"]),
        load_plugins(),
    )
    run_rl_job(apply_overrides(base, [f"output_dir={interrupted}", "steps=2"]), load_plugins())
    run_rl_job(
        apply_overrides(base, [f"output_dir={interrupted}", "steps=4", "save_every=2"]),
        load_plugins(),
        resume=True,
    )
    rows = _rows(straight)
    assert all("critic/vf_loss" in r for r in rows)
    assert _rows(interrupted) == rows


def test_moe_recipe_on_megatron_at_ep2_follows_fsdp2(tmp_path: Path) -> None:
    """``moe_tiny`` (routes replayed from the hf rollout, the balance loss on) with the experts
    spread over two megatron ranks: the same rows as fsdp2 on one rank, the route mismatch 0
    and the experts' load logged per layer."""
    runs = {}
    base = ["steps=2", "warmup_sft_steps=0", "eval.every=0", "log_every=1"]
    layouts = {
        "fsdp2": [],
        "megatron": [
            "engine.backend=megatron",
            "engine.expert_parallel_size=2",
            "placement.executor=local",
            "placement.actor.dp=2",
        ],
    }
    for name, overrides in layouts.items():
        out = tmp_path / name
        raw = load_recipe(RECIPES / "moe_tiny.yaml", [f"output_dir={out}", *base, *overrides])
        run_rl_job(raw, load_plugins())
        runs[name] = _rows(out)
    rows = runs["megatron"]
    assert [r["rollout/route_mismatch"] for r in rows] == [0.0, 0.0]
    assert all(1.0 <= r["moe/load_spread_max"] <= 4.0 for r in rows)  # 8 experts, top-2
    for a, b in zip(runs["fsdp2"], rows, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), k
