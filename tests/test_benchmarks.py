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
