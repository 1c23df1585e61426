"""The environment in two modules: :mod:`engine_core.settings` reads it (the launch view of
torch.distributed's variables among it), :mod:`engine_core.launch` writes it; no other module
of the packages touches ``os.environ``."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from engine_core.errors import ConfigError
from engine_core.launch import (
    RENDEZVOUS,
    adopt_environment,
    caller_environment,
    set_default_for_process,
    set_for_process,
    unset_for_process,
    with_variable,
)
from engine_core.settings import Launch, launch_from_env, mlflow_tracking_uri

ROOT = Path(__file__).parents[1]
ENVIRONMENT = re.compile(r"os\.environ|os\.getenv|putenv")
# the only modules that touch the environment (the kit's process tooling and the sgl_kernel
# stand-in of SGLang's CPU environment go through them too)
OWNERS = {"engine_core/settings.py", "engine_core/launch.py"}


def test_launch_view_defaults_to_rank_0_of_1() -> None:
    assert launch_from_env({}) == Launch(rank=0, world_size=1, local_rank=0)


def test_launch_view_reads_the_rendezvous_variables() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_PORT": "1234"}
    assert launch_from_env(env) == Launch(rank=3, world_size=4, local_rank=1)


def test_launch_view_refuses_a_value_that_is_no_number() -> None:
    with pytest.raises(ConfigError, match=r"WORLD_SIZE='two' is not a whole number.*unset"):
        launch_from_env({"WORLD_SIZE": "two"})


def test_mlflow_tracking_uri_as_set() -> None:
    assert mlflow_tracking_uri({}) is None
    assert mlflow_tracking_uri({"MLFLOW_TRACKING_URI": "sqlite:///x.db"}) == "sqlite:///x.db"


def test_set_unset_and_defaults_for_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINE_CORE_TEST_A", raising=False)
    monkeypatch.setenv("ENGINE_CORE_TEST_B", "user")
    set_for_process({"ENGINE_CORE_TEST_A": "1"})
    assert os.environ["ENGINE_CORE_TEST_A"] == "1"
    assert set_default_for_process("ENGINE_CORE_TEST_B", "ours") == "user"  # the user's wins
    unset_for_process(["ENGINE_CORE_TEST_A", "ENGINE_CORE_TEST_NEVER_SET"])
    assert "ENGINE_CORE_TEST_A" not in os.environ
    assert set_default_for_process("ENGINE_CORE_TEST_A", "ours") == "ours"
    monkeypatch.delenv("ENGINE_CORE_TEST_A")


def test_a_variable_for_a_block_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINE_CORE_TEST_A", raising=False)
    monkeypatch.setenv("ENGINE_CORE_TEST_B", "before")
    with with_variable("ENGINE_CORE_TEST_A", "x"), with_variable("ENGINE_CORE_TEST_B", "y"):
        assert (os.environ["ENGINE_CORE_TEST_A"], os.environ["ENGINE_CORE_TEST_B"]) == ("x", "y")
    assert "ENGINE_CORE_TEST_A" not in os.environ
    assert os.environ["ENGINE_CORE_TEST_B"] == "before"


def test_the_callers_environment_is_copied_and_adopted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CORE_TEST_A", "1")
    saved = caller_environment()
    copy = caller_environment(exclude=["ENGINE_CORE_TEST_A"])
    assert saved["ENGINE_CORE_TEST_A"] == "1" and "ENGINE_CORE_TEST_A" not in copy
    try:
        adopt_environment(copy)
        assert dict(os.environ) == copy
    finally:
        adopt_environment(saved)
    assert dict(os.environ) == saved


def test_rendezvous_names_what_worker_env_sets() -> None:
    from engine_core.executors.base import worker_env

    env = worker_env(1, 2, 29500)
    assert set(RENDEZVOUS) <= set(env)


def environment_users(root: Path) -> list[str]:
    """``path:line`` of each line outside :data:`OWNERS` that touches the environment."""
    found = []
    for top in ("engine_core", "roles", "plugins", "benchmarks"):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if "/tests/" in rel or rel in OWNERS:
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if ENVIRONMENT.search(line):
                    found.append(f"{rel}:{n}")
    return found


def test_only_settings_and_launch_touch_the_environment() -> None:
    users = environment_users(ROOT)
    assert not users, (
        f"{users} touch os.environ: read a variable through engine_core.settings and set one "
        "through engine_core.launch (a backend: engine_core.backend.set_for_process)"
    )


# what reads a variable or the whole environment, rather than writing it
READS = re.compile(
    r"os\.environ\.(get|items|keys|values|copy)\(|os\.getenv|in os\.environ|= os\.environ\b"
)


def test_the_launch_helper_reads_the_environment_through_settings() -> None:
    source = (ROOT / "engine_core" / "launch.py").read_text(encoding="utf-8").splitlines()
    reads = [f"launch.py:{n}" for n, line in enumerate(source, 1) if READS.search(line)]
    assert not reads, f"{reads} read os.environ: read it through engine_core.settings"
    assert READS.search("saved = os.environ.get(name)")  # the rule sees the read it replaced


def test_the_rule_catches_a_stray_read(tmp_path: Path) -> None:
    module = tmp_path / "roles" / "pkg" / "mod.py"
    module.parent.mkdir(parents=True)
    module.write_text('import os\nURI = os.environ.get("X")\n')
    assert environment_users(tmp_path) == ["roles/pkg/mod.py:2"]


def test_the_cores_a_job_shares_are_its_affinity_unless_set() -> None:
    from engine_core.executors.base import threads_per_process
    from engine_core.settings import cpu_cores

    assert cpu_cores({}) == len(os.sched_getaffinity(0))
    assert cpu_cores({"ENGINE_CORE_CPUS": "3"}) == 3
    for wrong in ("0", "-2", "two", "1.5"):
        with pytest.raises(ConfigError, match=r"ENGINE_CORE_CPUS=.* positive whole number"):
            cpu_cores({"ENGINE_CORE_CPUS": wrong})
    assert threads_per_process(2, cores=5) == 2 and threads_per_process(4, cores=2) == 1
