"""The same dispatch/collect through every executor: in-process, local processes, Ray."""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from engine_core.errors import ConfigError, DispatchError, MeshRegistrationError
from engine_core.executors import LocalWorkerGroup, WorkerGroup, worker_env
from engine_core.executors.base import host_rendezvous
from engine_core.settings import ENV_COLLECTIVE_TIMEOUT, ENV_WORKER_START, Settings
from tests._workers import MeshWorker

EXECUTORS = ["in_process", "processes", pytest.param("ray", marks=pytest.mark.ray)]


def make_group(
    kind: str,
    request: pytest.FixtureRequest | None,
    n: int,
    executor: Mapping[str, Any] | None = None,
    **init: Any,
) -> WorkerGroup:
    """A group of ``n`` MeshWorkers built with ``init``; ``executor``: the executor's options."""
    options = dict(executor or {})
    if kind == "ray":
        assert request is not None
        request.getfixturevalue("ray_session")
        from engine_core.executors import RayWorkerGroup

        group: WorkerGroup = RayWorkerGroup(MeshWorker, n, init_kwargs=init, **options)
    else:
        group = LocalWorkerGroup(
            MeshWorker, n, init_kwargs=init, in_process=kind == "in_process", **options
        )
    group.execute("setup", list(range(n)))
    return group


def data(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(n)}, batch_size=[n])


# One group of four workers (dp=2 x tp=2) for each executor, shared by the tests below that
# leave it as they found it (its workers alive and answering): a group's start is most of what
# such a test costs, above all on Ray. Tests that kill a worker, time a call out or change the
# group's timeouts start groups of their own.
_SHARED: dict[str, WorkerGroup] = {}


@pytest.fixture(scope="module", autouse=True)
def _shared_groups() -> Any:
    yield
    while _SHARED:
        _SHARED.popitem()[1].shutdown()


def shared(kind: str, request: pytest.FixtureRequest) -> WorkerGroup:
    if kind not in _SHARED:
        _SHARED[kind] = make_group(kind, request, 4, tp=2, world=4)
    return _SHARED[kind]


@pytest.mark.parametrize("kind", EXECUTORS)
def test_nd_dispatch_dp2_tp2(kind: str, request: pytest.FixtureRequest) -> None:
    group = shared(kind, request)
    out = group.execute("square", data(6))
    assert torch.equal(out["y"], torch.arange(6).float() ** 2)
    assert out["rank"].tolist() == [0, 0, 0, 2, 2, 2]  # one collector per dp rank, dp order
    # replicas of a dp rank receive the same chunk
    per_worker = group._call("digest", [((data(6)[i * 3 : i * 3 + 3],), {}) for i in (0, 0, 1, 1)])
    assert per_worker[0] == per_worker[1] and per_worker[2] == per_worker[3]
    collected = group.execute("digest", data(6))
    assert collected == [0 + 1 + 2, 3, 3 + 4 + 5, 3]


@pytest.mark.parametrize("kind", EXECUTORS)
def test_not_divisible_is_padded_and_trimmed(kind: str, request: pytest.FixtureRequest) -> None:
    out = shared(kind, request).execute("square", data(5))  # 5 samples over dp=2
    assert torch.equal(out["y"], torch.arange(5).float() ** 2)


@pytest.mark.parametrize("bad", ["two_collectors", "missing_dp"])
@pytest.mark.parametrize("kind", EXECUTORS)
def test_misregistered_mesh_is_an_error(
    kind: str, bad: str, request: pytest.FixtureRequest
) -> None:
    with pytest.raises(MeshRegistrationError, match=f"mesh '{bad}'"):
        shared(kind, request).execute(f"square_on_{bad}", data(4))


@pytest.mark.parametrize("kind", EXECUTORS)
def test_worker_error_surfaces_with_its_traceback(
    kind: str, request: pytest.FixtureRequest
) -> None:
    with pytest.raises((DispatchError, ValueError), match="fails on purpose"):
        shared(kind, request).call_all("fail")


@pytest.mark.parametrize("kind", ["processes", pytest.param("ray", marks=pytest.mark.ray)])
def test_workers_form_a_real_gloo_group(kind: str, request: pytest.FixtureRequest) -> None:
    assert shared(kind, request).call_all("all_reduce_rank") == [6.0] * 4


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


@pytest.mark.parametrize("kind", ["processes", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_call_past_call_timeout_names_the_worker_that_did_not_answer(
    kind: str, request: pytest.FixtureRequest
) -> None:
    with make_group(kind, request, 2, world=2) as group:
        # starting the workers may take long; the timeout may be lowered once they are up
        group.call_timeout_s = 0.5
        start = time.monotonic()
        with pytest.raises(DispatchError) as late:
            group.call_all("nap", 1, 3.0)
        waited = time.monotonic() - start
        group.call_timeout_s = 60
    assert waited < 2.5, waited
    assert str(late.value).startswith("worker 1: no answer to 'nap' within call_timeout_s=0.5 s")
    assert "worker 0" not in str(late.value)


@pytest.mark.parametrize("kind", ["processes", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_collective_missing_a_rank_fails_after_collective_timeout(
    kind: str, request: pytest.FixtureRequest
) -> None:
    timeouts = {"collective_timeout_s": 3, "call_timeout_s": 120}
    with make_group(kind, request, 2, timeouts, world=2) as group:
        assert group.call_all("all_reduce_rank") == [1.0, 1.0]  # the group is formed
        start = time.monotonic()
        with pytest.raises(DispatchError) as stuck:
            group.call_all("skip_a_collective", 1)  # worker 1 never joins; torch's default: 30 min
        waited = time.monotonic() - start
    message = str(stuck.value)
    assert message.startswith("worker 0 raised in 'skip_a_collective'"), message
    assert "timed out" in message.lower(), message  # the collective's own error, not a hang
    assert "no answer" not in message and "worker 1" not in message, message
    assert 2.5 < waited < 60, waited


def test_a_failed_worker_is_named_at_once_not_when_its_waiting_peer_times_out() -> None:
    # worker 1 waits for worker 0 in a collective for up to 600 s; the call fails within the
    # grace the executor gives peers after a first failure, naming worker 0's error first
    with make_group("processes", None, 2, {"collective_timeout_s": 600}, world=2) as group:
        assert group.call_all("all_reduce_rank") == [1.0, 1.0]  # the group is formed
        start = time.monotonic()
        with pytest.raises(DispatchError) as failed:
            group.call_all("raise_or_wait", 0)
        waited = time.monotonic() - start
        message = str(failed.value)
        assert isinstance(failed.value, ValueError)  # worker 0's error, as its own type
        assert message.startswith("worker 0 raised in 'raise_or_wait'"), message
        assert "fails before the collective" in message, message
        assert "worker 1: no answer to 'raise_or_wait' within 10 s of the failure above" in message
        assert waited < 60, waited
        # worker 1's late answer must never be taken for the next call's
        with pytest.raises(DispatchError, match="did not all answer 'raise_or_wait'"):
            group.call_all("whoami")


def test_the_rendezvous_port_is_held_while_the_group_lives() -> None:
    # the port is bound by the store this process hosts, so no other process can take it
    # between choosing it and the workers meeting there
    store, port = host_rendezvous(2)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    del store


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"call_timeout_s": 0}, "call_timeout_s=0 is not allowed"),
        ({"call_timeout_s": -1.0}, "call_timeout_s=-1.0 is not allowed"),
        ({"call_timeout_s": float("inf")}, "call_timeout_s=inf is not allowed"),
        ({"call_timeout_s": "600"}, "call_timeout_s='600' is not allowed"),
        ({"collective_timeout_s": float("nan")}, "collective_timeout_s=nan is not allowed"),
        ({"collective_timeout_s": True}, "collective_timeout_s=True is not allowed"),
    ],
)
def test_invalid_timeouts_are_refused_before_any_worker_starts(
    options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError, match="use a positive, finite number of seconds") as bad:
        LocalWorkerGroup(MeshWorker, 2, **options)
    assert str(bad.value).startswith(named)
    with LocalWorkerGroup(MeshWorker, 1, in_process=True) as group:
        with pytest.raises(ConfigError, match="call_timeout_s=0 is not allowed"):
            group.call_timeout_s = 0
        assert group.call_timeout_s == 600.0


def test_the_collective_timeout_reaches_the_workers_environment() -> None:
    env = worker_env(0, 2, 1234, {ENV_COLLECTIVE_TIMEOUT: "9"}, collective_timeout_s=3)
    assert Settings.from_env(env).collective_timeout == datetime.timedelta(seconds=3)
    assert Settings.from_env(worker_env(0, 2, 1234)).collective_timeout is None
    with pytest.raises(ConfigError, match=f"{ENV_COLLECTIVE_TIMEOUT}='soon' is not a timeout"):
        Settings.from_env({ENV_COLLECTIVE_TIMEOUT: "soon"})


@pytest.mark.parametrize("kind", EXECUTORS)
def test_non_blocking_calls_return_futures(kind: str, request: pytest.FixtureRequest) -> None:
    """The calls are sent at once; their results (or errors) come when asked for, the same
    every time they are asked for."""
    group = shared(kind, request)
    pending = group.call_all_async("nap", 1, 0.3)
    busy = torch.randn(64, 64) @ torch.randn(64, 64)  # this process works meanwhile
    assert pending.result() == [0, 1, 2, 3] and busy.shape == (64, 64)
    assert pending.result() == [0, 1, 2, 3]
    nd = group.execute_async("square", data(5))
    assert torch.equal(nd.result()["y"], torch.arange(5).float() ** 2)
    each = group.call_each_async("echo", [(1,), (2,), (3,), (4,)])
    assert each.result() == [10, 21, 32, 43]
    with pytest.raises(DispatchError, match="one argument tuple per worker"):
        group.call_each_async("echo", [(1,)])
    failing = group.call_all_async("fail")
    for _ in range(2):
        with pytest.raises((DispatchError, ValueError), match="fails on purpose"):
            failing.result()
    assert group.call_all("whoami") == [0, 1, 2, 3]  # the group is usable after a failed call


def test_a_second_call_while_one_is_in_flight_is_refused(request: pytest.FixtureRequest) -> None:
    """One call at a time per group of processes: a second is refused, naming the first,
    until the first's result is taken."""
    with make_group("processes", request, 2, world=2) as group:
        pending = group.call_all_async("nap", 0, 0.2)
        with pytest.raises(DispatchError, match=r"'whoami' was called while 'nap' is still in"):
            group.call_all("whoami")
        assert pending.result() == [0, 1]
        assert group.call_all("whoami") == [0, 1]


@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_workers_start_either_way_with_the_callers_environment(
    start: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spawned, or forked from a fork server: the workers form their gloo group and see the
    environment of the call that started them, not the one the fork server started with."""
    monkeypatch.setenv(ENV_WORKER_START, start)
    with LocalWorkerGroup(MeshWorker, 2, init_kwargs={"world": 2}) as first:
        first.execute("setup", [0, 1])
        assert first.call_all("all_reduce_rank") == [1.0, 1.0]
        # a changed environment starts a new fork server while the first one's workers live
        # (it must not wait for them to end); the new workers see the new value
        monkeypatch.setenv("ENGINE_CORE_TEST_MARK", start)
        with LocalWorkerGroup(MeshWorker, 2, init_kwargs={"world": 2}) as second:
            second.execute("setup", [0, 1])
            assert second.call_all("getenv", "ENGINE_CORE_TEST_MARK") == [start, start]
            assert second.call_all("getenv", "RANK") == ["0", "1"]
        assert first.call_all("getenv", "ENGINE_CORE_TEST_MARK") == [None, None]
        assert first.call_all("all_reduce_rank") == [1.0, 1.0]


def test_an_unknown_start_method_is_refused_before_any_worker_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_WORKER_START, "thread")
    with pytest.raises(ConfigError, match="ENGINE_CORE_WORKER_START='thread' is not a start"):
        LocalWorkerGroup(MeshWorker, 2, init_kwargs={"world": 2})
