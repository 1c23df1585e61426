"""The rollout contract, as pytest tests run against every ``--engine-core-rollout``.

Collected by the ``engine_core`` pytest plugin when that option is given; each test is marked
``engine_core_rollout_contract`` and parametrized by rollout name (``NAME``, a registered
rollout in this process, or ``process:NAME``, two replicas of it in processes of their own).
Each rollout is started once per run; each test runs one check of
:mod:`engine_core.testing.rollout_kit`, whose failure names the promise it broke.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine_core.testing.rollout_kit import (
    CHECKS,
    CannotRunHere,
    NotDeclared,
    Subject,
    runs_on_cpu,
    started,
)

pytestmark = pytest.mark.engine_core_rollout_contract


@pytest.fixture(scope="module")
def rollout_subject(engine_core_rollout: str, pytestconfig: pytest.Config) -> Iterator[Subject]:
    settings = pytestconfig.getoption("engine_core_rollout_config")
    python = pytestconfig.getoption("engine_core_rollout_python")
    if not runs_on_cpu(engine_core_rollout, settings):
        pytest.skip(
            f"rollout {engine_core_rollout!r} does not declare cpu: the kit runs on CPU (give "
            f"its device with --engine-core-rollout-config=device=cpu where it can)."
        )
    with started(engine_core_rollout, python, settings) as subject:
        yield subject


@pytest.mark.parametrize("check", list(CHECKS))
def test_rollout_keeps_its_promise(rollout_subject: Subject, check: str) -> None:
    try:
        CHECKS[check](rollout_subject)
    except NotDeclared as e:
        pytest.skip(f"the rollout does not declare {e}: nothing to check")
    except CannotRunHere as e:
        pytest.skip(f"the rollout refused to start this check on this host: {e}")
