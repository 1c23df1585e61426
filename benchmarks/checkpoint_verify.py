"""Checkpoint verification time per GB: one reader against the work split over threads or ranks.

A checkpoint folder of ``--files`` files of random bytes (``--total-mb`` in all) and its
manifest is written once; then, side by side in the same run, ``--repeats`` times each
(median): every file hashed by one thread (what rank 0 alone did before the work was split),
the same on ``--threads`` threads (a single process: a driver's ``--resume``, an engine
without a process group), and split between two gloo ranks with ``verify_on_every_rank``
(each rank hashes its share; the verdict is gathered; timed after one untimed verification,
the slower rank's median). The files stay in the page cache after
they are written, so the figures are hashing and reading from memory, not from a disk. Prints
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _on_rank(rank: int, world: int, folder: str, repeats: int) -> float:
    """Median seconds of ``repeats`` verifications on this rank, after one untimed one (the
    process group's first collectives set up its connections)."""
    from engine_core.checkpoint import verify_on_every_rank

    verify_on_every_rank(folder)
    times = []
    for _ in range(repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        verify_on_every_rank(folder)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mb", type=int, default=512)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from engine_core.checkpoint import verify_checkpoint, write_manifest
    from engine_core.testing.distributed import run_distributed

    per_file = (args.total_mb << 20) // args.files
    result: dict[str, Any] = {"benchmark": "checkpoint_verify", **vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "global_step_1")
        os.makedirs(folder)
        for i in range(args.files):
            with open(os.path.join(folder, f"shard_{i}.bin"), "wb") as f:
                f.write(os.urandom(per_file))
        write_manifest(folder, step=1)
        gb = args.files * per_file / 2**30

        def timed(run: Any) -> float:
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        one = timed(lambda: verify_checkpoint(folder))
        threaded = timed(lambda: verify_checkpoint(folder, threads=args.threads))
        ranks = max(run_distributed(_on_rank, 2, folder, args.repeats))
    result.update(
        {
            "one_thread_s_per_gb": round(one / gb, 3),
            f"{args.threads}_threads_s_per_gb": round(threaded / gb, 3),
            "2_ranks_s_per_gb": round(ranks / gb, 3),
            "speedup_threads": round(one / threaded, 2),
            "speedup_2_ranks": round(one / ranks, 2),
            "host": f"CPU, {os.cpu_count()} cores, torch {torch.__version__}; page cache warm",
        }
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
