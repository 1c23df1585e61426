"""The rollout kit catches each realistic bug of the example rollouts broken on purpose
(``tests/fixtures/example_engine/engine_core_example/rollout.py``), naming the promise; and a
rollout's kinds are one type to the layers above (its capabilities, never its class)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

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
    # two replicas of it in processes of their own, the weights streamed to them over a group
    (
        "process:example-skips-later-updates",
        "weight_sync_group",
        "weight sync group",
        "over the group, greedy gives",
    ),
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


def test_every_check_is_a_clause_of_the_conformance_page() -> None:
    """docs/conformance.md's rollout table names every check of ``CHECKS`` in its check
    column."""
    page = (Path(__file__).parents[1] / "docs" / "conformance.md").read_text(encoding="utf-8")
    table = page[
        page.index("| promise | check | what must hold | broken variant the kit fails |") :
    ]
    named = {
        name.strip("` ")
        for line in table.splitlines()
        if line.startswith("| ")
        for name in line.split("|")[2].split(",")
    }
    assert set(CHECKS) <= named, sorted(set(CHECKS) - named)


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


def test_routes_placed_one_token_late_are_caught() -> None:
    """The routes check fails a rollout whose routes sit one position late (the prompt's
    forward's experts shifted onto the next token), naming the token and the promise."""
    from engine_core.rollout import ROUTED_EXPERTS

    with started("hf") as subject:
        build = subject.build
        assert build is not None

        def shifted(model: Any, **fields: Any) -> Any:
            rollout = build(model, **fields)
            generate = rollout.generate

            def late(prompts: Any, params: Any) -> Any:
                out = generate(prompts, params)
                out[ROUTED_EXPERTS] = out[ROUTED_EXPERTS].roll(1, dims=1)
                return out

            rollout.generate = late  # type: ignore[method-assign]
            return rollout

        subject.build = shifted
        with pytest.raises(PromiseBroken) as caught:
            CHECKS["routes"](subject)
    assert caught.value.promise == "routes"
    assert "are not the routers'" in str(caught.value)


def test_the_kit_options_set_the_rollout_up_and_refuse_a_setting_it_lacks() -> None:
    """``--engine-core-rollout-config=KEY=VALUE`` reaches the rollout's config (a ``device=``
    lets a rollout that does not declare cpu run), and a key the config lacks is refused
    naming the valid ones before any rollout starts."""
    from pydantic import ValidationError

    from engine_core.errors import ConfigError
    from engine_core.testing.rollout_subject import runs_on_cpu

    assert runs_on_cpu("hf") and not runs_on_cpu("sglang")
    assert runs_on_cpu("sglang", ["device=cpu"])
    with pytest.raises(ValidationError, match=r"rollout\.no_such_field\n.*Valid keys here: seed"):
        with started("hf", None, ["no_such_field=1"]):
            pass
    with pytest.raises(ConfigError, match="override 'nonsense' has no '='"):
        with started("hf", None, ["nonsense"]):
            pass
    with started("hf", None, ["generation_batch_size=3"]) as subject:
        assert subject.rollout.config.generation_batch_size == 3
