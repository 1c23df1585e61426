"""``WorkerGroup``: a set of workers called through the dispatch/collect functions.

Also the contract between an executor and its worker processes: :func:`worker_env` is the
environment it hands each worker (the rendezvous, and the collective timeout), and
:func:`join_process_group` is how a worker forms its process group from that environment.
"""

from __future__ import annotations

import abc
import contextlib
import math
import socket
from collections.abc import Callable, Mapping
from typing import Any

from engine_core.dispatch import (
    DispatchMode,
    MeshRank,
    collect_nd,
    dispatch_all_to_all,
    dispatch_mode_of,
    dispatch_nd,
    dispatch_one_to_all,
)
from engine_core.errors import ConfigError, DispatchError
from engine_core.launch import set_for_process
from engine_core.settings import ENV_COLLECTIVE_TIMEOUT, Settings, cpu_cores, launch_from_env

__all__ = [
    "DEFAULT_CALL_TIMEOUT_S",
    "WorkerFuture",
    "WorkerGroup",
    "threads_per_process",
    "check_timeout",
    "enter_worker_env",
    "free_port",
    "host_rendezvous",
    "join_process_group",
    "no_answer",
    "worker_env",
]

# how long a call may take on every worker of a group before the executor gives up on it
DEFAULT_CALL_TIMEOUT_S = 600.0

# after a first worker fails a call, how long its peers may take to report: they fail (or
# hang) in collectives waiting for it, and the failed one is named now, not at the deadline
FAILURE_GRACE_S = 10.0


def no_answer(worker: int, method: str, *, after_failure: bool, call_timeout_s: float) -> str:
    """The line naming a worker that did not answer ``method``: within the call's timeout, or
    (``after_failure``) within the grace period that follows another worker's failure."""
    waited = (
        f"within {FAILURE_GRACE_S:g} s of the failure above (it may wait on that worker)"
        if after_failure
        else f"within call_timeout_s={call_timeout_s:g} s"
    )
    return f"worker {worker}: no answer to {method!r} {waited}"


Calls = list[tuple[tuple[Any, ...], dict[str, Any]]]


LOOPBACK = "127.0.0.1"


def meeting_host(any_node: bool) -> str:
    """The address a rendezvous hosted by this process listens on: loopback when every member
    runs on this machine; this node's address (as Ray sees it) when Ray may place members on
    other nodes."""
    if not any_node:
        return LOOPBACK
    import ray

    return str(ray.util.get_node_ip_address())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the gloo/NCCL rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_rendezvous(world_size: int) -> tuple[Any, int]:
    """A rendezvous store this process hosts for a group of ``world_size`` ranks, and its port.

    The store binds a port the system picks and keeps listening on it, so no other process can
    take the port between choosing it and listening (a port chosen by :func:`free_port` and bound
    later by rank 0 can be, and rank 0 then fails while its peers wait). Hand the port to
    :func:`worker_env` with ``hosted=True``: every rank then joins as a client. Keep the store
    alive as long as the group's process group may form sub-groups (until shutdown).
    """
    import torch.distributed as dist

    store = dist.TCPStore(LOOPBACK, 0, world_size, is_master=True, wait_for_workers=False)
    return store, int(store.port)


def threads_per_process(processes: int, cores: int | None = None) -> int:
    """CPU threads each of ``processes`` busy processes gets when they share ``cores`` (default:
    :func:`engine_core.settings.cpu_cores`, the cores this process may use): the one rule every
    executor and job uses, so no module halves, reads or restores another's thread count."""
    return max(1, (cores or cpu_cores()) // max(1, processes))


class WorkerFuture:
    """A call sent to every worker of a group and not yet waited for.

    :meth:`result` waits for every worker's answer (at most the group's ``call_timeout_s``) and
    returns them in worker order, or raises the same :class:`DispatchError` the blocking call
    would; it can be called again and gives the same outcome. Meanwhile this process is free to
    take part in the exchange the workers are in (e.g. send the weights they receive).
    """

    def __init__(self, wait: Callable[[], Any], method: str) -> None:
        self._wait: Callable[[], Any] | None = wait
        self.method = method
        self._result: Any = None
        self._error: BaseException | None = None

    @classmethod
    def finished(cls, method: str, run: Callable[[], list[Any]]) -> WorkerFuture:
        """A future whose call runs here, now (its error is kept for :meth:`result`)."""
        future = cls(run, method)
        with contextlib.suppress(Exception):
            future.result()
        return future

    def result(self) -> Any:
        if self._wait is not None:  # waits once; later calls give the same result or error
            wait, self._wait = self._wait, None
            try:
                self._result = wait()
            except BaseException as e:
                self._error = e
        if self._error is not None:
            raise self._error
        return self._result

    def map(self, fn: Callable[[Any], Any]) -> WorkerFuture:
        """A future of ``fn(self.result())``, computed once, when it is asked for."""
        return WorkerFuture(lambda: fn(self.result()), self.method)


def check_timeout(name: str, value: object, *, or_else: str = "") -> float:
    """``value`` as a float if it is a positive, finite number of seconds; else a ConfigError.

    ``or_else`` names what else the caller takes, for the message (e.g. "None for the default").
    """
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    ):
        return float(value)
    other = f", or {or_else}" if or_else else ""
    raise ConfigError(
        f"{name}={value!r} is not allowed: use a positive, finite number of seconds, e.g. "
        f"600{other}."
    )


def worker_env(
    rank: int,
    world_size: int,
    port: int,
    extra: Mapping[str, str] | None = None,
    *,
    collective_timeout_s: float | None = None,
    hosted: bool = False,
) -> dict[str, str]:
    """The environment a worker needs to call ``torch.distributed.init_process_group``.

    ``collective_timeout_s`` (None: torch's default) becomes ``ENGINE_CORE_COLLECTIVE_TIMEOUT_S``,
    which :func:`join_process_group` reads; it wins over the same variable in ``extra``.
    ``hosted``: the store at ``port`` is hosted by the caller (:func:`host_rendezvous`), so every
    rank, rank 0 included, joins it as a client (torch's ``TORCHELASTIC_USE_AGENT_STORE``).
    """
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    if hosted:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    env.update(extra or {})
    if collective_timeout_s is not None:
        env[ENV_COLLECTIVE_TIMEOUT] = repr(float(collective_timeout_s))
    return env


def enter_worker_env(env: Mapping[str, str]) -> None:
    """Inside a new worker process: apply ``env`` and cap torch's intra-op threads to match.

    torch is already imported there, so ``OMP_NUM_THREADS`` alone would come too late.
    """
    set_for_process(env)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))


def join_process_group(backend: str | None = None) -> bool:
    """Inside a worker of a group of several: form the group's process group, once.

    ``backend`` defaults to NCCL where CUDA is available and gloo elsewhere; under NCCL each
    worker takes the GPU of its ``LOCAL_RANK`` (modulo the GPUs visible). The rendezvous and
    every collective wait for the other ranks at most ``ENGINE_CORE_COLLECTIVE_TIMEOUT_S``
    seconds (the executor's ``collective_timeout_s``; unset, torch's default), then fail instead
    of hanging. Returns whether a process group is up; a single worker has none.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return True
    launch = launch_from_env()
    if launch.world_size <= 1:
        return False
    if backend is None:
        from engine_core.comm import default_backend

        backend = default_backend()
    if backend == "nccl":  # one GPU per rank of this host (never executed here)
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=Settings.from_env().collective_timeout)
    return True


class WorkerGroup(abc.ABC):
    """Workers of one class; :meth:`execute` dispatches by the method's declared mode."""

    #: whether the workers may run on other machines than this one (a rendezvous this process
    #: hosts for them must then listen on this node's address, not loopback only)
    may_span_nodes: bool = False

    def __init__(
        self,
        worker_cls: type,
        num_workers: int,
        *,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        collective_timeout_s: float | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}.")
        self.worker_cls = worker_cls
        self.num_workers = num_workers
        self.call_timeout_s = call_timeout_s
        # handed to worker processes, whose process group's collectives wait at most this long
        self.collective_timeout_s = (
            None
            if collective_timeout_s is None
            else check_timeout(
                "collective_timeout_s", collective_timeout_s, or_else="None for torch's default"
            )
        )
        # a mesh cannot be re-registered, so its ranks are fixed once every worker has it
        self._mesh_ranks: dict[str, list[MeshRank]] = {}

    @property
    def call_timeout_s(self) -> float:
        """Seconds every worker has to answer a call (the workers' start included); a worker
        that has not answered by then is named in a :class:`DispatchError`. It may be changed
        between calls, e.g. lowered once slow start-up work such as loading a model is done."""
        return self._call_timeout_s

    @call_timeout_s.setter
    def call_timeout_s(self, value: float) -> None:
        self._call_timeout_s = check_timeout("call_timeout_s", value)

    @abc.abstractmethod
    def _submit(self, method: str, calls: Calls) -> WorkerFuture:
        """Send ``method`` to every worker with its own (args, kwargs) and return at once; the
        future's result is every worker's answer, in worker order. One call is in flight on a
        group at a time: submitting another before the first's result is taken is refused."""

    def _call(self, method: str, calls: Calls) -> list[Any]:
        return self._submit(method, calls).result()

    def call_all_async(self, method: str, *args: Any, **kwargs: Any) -> WorkerFuture:
        """:meth:`call_all` without waiting: a :class:`WorkerFuture` of every worker's result."""
        return self._submit(method, dispatch_one_to_all(self.num_workers, args, kwargs))

    def call_each_async(self, method: str, per_worker: list[tuple[Any, ...]]) -> WorkerFuture:
        """Worker ``i`` runs ``method(*per_worker[i])``, without waiting; a future of the
        results in worker order."""
        if len(per_worker) != self.num_workers:
            raise DispatchError(
                f"call_each_async needs one argument tuple per worker ({self.num_workers}), got "
                f"{len(per_worker)}."
            )
        return self._submit(method, [(tuple(a), {}) for a in per_worker])

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; safe to call twice."""

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """The same call on every worker; every result, in worker order."""
        return self._call(method, dispatch_one_to_all(self.num_workers, args, kwargs))

    def mesh_ranks(self, mesh: str) -> list[MeshRank]:
        if mesh not in self._mesh_ranks:
            self._mesh_ranks[mesh] = self.call_all("mesh_rank", mesh)
        return self._mesh_ranks[mesh]

    def execute(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Dispatch ``method`` as declared with :func:`engine_core.dispatch.register`."""
        return self.execute_async(method, *args, **kwargs).result()

    def execute_async(self, method: str, *args: Any, **kwargs: Any) -> WorkerFuture:
        """:meth:`execute` without waiting: a future of what it returns."""
        mode, mesh = dispatch_mode_of(self.worker_cls, method)
        if mode is DispatchMode.ALL_TO_ALL:
            return self._submit(method, dispatch_all_to_all(self.num_workers, args, kwargs))
        if mode is DispatchMode.ND_COMPUTE:
            assert mesh is not None  # enforced by register()
            name, ranks = mesh, self.mesh_ranks(mesh)
            calls, pad = dispatch_nd(name, ranks, args, kwargs)
            return self._submit(method, calls).map(lambda out: collect_nd(name, ranks, out, pad))
        return self.call_all_async(method, *args, **kwargs)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
