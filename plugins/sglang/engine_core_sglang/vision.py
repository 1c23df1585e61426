"""Prompts with images into SGLang as the pixel patches the batch already carries.

A prompt batch holds each prompt's images as the model's image processor made them
(``pixel_values``, ``image_grid_thw``: :mod:`engine_core.vision`) and prompt ids in which each
image's placeholder is already expanded to its ``t * h * w / merge**2`` image tokens. SGLang's
``Engine.generate`` takes, beside token ids, one ``image_data`` entry per request; an entry may
be what an HF processor returned (``{"format": "processor_output", "pixel_values": [P, D],
"image_grid_thw": [I, 3]}``), which SGLang passes to its own vision tower as it is. That is the
form used here (:func:`image_data`):

- the ids go in expanded, as the prompt holds them: SGLang finds each image's run of image
  tokens itself, splits the patches per image by the grids, and computes the 3-D rotary
  positions from the runs and grids;
- the patches are the image processor's (normalised); the tower encodes them as transformers'
  does. Raw images would be processed again by SGLang, and the patches cannot be turned back
  into the images they came from;
- SGLang keeps encoded images in a cache of its own keyed by the pixels' hash
  (``SGLANG_VLM_CACHE_SIZE_MB``), which neither a weight update nor ``flush_cache`` clears:
  after a sync of the vision tower it would serve features of the old tower. The rollout
  starts SGLang with that cache off (:data:`NO_IMAGE_CACHE`), so each request encodes its
  images with the weights loaded then;
- a weight sync sends transformers' names; SGLang's Qwen-VL loaders take the original
  checkpoints' (``visual.*``, ``model.*``, ``lm_head.*``), and its Qwen2.5-VL loader skips a
  name it does not know without a word, so the names are mapped here
  (:func:`sglang_weight_names`), every one of them, before SGLang sees them.

What SGLang needs beside the weights: its multimodal processor is built from the model's HF
processor even with token ids in, so the model folder (or ``model.tokenizer``) must hold the
tokenizer and the image processor (``save_pretrained`` of both), as a released model's does.

Served: Qwen2-VL, Qwen2.5-VL and Qwen3-VL, images of one frame (as image processors make them).
SGLang 0.5.23's Qwen2.5-VL encodes patches only 1,176 wide (3 channels x 2 frames x 14 x 14, as
every released Qwen2/2.5-VL has); a patch of another width it takes for an image's finished
embedding and skips its tower, so such a model is refused (:func:`check_vision_model`).
SGLang's Qwen2-VL reads the tower's channel count under the name released configs use
(``in_chans``), which a config written by transformers 5 lacks: such a model is refused, saying
what to add. Qwen3-VL-MoE and other families are refused when the rollout starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from tensordict import TensorDict

from engine_core.backend import (
    IMAGE_GRID_THW,
    PIXEL_VALUES,
    CapabilityError,
    ConfigError,
    ModelConfig,
    WeightSyncError,
    patch_width,
    single_frame_images,
    tokenizer_folder,
)

__all__ = [
    "VISION_FAMILIES",
    "NO_IMAGE_CACHE",
    "check_vision_model",
    "image_data",
    "processor_folder",
    "sglang_weight_names",
]

#: the vision-language families (transformers' ``model_type``) served with their patches
VISION_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"})
#: set for SGLang's processes: its cache of encoded images off (it outlives weight updates)
NO_IMAGE_CACHE = {"SGLANG_VLM_CACHE_SIZE_MB": "0"}
# SGLang's Qwen2.5-VL runs its tower only on patches this wide (get_image_feature)
_QWEN2_5_VL_PATCH = 1176
# transformers' prefixes -> the original checkpoints' that SGLang's Qwen-VL loaders take
_RENAMES = (("model.visual.", "visual."), ("model.language_model.", "model."))
_KNOWN = ("visual.", "model.", "lm_head.")


def check_vision_model(hf_config: Any) -> None:
    """Refuse a vision-language model (``hf_config``) SGLang would not serve from patches."""
    family = getattr(hf_config, "model_type", None)
    if family not in VISION_FAMILIES:
        raise CapabilityError(
            f"rollout.backend=sglang serves the vision-language families "
            f"{sorted(VISION_FAMILIES)}; the model is {family!r}. Use rollout.backend=hf, which "
            f"generates with transformers' own model for every family the engines train."
        )
    vision = hf_config.vision_config
    if family == "qwen2_vl" and getattr(vision, "in_chans", None) is None:
        raise CapabilityError(
            f"SGLang's Qwen2-VL reads its vision tower's channel count as vision_config.in_chans "
            f"(the name released Qwen2-VL configs use); this model's config has only "
            f'in_channels, as transformers 5 writes it. Add "in_chans": {vision.in_channels} '
            f"to vision_config in the model folder's config.json."
        )
    width = patch_width(vision)
    if family == "qwen2_5_vl" and width != _QWEN2_5_VL_PATCH:
        raise CapabilityError(
            f"SGLang's Qwen2.5-VL runs its vision tower only on pixel patches "
            f"{_QWEN2_5_VL_PATCH} wide (3 channels x temporal patch 2 x patch 14 x 14, as "
            f"released Qwen2.5-VL models have); this model's are {width} wide, which SGLang "
            f"would take for finished image embeddings and skip the tower. Use "
            f"rollout.backend=hf or vllm for it."
        )


def image_data(images: TensorDict, prompt: int = 0) -> dict[str, Any] | None:
    """SGLang's ``image_data`` entry for one prompt (``images``: its row of
    :func:`engine_core.vision.prompt_images`): its real patches and grids as an HF processor's
    output; None for a prompt without images. ``prompt`` names the prompt in an error."""
    found = single_frame_images(images, "sglang", prompt)
    if found is None:
        return None
    pixels, grids = found
    return {
        "format": "processor_output",
        PIXEL_VALUES: pixels.contiguous(),
        IMAGE_GRID_THW: grids,
    }


def sglang_weight_names(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """A vision-language model's tensors under the names SGLang's loader takes: the tower's
    ``model.visual.*`` as ``visual.*``, the decoder's ``model.language_model.*`` as
    ``model.*``; names already in that form (and ``lm_head.*``) are kept. Any other name is
    refused: SGLang's Qwen2.5-VL loader would skip it without a word."""
    out = []
    for name, tensor in tensors:
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        if not name.startswith(_KNOWN):
            raise WeightSyncError(
                f"weight {name!r} has no name SGLang's Qwen-VL loaders take (they load "
                f"{', '.join(p + '*' for p in _KNOWN)}); it would not be loaded."
            )
        out.append((name, tensor))
    return out


def processor_folder(model: ModelConfig) -> dict[str, Any]:
    """The ``Engine`` argument naming where SGLang reads a vision-language model's HF processor
    (tokenizer and image processor), if not the model folder: SGLang builds it even with token
    ids in. Refused where the model has none."""
    if tokenizer_folder(model) is None:  # model.tokenizer, else model.path
        raise ConfigError(
            "rollout.backend=sglang with a vision-language model needs the model's HF processor "
            "(tokenizer and image processor, saved with save_pretrained): SGLang builds its "
            "image input from it. Set model.path to a folder holding them, or model.tokenizer "
            f"to one (model.path={model.path!r}, model.tokenizer="
            f"{model.tokenizer!r})."
        )
    tokenizer = model.tokenizer
    return {} if tokenizer is None else {"tokenizer_path": tokenizer}
