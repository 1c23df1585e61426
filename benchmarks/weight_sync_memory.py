"""Driver memory during a weight sync from a data-parallel actor group to a rollout in the driver.

An actor group of two fsdp2 workers (local processes, gloo) holds a Qwen2 built from a config;
the driver holds an HF rollout of the same model. ``engine_core_roles.WeightLink`` streams the weights from
the group's writing rank to the driver bucket by bucket. A thread samples the driver's resident
memory (``/proc/self/statm``) every millisecond during each sync; the figure is the peak above
the resident memory just before it. A bucket holds at least one tensor, so its size is the
larger of ``bucket_bytes`` and the largest tensor (reported). Side by side, in the same run: the same sync at two bucket
sizes, and the baseline of holding the whole model once in the driver (a copy of the rollout's
state dict, what a path that ships the model as one dict costs at least). Prints one JSON object.
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _process_stats import peak_rss_above_start  # noqa: E402  (benchmarks/ is on sys.path)

MODEL = {
    "model_type": "qwen2",
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def _peak_above_start(run: Callable[[], Any]) -> int:
    """This process's peak resident bytes during ``run()`` above the level just before it."""
    return peak_rss_above_start(run, [os.getpid()])[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets-mb", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from engine_core_hf.rollout import HFRollout, HFRolloutConfig

    from engine_core_roles import ActorConfig, WeightLink
    from engine_core_roles.distributed.placement import ActorGroup, PlacementConfig, start_group
    from engine_core_roles.distributed.workers import ActorWorker

    engine = {"backend": "fsdp2", "model": {"config": dict(MODEL)}, "seed": 1}
    group = start_group(PlacementConfig(executor="local"), ActorWorker, 2, (engine, {}))
    rollout = HFRollout(HFRolloutConfig(backend="hf", model={"config": dict(MODEL)}))
    tensors = list(rollout.model.state_dict().values())
    model_bytes = sum(t.numel() * t.element_size() for t in tensors)
    largest = max(t.numel() * t.element_size() for t in tensors)
    result: dict[str, Any] = {"benchmark": "weight_sync_memory", "model": MODEL}
    try:
        actor = ActorGroup(group, ActorConfig())
        for mb in args.buckets_mb:
            with WeightLink(actor, rollout, bucket_bytes=mb << 20) as link:
                assert link.arrangement == "actor group -> driver rollout"
                link.sync()  # warm-up: first-touch allocations of the group and the rollout
                peaks = [_peak_above_start(link.sync) for _ in range(args.repeats)]
            result[f"bucket_{mb}mb_driver_peak_mb"] = round(max(peaks) / 2**20, 1)
        whole = [
            _peak_above_start(lambda: {k: v.clone() for k, v in rollout.model.state_dict().items()})
            for _ in range(args.repeats)
        ]
    finally:
        group.shutdown()
    result.update(
        {
            "model_mb": round(model_bytes / 2**20, 1),
            "largest_tensor_mb": round(largest / 2**20, 1),  # a bucket holds at least one tensor
            "baseline_whole_model_in_driver_mb": round(max(whole) / 2**20, 1),
            "repeats": args.repeats,
            "how": "peak RSS above the level before the call, sampled every 1 ms; max over repeats",
            "host": f"CPU, {os.cpu_count()} cores, torch {torch.__version__}",
        }
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
