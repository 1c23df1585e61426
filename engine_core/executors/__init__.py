"""Executors: where the workers of a group live. All of them dispatch and collect through
:mod:`engine_core.dispatch`; they differ only in how workers are created and called.

``LocalWorkerGroup`` (in this process, or one ``torch.multiprocessing`` process per worker) needs
no extra dependency; ``RayWorkerGroup`` needs the ``ray`` extra and is imported lazily.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from engine_core.executors.base import (
    DEFAULT_CALL_TIMEOUT_S,
    WorkerGroup,
    join_process_group,
    threads_per_process,
    worker_env,
)
from engine_core.executors.local import LocalWorkerGroup

if TYPE_CHECKING:
    from engine_core.executors.ray import RayWorkerGroup

__all__ = [
    "WorkerGroup",
    "LocalWorkerGroup",
    "RayWorkerGroup",
    "join_process_group",
    "start_worker_group",
    "worker_env",
]


def start_worker_group(
    executor: Literal["local", "ray"],
    worker_cls: type,
    workers: int,
    *,
    init_args: tuple[Any, ...] = (),
    env: Mapping[str, str] | None = None,
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    collective_timeout_s: float | None = None,
    resources: Mapping[str, float] | None = None,
    strategy: str = "PACK",
) -> WorkerGroup:
    """``workers`` instances of ``worker_cls`` as processes (``local``) or Ray actors (``ray``),
    each given its share of the cores this process may use (``OMP_NUM_THREADS``, from
    :func:`~engine_core.settings.cpu_cores`, unless ``env`` sets it;
    the driver keeps its own). On Ray, ``resources`` per worker and the placement ``strategy``
    (:class:`~engine_core.executors.ray.RayWorkerGroup`); local processes take neither."""
    kwargs: dict[str, Any] = {
        "init_args": init_args,
        "env": {"OMP_NUM_THREADS": str(threads_per_process(workers)), **(env or {})},
        "call_timeout_s": call_timeout_s,
        "collective_timeout_s": collective_timeout_s,
    }
    if executor == "ray":
        from engine_core.executors.ray import RayWorkerGroup

        return RayWorkerGroup(worker_cls, workers, resources=resources, strategy=strategy, **kwargs)
    if resources or strategy != "PACK":
        raise ValueError(
            f"resources and strategy place Ray actors; the local executor got "
            f"resources={dict(resources or {})}, strategy={strategy!r}. Use executor='ray'."
        )
    return LocalWorkerGroup(worker_cls, workers, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "RayWorkerGroup":
        from engine_core.executors.ray import RayWorkerGroup

        return RayWorkerGroup
    raise AttributeError(f"module 'engine_core.executors' has no attribute {name!r}")
