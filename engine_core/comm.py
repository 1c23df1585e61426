"""Collectives between our own ranks, in fixed formats: tensors, UTF-8 text and JSON headers.

Nothing a rank receives is unpickled. NCCL reduces only CUDA tensors (on the rank's current
device); gloo, and the mixed ``cpu:gloo`` backends, take CPU tensors. Counts, losses and metrics
are built on the CPU, moved to the group's device for the collective and read back from there.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, is_leaf_nontensor

__all__ = [
    "default_backend",
    "all_gather_bytes",
    "all_gather_tensordict",
    "all_reduce_cpu",
    "broadcast_text",
    "collective_device",
]


def default_backend() -> str:
    """The process-group backend for this host: NCCL where CUDA is available, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


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


def all_gather_bytes(data: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's ``data``, in group rank order: the lengths first, then one padded buffer."""
    device = collective_device(group)
    world = dist.get_world_size(group)
    lengths = _all_gather(torch.tensor([len(data)], dtype=torch.int64, device=device), group)
    sizes = [int(n) for n in torch.cat(lengths).cpu()]
    if max(sizes) == 0:
        return [b""] * world
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = _all_gather(buf.to(device), group)
    return [p[:n].cpu().numpy().tobytes() for p, n in zip(parts, sizes, strict=True)]


def all_gather_tensordict(td: TensorDict, group: dist.ProcessGroup | None = None) -> TensorDict:
    """Every rank's ``td`` concatenated along dim 0, in group rank order.

    Ranks may hold different numbers of rows, but must hold the same leaf keys, dtypes and
    trailing shapes: a JSON header (gathered first) checks that, then each leaf goes as one
    all-gather padded to the longest rank. Leaves keep their device; the batch size is the sum.
    """
    if td.batch_dims == 0:
        raise ValueError("all_gather_tensordict: the TensorDict needs a batch dimension to join on")
    leaves = list(
        td.items(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor, sort=True)
    )
    layout = {
        "batch_dims": list(td.batch_size[1:]),
        "leaves": [
            [
                [key] if isinstance(key, str) else list(key),
                str(v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__,
                list(v.shape[1:]),
            ]
            for key, v in leaves
        ],
    }
    header = json.dumps({"rows": int(td.batch_size[0]), "layout": layout}).encode()
    headers = [json.loads(h) for h in all_gather_bytes(header, group)]
    for rank, other in enumerate(headers):
        if other["layout"] != headers[0]["layout"]:
            difference = _layout_difference(rank, other["layout"], headers[0]["layout"])
            raise ValueError(
                f"all_gather_tensordict: {difference}; every rank must hold the same keys, "
                f"dtypes and trailing shapes."
            )
    # raised after the header exchange, so every rank raises rather than leaving peers waiting
    tensors = [(key, v) for key, v in leaves if isinstance(v, torch.Tensor)]
    if len(tensors) < len(leaves):
        strays = {key: type(v).__name__ for key, v in leaves if not isinstance(v, torch.Tensor)}
        raise ValueError(
            f"all_gather_tensordict: leaves {strays} are not tensors; outputs must be tensors to "
            f"be gathered across ranks."
        )
    rows = [h["rows"] for h in headers]
    device = collective_device(group)
    out = TensorDict({}, batch_size=[sum(rows), *td.batch_size[1:]], device=td.device)
    for key, value in tensors:
        padded = value.new_zeros((max(rows), *value.shape[1:]), device=device)
        padded[: value.shape[0]] = value
        parts = _all_gather(padded, group)
        joined = torch.cat([p[:n] for p, n in zip(parts, rows, strict=True)])
        out.set(key, joined.to(value.device))
    return out


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return parts


def _layout_difference(rank: int, theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    """How rank ``rank``'s layout differs from rank 0's, in words."""
    their_keys = [leaf[0] for leaf in theirs["leaves"]]
    our_keys = [leaf[0] for leaf in ours["leaves"]]
    if their_keys != our_keys:
        return f"rank {rank} holds keys {their_keys} but rank 0 holds {our_keys}"
    for (key, dtype, shape), (_, our_dtype, our_shape) in zip(
        theirs["leaves"], ours["leaves"], strict=True
    ):
        if (dtype, shape) != (our_dtype, our_shape):
            return (
                f"rank {rank} holds {key} as {dtype} with trailing shape {shape} but rank 0 "
                f"as {our_dtype} with {our_shape}"
            )
    return (
        f"rank {rank} has batch dims [*, {theirs['batch_dims']}] but rank 0 has "
        f"[*, {ours['batch_dims']}]"
    )
