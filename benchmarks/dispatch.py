"""Split + collect of a batch over dp ranks: time and bytes copied, against a copying baseline.

Batch: N=8192 samples, L=1024, int64 ``input_ids`` and ``attention_mask`` (128 MiB), dp=8.
Ours: :func:`engine_core.dispatch.split_for_dp` (views) and :func:`collect_nd`.
Baseline (same run): index-tensor selection per dp rank, which copies, and the same collect.
Bytes copied on split are measured, not assumed: a chunk whose storage is the batch's storage
copied nothing. Prints one JSON object.
"""

from __future__ import annotations

import json

import torch
from _recipes import timed  # benchmarks/ is on sys.path when run as a script
from tensordict import TensorDict

from engine_core.dispatch import MeshRank, collect_nd, split_for_dp

N, L, DP, REPEATS = 8192, 1024, 8, 5


def nbytes(td: TensorDict) -> int:
    return sum(t.numel() * t.element_size() for t in td.values())


def copied_bytes(batch: TensorDict, chunks: list[TensorDict]) -> int:
    base = {batch[k].untyped_storage().data_ptr() for k in batch.keys()}
    return sum(
        t.numel() * t.element_size()
        for c in chunks
        for t in c.values()
        if t.untyped_storage().data_ptr() not in base
    )


def index_split(batch: TensorDict, dp: int) -> list[TensorDict]:
    per = batch.batch_size[0] // dp
    return [batch[torch.arange(r * per, (r + 1) * per)] for r in range(dp)]


def main() -> None:
    g = torch.Generator().manual_seed(0)
    batch = TensorDict(
        {
            "input_ids": torch.randint(0, 32000, (N, L), generator=g),
            "attention_mask": torch.ones(N, L, dtype=torch.int64),
        },
        batch_size=[N],
    )
    ranks = [MeshRank(d, DP, True) for d in range(DP)]
    (chunks, pad), split_ms = timed(split_for_dp, batch, DP, repeats=REPEATS, warmup=False)
    merged, collect_ms = timed(
        collect_nd, "actor", ranks, chunks, pad, repeats=REPEATS, warmup=False
    )
    assert torch.equal(merged["input_ids"], batch["input_ids"])
    base_chunks, base_split_ms = timed(index_split, batch, DP, repeats=REPEATS, warmup=False)
    _, base_collect_ms = timed(
        collect_nd, "actor", ranks, base_chunks, 0, repeats=REPEATS, warmup=False
    )
    ours_copied = copied_bytes(batch, chunks)
    result = {
        "benchmark": "dp split + collect",
        "batch": {"N": N, "L": L, "dp": DP, "bytes": nbytes(batch)},
        "ours": {
            "split_ms": round(split_ms, 3),
            "split_bytes_copied": ours_copied,
            "collect_ms": round(collect_ms, 2),
            "collect_bytes_copied": nbytes(merged),
        },
        "baseline_index_select": {
            "split_ms": round(base_split_ms, 2),
            "split_bytes_copied": copied_bytes(batch, base_chunks),
            "collect_ms": round(base_collect_ms, 2),
        },
        "target": "no copy on split",
        "target_met": ours_copied == 0,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
