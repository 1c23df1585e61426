"""Tiny vision-language models and batches with images, for tests and the conformance kit.

The configs are the Qwen families transformers ships (Qwen2.5-VL, Qwen3-VL), shrunk to odd
shapes that no released model has; a batch holds images of several sizes and rows without
images, its pixel patches random (the models' forwards take any values).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from tensordict import TensorDict

from engine_core.batch import ATTENTION_MASK, INPUT_IDS, make_batch
from engine_core.moe import replaying
from engine_core.testing.moe import routes_per_sample
from engine_core.vision import (
    IMAGE_GRID_THW,
    PIXEL_VALUES,
    images_in_order,
    patch_counts,
    rope_positions,
    vision_fields,
)

__all__ = [
    "TINY_QWEN2_5_VL",
    "TINY_QWEN3_VL",
    "TINY_QWEN3_VL_MOE",
    "VL_IMAGE_TOKEN",
    "image_batch",
    "image_prompts",
    "plain_vl_log_probs",
    "plain_vl_loss_and_grad_norm",
    "vl_own_routes",
]

#: the special ids of the tiny configs below (text ids are 1 .. 95)
VL_IMAGE_TOKEN, VL_VIDEO_TOKEN, VL_START, VL_END = 124, 125, 126, 127
_TOKENS = {
    "image_token_id": VL_IMAGE_TOKEN,
    "video_token_id": VL_VIDEO_TOKEN,
    "vision_start_token_id": VL_START,
    "vision_end_token_id": VL_END,
}
_PATCH = {"patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3}
# what the two families' tiny decoders and towers share (head size 16)
_TEXT = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_TOWER = {
    **_PATCH,
    "depth": 2,
    "hidden_size": 24,
    "intermediate_size": 40,
    "num_heads": 2,
    "out_hidden_size": 64,
}

TINY_QWEN2_5_VL: dict[str, Any] = {
    "model_type": "qwen2_5_vl",
    **_TOKENS,
    "text_config": {**_TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
    "vision_config": {**_TOWER, "window_size": 16, "fullatt_block_indexes": [1]},
}

TINY_QWEN3_VL: dict[str, Any] = {
    "model_type": "qwen3_vl",
    **_TOKENS,
    "text_config": {
        **_TEXT,
        "head_dim": 16,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
    },
    "vision_config": {**_TOWER, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
}


#: Qwen3-VL-MoE: the dense config's vision tower, its text layers mixtures of 4 experts, top 2
TINY_QWEN3_VL_MOE: dict[str, Any] = {
    **TINY_QWEN3_VL,
    "model_type": "qwen3_vl_moe",
    "text_config": {
        **TINY_QWEN3_VL["text_config"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "decoder_sparse_step": 1,
    },
}


def image_batch(
    grids: list[list[tuple[int, int, int]]], *, seq_len: int = 64, seed: int = 0
) -> TensorDict:
    """One sample per entry of ``grids``: its images' ``(t, h, w)`` patch grids (``[]``: a
    text-only row). A sample is text, then each image as start, its image tokens
    (``t * h * w / 4``) and end, then more text, right-padded to ``seq_len``; its pixel patches
    random."""
    g = torch.Generator().manual_seed(seed)
    width = _PATCH["in_channels"] * _PATCH["temporal_patch_size"] * _PATCH["patch_size"] ** 2
    merge = _PATCH["spatial_merge_size"] ** 2
    rows: list[list[int]] = []
    values: list[torch.Tensor | None] = []
    thw: list[torch.Tensor | None] = []
    for images in grids:
        ids: list[int] = torch.randint(
            3, 96, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g
        ).tolist()
        for t, h, w in images:
            ids += [VL_START] + [VL_IMAGE_TOKEN] * (t * h * w // merge) + [VL_END]
            ids += torch.randint(
                3, 96, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g
            ).tolist()
        ids += torch.randint(
            3, 96, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g
        ).tolist()
        if len(ids) > seq_len:
            raise ValueError(f"a sample of {len(ids)} tokens does not fit seq_len={seq_len}")
        rows.append(ids)
        if images:
            grid = torch.tensor(images, dtype=torch.long)
            values.append(torch.randn(int(grid.prod(-1).sum()), width, generator=g))
            thw.append(grid)
        else:
            values.append(None)
            thw.append(None)
    ids_t = torch.zeros(len(rows), seq_len, dtype=torch.long)
    mask = torch.zeros(len(rows), seq_len, dtype=torch.long)
    for i, ids in enumerate(rows):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    batch = make_batch(ids_t, mask)
    for key, value in vision_fields(values, thw).items():
        batch[key] = value
    return batch


def _sample_log_probs(
    model: torch.nn.Module, batch: TensorDict, i: int, rope: torch.Tensor | None
) -> torch.Tensor:
    """Sample ``i`` alone through ``model``: the log-prob of each of its real tokens after the
    first, with its images (``rope`` None) or at their positions without them."""
    ids, mask = batch[INPUT_IDS], batch[ATTENTION_MASK]
    grids = batch[IMAGE_GRID_THW]
    count = int(patch_counts(grids)[i])
    real = mask[i].bool()
    seq = ids[i][real].unsqueeze(0)
    kwargs: dict[str, Any] = {"input_ids": seq}
    if rope is not None:  # the images' positions, without the images
        text = torch.arange(seq.shape[1])[None, None]
        kwargs["position_ids"] = torch.cat([text, rope[i, real].T[:, None]])
    elif count:
        pixels, thw = images_in_order(batch[PIXEL_VALUES][i : i + 1], grids[i : i + 1])
        kwargs["pixel_values"], kwargs["image_grid_thw"] = pixels, thw
        config: Any = model.config
        kwargs["mm_token_type_ids"] = (seq == int(config.image_token_id)).int()
    logp = torch.log_softmax(model(**kwargs).logits.float()[0, :-1], -1)
    return logp.gather(-1, seq[0, 1:, None]).squeeze(-1)


def image_prompts(grids: list[list[tuple[int, int, int]]], *, seed: int = 0) -> TensorDict:
    """:func:`image_batch`'s samples as ``generate`` prompts: ``prompt_ids`` / ``prompt_mask``
    left-padded to the longest, with their ``pixel_values`` and ``image_grid_thw``."""
    batch = image_batch(grids, seq_len=128, seed=seed)
    ids, mask = batch[INPUT_IDS], batch[ATTENTION_MASK]
    width = int(mask.sum(-1).max())
    prompt_ids = torch.zeros(len(grids), width, dtype=torch.long)
    prompt_mask = torch.zeros(len(grids), width, dtype=torch.long)
    for i in range(len(grids)):
        n = int(mask[i].sum())
        prompt_ids[i, width - n :] = ids[i, :n]
        prompt_mask[i, width - n :] = 1
    return TensorDict(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            PIXEL_VALUES: batch[PIXEL_VALUES],
            IMAGE_GRID_THW: batch[IMAGE_GRID_THW],
        },
        batch_size=[len(grids)],
    )


def plain_vl_log_probs(
    model: torch.nn.Module,
    batch: TensorDict,
    *,
    images: bool = True,
    routes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sample alone through the vision-language ``model`` (its own images, the model's
    own positions): log-probs aligned to ``input_ids``. ``images=False``: the same ids without
    the images at their positions (what a model called without them gives). ``routes``
    (``[B, L, layers, top_k]``, a mixture of experts): each sample's routes replayed."""
    mask = batch[ATTENTION_MASK]
    out = torch.zeros(mask.shape)
    rope = None if images else rope_positions(model, batch)
    with torch.no_grad():
        for i in range(mask.shape[0]):
            real = mask[i].bool()
            idx = real.nonzero().squeeze(-1)
            replay = (
                contextlib.nullcontext()
                if routes is None
                else replaying(model, routes[i, real].transpose(0, 1))
            )
            with replay:
                out[i, idx[1:]] = _sample_log_probs(model, batch, i, rope)
    return out


def vl_own_routes(model: torch.nn.Module, batch: TensorDict) -> torch.Tensor:
    """The experts a vision-language mixture of experts' routers choose for each real token of
    ``batch``, each sample alone with its images: ``[B, L, layers, top_k]``, zeros on
    padding."""
    return routes_per_sample(
        model, batch[ATTENTION_MASK], lambda i: _sample_log_probs(model, batch, i, None)
    )


def plain_vl_loss_and_grad_norm(model: torch.nn.Module, batch: TensorDict) -> tuple[float, float]:
    """Token-mean NLL over every predicted token of the batch (each sample alone, with its
    images) and the norm of its gradient, the vision tower's included."""
    model.zero_grad(set_to_none=True)
    mask = batch[ATTENTION_MASK]
    total = (mask.sum(-1) - 1).clamp_min(0).sum()
    loss = sum(-_sample_log_probs(model, batch, i, None).sum() / total for i in range(len(mask)))
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), norm
