"""The rollout kit catches each realistic bug of the example rollouts broken on purpose
(``tests/fixtures/example_engine/engine_core_example/rollout.py``), naming the promise; and a
rollout's kinds are one type to the layers above (its capabilities, never its class)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine_core.testing.rollout_kit import CHECKS, PromiseBroken, started

ROLES = Path(__file__).parents[1] / "roles"

BROKEN = [
    ("example-log-probs-at-one", "log_probs", "log-probs", "at temperature 0.6"),
    ("example-ignores-seeds", "seeds", "seeds", "the same seeded call twice"),
    ("example-never-truncated", "greedy", "truncated", "truncated=[False"),
    ("example-skips-later-updates", "weights", "weight update", "after a second update"),
    ("example-drops-stop-token", "stop", "stop ids", "with stop_token_ids="),
    ("example-stops-after-budget", "stop_strings", "truncated", "ended on a stop string"),
]


@pytest.mark.parametrize(("name", "check", "promise", "detail"), BROKEN)
def test_each_broken_rollout_is_caught_naming_the_promise(
    name: str, check: str, promise: str, detail: str
) -> None:
    with started(name) as subject:
        with pytest.raises(PromiseBroken) as caught:
            CHECKS[check](subject)
    assert caught.value.promise == promise
    message = str(caught.value)
    assert message.startswith(f"rollout promise '{promise}' broken: ") and detail in message
    assert "Fix: " in message


def test_no_isinstance_on_rollout_kinds_above_the_core() -> None:
    """The trainer, the weight link and the episode loop take one rollout type: no
    ``isinstance(x, BaseRollout / ProcessRollout / ...Rollout)`` anywhere in the roles."""
    found = []
    for path in ROLES.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2
                and "Rollout" in ast.unparse(node.args[1])
                and "Config" not in ast.unparse(node.args[1])
            ):
                found.append(f"{path.relative_to(ROLES)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
