"""Weight-sync memory and bytes as the model grows: the sender's peak stays at a bucket.

For three sizes of a Qwen2 built from a config (the same width, 4, 12 and 24 layers), an actor
group of two fsdp2 workers (local processes, gloo) syncs an HF rollout in the driver through
``engine_core_roles.WeightLink`` with 16 MiB buckets. A thread samples the resident memory of
the sending worker (the group's writing rank), of the other worker and of the driver every
millisecond during each sync (``/proc/<pid>/statm``); each figure is the peak above the level
just before the sync, the largest of three syncs after a warm-up. Side by side, on the same
group: the baseline of a sender that holds the whole model once (``export_hf``, which gathers
every full tensor on the writing rank before writing them, as a sync that gathers the model
before sending would).

LoRA, per size (rank 8 on the attention and MLP projections; an fsdp2 actor and an HF rollout
with the same ``model.lora``, in this process): bytes of the first sync (the peft model's
tensors, base included) and of every later one (the adapters alone), against the merged model a
rollout without adapter support takes at every sync.

Every process maps buffers of 1 MiB and more on their own (glibc's mmap threshold, fixed), so
freed buffers leave the resident set at once. Prints one JSON object. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _process_stats import peak_rss_above_start  # noqa: E402  (benchmarks/ is on sys.path)

from engine_core.launch import set_for_process

WIDTH = {
    "model_type": "qwen2",
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
LORA = {
    "rank": 8,
    "alpha": 16.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
MB = 2**20


def _sizes(layers: list[int]) -> list[dict[str, Any]]:
    return [{**WIDTH, "num_hidden_layers": n} for n in layers]


def _group_figures(model: dict[str, Any], bucket_bytes: int, repeats: int) -> dict[str, Any]:
    from engine_core_hf.rollout import HFRollout, HFRolloutConfig

    from engine_core_roles import ActorConfig, WeightLink
    from engine_core_roles.distributed.placement import ActorGroup, PlacementConfig, start_group
    from engine_core_roles.distributed.workers import ActorWorker

    engine = {"backend": "fsdp2", "model": {"config": model}, "seed": 1}
    group = start_group(PlacementConfig(executor="local"), ActorWorker, 2, (engine, {}))
    rollout = HFRollout(HFRolloutConfig(backend="hf", model={"config": model}))
    tensors = list(rollout.model.state_dict().values())
    out: dict[str, Any] = {
        "layers": model["num_hidden_layers"],
        "model_mb": round(sum(t.numel() * t.element_size() for t in tensors) / MB, 1),
        "largest_tensor_mb": round(max(t.numel() * t.element_size() for t in tensors) / MB, 1),
    }
    try:
        workers = group.pids
        # the writing rank (the one with a weight-sync address) sends; the other takes part in
        # the gathers
        addresses = group.call_all("weight_sync_address", False)
        writer = next(i for i, a in enumerate(addresses) if a is not None)
        pids = [workers[writer], workers[1 - writer], os.getpid()]
        actor = ActorGroup(group, ActorConfig())
        with WeightLink(actor, rollout, bucket_bytes=bucket_bytes) as link:
            link.sync()  # warm-up: first-touch allocations of the group and the rollout
            peaks = [peak_rss_above_start(link.sync, pids) for _ in range(repeats)]
        with tempfile.TemporaryDirectory() as tmp:
            whole = [
                peak_rss_above_start(lambda: group.call_all("export_hf", tmp), pids)
                for _ in range(repeats)
            ]
    finally:
        group.shutdown()
    for i, who in enumerate(("sender", "other_rank", "driver")):
        out[f"sync_{who}_peak_mb"] = round(max(p[i] for p in peaks) / MB, 1)
    out["baseline_whole_model_sender_peak_mb"] = round(max(p[0] for p in whole) / MB, 1)
    return out


def _lora_bytes(model: dict[str, Any]) -> dict[str, Any]:
    from engine_core_hf.rollout import HFRollout, HFRolloutConfig

    from engine_core_roles import ActorConfig, WeightLink
    from engine_core_roles.distributed.workers import build_engine
    from engine_core_roles.models.actor import Actor

    spec = {"config": model, "lora": LORA}
    actor = Actor(ActorConfig(), build_engine({"backend": "fsdp2", "model": spec, "seed": 1}))
    rollout = HFRollout(HFRolloutConfig(backend="hf", model=spec))
    with WeightLink(actor, rollout) as link:
        first = link.sync()["weight_sync/bytes"]
        later = link.sync()["weight_sync/bytes"]
    merged = sum(t.numel() * t.element_size() for _, t in actor.engine.named_weights("model"))
    return {
        "lora_first_sync_mb": round(first / MB, 2),
        "lora_later_sync_mb": round(later / MB, 2),
        "merged_model_sync_mb": round(merged / MB, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs=3, default=[4, 12, 24])
    parser.add_argument("--bucket-mb", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    # buffers of 1 MiB and more mapped on their own and unmapped when freed, so RSS follows
    # what is live: the workers read it from their environment at start-up, this process is
    # told through mallopt (M_MMAP_THRESHOLD)
    set_for_process({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 1 << 20)
    sizes = []
    for model in _sizes(args.layers):
        figures = _group_figures(model, args.bucket_mb * MB, args.repeats)
        figures.update(_lora_bytes(model))
        sizes.append(figures)
        print(json.dumps(figures), file=sys.stderr, flush=True)  # progress, one line a size
    result = {
        "benchmark": "weight_sync_scaling",
        "bucket_mb": args.bucket_mb,
        "width": WIDTH,
        "lora": LORA,
        "sizes": sizes,
        "repeats": args.repeats,
        "how": "peak RSS above the level before the call, sampled every 1 ms per process; max "
        "over repeats after one warm-up sync; glibc mmap threshold fixed at 1 MiB in every process",
        "host": f"CPU, {os.cpu_count()} cores, torch {torch.__version__}",
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
