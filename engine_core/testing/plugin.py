"""The ``engine_core`` pytest plugin (entry point ``pytest11``): the engine and rollout
conformance kits.

``pytest --engine-core-backend=NAME`` (repeatable) adds the contract tests gathered in
:mod:`engine_core.testing.contract` (each beside its check in :mod:`engine_core.testing.checks`)
to the run, parametrized by each named backend. Select only
them with ``-m engine_core_contract``. ``pytest --engine-core-rollout=NAME`` (repeatable;
``process:NAME`` runs two replicas of NAME in processes of their own) adds the rollout contract
(:mod:`engine_core.testing.rollout_contract`), marked ``engine_core_rollout_contract``.
Without either option the plugin does nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# the contract tests live in the concern modules of engine_core.testing.checks: rewrite their
# asserts as pytest does a test file's (registered before the plugin imports any of them)
pytest.register_assert_rewrite("engine_core.testing.checks")

OPTION = "--engine-core-backend"
ROLLOUT_OPTION = "--engine-core-rollout"
CONTRACT = Path(__file__).with_name("contract.py")
ROLLOUT_CONTRACT = Path(__file__).with_name("rollout_contract.py")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine-core", "engine-core conformance kit")
    group.addoption(
        OPTION,
        action="append",
        default=[],
        metavar="NAME",
        help="Run the engine contract tests against the registered engine NAME (repeatable).",
    )
    group.addoption(
        ROLLOUT_OPTION,
        action="append",
        default=[],
        metavar="NAME",
        help="Run the rollout contract tests against the registered rollout NAME, or "
        "process:NAME for two replicas of it in processes of their own (repeatable).",
    )
    group.addoption(
        "--engine-core-rollout-python",
        default=None,
        metavar="PATH",
        help="The interpreter interpreter:NAME starts its replicas in (default: this one), e.g. "
        "an environment of the rollout's own.",
    )
    group.addoption(
        "--engine-core-rollout-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Set a field of the rollout's config under test (repeatable), e.g. device=cpu; a "
        "rollout that does not declare cpu runs when its device is given.",
    )
    group.addoption(
        "--engine-core-kit-only",
        action="append",
        default=[],
        metavar="CHECK",
        help="Run only the kit's checks whose name starts with CHECK (repeatable; e.g. "
        "checkpoint, inputs, lifecycle, step_, outputs); NAME:CHECK limits only the engine NAME's "
        "checks. Select the matching contract tests with -k; a test whose check did not run "
        "fails with 'did not run'.",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "engine_core_contract: an engine-core conformance-kit contract test"
    )
    config.addinivalue_line(
        "markers", "engine_core_rollout_contract: an engine-core rollout-kit contract test"
    )
    if config.getoption("engine_core_backend") and str(CONTRACT) not in config.args:
        config.args.append(str(CONTRACT))
    if config.getoption("engine_core_rollout") and str(ROLLOUT_CONTRACT) not in config.args:
        config.args.append(str(ROLLOUT_CONTRACT))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine_core_backend" in metafunc.fixturenames:
        backends = list(dict.fromkeys(metafunc.config.getoption("engine_core_backend")))
        metafunc.parametrize("engine_core_backend", backends, scope="module")
    if "engine_core_rollout" in metafunc.fixturenames:
        rollouts = list(dict.fromkeys(metafunc.config.getoption("engine_core_rollout")))
        metafunc.parametrize("engine_core_rollout", rollouts, scope="module")
