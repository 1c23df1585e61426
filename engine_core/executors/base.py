"""``WorkerGroup``: a set of workers called through the dispatch/collect functions."""

from __future__ import annotations

import abc
import os
import socket
from collections.abc import Mapping
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

__all__ = ["WorkerGroup", "enter_worker_env", "free_port", "worker_env"]

Calls = list[tuple[tuple[Any, ...], dict[str, Any]]]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the gloo/NCCL rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(
    rank: int, world_size: int, port: int, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment a worker needs to call ``torch.distributed.init_process_group``."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra or {})
    return env


def enter_worker_env(env: Mapping[str, str]) -> None:
    """Inside a new worker process: apply ``env`` and cap torch's intra-op threads to match.

    torch is already imported there, so ``OMP_NUM_THREADS`` alone would come too late.
    """
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))


class WorkerGroup(abc.ABC):
    """Workers of one class; :meth:`execute` dispatches by the method's declared mode."""

    def __init__(self, worker_cls: type, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}.")
        self.worker_cls = worker_cls
        self.num_workers = num_workers
        # a mesh cannot be re-registered, so its ranks are fixed once every worker has it
        self._mesh_ranks: dict[str, list[MeshRank]] = {}

    @abc.abstractmethod
    def _call(self, method: str, calls: Calls) -> list[Any]:
        """Run ``method`` on every worker with its own (args, kwargs), concurrently; results in worker order."""

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
        mode, mesh = dispatch_mode_of(self.worker_cls, method)
        if mode is DispatchMode.ALL_TO_ALL:
            return self._call(method, dispatch_all_to_all(self.num_workers, args, kwargs))
        if mode is DispatchMode.ND_COMPUTE:
            assert mesh is not None  # enforced by register()
            ranks = self.mesh_ranks(mesh)
            calls, pad = dispatch_nd(mesh, ranks, args, kwargs)
            return collect_nd(mesh, ranks, self._call(method, calls), pad)
        return self.call_all(method, *args, **kwargs)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
