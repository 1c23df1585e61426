"""Executors: where the workers of a group live. All of them dispatch and collect through
:mod:`engine_core.dispatch`; they differ only in how workers are created and called.

``LocalWorkerGroup`` (in this process, or one ``torch.multiprocessing`` process per worker) needs
no extra dependency; ``RayWorkerGroup`` needs the ``ray`` extra and is imported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine_core.executors.base import WorkerGroup, join_process_group, worker_env
from engine_core.executors.local import LocalWorkerGroup

if TYPE_CHECKING:
    from engine_core.executors.ray import RayWorkerGroup

__all__ = ["WorkerGroup", "LocalWorkerGroup", "RayWorkerGroup", "join_process_group", "worker_env"]


def __getattr__(name: str) -> Any:
    if name == "RayWorkerGroup":
        from engine_core.executors.ray import RayWorkerGroup

        return RayWorkerGroup
    raise AttributeError(f"module 'engine_core.executors' has no attribute {name!r}")
