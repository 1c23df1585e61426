"""CPU compatibility layer for megatron-core: run it for real on CPU hosts with gloo.

megatron-core 0.16 assumes a CUDA device in a few places that have nothing to do with the
mathematics: tensors are created with ``device=torch.cuda.current_device()``, moved with
``.cuda()``, the RNG tracker reads and writes CUDA generator states, and the schedules and
optimizer synchronise CUDA streams. None of that exists on a CPU-only host.

:func:`cpu_compat` is a re-entrant context manager that, while active,

- rewrites every CUDA device argument of a torch call (``device=0``, ``"cuda"``,
  ``torch.device("cuda", i)``, ``Tensor.to(0)``, ``Tensor.cuda()``) to the CPU, through a
  ``TorchFunctionMode``;
- answers the ``torch.cuda`` calls megatron-core makes for bookkeeping (current device,
  synchronize, streams, events, NVTX ranges, memory stats) with CPU-side no-ops;
- points megatron-core's RNG tracker at the CPU generator.

The engine enters it only when it runs on the CPU (a gloo process group); on a GPU host it is
never entered, and megatron-core runs unmodified. Nothing here changes a computation: the
kernels, collectives and optimizer are megatron-core's own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_compat", "is_active"]

_CPU = torch.device("cpu")
_state = threading.local()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare index names a CUDA device in torch's API
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CpuDevices(TorchFunctionMode):
    """Every CUDA device argument becomes the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron-core asks for the CUDA type name of a parameter to pick its dtype path
            return func(*args).replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs["device"] = _CPU
        if func in (torch.Tensor.to, torch.Tensor.new_empty) or getattr(func, "__name__", "") in (
            "to",
        ):
            args = tuple(_CPU if i > 0 and _is_cuda(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _Stream:
    """A CUDA stream or event stand-in: every call is a no-op that returns another stand-in
    (``stream.record_event()`` gives an event the caller then synchronises on)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: _Stream()

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def elapsed_time(self, other: Any) -> float:
        return 0.0

    def query(self) -> bool:
        return True


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> Any:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron-core's ``maybe_move_tensor_to_cpu`` on a CPU host: what it gives from a GPU (a
    numpy array where asked; the MoE token dispatcher's split sizes, which the all-to-all
    takes as a list), not the tensor unchanged."""
    if as_numpy and isinstance(tensor, torch.Tensor):
        return tensor.numpy()
    return tensor


def _patches() -> list[tuple[Any, str, Any]]:
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    cuda = torch.cuda
    return [
        # a device, not an index: backward passes (sequence parallelism's reduce-scatter) run
        # outside the TorchFunctionMode and pass it straight to torch.empty(device=...)
        (cuda, "current_device", lambda: _CPU),
        (cuda, "synchronize", _nothing),
        (cuda, "empty_cache", _nothing),
        (cuda, "Stream", _Stream),
        (cuda, "Event", _Stream),
        (cuda, "current_stream", lambda *a, **k: _Stream()),
        (cuda, "default_stream", lambda *a, **k: _Stream()),
        (cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        (cuda, "set_stream", _nothing),
        (cuda, "manual_seed", lambda seed: torch.manual_seed(seed)),
        (cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
        (cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        (cuda, "memory_stats", lambda *a, **k: {}),
        (cuda, "memory_allocated", lambda *a, **k: 0),
        (cuda, "max_memory_allocated", lambda *a, **k: 0),
        (cuda.nvtx, "range_push", _nothing),
        (cuda.nvtx, "range_pop", _nothing),
        (mrandom, "_get_cuda_rng_state", _cpu_rng_state),
        (mrandom, "_set_cuda_rng_state", _set_cpu_rng_state),
        (dispatcher, "maybe_move_tensor_to_cpu", _host_copy),
    ]


def is_active() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Run megatron-core on the CPU inside this context (re-entrant; see the module docstring)."""
    depth = getattr(_state, "depth", 0)
    if depth:
        _state.depth = depth + 1
        try:
            yield
        finally:
            _state.depth -= 1
        return
    saved = []
    for owner, name, replacement in _patches():
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)
    _state.depth = 1
    mode = _CpuDevices()
    try:
        with mode:
            yield
    finally:
        _state.depth = 0
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
