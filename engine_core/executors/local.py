"""The local executor: workers in this process, or one process each (spawned by default).

Multi-process workers get the rendezvous environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ...) before their class is constructed, so they can form a real gloo (or NCCL)
group. Calls are sent to every worker before any result is awaited, so workers that meet in a
collective do not deadlock. Tensors travel through shared memory (torch's pickler).

Two timeouts bound a call: ``call_timeout_s``, after which a worker that has not answered is
named in a :class:`DispatchError`, and ``collective_timeout_s``, handed to the worker processes
for their process group (:func:`join_process_group`), after which a collective that waits for a
rank fails in the ranks that wait; in-process workers have neither.

A worker process sends its errors as plain data, and the error is raised here again as its own
class where that is an engine-core or builtin one (:mod:`engine_core.executors.worker_errors`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Mapping
from multiprocessing.connection import wait
from typing import Any

from engine_core.errors import DispatchError
from engine_core.executors.base import (
    DEFAULT_CALL_TIMEOUT_S,
    FAILURE_GRACE_S,
    Calls,
    WorkerFuture,
    WorkerGroup,
    enter_worker_env,
    host_rendezvous,
    no_answer,
    worker_env,
)
from engine_core.executors.forkserver import worker_context
from engine_core.executors.worker_errors import WorkerErrorInfo, error_payload, worker_failure
from engine_core.launch import adopt_environment, caller_environment, own_session

__all__ = ["LocalWorkerGroup"]

_STOP = "__stop__"


def _serve(
    conn: Any,
    cls: type,
    init_args: tuple,
    init_kwargs: dict,
    env: dict[str, str],
    caller_env: dict[str, str] | None = None,
) -> None:
    own_session()  # a signal to the caller's process group is the caller's to handle
    if caller_env is not None:  # forked from a fork server: its environment, not the caller's
        adopt_environment(caller_env)
    enter_worker_env(env)
    try:
        worker = cls(*init_args, **init_kwargs)
        conn.send(("ok", None))
    except BaseException as e:
        conn.send(("error", error_payload(e)))  # plain data, never the exception object
        return
    # a caller gone (its pipe closed: it does not wait for the stop's answer) is told nothing
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        while True:
            try:
                method, args, kwargs = conn.recv()
            except EOFError:
                return
            if method == _STOP:
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", getattr(worker, method)(*args, **kwargs)))
            except BaseException as e:
                conn.send(("error", error_payload(e)))


# what a fork server imports besides the worker's own module, where installed: the engines and
# the rollout every role worker builds, and what they import
_PRELOAD = (
    "transformers",
    "engine_core_fsdp.fsdp2",
    "engine_core_fsdp.fsdp1",
    "engine_core_hf.rollout",
)


def _preloaded() -> list[str]:
    return [m for m in _PRELOAD if _installed(m)]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its package is not installed
        return False


class LocalWorkerGroup(WorkerGroup):
    """``num_workers`` instances of ``worker_cls``, in this process or in processes of their own
    (spawned, or forked from a fork server: :mod:`engine_core.executors.forkserver`)."""

    def __init__(
        self,
        worker_cls: type,
        num_workers: int,
        *,
        init_args: tuple[Any, ...] = (),
        init_kwargs: Mapping[str, Any] | None = None,
        in_process: bool = False,
        env: Mapping[str, str] | None = None,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        collective_timeout_s: float | None = None,
    ) -> None:
        super().__init__(
            worker_cls,
            num_workers,
            call_timeout_s=call_timeout_s,
            collective_timeout_s=collective_timeout_s,
        )
        self.in_process = in_process
        self._workers: list[Any] = []
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._in_flight: str | None = None  # the method of the call sent and not yet gathered
        self._store: Any = None  # the rendezvous this process hosts for the workers
        self._unanswered: str | None = None  # a call some worker never answered
        if in_process:
            self._workers = [
                worker_cls(*init_args, **dict(init_kwargs or {})) for _ in range(num_workers)
            ]
            return
        self._start(worker_cls, init_args, dict(init_kwargs or {}), env)
        try:
            self._gather("__init__")
        except BaseException:
            self.shutdown()
            raise

    def _start(
        self,
        worker_cls: type,
        init_args: tuple[Any, ...],
        init_kwargs: dict,
        env: Mapping[str, str] | None,
    ) -> None:
        """One process per worker, each with a pipe (``self._conns``) it answers on: spawned,
        or forked from a fork server (``ENGINE_CORE_WORKER_START=forkserver``)."""
        num_workers = self.num_workers
        ctx = worker_context(_preloaded(), worker_cls.__module__)
        caller_env = None if ctx.get_start_method() == "spawn" else caller_environment()
        self._store, port = host_rendezvous(num_workers)
        for rank in range(num_workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve,
                args=(
                    child,
                    worker_cls,
                    init_args,
                    init_kwargs,
                    worker_env(
                        rank,
                        num_workers,
                        port,
                        env,
                        collective_timeout_s=self.collective_timeout_s,
                        hosted=True,
                    ),
                    caller_env,
                ),
                # not daemonic: a worker may start processes of its own (megatron-core's
                # checkpoint writers do); shutdown() stops every worker, and a worker whose
                # parent is gone exits when its pipe closes
                daemon=False,
            )
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)

    def _gather(self, method: str, deadline: float | None = None) -> list[Any]:
        if deadline is None:  # for the whole call, not per worker
            deadline = time.monotonic() + self.call_timeout_s
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        raised: dict[int, object] = {}  # each worker's error payload, first to arrive first
        died: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            # after a first failure, give the other workers a moment to report theirs: a failed
            # worker's peers fail (or hang) in collectives, and the failed one must be named
            # now, not when the call's whole time is up
            end = (
                deadline
                if not (failures or died)
                else min(deadline, time.monotonic() + FAILURE_GRACE_S)
            )
            ready = wait(list(pending.values()), timeout=max(end - time.monotonic(), 0.0))
            if not ready:
                break
            for i in [i for i, conn in pending.items() if conn in ready]:
                conn, proc = pending.pop(i), self._procs[i]
                try:
                    status, payload = conn.recv()
                except EOFError:
                    proc.join(timeout=5)
                    died[i] = f"worker {i} died during {method!r} (exit code {proc.exitcode})"
                    continue
                if status == "ok":
                    results[i] = payload
                else:
                    raised[i] = payload
                    described = WorkerErrorInfo.parse(payload).describe()
                    failures[i] = f"worker {i} raised in {method!r}: {described}"
        if pending:  # an answer that comes later would be taken for the next call's
            self._unanswered = method
        for i in pending:  # no answer in time
            proc = self._procs[i]
            alive = "alive" if proc.is_alive() else f"dead (exit code {proc.exitcode})"
            line = no_answer(
                i, method, after_failure=bool(failures or died), call_timeout_s=self.call_timeout_s
            )
            failures[i] = f"{line} ({alive})"
        if died or failures:
            # a dead worker leaves its peers failing (or hanging) in collectives: name it first
            head = (
                [f"{'; '.join(died.values())}; the other failures follow from it:"] if died else []
            )
            summary = "\n".join(head + [failures[i] for i in sorted(failures)])
            # the first error raised keeps its type (when allowed), the tracebacks its cause
            raise worker_failure(summary, raised, method=method, typed=not died)
        return [results[i] for i in range(len(self._conns))]

    def _submit(self, method: str, calls: Calls) -> WorkerFuture:
        if self.in_process:
            return WorkerFuture.finished(method, lambda: self._run_here(method, calls))
        if not self._conns:
            raise DispatchError("this worker group has been shut down.")
        if self._unanswered is not None:
            raise DispatchError(
                f"{method!r} was called on a worker group whose workers did not all answer "
                f"{self._unanswered!r}; shut this group down and start a new one."
            )
        if self._in_flight is not None:
            raise DispatchError(
                f"{method!r} was called while {self._in_flight!r} is still in flight on this "
                f"worker group; take the first call's result() before starting another."
            )
        for conn, (args, kwargs) in zip(self._conns, calls, strict=True):
            conn.send((method, args, kwargs))
        self._in_flight = method
        deadline = time.monotonic() + self.call_timeout_s  # for the whole call, from now

        def wait() -> list[Any]:
            try:
                return self._gather(method, deadline)
            finally:
                self._in_flight = None

        return WorkerFuture(wait, method)

    def _run_here(self, method: str, calls: Calls) -> list[Any]:
        out = []
        for i, (worker, (args, kwargs)) in enumerate(zip(self._workers, calls, strict=True)):
            try:
                out.append(getattr(worker, method)(*args, **kwargs))
            except Exception as e:
                e.add_note(f"(in worker {i} of {type(worker).__name__}.{method})")
                raise
        return out

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, worker ``i`` at ``i`` (empty for workers in this
        process): for monitoring them from outside (memory, open files)."""
        return [proc.pid for proc in self._procs]

    def shutdown(self) -> None:
        for conn in self._conns:
            try:
                conn.send((_STOP, (), {}))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._conns, self._procs, self._workers = [], [], []
        self._store = None
