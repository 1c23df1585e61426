"""Where a collective's tensors must live: one rule for every small all-reduce in the core.

NCCL reduces only CUDA tensors (on the rank's current device); gloo, and the mixed ``cpu:gloo``
backends, take CPU tensors. Counts, losses and metrics are built on the CPU, moved to the group's
device for the collective and read back from there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_cpu", "collective_device"]


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a plain collective on ``group`` needs its tensors on."""
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_cpu(
    t: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """All-reduce the CPU tensor ``t`` over ``group`` and return the result on the CPU."""
    device = collective_device(group)
    on_device = t.to(device)
    dist.all_reduce(on_device, op=op, group=group)
    return on_device.cpu()
