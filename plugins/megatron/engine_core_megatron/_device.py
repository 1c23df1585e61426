"""Running the megatron engine's calls where megatron-core can: :func:`on_device` wraps a
method in the CPU compatibility layer on a CPU host (:mod:`engine_core_megatron._cpu_compat`),
and :func:`ensure_process_group` gives a plain process the one-rank group megatron-core needs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["ensure_process_group", "on_device"]

F = TypeVar("F", bound=Callable[..., Any])


def on_device(fn: F) -> F:
    """Run ``fn`` inside the CPU compatibility layer when the engine runs on the CPU."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._device_context():
            return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def ensure_process_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
