"""Tiny vision-language models and batches with images, for tests and the conformance kit.

The configs are the Qwen families transformers ships (Qwen2.5-VL, Qwen3-VL), shrunk to odd
shapes that no released model has; a batch holds images of several sizes and rows without
images, its pixel patches random (the models' forwards take any values).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from engine_core.batch import ATTENTION_MASK, INPUT_IDS, make_batch
from engine_core.vision import IMAGE_GRID_THW, PIXEL_VALUES, patch_counts, vision_fields

__all__ = [
    "TINY_QWEN2_5_VL",
    "TINY_QWEN3_VL",
    "VL_IMAGE_TOKEN",
    "image_batch",
    "plain_vl_log_probs",
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

TINY_QWEN2_5_VL: dict[str, Any] = {
    "model_type": "qwen2_5_vl",
    **_TOKENS,
    "text_config": {
        "vocab_size": 128,
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_hidden_layers": 2,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "vision_config": {
        **_PATCH,
        "depth": 2,
        "hidden_size": 24,
        "intermediate_size": 40,
        "num_heads": 2,
        "out_hidden_size": 48,
        "window_size": 16,
        "fullatt_block_indexes": [1],
    },
}

TINY_QWEN3_VL: dict[str, Any] = {
    "model_type": "qwen3_vl",
    **_TOKENS,
    "text_config": {
        "vocab_size": 128,
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_hidden_layers": 2,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "vision_config": {
        **_PATCH,
        "depth": 2,
        "hidden_size": 24,
        "intermediate_size": 40,
        "num_heads": 2,
        "out_hidden_size": 48,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
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


def plain_vl_log_probs(model: torch.nn.Module, batch: TensorDict) -> torch.Tensor:
    """Each sample alone through the vision-language ``model`` (its own images, the model's
    own positions): log-probs aligned to ``input_ids``."""
    ids, mask = batch[INPUT_IDS], batch[ATTENTION_MASK]
    grids, values = batch[IMAGE_GRID_THW], batch[PIXEL_VALUES]
    counts = patch_counts(grids)
    out = torch.zeros(ids.shape)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            real = mask[i].bool()
            seq = ids[i][real].unsqueeze(0)
            kwargs: dict[str, Any] = {"input_ids": seq}
            if int(counts[i]):
                kwargs["pixel_values"] = values[i, : int(counts[i])]
                kwargs["image_grid_thw"] = grids[i][grids[i, :, 0] > 0]
                kwargs["mm_token_type_ids"] = (seq == VL_IMAGE_TOKEN).int()
            logits = model(**kwargs).logits
            logp = torch.log_softmax(logits.float()[0, :-1], -1)
            idx = real.nonzero().squeeze(-1)
            out[i, idx[1:]] = logp.gather(-1, seq[0, 1:, None]).squeeze(-1)
    return out
