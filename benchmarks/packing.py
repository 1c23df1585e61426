"""Packed (padding-free) against padded training throughput on long-tailed lengths.

The same ``fsdp2`` engine, model, data and optimizer, with ``use_packing=True`` and a token
budget per micro-batch — attention by ``sdpa_varlen`` (per sequence) and, for comparison, by
transformers' SDPA with one dense block-diagonal mask — and with ``use_packing=False`` and a
fixed micro-batch size (the padded path runs each micro-batch at the batch's padded length, as
the engine does). Lengths follow the
core's long-tailed recipe, ``clip(rint(lognormal(6.5, 1.0)), 16, 8192)``, divided by ``--scale``
and clipped to ``[8, 8192 / scale]`` so a tiny model on a CPU can run them.

Reported: real (non-pad) tokens per second for both, the achieved speedup packed / padded, the
ideal speedup = token slots the padded run computes / real tokens, and the fraction of the ideal
achieved (target 0.70). Steps of the two modes alternate so drift hits both; medians over
``--repeats`` steps after one warm-up step each. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._recipes import lengths_recipe  # noqa: E402

MODEL = {
    "model_type": "qwen2",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
TARGET = 0.70


def _lengths(n: int, scale: int, step: int) -> list[int]:
    # a different window of the recipe per step, same distribution
    all_lengths = lengths_recipe(n * 64)
    window = all_lengths[(step % 64) * n : (step % 64 + 1) * n]
    return [int(x) for x in (window / scale).round().clip(8, 8192 // scale)]


def _batch(lengths: list[int], step: int):  # type: ignore[no-untyped-def]
    from engine_core.batch import make_batch

    g = torch.Generator().manual_seed(step)
    longest = max(lengths)
    ids = torch.randint(1, MODEL["vocab_size"], (len(lengths), longest), generator=g)
    mask = (torch.arange(longest) < torch.tensor(lengths)[:, None]).long()
    return make_batch(ids * mask, mask)


def _engine(attn: str = "sdpa", **overrides: Any):  # type: ignore[no-untyped-def]
    from engine_core.testing.models import registered_engine

    return registered_engine(
        "fsdp2",
        model={"config": dict(MODEL), "attn_implementation": attn},
        optim={"lr": 1e-4, "clip_grad": 1.0},
        **overrides,
    )


def _padded_slots(lengths: list[int], micro_batch_size: int) -> int:
    """Token slots the padded path computes: every micro-batch at the batch's padded length."""
    n = len(lengths)
    return -(-n // micro_batch_size) * micro_batch_size * max(lengths) if n else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64, help="sequences per step")
    parser.add_argument("--scale", type=int, default=16, help="divide the recipe's lengths by")
    parser.add_argument("--budget", type=int, default=1024, help="packed tokens per micro-batch")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="padded micro-batch size")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a small smoke run (<1 min)")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.repeats = 16, 2
    torch.set_num_threads(args.threads)

    packed = {"use_packing": True, "max_tokens_per_micro_batch": args.budget}
    engines = {
        "packed": _engine("sdpa_varlen", **packed),
        "packed_dense_mask": _engine("sdpa", **packed),
        "padded": _engine("sdpa", use_packing=False, micro_batch_size=args.micro_batch_size),
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    real_tokens: list[int] = []
    slots: list[int] = []
    for step in range(1 + args.repeats):
        lengths = _lengths(args.samples, args.scale, step)
        batch = _batch(lengths, step)
        for name, engine in engines.items():
            start = time.perf_counter()
            with engine.train_mode():
                engine.forward_backward_step(batch)
                engine.optimizer_step()
                engine.lr_scheduler_step()
                engine.optimizer_zero_grad()
            if step:  # the first step of each mode is the warm-up
                times[name].append(time.perf_counter() - start)
        if step:
            real_tokens.append(sum(lengths))
            slots.append(_padded_slots(lengths, args.micro_batch_size))
    tokens = statistics.median(real_tokens)
    packed_s, padded_s = statistics.median(times["packed"]), statistics.median(times["padded"])
    dense_s = statistics.median(times["packed_dense_mask"])
    speedup = padded_s / packed_s
    ideal = sum(slots) / sum(real_tokens)
    fraction = speedup / ideal
    print(
        json.dumps(
            {
                "benchmark": "packing",
                "engine": "fsdp2, 1 process (gloo), CPU",
                "model": MODEL,
                "threads": args.threads,
                "samples_per_step": args.samples,
                "lengths": f"clip(rint(lognormal(6.5, 1.0)) / {args.scale}, 8, {8192 // args.scale})",
                "packed": {
                    "max_tokens_per_micro_batch": args.budget,
                    "attn_implementation": "sdpa_varlen",
                },
                "packed_dense_mask": {
                    "max_tokens_per_micro_batch": args.budget,
                    "attn_implementation": "sdpa (one [T, T] block-diagonal mask)",
                },
                "padded": {
                    "micro_batch_size": args.micro_batch_size,
                    "attn_implementation": "sdpa",
                },
                "repeats": args.repeats,
                "median_real_tokens_per_step": tokens,
                "packed_step_s": round(packed_s, 4),
                "packed_dense_mask_step_s": round(dense_s, 4),
                "padded_step_s": round(padded_s, 4),
                "packed_tokens_per_s": round(tokens / packed_s, 1),
                "padded_tokens_per_s": round(tokens / padded_s, 1),
                "packed_dense_mask_tokens_per_s": round(tokens / dense_s, 1),
                "speedup": round(speedup, 3),
                "speedup_dense_mask": round(padded_s / dense_s, 3),
                "ideal_speedup": round(ideal, 3),
                "fraction_of_ideal": round(fraction, 3),
                "target_fraction": TARGET,
                "meets_target": fraction >= TARGET,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
