"""Activation offload: the tensors a backward needs wait in host memory instead of on the device.

Inside :class:`OffloadActivations` (a ``torch.autograd.graph.saved_tensors_hooks`` context),
every tensor autograd saves for the backward that lives on an offloaded device type and is not a
parameter is copied to host memory (pinned when an accelerator is present) when the forward
saves it, and copied back to its device when the backward reads it. Parameters stay where they
are: they outlive the step anyway, and under FSDP the gathered weights are gathered again for the
backward. Views of parameters (FSDP1's forward uses views of its flat parameter) and tensor
subclasses (a tensor-parallel DTensor, say) stay as well. Tensors smaller than ``min_bytes``
stay too: their copies cost more than they free.

The engine option is ``activation_offload`` (capability ``activation_offload``): the default
forward of :class:`~engine_core.engine.BaseEngine` runs the model inside this context (one
object per engine, entered at every forward; compiled blocks' saved tensors pass through it
too, without recompiling). It trades two copies of every activation over the host link for
device memory; the copies are synchronous (no overlap with compute). On a CPU device activations
already live in host memory, so nothing moves; the copying path runs on accelerator devices
only, and has not been executed on one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["OffloadActivations", "OffloadStats"]

# smaller saved tensors stay on the device: their copies cost more than they free
MIN_OFFLOAD_BYTES = 1 << 16


@dataclass
class OffloadStats:
    """What one :class:`OffloadActivations` context moved: tensors and bytes copied to the host,
    and saved tensors it left where they were."""

    moved: int = 0
    moved_bytes: int = 0
    kept: int = 0
    devices: set[str] = field(default_factory=set)


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors on ``devices`` (device types; default: every type but ``cpu``) go to host
    memory for the time between the forward and the backward. ``stats`` counts what moved in
    every use of this object (it can be entered again and again, not nested in itself)."""

    def __init__(
        self, devices: tuple[str, ...] | None = None, min_bytes: int = MIN_OFFLOAD_BYTES
    ) -> None:
        self.stats = OffloadStats()
        pin = torch.cuda.is_available()
        stats = self.stats

        def offloaded(t: torch.Tensor) -> bool:
            on = t.device.type != "cpu" if devices is None else t.device.type in devices
            return (
                on
                and type(t) is torch.Tensor  # not a parameter, nor a DTensor or other subclass
                # nor a view of one (FSDP1 hands the forward views of its flat parameter)
                and not isinstance(t._base, torch.nn.Parameter)
                and t.layout == torch.strided
                and t.numel() * t.element_size() >= min_bytes
            )

        def pack(t: torch.Tensor) -> Any:
            if not offloaded(t):
                stats.kept += 1
                return t
            host = torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=pin)
            host.copy_(t)
            stats.moved += 1
            stats.moved_bytes += host.numel() * host.element_size()
            stats.devices.add(str(t.device))
            return (t.device, host)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, copy=True)

        super().__init__(pack, unpack)
