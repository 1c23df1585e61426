"""The benchmarks keep up with the code they time: each script imports, and every call the
step benchmark times by name is still there (a rename would otherwise surface only when the
benchmark is run)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture(autouse=True)
def _on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))


@pytest.mark.parametrize("script", sorted(p.stem for p in BENCHMARKS.glob("*.py")))
def test_every_benchmark_imports(script: str) -> None:
    module = importlib.import_module(script)
    assert module.__doc__, f"benchmarks/{script}.py says what it measures in its docstring"
    sys.modules.pop(script, None)


def test_the_step_breakdown_times_calls_that_exist() -> None:
    grpo_step = importlib.import_module("grpo_step")
    calls = grpo_step.timed_calls()
    for owner, name, label in calls:
        assert callable(getattr(owner, name, None)), f"{label}: {owner.__name__}.{name} is gone"
    assert {label for _, _, label in calls} >= {"generation", "update", "weight_sync"}


def test_the_interleaved_steps_pair_each_job_step_with_a_minimal_one() -> None:
    # the step benchmark's step-by-step comparison: one minimal step after each of the job's,
    # outside its time_s, and the trainer's step as it was afterwards
    from engine_core_roles.jobs.cli import RECIPES, load_recipe
    from engine_core_roles.trainer.loop import RLTrainer

    grpo_step = importlib.import_module("grpo_step")
    recipe = RECIPES / "grpo_tiny.yaml"
    small = ["prompts_per_step=2", "trainer.samples_per_prompt=2"]
    loop = importlib.import_module("_minimal").MinimalGRPO(load_recipe(recipe, small))
    step, minimal = RLTrainer.step, []
    rows, times = grpo_step._engine_core(3, recipe, small, lambda: minimal.append(loop.step()))
    assert RLTrainer.step is step
    assert len(rows) == len(minimal) == 3 and len(times["update"]) == 3
    assert all(t > 0 and 0.0 <= r <= 1.0 for t, r in rows + minimal)
