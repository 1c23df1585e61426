"""Where a collective's tensors must live: one rule for every small all-reduce in the core.

NCCL reduces only CUDA tensors (on the rank's current device); gloo, and the mixed ``cpu:gloo``
backends, take CPU tensors. Counts, losses and metrics are built on the CPU, moved to the group's
device for the collective and read back from there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_cpu", "broadcast_text", "collective_device"]


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


def broadcast_text(text: str | None, src: int = 0, max_bytes: int = 4096) -> str | None:
    """``text`` of global rank ``src`` (``None`` included) on every rank of the default group.

    Sent as UTF-8 bytes in a fixed-size tensor (no pickling); longer texts are cut at
    ``max_bytes``.
    """
    raw = b"" if text is None else text.encode()[:max_bytes]
    buf = torch.zeros(max_bytes + 2, dtype=torch.uint8)
    if text is not None:
        buf[0] = 1
        buf[1] = 0
        buf[2 : 2 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    length = torch.tensor([len(raw)], dtype=torch.int64)
    device = collective_device()
    on_device, n = buf.to(device), length.to(device)
    dist.broadcast(on_device, src=src)
    dist.broadcast(n, src=src)
    out = on_device.cpu()
    if int(out[0]) == 0:
        return None
    return bytes(out[2 : 2 + int(n.cpu())].tolist()).decode(errors="replace")
