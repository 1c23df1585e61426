"""Fixtures shared by the core's tests, and the example engine for every test run.

The example out-of-tree engine in ``tests/fixtures/example_engine`` (and its variants broken on
purpose) is a test fixture and is never installed, so a user's ``engine-core plugins`` does not
list it. Tests see it through ``ENGINE_CORE_EXTRA_PLUGINS`` instead, with its folder on
``sys.path`` and ``PYTHONPATH``, set when pytest loads this file (``tests/`` is among the paths
every ``make test`` run collects), before any test runs: worker processes started by the kit
(spawned: they inherit ``os.environ`` and ``sys.path``) and pytest subprocesses (they inherit
``os.environ``) find it too. To run the kit on the example by hand, set the same variables:
``ENGINE_CORE_EXTRA_PLUGINS=example=engine_core_example.plugin
PYTHONPATH=tests/fixtures/example_engine pytest --engine-core-backend=example``.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from engine_core.settings import ENV_EXTRA_PLUGINS, ENV_WORKER_START
from engine_core_roles.jobs.cli import RECIPES

EXAMPLE_ENGINE = Path(__file__).parent / "fixtures" / "example_engine"
EXAMPLE_PLUGIN = ("example", "engine_core_example.plugin")


def _use_example_engine() -> None:
    folder = str(EXAMPLE_ENGINE)
    if folder not in sys.path:
        sys.path.append(folder)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, folder])
    extra = os.environ.get(ENV_EXTRA_PLUGINS, "").strip().strip(",")
    if EXAMPLE_PLUGIN[0] not in {item.partition("=")[0].strip() for item in extra.split(",")}:
        os.environ[ENV_EXTRA_PLUGINS] = ",".join(filter(None, [extra, "=".join(EXAMPLE_PLUGIN)]))


_use_example_engine()


def _fork_workers() -> None:
    """Worker processes forked from a fork server that imported torch and the engines once
    (``ENGINE_CORE_WORKER_START=forkserver``), not spawned: seconds of imports less per worker,
    over the suite's few hundred. On CPU hosts only; tests of the start methods set their own."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault(ENV_WORKER_START, "forkserver")


_fork_workers()


def _share_the_cores() -> None:
    """Each of the suite's pytest workers (``-n N``) gets its share of the cores, for itself
    (torch's intra-op threads), for the workers and replicas its jobs start
    (``ENGINE_CORE_CPUS``) and for the interpreters its tests start (``OMP_NUM_THREADS``): two
    workers that each ran every process on every core oversubscribed a small host, and torch's
    threads waiting on each other made its tests up to five times slower (measured: the GRPO
    recipe's learning test 125 s beside another module, 25 s with the cores shared)."""
    import torch

    from engine_core.executors.base import threads_per_process
    from engine_core.settings import ENV_CPUS

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or ENV_CPUS in os.environ:
        return
    share = threads_per_process(workers)
    os.environ[ENV_CPUS] = str(share)
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    if torch.get_num_threads() != share:
        torch.set_num_threads(share)


_share_the_cores()

# How `make test` shares the suite between its two pytest workers (--dist loadscope): in units,
# each a module or a test class, run whole on one worker (module-scoped set-ups built once),
# except the conformance kit, whose tests are one unit per engine (each engine's module-scoped
# runs are its own). Units go out longest first (--no-loadscope-reorder keeps the order set
# here), so that no long unit starts last while the other worker idles: LONG_UNITS, longest
# first, as the suite's durations on a fresh clone measured them, then every other unit, those
# with more tests first.
KIT_MODULE = "engine_core/testing/contract.py"
LONG_UNITS = (
    f"{KIT_MODULE}[megatron]",
    "tests/test_conformance.py",
    "tests/test_signals.py",
    f"{KIT_MODULE}[fsdp]",
    f"{KIT_MODULE}[fsdp2]",
    f"{KIT_MODULE}[reference]",
    f"{KIT_MODULE}[example]",
    "tests/test_docs.py::TestDocumentedCommandsRayAndVllm",
    "plugins/megatron/tests/test_megatron_engine.py",
    "tests/test_grpo.py",
    "plugins/fsdp/tests/test_fsdp_engines.py",
    "tests/test_checkpoint_kill.py",
    "tests/test_docs.py::TestDocumentedCommandsInProcess",
    "plugins/megatron/tests/test_megatron_moe.py",
    "tests/test_rollout_replicas.py",
    "tests/test_executors.py",
    "tests/test_docs.py::TestDocumentedCommandsWithProcesses",
    "tests/test_placement.py",
    "tests/test_agents.py",
    "tests/test_ray_nodes.py",
    "tests/test_role_workers.py",
    "tests/test_text_job.py",
    "tests/test_moe_jobs.py",
    "tests/test_ray_cleanup.py",
)


def work_unit(nodeid: str, backends: Sequence[str]) -> str:
    """The unit of work ``nodeid`` belongs to: its class, else its module; a kit test's module
    and engine (``contract.py[NAME]``, NAME among ``backends``)."""
    scope = nodeid.split("[", 1)[0].rsplit("::", 1)[0]
    if scope == KIT_MODULE and nodeid.endswith("]"):
        params = nodeid[nodeid.index("[") + 1 : -1].split("-")
        backend = next((p for p in params if p in backends), None)
        if backend is not None:
            return f"{scope}[{backend}]"
    return scope


def _backends(config: pytest.Config) -> list[str]:
    return list(config.getoption("engine_core_backend", None) or [])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    backends = _backends(config)
    units = [work_unit(item.nodeid, backends) for item in items]
    counts = Counter(units)
    first = {unit: n for n, unit in enumerate(dict.fromkeys(units))}
    rank = {unit: n for n, unit in enumerate(LONG_UNITS)}
    key = {unit: (rank.get(unit, len(LONG_UNITS)), -counts[unit], first[unit]) for unit in counts}
    order = sorted(range(len(items)), key=lambda i: key[units[i]])  # stable within a unit
    items[:] = [items[i] for i in order]


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist", None) != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    backends = _backends(config)

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid, backends)

    return Units(config, log)


@pytest.fixture(scope="session")
def job_server() -> Iterator[Any]:
    """One fork server per pytest worker for the tests that run ``engine-core`` commands and
    the documentation's examples (``tests/_forkserver.py``: ``JOB_RUNNER``), started in the
    repository's root: its imports are paid once, not once per module."""
    from tests._forkserver import JOB_RUNNER, ForkServer

    server = ForkServer(
        JOB_RUNNER, cwd=Path(__file__).parents[1], env={**os.environ, "RAY_AUTH_MODE": "disabled"}
    )
    yield server
    server.close()


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """One local Ray instance (2 CPUs, no auth token written) for every Ray test."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def recipe_reward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reward model on the default recipe's architecture and vocabulary (random weights)."""
    from engine_core.configio import load_yaml
    from tests._models import save_reward_model

    recipe = RECIPES / "grpo_tiny.yaml"
    folder = tmp_path_factory.mktemp("recipe_rm")
    save_reward_model(folder, load_yaml(recipe)["engine"]["model"]["config"])
    return folder


@pytest.fixture(scope="session")
def vl_chat_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """A tiny Qwen2.5-VL folder with its tokenizer, a chat template rendering image parts, and
    an image processor (``tests/fixtures/vl_chat.py``); and its tokenizer."""
    from tests.fixtures.vl_chat import build_vl_chat_folder

    folder = tmp_path_factory.mktemp("qwen2_5_vl_chat")
    return str(folder), build_vl_chat_folder(folder)


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A checkpoint root: a local folder, or an fsspec ``memory://`` URL (removed afterwards)."""
    if request.param == "local":
        yield str(tmp_path / "ckpt")
        return
    import fsspec

    url = f"memory://{request.node.name.replace('[', '-').rstrip(']')}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)
