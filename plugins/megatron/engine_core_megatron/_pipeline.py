"""Sharing one rank's micro-batch results with the rest of its pipeline group.

Only the last pipeline stage computes outputs, losses and metrics. :func:`broadcast_results`
sends them to every stage with a fixed-format header (JSON in a byte tensor: output keys,
shapes and dtypes, the loss, the metrics) and one flat buffer, so every rank of the engine
returns the same :class:`~engine_core.engine.MicroBatchResults` (nothing is pickled).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_core.backend import (
    Metric,
    MetricAccumulator,
    MicroBatchResults,
)

__all__ = ["broadcast_results"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _header(results: MicroBatchResults) -> dict[str, Any]:
    outputs = []
    for out in results.outputs:
        keys = sorted(str(k) for k in out.keys())
        outputs.append(
            {
                "batch": int(out.batch_size[0]),
                "entries": [
                    [k, list(out[k].shape), str(out[k].dtype).removeprefix("torch.")] for k in keys
                ],
            }
        )
    metrics = [
        [name, str(results.metrics._reductions[name]), values]
        for name, values in sorted(results.metrics._values.items())
    ]
    return {"outputs": outputs, "loss": float(results.loss), "metrics": metrics}


def broadcast_results(
    results: MicroBatchResults | None, *, src: int, group: dist.ProcessGroup, device: torch.device
) -> MicroBatchResults:
    """``results`` of global rank ``src`` on every rank of ``group`` (``None`` elsewhere)."""
    sender = dist.get_rank() == src
    if sender:
        assert results is not None
        raw = json.dumps(_header(results)).encode()
        size = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    data = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
        if sender
        else torch.empty(int(size), dtype=torch.uint8, device=device)
    )
    dist.broadcast(data, src=src, group=group)
    header = raw if sender else bytes(data.cpu().tolist())
    meta = json.loads(header)
    numel = sum(
        int(torch.Size(shape).numel()) for o in meta["outputs"] for _, shape, _ in o["entries"]
    )
    if sender:
        assert results is not None
        flat = torch.cat(
            [
                out[k].detach().reshape(-1).to(torch.float64)
                for out in results.outputs
                for k in sorted(str(k) for k in out.keys())
            ]
            or [torch.zeros(0, dtype=torch.float64)]
        ).to(device)
    else:
        flat = torch.empty(numel, dtype=torch.float64, device=device)
    dist.broadcast(flat, src=src, group=group)
    if sender:
        assert results is not None
        return results
    flat = flat.cpu()
    outputs, offset = [], 0
    for o in meta["outputs"]:
        data_out = {}
        for key, shape, dtype in o["entries"]:
            n = int(torch.Size(shape).numel())
            data_out[key] = flat[offset : offset + n].reshape(shape).to(_DTYPES[dtype])
            offset += n
        outputs.append(TensorDict(data_out, batch_size=[o["batch"]]))
    acc = MetricAccumulator()
    for name, reduction, values in meta["metrics"]:
        for v in values:
            acc.add(name, Metric(v, reduction))
    return MicroBatchResults(outputs, torch.tensor(meta["loss"], dtype=torch.float64), acc)
