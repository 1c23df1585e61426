"""A worker's error reaches the driver with its type, its message and its traceback.

Workers send their errors as plain data (engine_core.executors.worker_errors); the driver
raises engine-core and builtin errors as their own class (also a DispatchError, as before),
any other as a DispatchError naming it, with the worker's traceback as the ``__cause__``.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_core.errors import ConfigError, DispatchError, RunFailed
from engine_core.executors import LocalWorkerGroup, WorkerGroup
from engine_core.executors.worker_errors import (
    RemoteTraceback,
    WorkerErrorInfo,
    error_payload,
    rebuild_error,
    worker_failure,
)

KINDS = ["processes", pytest.param("ray", marks=pytest.mark.ray)]


class Custom(Exception):
    """An error class of the worker's own code: not on the driver's allow-list."""


CUSTOM = f"{Custom.__module__}.Custom"  # the module's name depends on pytest's import mode


def _deep_inside_the_worker(kind: str, rank: int) -> None:
    if kind == "value":
        raise ValueError("x")
    if kind == "config":
        raise ConfigError("bad knob: use 1 to 8")
    if kind == "custom":
        raise Custom("made here")
    if kind == "run_failed":  # an engine-core error whose constructor takes more than a message
        raise RunFailed("stopped", Path("/nowhere/run.log"))
    if kind == "key":
        raise KeyError("k")
    if kind == "everyone":
        raise ValueError(f"rank {rank} failed too")


class Raiser:
    """Worker 1 raises what it is asked to (every worker for "everyone"); worker 0 answers."""

    def __init__(self, fail_to_start: str | None = None) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        if fail_to_start is not None and self.rank == 1:
            raise ConfigError(fail_to_start)

    def raise_in_worker(self, kind: str) -> int:
        if self.rank == 1 or kind == "everyone":
            _deep_inside_the_worker(kind, self.rank)
        return self.rank


def _start(kind: str, request: pytest.FixtureRequest, **init: str) -> WorkerGroup:
    if kind == "ray":
        ray = request.getfixturevalue("ray_session")
        from engine_core.executors import RayWorkerGroup

        # this module is imported by path, not as a package's: Ray's workers get its classes
        # by value, not by a module name they could not import
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

        return RayWorkerGroup(Raiser, 2, init_kwargs=init)
    return LocalWorkerGroup(Raiser, 2, init_kwargs=init)


@pytest.fixture(scope="module", params=KINDS)
def group(request: pytest.FixtureRequest) -> Iterator[WorkerGroup]:
    started = _start(request.param, request)
    yield started
    started.shutdown()


def _remote_traceback(error: BaseException) -> str:
    assert isinstance(error.__cause__, RemoteTraceback), repr(error.__cause__)
    return str(error.__cause__)


def test_a_builtin_error_keeps_its_type_message_and_traceback(group: WorkerGroup) -> None:
    with pytest.raises(ValueError) as failed:
        group.call_all("raise_in_worker", "value")
    error = failed.value
    assert error.args == ("x",)  # the worker's message, intact
    assert str(error) == "worker 1 raised in 'raise_in_worker': ValueError: x"
    assert isinstance(error, DispatchError)  # what every worker failure was before
    assert (error.worker, error.remote_type) == (1, "builtins.ValueError")  # type: ignore[attr-defined]
    remote = _remote_traceback(error)
    assert "Traceback (most recent call last)" in remote and "_deep_inside_the_worker" in remote
    assert remote.rstrip().endswith("ValueError: x")
    assert group.call_all("raise_in_worker", "nothing") == [0, 1]  # the group is still usable


def test_an_engine_core_error_keeps_its_type(group: WorkerGroup) -> None:
    with pytest.raises(ConfigError) as failed:
        group.call_all("raise_in_worker", "config")
    assert failed.value.args == ("bad knob: use 1 to 8",)
    assert str(failed.value) == (
        "worker 1 raised in 'raise_in_worker': engine_core.errors.ConfigError: bad knob: use 1 to 8"
    )
    assert "_deep_inside_the_worker" in _remote_traceback(failed.value)


def test_a_class_off_the_allow_list_arrives_as_a_dispatch_error_naming_it(
    group: WorkerGroup,
) -> None:
    with pytest.raises(DispatchError) as failed:
        group.call_all("raise_in_worker", "custom")
    assert type(failed.value) is DispatchError
    assert str(failed.value) == f"worker 1 raised in 'raise_in_worker': {CUSTOM}: made here"
    assert "_deep_inside_the_worker" in _remote_traceback(failed.value)


@pytest.mark.parametrize(
    ("kind", "raised", "named"),
    [
        # allowed, but its constructor needs a log_path: not rebuilt, named
        ("run_failed", DispatchError, "engine_core.errors.RunFailed: stopped"),
        ("key", KeyError, "KeyError: 'k'"),  # str() of a KeyError is its key's repr
    ],
)
def test_an_allowed_class_is_rebuilt_only_when_it_says_the_same(
    group: WorkerGroup, kind: str, raised: type[Exception], named: str
) -> None:
    with pytest.raises(raised) as failed:
        group.call_all("raise_in_worker", kind)
    assert str(failed.value) == f"worker 1 raised in 'raise_in_worker': {named}"
    if raised is KeyError:
        assert failed.value.args == ("k",)
    else:
        assert type(failed.value) is DispatchError
    assert "_deep_inside_the_worker" in _remote_traceback(failed.value)


def test_every_failing_worker_is_named_and_every_traceback_is_the_cause(
    group: WorkerGroup,
) -> None:
    with pytest.raises(ValueError) as failed:
        group.call_all("raise_in_worker", "everyone")
    lines = str(failed.value).splitlines()
    assert lines == [
        "worker 0 raised in 'raise_in_worker': ValueError: rank 0 failed too",
        "worker 1 raised in 'raise_in_worker': ValueError: rank 1 failed too",
    ]
    assert failed.value.args in {("rank 0 failed too",), ("rank 1 failed too",)}  # first in
    remote = _remote_traceback(failed.value)
    assert "worker 0, in 'raise_in_worker'" in remote and "worker 1, in 'raise_in_worker'" in remote
    assert remote.count(", in _deep_inside_the_worker\n") == 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_worker_that_fails_to_start_raises_its_error_type(
    kind: str, request: pytest.FixtureRequest
) -> None:
    with pytest.raises(ConfigError) as failed:
        _start(kind, request, fail_to_start="no such device")
    assert failed.value.args == ("no such device",)
    started = "raised in '__init__'" if kind == "processes" else "failed to start"
    assert str(failed.value) == (
        f"worker 1 {started}: engine_core.errors.ConfigError: no such device"
    )
    assert "in __init__" in _remote_traceback(failed.value)


# -- the wire and the allow-list, without processes ------------------------------------------


def _payload(error: BaseException) -> dict[str, object]:
    try:
        raise error
    except BaseException as e:
        return error_payload(e)


def test_the_wire_is_plain_json_data() -> None:
    for error in (ConfigError("a", 1, 2.5, None), ValueError(Path("/x")), Custom()):
        payload = _payload(error)
        assert json.loads(json.dumps(payload)) == payload
    assert _payload(ConfigError("a", 1, 2.5, None))["args"] == ["a", 1, 2.5, None]
    assert _payload(ValueError(Path("/x")))["args"] is None  # a Path is not plain: dropped
    assert _payload(Custom())["type"] == CUSTOM


@pytest.mark.parametrize(
    "name",
    [
        "os.system",
        "subprocess.Popen",
        "antigravity.Fly",
        "this.s",
        "builtins.eval",
        "builtins.__import__",
        "builtins.object",
        "builtins.KeyboardInterrupt",  # not an Exception: the driver is not interrupted
        "builtins.SystemExit",
        "builtins.ValueError.__init__",
        "engine_core.errors.__builtins__",
        "engine_core.errors.os",
        "engine_core.errors.ConfigError; import os",
        CUSTOM,  # imported here, and still not allowed
        "ValueError",
        "",
        "../../etc/passwd",
    ],
)
def test_a_class_name_from_the_other_side_is_never_imported_or_called(name: str) -> None:
    modules = set(sys.modules)
    error = rebuild_error(WorkerErrorInfo(name, "m", ("m",), "tb"), "worker 3 raised", 3)
    assert type(error) is DispatchError and str(error) == "worker 3 raised"
    assert error.remote_type == name  # type: ignore[attr-defined]
    assert set(sys.modules) == modules


@pytest.mark.parametrize(
    "payload",
    [
        "just text",
        None,
        ["builtins.ValueError", "m"],
        {"type": 5, "message": b"m", "args": {"a": 1}, "traceback": 7},
        {"type": "builtins.ExceptionGroup", "message": "m", "args": None, "traceback": "tb"},
    ],
)
def test_a_garbled_payload_gives_a_dispatch_error(payload: object) -> None:
    error = worker_failure("worker 0 raised in 'm'", {0: payload}, method="m")
    assert type(error) is DispatchError and str(error) == "worker 0 raised in 'm'"
    assert isinstance(error.__cause__, RemoteTraceback)


def test_args_that_are_not_plain_fall_back_to_the_message() -> None:
    payload = {"type": "builtins.ValueError", "message": "m", "args": [{"x": 1}], "traceback": ""}
    error = worker_failure("s", {0: payload}, method="m")
    assert isinstance(error, ValueError) and error.args == ("m",)


def test_a_worker_that_died_is_the_failure_not_what_its_peers_raised() -> None:
    error = worker_failure("worker 0 died", {1: _payload(ValueError("v"))}, method="m", typed=False)
    assert type(error) is DispatchError
    assert "ValueError: v" in _remote_traceback(error)


def test_a_rebuilt_error_pickles_as_itself() -> None:
    error = worker_failure("worker 2 raised", {2: _payload(ConfigError("c"))}, method="m")
    again = pickle.loads(pickle.dumps(error))
    assert isinstance(again, ConfigError) and isinstance(again, DispatchError)
    assert (again.args, str(again), again.worker) == (("c",), "worker 2 raised", 2)
