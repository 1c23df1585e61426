"""A trainer's resumable state as plain data: batches as tensors and lists, never pickled objects."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

__all__ = ["batch_of", "plain"]


def plain(td: TensorDict) -> dict[str, Any]:
    """A flat batch as plain data (tensors, and lists for non-tensor fields) for a checkpoint."""
    out: dict[str, Any] = {"batch_size": list(td.batch_size)}
    for key in td.keys():
        value = td.get(key)
        out[str(key)] = value if isinstance(value, torch.Tensor) else list(value.tolist())
    return out


def batch_of(data: dict[str, Any]) -> TensorDict:
    """The batch :func:`plain` wrote."""
    td = TensorDict({}, batch_size=data["batch_size"])
    for key, value in data.items():
        if key != "batch_size":
            td[key] = value if isinstance(value, torch.Tensor) else NonTensorStack.from_list(value)
    return td
