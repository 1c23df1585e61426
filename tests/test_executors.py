"""The same dispatch/collect through every executor: in-process, local processes, Ray."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict

from engine_core.errors import DispatchError, MeshRegistrationError
from engine_core.executors import LocalWorkerGroup, WorkerGroup
from tests._workers import MeshWorker

EXECUTORS = ["in_process", "processes", pytest.param("ray", marks=pytest.mark.ray)]


def make_group(kind: str, request: pytest.FixtureRequest, n: int, **init: Any) -> WorkerGroup:
    if kind == "ray":
        request.getfixturevalue("ray_session")
        from engine_core.executors import RayWorkerGroup

        group: WorkerGroup = RayWorkerGroup(MeshWorker, n, init_kwargs=init)
    else:
        group = LocalWorkerGroup(MeshWorker, n, init_kwargs=init, in_process=kind == "in_process")
    group.execute("setup", list(range(n)))
    return group


def data(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(n)}, batch_size=[n])


@pytest.mark.parametrize("kind", EXECUTORS)
def test_nd_dispatch_dp2_tp2(kind: str, request: pytest.FixtureRequest) -> None:
    with make_group(kind, request, 4, tp=2, world=4) as group:
        out = group.execute("square", data(6))
        assert torch.equal(out["y"], torch.arange(6).float() ** 2)
        assert out["rank"].tolist() == [0, 0, 0, 2, 2, 2]  # one collector per dp rank, dp order
        # replicas of a dp rank receive the same chunk
        per_worker = group._call(
            "digest", [((data(6)[i * 3 : i * 3 + 3],), {}) for i in (0, 0, 1, 1)]
        )
        assert per_worker[0] == per_worker[1] and per_worker[2] == per_worker[3]
        collected = group.execute("digest", data(6))
        assert collected == [0 + 1 + 2, 3, 3 + 4 + 5, 3]


@pytest.mark.parametrize("kind", EXECUTORS)
def test_not_divisible_is_padded_and_trimmed(kind: str, request: pytest.FixtureRequest) -> None:
    with make_group(kind, request, 2, world=2) as group:
        out = group.execute("square", data(5))
        assert torch.equal(out["y"], torch.arange(5).float() ** 2)


@pytest.mark.parametrize("bad", ["two_collectors", "missing_dp"])
@pytest.mark.parametrize("kind", EXECUTORS)
def test_misregistered_mesh_is_an_error(
    kind: str, bad: str, request: pytest.FixtureRequest
) -> None:
    with make_group(kind, request, 4, tp=2, world=4, bad=bad) as group:
        with pytest.raises(MeshRegistrationError):
            group.execute("square", data(4))


@pytest.mark.parametrize("kind", EXECUTORS)
def test_worker_error_surfaces_with_its_traceback(
    kind: str, request: pytest.FixtureRequest
) -> None:
    with make_group(kind, request, 2, world=2) as group:
        with pytest.raises((DispatchError, ValueError), match="fails on purpose"):
            group.call_all("fail")


@pytest.mark.parametrize("kind", ["processes", pytest.param("ray", marks=pytest.mark.ray)])
def test_workers_form_a_real_gloo_group(kind: str, request: pytest.FixtureRequest) -> None:
    with make_group(kind, request, 2, world=2) as group:
        assert group.call_all("all_reduce_rank") == [1.0, 1.0]


def test_all_to_all_through_a_group() -> None:
    with LocalWorkerGroup(MeshWorker, 3, init_kwargs={"world": 3}, in_process=True) as group:
        group.execute("setup", [0, 1, 2])
        assert group.execute("echo", [1, 2, 3]) == [10, 21, 32]


@pytest.mark.parametrize("kind", ["processes", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_dead_worker_is_named_not_its_waiting_peer(
    kind: str, request: pytest.FixtureRequest
) -> None:
    with make_group(kind, request, 2, world=2) as group:
        assert group.call_all("all_reduce_rank") == [1.0, 1.0]  # the group is formed
        with pytest.raises(DispatchError) as failed:
            group.call_all("die_in_a_collective", 1)
    first = str(failed.value).splitlines()[0]
    assert first.startswith("worker 1 died during 'die_in_a_collective'"), str(failed.value)
