"""A training step with images against a text-only step at equal decoder token counts.

The same engine (``--engine``, default ``fsdp2``) and the same tiny Qwen2.5-VL (built from a
config), packed, one micro-batch: a batch of ``--samples`` rows, each an image of ``--grid``
patches among text, against a batch of the same rows with every image token replaced by a text
token and no image (the decoder sees exactly as many tokens; only the vision tower's work and
the images' plumbing differ). Steps of the two alternate so drift hits both; medians over
``--repeats`` steps after one warm-up step each.

Reported: the median step time of each, their ratio (image / text), the decoder tokens and the
pixel patches per step. What the ratio holds: the vision tower's forward and backward over the
patches, the 3-D positions (computed once per sample by the model's ``get_rope_index`` when the
batch lacks them: ``--given-positions`` hands them in precomputed, as a data layer that computes
them once would), and gathering each micro-batch's images. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


def _engine(backend: str) -> Any:
    from engine_core.testing.models import registered_engine
    from engine_core.testing.vision import TINY_QWEN2_5_VL

    return registered_engine(
        backend,
        model={"config": dict(TINY_QWEN2_5_VL)},
        optim={"lr": 1e-4, "clip_grad": 1.0},
        use_packing=True,
    )


def _batches(samples: int, grid: tuple[int, int, int], engine: Any, given: bool) -> Any:
    from engine_core.testing.vision import VL_IMAGE_TOKEN, image_batch
    from engine_core.vision import IMAGE_GRID_THW, PIXEL_VALUES, ROPE_POSITIONS, rope_positions

    t, h, w = grid
    images = image_batch([[grid]] * samples, seq_len=t * h * w // 4 + 16, seed=1)
    if given:
        images[ROPE_POSITIONS] = rope_positions(engine.module, images)
    text = images.exclude(PIXEL_VALUES, IMAGE_GRID_THW, ROPE_POSITIONS)
    text["input_ids"] = text["input_ids"].masked_fill(text["input_ids"] == VL_IMAGE_TOKEN, 7)
    return images, text


def _step(engine: Any, batch: Any) -> float:
    start = time.perf_counter()
    with engine.train_mode():
        engine.forward_backward_step(batch)
        engine.optimizer_step()
        engine.optimizer_zero_grad()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="fsdp2")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--grid", type=int, nargs=3, default=[1, 16, 16], metavar=("T", "H", "W"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--given-positions", action="store_true")
    args = parser.parse_args()
    from engine_core.batch import sample_workloads, sequence_lengths

    engine = _engine(args.engine)
    images, text = _batches(args.samples, tuple(args.grid), engine, args.given_positions)
    assert torch.equal(sequence_lengths(images), sequence_lengths(text))
    times: dict[str, list[float]] = {"images": [], "text": []}
    for i in range(args.repeats + 1):
        for name, batch in (("images", images), ("text", text)):
            took = _step(engine, batch)
            if i:  # the first step of each warms up
                times[name].append(took)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        json.dumps(
            {
                "engine": args.engine,
                "samples": args.samples,
                "grid": args.grid,
                "given_positions": args.given_positions,
                "decoder_tokens_per_step": int(sequence_lengths(text).sum()),
                "pixel_patches_per_step": int(
                    (sample_workloads(images) - sequence_lengths(images)).sum()
                ),
                "median_step_s": {k: round(v, 4) for k, v in med.items()},
                "images_over_text": round(med["images"] / med["text"], 3),
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
