"""Prompts with images into vLLM as the pixel patches the batch already carries.

A prompt batch holds each prompt's images as the model's image processor made them
(``pixel_values``, ``image_grid_thw``: :mod:`engine_core.vision`) and prompt ids in which each
image's placeholder is already expanded to its ``t * h * w / merge**2`` image tokens. vLLM's own
multimodal path takes raw images (it runs the model's HF processor on them) or finished image
embeddings; neither gives the trainer's log-probs here: the patches cannot be turned back into
the images they came from, and embeddings would skip vLLM's vision tower (and with it the
tower's weights a sync sends). So the rollout starts vLLM's model class for the family under an
architecture of its own (``EngineCore<class>``, through ``hf_overrides``) whose multimodal
processor takes the patches themselves:

- a prompt's images arrive as ``multi_modal_data={"image": {"pixel_values": [P, D],
  "image_grid_thw": [I, 3]}}``; they pass through to the model unchanged, and vLLM's vision
  tower encodes them as transformers' does (vLLM's own normalization on the device, which
  expects raw pixels, is turned off: the patches are normalized already);
- each image's run of image tokens is folded back to one placeholder before the ids go in, and
  vLLM expands it again by the image's grid (its usual prompt update, done here from the
  model's config, not from an HF processor); the ids vLLM then runs on are checked to equal the
  prompt's;
- no HF processor or tokenizer is needed (a folder saved with ``save_pretrained`` is enough),
  so neither is torchvision, which this environment cannot load: vLLM's Qwen model files import
  one function (``smart_resize``) from transformers' torchvision-backed Qwen2-VL image
  processor, and where that module cannot be imported it is provided from the identical
  function of the PIL-backed one (:func:`_importable_without_torchvision`).

Served: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (images of one frame, as image
processors make them; vLLM's models take an image's grid with ``t = 1`` only); every other family
is refused when the rollout starts, naming the ones served. Qwen3-VL-MoE needs two bridges
between transformers 5.19 and vLLM 0.32:

- vLLM's model reads ``norm_topk_prob`` from the text config, which transformers' config of the
  family lacks (its model always scales the chosen experts' weights to sum to 1): the rollout
  fills it in, true (:data:`TEXT_CONFIG_FILL`);
- transformers holds each layer's experts stacked as ``gate_up_proj`` ``[E, 2I, H]`` and
  ``down_proj`` ``[E, H, I]`` and saves them so, while vLLM's loader reads the family's
  published checkpoint layout, each transposed (``[E, H, 2I]``, ``[E, I, H]``). A tensor in
  transformers' layout (the shape the model holds it in) is transposed on its way into vLLM,
  in every sync and when the rollout starts from a folder (:func:`to_vllm_layout`); vLLM then
  starts with dummy weights and loads the folder's through the same path
  (:data:`EXPERTS_TRANSPOSED`). Where the two layouts have the same shape (``I == H``) a tensor
  is taken as transformers' own, as transformers' own loader takes it.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from engine_core.backend import (
    IMAGE_GRID_THW,
    PIXEL_VALUES,
    BatchError,
    CapabilityError,
    patch_width,
    single_frame_images,
)

__all__ = [
    "EXPERTS_TRANSPOSED",
    "TEXT_CONFIG_FILL",
    "VISION_FAMILIES",
    "folder_tensors",
    "to_vllm_layout",
    "vision_serving",
    "fold_image_tokens",
    "image_request",
]

#: model_type -> (vLLM module, vLLM class) of the vision-language families served with patches
VISION_FAMILIES: dict[str, tuple[str, str]] = {
    "qwen2_vl": ("vllm.model_executor.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("vllm.model_executor.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("vllm.model_executor.models.qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_moe": (
        "vllm.model_executor.models.qwen3_vl_moe",
        "Qwen3VLMoeForConditionalGeneration",
    ),
}
#: config fields vLLM's model of a family reads that transformers' config of it lacks, with the
#: value that computes what transformers' model does (Qwen3-VL-MoE: transformers always scales
#: the chosen experts' weights to sum to 1; vLLM reads that choice from its text config)
TEXT_CONFIG_FILL: dict[str, dict[str, Any]] = {"qwen3_vl_moe": {"norm_topk_prob": True}}
#: families whose stacked experts vLLM reads transposed from how transformers holds them
EXPERTS_TRANSPOSED = frozenset({"qwen3_vl_moe"})
_STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def to_vllm_layout(
    tensors: Iterable[tuple[str, torch.Tensor]], held: Mapping[str, Sequence[int]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` as vLLM's loader of an :data:`EXPERTS_TRANSPOSED` family reads them: each
    stacked expert tensor in the shape transformers holds it in (``held``: name -> shape)
    transposed to the published checkpoint layout, the rest as they are."""
    for name, tensor in tensors:
        if name.endswith(_STACKED) and tuple(tensor.shape) == tuple(held.get(name, ())):
            tensor = tensor.transpose(1, 2).contiguous()
        yield name, tensor


def folder_tensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a model folder's safetensors files, one at a time."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors file to load the model from.")
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                yield name, f.get_tensor(name)


def vision_serving(hf_config: Any) -> dict[str, Any]:
    """The ``LLM`` arguments that start a vision-language model (``hf_config``) on the
    patch-taking architecture of its family; refuses a family not served so."""
    family = getattr(hf_config, "model_type", None)
    if family not in VISION_FAMILIES:
        raise CapabilityError(
            f"rollout.backend=vllm serves the vision-language families "
            f"{sorted(VISION_FAMILIES)}; the model is {family!r}. Use rollout.backend=hf, which "
            f"generates with transformers' own model for every family the engines train."
        )
    overrides: dict[str, Any] = {"architectures": [_registered(family)]}
    if family in TEXT_CONFIG_FILL:  # a nested dict: vLLM updates the text config with it
        overrides["text_config"] = dict(TEXT_CONFIG_FILL[family])
    return {
        "hf_overrides": overrides,
        # the patches come normalized by the image processor that made them; left on, vLLM
        # (reading the folder's preprocessor_config.json) normalizes them again in the model
        "mm_device_do_normalize": False,
    }


@functools.cache
def _registered(family: str) -> str:
    """Register (once per process) vLLM's model class of ``family`` with the patch-taking
    processor, under an architecture name of its own; return that name."""
    from vllm import ModelRegistry
    from vllm.multimodal import MULTIMODAL_REGISTRY

    _importable_without_torchvision()
    module, name = VISION_FAMILIES[family]
    base = getattr(importlib.import_module(module), name)
    processor = _processor_classes()
    cls = MULTIMODAL_REGISTRY.register_processor(
        processor["processor"], info=processor["info"], dummy_inputs=processor["dummy"]
    )(type(f"EngineCore{name}", (base,), {"__module__": __name__}))
    ModelRegistry.register_model(cls.__name__, cls)
    return cls.__name__


def _importable_without_torchvision() -> None:
    """vLLM's Qwen-VL model files import ``smart_resize`` from transformers' Qwen2-VL image
    processor module, which imports torchvision; where it cannot be imported, the module name
    is given the same function from the PIL-backed processor (the two are identical). Nothing
    else is taken from it: the patches need no image processor."""
    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
    except (ImportError, RuntimeError):  # no torchvision, or a build that does not load
        sys.modules.pop(name, None)
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        stand_in = types.ModuleType(name, "smart_resize without torchvision (engine_core_vllm)")
        stand_in.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
        sys.modules[name] = stand_in


@functools.cache
def _processor_classes() -> dict[str, Any]:
    """The multimodal processor, its processing info and dummy inputs, defined on first use
    (their bases are vLLM's, imported only when a vision-language model is served)."""
    from transformers import BatchFeature
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
    from vllm.multimodal.parse import ModalityDataItems, MultiModalDataParser
    from vllm.multimodal.processing import (
        BaseDummyInputsBuilder,
        BaseMultiModalProcessor,
        BaseProcessingInfo,
        ProcessorInputs,
        PromptReplacement,
    )

    def fields(grids: torch.Tensor) -> dict[str, Any]:
        # an image's patches are its t*h*w rows of the prompt's pixel_values
        return {
            PIXEL_VALUES: MultiModalFieldConfig.flat_from_sizes("image", grids.prod(-1)),
            IMAGE_GRID_THW: MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        }

    class PatchItems(ModalityDataItems[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]):
        """One prompt's images as patches: passed through to the model as they are."""

        def __init__(self, data: Mapping[str, torch.Tensor]) -> None:
            super().__init__(data, "image")
            config = fields(data[IMAGE_GRID_THW])
            self._items = MultiModalKwargsItems.from_hf_inputs(BatchFeature(dict(data)), config)

        def get_count(self) -> int:
            return len(self._items["image"])

        def get(self, index: int) -> Mapping[str, torch.Tensor]:
            return self._items["image"][index].get_data()

        def get_processor_data(self) -> Mapping[str, object]:
            return {}

        def get_passthrough_data(self) -> Mapping[str, object]:
            return self.data

    class PatchParser(MultiModalDataParser):
        def _parse_image_data(self, data: Any) -> Any:
            if not (isinstance(data, Mapping) and set(data) == {PIXEL_VALUES, IMAGE_GRID_THW}):
                raise ValueError(
                    f"this vLLM model was started by engine-core to take images as pixel "
                    f"patches: {{'{PIXEL_VALUES}': [P, D], '{IMAGE_GRID_THW}': [I, 3]}}; got "
                    f"{type(data).__name__}."
                )
            return PatchItems(data)

        def _parse_video_data(self, data: Any) -> Any:
            raise ValueError("videos are not served by engine-core's vLLM rollout.")

    class PatchInfo(BaseProcessingInfo):
        def get_supported_mm_limits(self) -> Mapping[str, int | None]:
            return {"image": None}

        def get_data_parser(self) -> MultiModalDataParser:
            return PatchParser()

        def get_mm_max_tokens_per_item(
            self, seq_len: int, mm_counts: Mapping[str, int]
        ) -> Mapping[str, int]:
            return {"image": seq_len}  # an image's tokens are part of its prompt

        def merge(self) -> int:
            return int(self.get_hf_config().vision_config.spatial_merge_size)

        def image_token(self) -> int:
            return int(self.get_hf_config().image_token_id)

    class PatchDummyInputs(BaseDummyInputsBuilder[PatchInfo]):
        """vLLM profiles the vision tower on the largest image a prompt can hold."""

        def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
            return ""

        def get_dummy_mm_data(
            self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Any
        ) -> Any:
            merge = self.info.merge()
            tokens = max(1, seq_len // max(1, mm_counts.get("image", 1)))
            grid = torch.tensor([[1, merge, merge * tokens]] * mm_counts.get("image", 0))
            width = patch_width(self.info.get_hf_config().vision_config)
            pixels = torch.zeros(int(grid.prod(-1).sum()), width)
            return {"image": {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid}} if len(grid) else {}

    class PatchProcessor(BaseMultiModalProcessor[PatchInfo]):
        requires_tokenizer = False

        def get_dummy_inputs(
            self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Any
        ) -> Any:
            data = self.dummy_inputs.get_dummy_mm_data(seq_len, mm_counts, mm_options)
            items = self.info.parse_mm_data(data, validate=False)
            count = mm_counts.get("image", 0) if data else 0
            return ProcessorInputs(prompt=[self.info.image_token()] * count, mm_data_items=items)

        def _get_mm_fields_config(self, hf_inputs: Any, hf_processor_mm_kwargs: Any) -> Any:
            return fields(hf_inputs.get(IMAGE_GRID_THW, torch.empty(0, 3, dtype=torch.long)))

        def _get_prompt_updates(
            self, mm_items: Any, hf_processor_mm_kwargs: Any, out_mm_kwargs: Any
        ) -> Sequence[Any]:
            token, merge = self.info.image_token(), self.info.merge()

            def expanded(index: int) -> list[int]:
                grid = out_mm_kwargs["image"][index][IMAGE_GRID_THW].data
                return [token] * (int(grid.prod()) // merge**2)

            return [PromptReplacement(modality="image", target=[token], replacement=expanded)]

    return {"processor": PatchProcessor, "info": PatchInfo, "dummy": PatchDummyInputs}


def fold_image_tokens(
    ids: list[int], counts: Sequence[int], image_token: int, prompt: int = 0
) -> list[int]:
    """``ids`` with each image's run of ``counts[k]`` image tokens folded to one placeholder
    (image ``k`` the ``k``-th run, in order), the form vLLM expands itself; ``prompt`` names
    the prompt in an error."""
    out: list[int] = []
    i, image = 0, 0
    while i < len(ids):
        if ids[i] != image_token:
            out.append(ids[i])
            i += 1
            continue
        if image >= len(counts) or ids[i : i + counts[image]] != [image_token] * counts[image]:
            raise BatchError(
                f"prompt {prompt}: its image tokens (id {image_token}) do not split into its images' "
                f"runs of {list(counts)} tokens; render each image's placeholder with the "
                f"processor that made its patches."
            )
        out.append(image_token)
        i += counts[image]
        image += 1
    return out


def image_request(
    ids: list[int], images: TensorDict, image_token: int, merge: int, prompt: int = 0
) -> dict[str, Any]:
    """The vLLM prompt of one prompt's ``ids`` (placeholders expanded) and its ``images`` (a row
    of :func:`engine_core.vision.prompt_images`): the ids with each image folded to one placeholder, and the
    image's patches and grids as multimodal data. ``prompt`` names the prompt in an error."""
    found = single_frame_images(images, "vllm", prompt)
    if found is None:
        return {"prompt_token_ids": ids}
    pixels, grids = found
    counts = [int(g.prod()) // merge**2 for g in grids]
    return {
        "prompt_token_ids": fold_image_tokens(ids, counts, image_token, prompt),
        "multi_modal_data": {"image": {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grids}},
    }
