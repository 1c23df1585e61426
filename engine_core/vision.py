"""Images in a batch: the typed fields that carry each sample's vision inputs, and the model
input part (:class:`VisionInputs`) that hands them to a vision-language model.

A sample's images travel with it as three tensors of the batch, each with the batch's first
dimension, so sharding, balancing, reordering and splitting a batch into micro-batches carry
them as they carry the tokens, and a batch crosses a process boundary as plain tensors:

- ``pixel_values``, float ``[B, P, D]``: the sample's pixel patches, its images' one after
  another, as the model's image processor gives them (``D`` = channels x temporal patch x
  patch x patch), padded to the batch's largest count ``P``;
- ``image_grid_thw``, int ``[B, I, 3]``: each of the sample's images' patch grid ``(t, h, w)``,
  padded with rows of 0 to the batch's largest image count ``I``; image ``k`` of a sample owns
  ``t * h * w`` patches, so the grids say how many of the sample's ``P`` rows are real;
- ``rope_positions``, int ``[B, L, 3]``: each token's 3-D rotary position (time, height,
  width), computed once per sample with the model's own ``get_rope_index``
  (:func:`rope_positions`) and carried with it; a text token's three are its 1-D position.

The families handled are the Qwen vision-language models of transformers (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE): their forward takes ``pixel_values`` of all the call's
images concatenated, their grids, and ``position_ids`` of shape ``[4, b, L]`` whose first row
is the text position (read, in a packed row, for the sequence boundaries) and whose other
three are the rotary ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from engine_core.batch import ATTENTION_MASK, IMAGE_GRID_THW, INPUT_IDS, patch_counts
from engine_core.errors import BatchError, CapabilityError
from engine_core.model_inputs import InputPart, ModelInputs
from engine_core.packing import pack_tensor

__all__ = [
    "PIXEL_VALUES",
    "IMAGE_GRID_THW",
    "ROPE_POSITIONS",
    "VISION_KEYS",
    "VisionInputs",
    "is_vision_config",
    "has_images",
    "patch_counts",
    "images_in_order",
    "patch_width",
    "vision_fields",
    "rope_positions",
    "check_vision_batch",
    "refuse_vision",
    "prompt_images",
    "single_frame_images",
    "vision_token_ids",
]

PIXEL_VALUES = "pixel_values"
ROPE_POSITIONS = "rope_positions"
#: the keys that say a batch carries images
VISION_KEYS = (PIXEL_VALUES, IMAGE_GRID_THW)


def is_vision_config(hf_config: Any) -> bool:
    """Whether a transformers config describes a vision-language model (it has a vision
    tower's config)."""
    return getattr(hf_config, "vision_config", None) is not None


def has_images(batch: TensorDict) -> bool:
    """Whether ``batch`` carries vision inputs (any of :data:`VISION_KEYS`)."""
    keys = batch.keys()
    return any(k in keys for k in VISION_KEYS)


def images_in_order(values: torch.Tensor, grids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The images of rows as a model's call takes them: every row's real pixel patches one
    after another ``[patches, D]`` (from ``pixel_values`` ``[B, P, D]``) and their grids
    ``[images, 3]`` (from ``image_grid_thw`` ``[B, I, 3]``, without its rows of 0)."""
    counts = patch_counts(grids)
    rows = [values[i, : int(counts[i])] for i in range(grids.shape[0])]
    return torch.cat(rows), grids[grids[..., 0] > 0].long()


def patch_width(vision_config: Any) -> int:
    """The width of one pixel patch a vision tower takes: channels x temporal patch x
    patch x patch."""
    v = vision_config
    return int(v.in_channels * v.temporal_patch_size * v.patch_size**2)


def vision_fields(
    pixel_values: Sequence[torch.Tensor | None], grids: Sequence[torch.Tensor | None]
) -> dict[str, torch.Tensor]:
    """The batch fields ``pixel_values`` and ``image_grid_thw`` of samples given one by one:
    sample ``i``'s patches ``[p_i, D]`` and its images' grids ``[n_i, 3]`` (``None`` for a
    sample without images), padded to the largest count."""
    if len(pixel_values) != len(grids):
        raise BatchError(
            f"vision_fields: {len(pixel_values)} samples' pixel values and {len(grids)} samples' "
            f"grids; give one of each per sample (None for a sample without images)."
        )
    dims = {int(p.shape[-1]) for p in pixel_values if p is not None}
    if len(dims) > 1:
        raise BatchError(
            f"vision_fields: the samples' pixel patches have different widths {sorted(dims)}; "
            f"they must come from one image processor."
        )
    width = dims.pop() if dims else 1
    most_patches = max([int(p.shape[0]) for p in pixel_values if p is not None] or [0])
    most_images = max([int(g.shape[0]) for g in grids if g is not None] or [0])
    b = len(grids)
    values = torch.zeros(b, max(1, most_patches), width)
    grid = torch.zeros(b, max(1, most_images), 3, dtype=torch.long)
    for i, (p, g) in enumerate(zip(pixel_values, grids, strict=True)):
        if (p is None) != (g is None):
            raise BatchError(
                f"vision_fields: sample {i} has {'grids' if p is None else 'pixel values'} "
                f"without {'pixel values' if p is None else 'grids'}; give both or neither."
            )
        if p is None or g is None:
            continue
        want = int(g.long().prod(-1).sum())
        if int(p.shape[0]) != want:
            raise BatchError(
                f"vision_fields: sample {i} has {int(p.shape[0])} pixel patches but its grids "
                f"{g.tolist()} describe {want}; pass the processor's pixel_values and "
                f"image_grid_thw of the same images."
            )
        values[i, : p.shape[0]] = p.float()
        grid[i, : g.shape[0]] = g.long()
    return {PIXEL_VALUES: values, IMAGE_GRID_THW: grid}


def _rope_module(model: nn.Module) -> Any:
    """The submodule of ``model`` that computes its 3-D rotary positions (``get_rope_index``)."""
    for module in model.modules():
        if callable(getattr(module, "get_rope_index", None)):
            return module
    raise CapabilityError(
        f"{type(model).__name__} has no get_rope_index: it is not one of the vision-language "
        f"families handled here (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE)."
    )


def rope_positions(model: nn.Module, batch: TensorDict) -> torch.Tensor:
    """Each token's 3-D rotary position ``[B, L, 3]`` in ``batch``, by the model's own
    ``get_rope_index`` (a sample without images gets its 1-D positions, three times)."""
    inner = _rope_module(model)
    config = inner.config
    ids, mask = batch[INPUT_IDS], batch[ATTENTION_MASK]
    kinds = torch.zeros_like(ids, dtype=torch.int)
    kinds[ids == config.image_token_id] = 1
    out = torch.zeros(*ids.shape, 3, dtype=torch.long)
    grids = batch.get(IMAGE_GRID_THW, None)
    for i in range(ids.shape[0]):
        real = mask[i].bool()
        if grids is None or not bool((kinds[i] == 1).any()):
            pos = torch.arange(int(real.sum()))
            out[i, real] = pos[:, None].expand(-1, 3)
            continue
        g = grids[i][grids[i, :, 0] > 0]
        with torch.no_grad():
            found, _ = inner.get_rope_index(
                ids[i : i + 1, real],
                mm_token_type_ids=kinds[i : i + 1, real],
                image_grid_thw=g,
            )
        out[i, real] = found[:, 0].T.cpu().long()
    return out


def refuse_vision(batch: TensorDict, engine: str) -> None:
    """Refuse a ``batch`` with images on an engine (named ``engine``) that does not declare
    ``vision``."""
    if has_images(batch):
        found = [k for k in VISION_KEYS if k in batch.keys()]
        raise CapabilityError(
            f"the batch carries images ({', '.join(found)}), which {engine} does not feed to "
            f"its model (it does not declare the vision capability); use an engine that "
            f"declares it (engine-core plugins lists each engine's), or drop the images."
        )


def vision_token_ids(hf_config: Any) -> frozenset[int]:
    """A vision-language model's vision tokens (image and video placeholders, vision start and
    end), which no response may hold: sampled and fed back, one would ask the model for an
    image it does not have. None for a text model."""
    if not is_vision_config(hf_config):
        return frozenset()
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return frozenset(int(i) for i in (getattr(hf_config, n, None) for n in names) if i is not None)


def prompt_images(
    prompts: TensorDict, ids: torch.Tensor, mask: torch.Tensor, hf_config: Any
) -> TensorDict | None:
    """A rollout's prompts' ``pixel_values`` and ``image_grid_thw``, checked against the prompt
    ``ids`` (``mask``: their real tokens) and the model (:func:`check_vision_batch`); None for
    prompts without images."""
    if not has_images(prompts):
        return None
    batch = TensorDict(
        {
            INPUT_IDS: ids,
            ATTENTION_MASK: mask,
            **{k: prompts[k] for k in VISION_KEYS if k in prompts.keys()},
        },
        batch_size=[ids.shape[0]],
    )
    check_vision_batch(batch, hf_config)
    return batch.select(*VISION_KEYS)


def single_frame_images(
    images: TensorDict, rollout: str, prompt: int = 0
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One prompt's images (its row of :func:`prompt_images`) for a rollout that serves images
    of one frame: the patches and grids of its real images, None for a prompt without. A grid
    of several frames (a video's) is refused, naming ``rollout`` and ``prompt``."""
    grids = images[IMAGE_GRID_THW]
    grids = grids[grids[:, 0] > 0].long()
    if not len(grids):
        return None
    frames = grids[:, 0].tolist()
    if any(t != 1 for t in frames):
        raise BatchError(
            f"prompt {prompt}: image grids {grids.tolist()} have {max(frames)} frames; the "
            f"{rollout} rollout takes an image as one frame (t=1, as image processors make them: "
            f"several frames are a video's, which it does not serve). Use rollout.backend=hf "
            f"for such inputs."
        )
    count = int(patch_counts(grids[None])[0])
    return images[PIXEL_VALUES][:count], grids


def check_vision_batch(batch: TensorDict, hf_config: Any) -> None:
    """The vision fields of ``batch`` against each other and the model (``hf_config``), before
    anything runs: both or neither of ``pixel_values`` and ``image_grid_thw``; their shapes;
    each sample's patches within the padded width; each sample's image tokens as many as its
    grids give the model (``t * h * w / merge**2``); ``rope_positions`` shaped ``[B, L, 3]``."""
    keys = batch.keys()
    ids = batch[INPUT_IDS]
    b, length = ids.shape
    if ROPE_POSITIONS in keys and tuple(batch[ROPE_POSITIONS].shape) != (b, length, 3):
        raise BatchError(
            f"{ROPE_POSITIONS} has shape {tuple(batch[ROPE_POSITIONS].shape)}, want "
            f"[batch, seq_len, 3] = {(b, length, 3)} (time, height, width per token; "
            f"engine_core.vision.rope_positions computes them)."
        )
    if not has_images(batch):
        return
    if not is_vision_config(hf_config):
        raise BatchError(
            f"the batch carries images but the model ({type(hf_config).__name__}) has no vision "
            f"tower; train a vision-language model (a config with a vision_config) or drop the "
            f"images."
        )
    missing = [k for k in VISION_KEYS if k not in keys]
    if missing:
        raise BatchError(
            f"the batch carries {[k for k in VISION_KEYS if k in keys][0]} without {missing[0]}; "
            f"images need both (engine_core.vision.vision_fields builds them)."
        )
    values, grids = batch[PIXEL_VALUES], batch[IMAGE_GRID_THW]
    if values.dim() != 3 or not values.is_floating_point():
        raise BatchError(
            f"{PIXEL_VALUES} must be float [batch, patches, patch_dim], got {values.dtype} of "
            f"shape {tuple(values.shape)}."
        )
    if grids.dim() != 3 or grids.shape[-1] != 3 or grids.is_floating_point():
        raise BatchError(
            f"{IMAGE_GRID_THW} must be int [batch, images, 3] (t, h, w per image), got "
            f"{grids.dtype} of shape {tuple(grids.shape)}."
        )
    vision = hf_config.vision_config
    width = patch_width(vision)
    if values.shape[-1] != width:
        raise BatchError(
            f"{PIXEL_VALUES} has patches of width {values.shape[-1]}; the model's vision tower "
            f"takes {width} (channels {vision.in_channels} x temporal patch "
            f"{vision.temporal_patch_size} x patch {vision.patch_size}^2): use its own image "
            f"processor."
        )
    counts = patch_counts(grids)
    over = (counts > values.shape[1]).nonzero().flatten().tolist()
    if over:
        raise BatchError(
            f"samples {over[:8]}: their grids give {counts[over[0]].item()} patches, more than "
            f"the {values.shape[1]} rows of {PIXEL_VALUES}."
        )
    merge = int(vision.spatial_merge_size) ** 2
    real = batch[ATTENTION_MASK].bool()
    tokens = ((ids == hf_config.image_token_id) & real).sum(-1)
    wrong = (tokens * merge != counts).nonzero().flatten().tolist()
    if wrong:
        i = wrong[0]
        raise BatchError(
            f"sample {i} holds {tokens[i].item()} image tokens (id {hf_config.image_token_id}) "
            f"but its images' grids give the model {counts[i].item() // merge} (patches "
            f"{counts[i].item()} / merge {merge}); render the prompt with the processor that "
            f"made the pixel values, and do not truncate through an image."
        )


@dataclass(frozen=True)
class VisionInputs(InputPart):
    """A vision-language model's share of a micro-batch: the images of its rows, in the row's
    order, and the 4-row positions (text, then time, height, width) of the model's row."""

    position_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    #: under context parallelism: the whole packed row's ids and this rank's slice of it
    #: ``[start, end)``; the rank's model call takes the images' features of its image tokens
    split: tuple[torch.Tensor, int, int] | None = None

    @classmethod
    def build(cls, micro_batch: TensorDict, inputs: ModelInputs) -> VisionInputs | None:
        keys = micro_batch.keys()
        text = inputs.kwargs["position_ids"].cpu()  # packed [1, T] (maybe a shard), or [b, L]
        images = IMAGE_GRID_THW in keys and bool((micro_batch[IMAGE_GRID_THW][..., 0] > 0).any())
        shard, packed = inputs.shard, inputs.packed
        split = None
        if ROPE_POSITIONS in keys:
            rope = micro_batch[ROPE_POSITIONS]
            if packed is None:
                rope3 = rope.permute(2, 0, 1)  # [3, b, L]
            else:
                row = pack_tensor(packed, rope)  # [1, T, 3]
                if shard is not None:
                    # the row as split over the context-parallel group: padded by one
                    # sequence of padding (positions from 0), of which this rank holds a slice
                    extra = shard.padded - shard.length
                    filler = torch.arange(extra, dtype=row.dtype)[None, :, None].expand(1, -1, 3)
                    row = shard.local(torch.cat([row, filler], 1))
                    step = shard.padded // shard.size
                    split = (packed.input_ids[0].cpu(), shard.start, shard.start + step)
                rope3 = row[0].T.unsqueeze(1)  # [3, 1, T]
        elif images:
            raise BatchError(
                f"the micro-batch carries images without {ROPE_POSITIONS}; the engine computes "
                f"them before its micro-batches (BaseEngine.forward_backward_step)."
            )
        else:  # text alone: its 3-D positions are its 1-D ones
            rope3 = text.unsqueeze(0).expand(3, *text.shape)
        position_ids = torch.cat([text.unsqueeze(0), rope3.to(text.dtype)], 0)
        if not images:
            return cls(position_ids, None, None)
        pixels, grids = images_in_order(micro_batch[PIXEL_VALUES], micro_batch[IMAGE_GRID_THW])
        return cls(position_ids, pixels, grids, split)

    def tower_context(self, module: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Entered around the model call (``BaseEngine.forward_model``). For a micro-batch
        without images, the vision tower still runs, on one blank image of the smallest grid,
        its output times 0 added to the token embeddings: under sharded data parallelism a
        tower's parameters are gathered in its forward and its gradients reduced in its
        backward on every rank at once, so a rank whose micro-batch holds no image would skip
        both while another rank waits in them. The outputs are unchanged. Under context
        parallelism every rank of the group encodes the micro-batch's whole images and keeps
        the features of the image tokens in its slice of the row (an image's tokens may fall
        on two ranks); the tower's gradients, like the decoder's, are summed over the group."""
        if self.pixel_values is None:
            return _blank_image(module)
        if self.split is not None:
            return _features_of_slice(module, *self.split)
        return contextlib.nullcontext()

    def model_kwargs(self, device: torch.device) -> dict[str, Any]:
        out: dict[str, Any] = {"position_ids": self.position_ids.to(device)}
        if self.pixel_values is not None and self.image_grid_thw is not None:
            out["pixel_values"] = self.pixel_values.to(device)
            out["image_grid_thw"] = self.image_grid_thw.to(device)
        return out


def _total(out: Any) -> torch.Tensor:
    """The sum of every floating tensor in a module's output (a tensor, a tuple, a mapping)."""
    if isinstance(out, torch.Tensor):
        return out.float().sum() if out.is_floating_point() else torch.zeros(())
    values = out.values() if isinstance(out, dict) else out if isinstance(out, tuple | list) else ()
    parts = [_total(v) for v in values if v is not None]
    return torch.stack([p.to(parts[0].device) for p in parts]).sum() if parts else torch.zeros(())


@contextlib.contextmanager
def _blank_image(model: nn.Module) -> Iterator[None]:
    """While entered, the token embeddings of ``model`` gain 0 times its vision tower's output
    on one blank image (:meth:`VisionInputs.tower_context`)."""
    inner = _rope_module(model)
    tower = getattr(inner, "visual", None)
    if tower is None:
        yield
        return
    vision = inner.config.vision_config
    merge = int(vision.spatial_merge_size)
    width = patch_width(vision)
    dtype = next(tower.parameters()).dtype

    def add_blank(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        pixels = torch.zeros(merge * merge, width, dtype=dtype, device=out.device)
        grid = torch.tensor([[1, merge, merge]], device=out.device)
        return out + 0.0 * _total(tower(pixels, grid_thw=grid)).to(out.device, out.dtype)

    handle = inner.get_input_embeddings().register_forward_hook(add_blank)
    try:
        yield
    finally:
        handle.remove()


def _slice_features(out: Any, first: int, count: int) -> Any:
    """``out`` of a model's ``get_image_features`` (per-image features, and a Qwen3-VL's
    deepstack features per layer) keeping the image tokens ``[first, first + count)`` of all
    its images' tokens together."""

    def keep(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor]:
        return (torch.cat(list(parts), 0)[first : first + count],)

    out.pooler_output = keep(out.pooler_output)
    deepstack = getattr(out, "deepstack_features", None)
    if deepstack is not None:
        out.deepstack_features = [keep(layer) for layer in deepstack]
    return out


@contextlib.contextmanager
def _features_of_slice(model: nn.Module, row: torch.Tensor, start: int, end: int) -> Iterator[None]:
    """While entered, ``model``'s image features are those of the image tokens of ``row``
    (the whole packed row's ids) that fall in ``[start, end)``."""
    inner = _rope_module(model)
    image = row == inner.config.image_token_id
    first, count = int(image[:start].sum()), int(image[start:end].sum())
    original = inner.get_image_features

    def sliced(*args: Any, **kwargs: Any) -> Any:
        return _slice_features(original(*args, **kwargs), first, count)

    inner.get_image_features = sliced
    try:
        yield
    finally:
        del inner.get_image_features  # the class's method again
