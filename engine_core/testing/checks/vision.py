"""Vision (``vision``): with images of three sizes, a row of two images and a text-only row in
one batch, a tiny Qwen2.5-VL's log-probs on two DP ranks equal transformers' per sample (each
sample alone with its own images and the model's own 3-D positions), padded, packed and (with
``context_parallel``) with each row split over the two ranks, and so do one training step's
loss and gradient norm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.batch import ATTENTION_MASK, LOG_PROBS
from engine_core.capabilities import Capability
from engine_core.engine import predicted_mask
from engine_core.testing.checks.registry import Check, Context, Layout
from engine_core.testing.checks.verdict import ATOL, result
from engine_core.testing.drive import build, first_step, forward

__all__ = ["CHECKS", "GRIDS", "test_log_probs_with_images_match_transformers"]

#: each sample's images' (t, h, w) patch grids: three sizes (one of two frames), a row with two
#: images, a text-only row; six samples, three per DP rank
GRIDS = [[(1, 4, 4)], [], [(1, 2, 6), (1, 4, 2)], [(2, 4, 4)], [(1, 2, 2)], []]


def _vision(c: Context) -> dict[str, Any]:
    """Per layout (padded; packed; cp=2 where declared): the largest gap to transformers per
    sample, the gap to transformers' forward without the images (what an engine that drops
    them gives), and one training step's loss and gradient norm with transformers'."""
    import torch.distributed as dist

    from engine_core.config import ModelConfig
    from engine_core.models import build_model
    from engine_core.testing.vision import (
        TINY_QWEN2_5_VL,
        image_batch,
        plain_vl_log_probs,
        plain_vl_loss_and_grad_norm,
    )

    folder = str(Path(c.root) / "vl_policy")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: Any = build_model(ModelConfig(config=dict(TINY_QWEN2_5_VL))).eval()
    model.save_pretrained(folder)  # transformers writes on rank 0 alone
    if dist.is_initialized():
        dist.barrier()
    batch = image_batch(GRIDS, seq_len=48, seed=3)
    want = plain_vl_log_probs(model, batch)
    blind = plain_vl_log_probs(model, batch, images=False)
    mask = predicted_mask(batch[ATTENTION_MASK])
    layouts: dict[str, dict[str, Any]] = {"padded": {"use_packing": False}}
    if Capability.PACKING in c.caps:
        layouts["packed"] = {"use_packing": True}
    if Capability.CONTEXT_PARALLEL in c.caps:  # one row split over two ranks, images too
        layouts["cp"] = {"context_parallel_size": 2}
    out: dict[str, Any] = {}
    want_step = None
    for name, layout in layouts.items():
        engine = build(c.backend, model={"path": folder}, micro_batch_size=2, **layout)
        got = forward(engine, batch)[LOG_PROBS]
        out[name] = float((got - want).abs()[mask].max())
        out[f"blind_{name}"] = float((got - blind).abs()[mask].max())
        if out[name] > ATOL or name == "padded":
            continue  # a failing layout's step would only add noise; padded is the base case
        # one training step: its loss and gradient norm (the vision tower's included)
        want_step = want_step or plain_vl_loss_and_grad_norm(model, batch)
        step = first_step(engine, batch)
        out[f"step_{name}"] = ((step["loss"], want_step[0]), (step["norm"], want_step[1]))
    return out


VISION = Check("vision", Layout.TWO, _vision, needs=frozenset({Capability.VISION}))

CHECKS = (VISION,)


def test_log_probs_with_images_match_transformers(double: list, caps: frozenset) -> None:
    if not VISION.applies(caps):
        pytest.skip("vision not declared")
    for rank, r in enumerate(double):
        got = result(r, VISION, "vision")
        for layout in ("padded", "packed", "cp"):
            if layout not in got or got[layout] <= ATOL:
                continue
            how = (
                "the model was called without the images (its log-probs are transformers' on "
                "the same ids with no pixel values)"
                if got[f"blind_{layout}"] <= ATOL
                else "the images, their grids or the 3-D positions reached the wrong rows"
            )
            pytest.fail(
                f"[vision] a tiny Qwen2.5-VL on two ranks (rank {rank}), {layout}: log-probs "
                f"{got[layout]:.3g} from transformers' per sample (atol {ATOL}); {how}. Hand "
                f"each micro-batch's pixel_values, image_grid_thw and rope_positions to the "
                f"model in the row's order (BaseEngine.prepare_model_inputs does, through "
                f"engine_core.vision.VisionInputs)."
            )
        steps = [k for k in got if k.startswith("step_")]
        if not steps:
            pytest.fail(f"[vision] rank {rank}: the check returned no training step.")
        for key in steps:
            for what, (value, want) in zip(("loss", "grad norm"), got[key], strict=True):
                if abs(value - want) > 1e-4 * max(1.0, abs(want)):
                    pytest.fail(
                        f"[vision] one training step with images, {key[5:]} on two ranks "
                        f"(rank {rank}): {what} {value:.6g}, transformers per sample "
                        f"{want:.6g}; every rank's gradients must flow through the vision "
                        f"tower and be summed over the ranks like the decoder's."
                    )
