"""The Ray executor: one Ray actor per worker, same dispatch/collect as the local executor.

Needs the optional extra: ``pip install 'engine-core[ray]'``. Ray is imported only when a
``RayWorkerGroup`` is created. Ray writes an auth token under the home directory unless
``RAY_AUTH_MODE=disabled`` is set before ``ray.init``; set it where that matters (tests do).
Actors ask for ``num_cpus`` each (default 0.01) so small hosts can place several. The timeouts
are the local executor's: ``call_timeout_s`` per call (and for the actors to start),
``collective_timeout_s`` for the workers' process group. A worker's errors are raised as the
local executor raises them (:mod:`engine_core.executors.worker_errors`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
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
    worker_env,
)
from engine_core.executors.worker_errors import WorkerErrorInfo, error_payload, worker_failure

__all__ = ["RayWorkerGroup"]


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "RayWorkerGroup needs Ray, which is not installed. Install it with: "
            "pip install 'engine-core[ray]'"
        ) from e
    return ray


class _Host:
    """Holds one worker inside a Ray actor; the environment is set before it is built.

    The worker's errors come back as plain data (:func:`error_payload`), as from the local
    executor's processes, so both raise the same types; what Ray itself raises (an actor
    that died, an interrupt) stays Ray's.
    """

    def __init__(self, cls: type, init_args: tuple, init_kwargs: dict, env: dict[str, str]) -> None:
        self.failed: dict[str, Any] | None = None
        try:
            enter_worker_env(env)
            self.worker = cls(*init_args, **init_kwargs)
        except Exception as e:
            self.failed = error_payload(e)

    def ready(self) -> dict[str, Any] | None:
        """None once the worker is built; else the error its construction raised."""
        return self.failed

    def call(self, method: str, args: tuple, kwargs: dict) -> tuple[str, Any]:
        try:
            return ("ok", getattr(self.worker, method)(*args, **kwargs))
        except Exception as e:
            return ("error", error_payload(e))


class RayWorkerGroup(WorkerGroup):
    """``num_workers`` Ray actors, each holding one ``worker_cls`` instance."""

    may_span_nodes = True

    def __init__(
        self,
        worker_cls: type,
        num_workers: int,
        *,
        init_args: tuple[Any, ...] = (),
        init_kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        num_cpus: float = 0.01,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        collective_timeout_s: float | None = None,
    ) -> None:
        super().__init__(
            worker_cls,
            num_workers,
            call_timeout_s=call_timeout_s,
            collective_timeout_s=collective_timeout_s,
        )
        ray = _import_ray()
        if not ray.is_initialized():
            raise DispatchError(
                "Ray is not initialized; call ray.init(...) (e.g. ray.init(num_cpus=2)) before "
                "creating a RayWorkerGroup."
            )
        self._ray = ray
        host = ray.remote(num_cpus=num_cpus)(_Host)
        self._store, port = host_rendezvous(num_workers)
        self._actors = [
            host.remote(
                worker_cls,
                init_args,
                dict(init_kwargs or {}),
                worker_env(
                    r,
                    num_workers,
                    port,
                    env,
                    collective_timeout_s=self.collective_timeout_s,
                    hosted=True,
                ),
            )
            for r in range(num_workers)
        ]
        try:  # surfaces a constructor failure here, with the worker index
            for i, actor in enumerate(self._actors):
                try:
                    failed = ray.get(actor.ready.remote(), timeout=self.call_timeout_s)
                except ray.exceptions.RayError as e:
                    raise DispatchError(f"worker {i} failed to start:\n{e}") from None
                if failed is not None:
                    described = WorkerErrorInfo.parse(failed).describe()
                    summary = f"worker {i} failed to start: {described}"
                    raise worker_failure(summary, {i: failed}, method="__init__")
        except BaseException:
            self.shutdown()
            raise

    def _submit(self, method: str, calls: Calls) -> WorkerFuture:
        if not self._actors:
            raise DispatchError("this worker group has been shut down.")
        refs = [
            a.call.remote(method, args, kwargs)
            for a, (args, kwargs) in zip(self._actors, calls, strict=True)
        ]
        deadline = time.monotonic() + self.call_timeout_s
        return WorkerFuture(lambda: self._wait(method, refs, deadline), method)

    def _wait(self, method: str, refs: list[Any], deadline: float) -> list[Any]:
        ray = self._ray
        index = {ref: i for i, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}  # what Ray raised
        raised: dict[int, object] = {}  # what the worker raised: its payload, first first
        pending = list(refs)
        while pending:
            # after a first failure, give the other workers a moment to report theirs: a dead
            # worker's peers fail (or hang) in collectives, and the dead one must be named
            failed = errors or raised
            wait = max(deadline - time.monotonic(), 0.0) if not failed else FAILURE_GRACE_S
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait)
            if not ready:
                break
            for ref in ready:
                try:
                    status, payload = ray.get(ref)
                except ray.exceptions.RayError as e:
                    errors[index[ref]] = e
                    continue
                if status == "ok":
                    results[index[ref]] = payload
                else:
                    raised[index[ref]] = payload
        if not (errors or raised) and pending:
            raise DispatchError(
                "\n".join(
                    f"worker {i}: no answer to {method!r} within call_timeout_s="
                    f"{self.call_timeout_s:g} s"
                    for i in sorted(index[r] for r in pending)
                )
            )
        if errors or raised:
            died = sorted(
                i for i, e in errors.items() if isinstance(e, ray.exceptions.ActorDiedError)
            )
            lines = [f"worker {i} died during {method!r}" for i in died]
            head = [f"{'; '.join(lines)}; the other failures follow from it:"] if died else []
            failures = {i: f"worker {i} raised in {method!r}:\n{e}" for i, e in errors.items()}
            for i, payload in raised.items():
                described = WorkerErrorInfo.parse(payload).describe()
                failures[i] = f"worker {i} raised in {method!r}: {described}"
            rest = [failures[i] for i in sorted(failures) if i not in died]
            summary = "\n".join(head + rest)
            # as the local executor: the first error raised keeps its type (when allowed)
            raise worker_failure(summary, raised, method=method, typed=not died)
        return [results[i] for i in range(len(refs))]

    def shutdown(self) -> None:
        for actor in getattr(self, "_actors", []):
            self._ray.kill(actor)
        self._actors = []
        self._store = None
