"""Algorithms from a third-party package: discovered, selected by a run, their parameters checked.

The package is ``tests/fixtures/plugins/algos`` (``engine-core-test-algos``: the advantage
estimator ``median_baseline`` and the policy loss ``clipped_pg``), installed for real beside the
other test plugins (the broken one among them) into a directory that only subprocesses see.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from engine_core_roles.algorithms.select import AlgorithmConfig
from engine_core_roles.jobs.cli import RECIPES, load_recipe
from tests.fixtures.plugins._install import install_test_plugins, run_python

RECIPE = str(RECIPES / "grpo_tiny.yaml")
ALGORITHM = [
    "trainer.algorithm.advantage=median_baseline",
    "trainer.algorithm.policy_loss=clipped_pg",
]
SMALL = ["steps=2", "prompts_per_step=4", "trainer.samples_per_prompt=4"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_test_plugins(tmp_path_factory)


def _run(site: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """``engine-core run`` of the grpo_tiny recipe with ``overrides``."""
    return run_python(["-m", "engine_core.cli", "run", RECIPE, *overrides], site)


# -- discovery ------------------------------------------------------------------------------------


def test_plugins_lists_the_third_party_algorithms_beside_the_shipped_ones(site: Path) -> None:
    proc = run_python(["-m", "engine_core.cli", "plugins", "--json"], site)
    assert proc.returncode == 0, proc.stderr
    plugins = {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}
    algos = plugins["test_algos"]
    assert (algos["status"], algos["distribution"], algos["version"]) == (
        "ok",
        "engine-core-test-algos",
        "0.1.0",
    )
    assert algos["backends"] == []
    listed = {(a["kind"], a["name"]): a for a in algos["algorithms"]}
    assert set(listed) == {("advantage", "median_baseline"), ("policy_loss", "clipped_pg")}
    median, clipped = listed["advantage", "median_baseline"], listed["policy_loss", "clipped_pg"]
    assert median["needs"] == ["groups"] and clipped["needs"] == []
    assert median["params"] == "engine_core_test_algos.algos:MedianBaselineParams"
    assert clipped["target"] == "engine_core_test_algos.algos:ClippedPG"
    shipped = plugins["algorithms"]
    assert (shipped["status"], shipped["distribution"]) == ("ok", "engine-core-roles")
    names = {a["name"] for a in shipped["algorithms"]}
    assert {"grpo", "gae", "rloo", "ppo_clip", "gspo", "cispo"} <= names


# -- a run --------------------------------------------------------------------------------------


def test_nested_overrides_give_the_algorithms_parameters() -> None:
    """``trainer.algorithm.advantage_params.scale=0.5`` builds the mapping level by level, as a
    YAML flow mapping of the whole section does; only the shape is checked here."""
    dotted = load_recipe(RECIPE, [*ALGORITHM, "trainer.algorithm.advantage_params.scale=0.5"])
    section = (
        "{advantage: median_baseline, policy_loss: clipped_pg, advantage_params: {scale: 0.5}}"
    )
    flow = load_recipe(RECIPE, [f"trainer.algorithm={section}"])
    assert dotted["trainer"]["algorithm"] == flow["trainer"]["algorithm"]
    config = AlgorithmConfig.model_validate(dotted["trainer"]["algorithm"])
    assert (config.advantage, config.policy_loss) == ("median_baseline", "clipped_pg")
    assert config.advantage_params == {"scale": 0.5} and config.policy_loss_params == {}


def test_a_tiny_job_trains_with_the_third_party_algorithms(site: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _run(
        site,
        *SMALL,
        *ALGORITHM,
        "trainer.algorithm.advantage_params.scale=0.5",
        f"output_dir={out}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        # the loss's own diagnostic, logged as actor/<name>, and the estimator's figure
        assert 0.0 <= row["actor/capped_frac"] <= 1.0
        assert "actor/pg_loss" in row and "advantage/baseline_mean" in row


# -- refusals -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def refused(site: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("refused") / "run"
    bad = "trainer.algorithm.policy_loss_params.cap=-1"
    proc = _run(site, *SMALL, *ALGORITHM, bad, f"output_dir={out}")
    return {"proc": proc, "out": out}


def test_a_wrong_parameter_of_the_third_party_loss_is_refused_before_anything_is_built(
    refused: dict[str, Any],
) -> None:
    proc = refused["proc"]
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("engine-core run: ")]
    assert len(errors) == 1 and errors[0].startswith("engine-core run: error: "), proc.stderr
    error = proc.stderr[proc.stderr.index(errors[0]) :]
    assert "algorithm.policy_loss_params.cap" in error and "greater than 0" in error
    assert "Traceback" not in proc.stderr
    assert not refused["out"].exists()  # refused while the config was read


def test_the_refusal_names_the_key_as_it_was_written(refused: dict[str, Any]) -> None:
    assert "error: trainer.algorithm.policy_loss_params.cap: " in refused["proc"].stderr


# -- a broken plugin beside them ----------------------------------------------------------------

_RESOLVE = textwrap.dedent(
    """
    import json
    from engine_core.plugins import load_plugins
    from engine_core_roles.algorithms.select import AlgorithmConfig, resolve_algorithm

    manager = load_plugins()
    config = AlgorithmConfig(
        advantage="median_baseline",
        policy_loss="clipped_pg",
        advantage_params={"scale": 0.5},
    )
    resolved = resolve_algorithm(config, manager)
    print(json.dumps({
        "advantage": [resolved.advantage.name, resolved.advantage.distribution],
        "policy_loss": [resolved.policy_loss.name, resolved.policy_loss.distribution],
        "params": [resolved.advantage_params.scale, resolved.policy_loss_params.cap],
        "failed": [p.distribution for p in manager.failed_plugins()],
    }))
    print("ok")
    """
)


def test_a_broken_plugin_is_one_warning_and_the_algorithms_still_resolve(site: Path) -> None:
    proc = run_python(["-c", _RESOLVE], site)
    assert proc.returncode == 0, proc.stderr
    report, ok = proc.stdout.splitlines()
    assert ok == "ok"
    assert json.loads(report) == {
        "advantage": ["median_baseline", "engine-core-test-algos"],
        "policy_loss": ["clipped_pg", "engine-core-test-algos"],
        "params": [0.5, 2.0],
        "failed": ["engine-core-testplugin-broken"],
    }
    warnings = [line for line in proc.stderr.splitlines() if "failed to load" in line]
    assert len(warnings) == 1, proc.stderr
    assert "'testbroken' (engine-core-testplugin-broken)" in warnings[0]
    assert "nonexistent_backend_lib" in warnings[0]
