"""The batch schema: a TensorDict whose batch dim is samples, plus typed batch-level metadata.

Per-token tensors are ``[batch, seq_len]`` (right- or left-padded; ``attention_mask`` marks the
real tokens, which must be contiguous in each row). Per-token outputs such as ``log_probs`` are
aligned to ``input_ids``: ``log_probs[i, t] = log p(input_ids[i, t] | input_ids[i, :t])``, and 0
at each sequence's first real token and at padding. Per-sample non-tensor data (e.g.
``multi_modal_inputs``) rides as a ``NonTensorStack`` and follows its samples through indexing,
splitting and concatenation. Batch-level metadata is a :class:`BatchMeta` stored under
:data:`META_KEY`; it is shared by reference on indexing, so the micro-batch utilities deep-copy it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tensordict import NonTensorStack, TensorDict

from engine_core.errors import BatchError
from engine_core.loss import LossAggregation

__all__ = [
    "INPUT_IDS",
    "ATTENTION_MASK",
    "POSITION_IDS",
    "LOSS_MASK",
    "LOG_PROBS",
    "ENTROPY",
    "VALUES",
    "META_KEY",
    "BatchMeta",
    "MoeAuxLoss",
    "make_batch",
    "get_meta",
    "set_meta",
    "with_meta",
    "split_with_meta",
    "require_keys",
    "require_token_shaped",
    "sequence_lengths",
    "sample_workloads",
    "patch_counts",
    "validate_batch",
]

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOSS_MASK = "loss_mask"
LOG_PROBS = "log_probs"
ENTROPY = "entropy"
VALUES = "values"
#: optional, int ``[B, L, layers, top_k]``: the experts each token was routed to in each MoE layer
#: (by the rollout that sampled it); an engine that declares ``routing_replay`` routes the same.
#: Also an output: with ``BatchMeta.return_routes``, the engine's own routers' choice
ROUTED_EXPERTS = "routed_experts"
#: output, float ``[B, L]`` (``BatchMeta.moe_aux``): each token's share of the routers'
#: sequence-level load-balancing loss (:func:`engine_core.moe.balance_terms`), detached: the
#: engine adds the loss itself (:class:`MoeAuxLoss`)
MOE_AUX = "moe_aux"
#: optional, int ``[B, I, 3]``: each sample's images' patch grids ``(t, h, w)``, rows of 0 past
#: its last image (the vision fields, with ``pixel_values`` and ``rope_positions``, are
#: :mod:`engine_core.vision`'s)
IMAGE_GRID_THW = "image_grid_thw"
META_KEY = "meta"


class MoeAuxLoss(BaseModel):
    """The routers' load-balancing loss an engine adds to a training step's loss.

    Each micro-batch adds ``coef * aggregate_loss(moe_aux, loss_mask, aggregation, ctx,
    norm_length=norm_length)`` (:func:`engine_core.loss.aggregate_loss`) to its loss before the
    backward: the per-token balance terms scaled like a per-token loss, the same for every
    micro-batch and DP size. The engine adds it, not the loss function, because a model split
    into pipeline stages (or recomputed in the backward) has each router's terms only on its
    own stage, in its own forward. The step's outputs carry the terms as ``moe_aux``, detached;
    the value is part of the step's loss, and the terms' token mean over the loss mask is
    reported as the metric ``moe_aux_loss``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    coef: float = Field(gt=0, description="Weight of the balance loss in the step's loss.")
    aggregation: LossAggregation = Field(
        LossAggregation.TOKEN_MEAN,
        description="How the per-token terms become one scalar (as the policy loss's).",
    )
    norm_length: int | None = Field(
        None, ge=1, description="The constant divisor of seq-mean-token-sum-norm."
    )

    @model_validator(mode="after")
    def _norm_length_given(self) -> MoeAuxLoss:
        if self.aggregation is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM and self.norm_length is None:
            raise ValueError(
                f"aggregation {self.aggregation} divides each sequence's token sum by "
                f"norm_length, which is unset; give norm_length (the generation budget, say)."
            )
        return self


class BatchMeta(BaseModel):
    """Typed batch-level metadata. Subclass it to add fields; never smuggle settings as strings."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    temperature: float = Field(
        1.0, gt=0, description="Logits are divided by this before log-softmax."
    )
    compute_entropy: bool = Field(False, description="Also return per-token entropy.")
    global_step: int = Field(0, ge=0, description="Trainer step that produced this batch.")
    values_at_token: bool = Field(
        False,
        description=(
            "Value-head outputs read at each token (the prefix up to and including it) instead "
            "of aligned like log-probs (the prefix before it). Reward models score this way."
        ),
    )
    moe_aux: MoeAuxLoss | None = Field(
        None,
        description=(
            "Add the routers' sequence-level load-balancing loss to the step's loss, weighted "
            "and aggregated as given (MoeAuxLoss; needs loss_mask), and return each token's "
            "share of it as moe_aux [B, L], detached. Engines that declare routing_replay."
        ),
    )
    return_routes: bool = Field(
        False,
        description=(
            "Also return routed_experts [B, L, layers, top_k]: the experts the model's own "
            "routers chose for each token (before any replay of the batch's routed_experts "
            "replaced them). Engines that declare routing_replay."
        ),
    )


M = TypeVar("M", bound=BatchMeta)


def make_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    meta: BatchMeta | None = None,
    non_tensor: Mapping[str, Sequence[Any]] | None = None,
    **tensors: torch.Tensor,
) -> TensorDict:
    """Build a validated batch from padded ``[B, L]`` tensors.

    ``attention_mask`` defaults to all ones; ``position_ids`` are derived from it when absent.
    ``non_tensor`` maps a key to one Python object per sample.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    data: dict[str, torch.Tensor] = {INPUT_IDS: input_ids, ATTENTION_MASK: attention_mask}
    if POSITION_IDS not in tensors:
        data[POSITION_IDS] = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    data.update(tensors)
    batch = TensorDict(data, batch_size=[input_ids.shape[0]])
    for key, values in (non_tensor or {}).items():
        if len(values) != input_ids.shape[0]:
            raise BatchError(
                f"non-tensor entry {key!r} has {len(values)} items but the batch has "
                f"{input_ids.shape[0]} samples; pass exactly one item per sample."
            )
        batch[key] = NonTensorStack.from_list(list(values))
    set_meta(batch, meta if meta is not None else BatchMeta())
    validate_batch(batch)
    return batch


def get_meta(batch: TensorDict, cls: type[M] = BatchMeta) -> M:  # type: ignore[assignment]
    """Return the batch's metadata, checking it is an instance of ``cls``."""
    if META_KEY not in batch.keys():
        return cls()
    meta = batch.get_non_tensor(META_KEY)
    if not isinstance(meta, cls):
        raise BatchError(
            f"batch metadata is {type(meta).__name__}, expected {cls.__name__}; build the batch "
            f"with make_batch(..., meta={cls.__name__}(...))."
        )
    return meta


def set_meta(batch: TensorDict, meta: BatchMeta) -> None:
    """Attach ``meta`` to ``batch`` in place."""
    if not isinstance(meta, BatchMeta):
        raise BatchError(f"meta must be a BatchMeta, got {type(meta).__name__}.")
    batch.set_non_tensor(META_KEY, meta)


def with_meta(batch: TensorDict, **fields: Any) -> TensorDict:
    """A shallow copy of ``batch`` whose metadata has ``fields`` replaced (validated, as the
    metadata's class validates them); the input is untouched."""
    copy_ = batch.clone(recurse=False)
    meta: BatchMeta = get_meta(batch)
    set_meta(copy_, type(meta).model_validate({**dict(meta), **fields}))
    return copy_


def split_with_meta(batch: TensorDict, indices: Iterable[torch.Tensor]) -> list[TensorDict]:
    """Index ``batch`` once per index tensor, giving each part its own deep copy of the metadata."""
    meta: BatchMeta = get_meta(batch)
    parts = []
    for idx in indices:
        part = batch[idx]
        set_meta(part, copy.deepcopy(meta))
        parts.append(part)
    return parts


def require_keys(
    batch: TensorDict,
    keys: Iterable[str],
    *,
    method: str,
    producers: Mapping[str, str] | None = None,
) -> None:
    """Refuse a batch missing any of ``keys``, naming the field and the method that produces it."""
    present = set(batch.keys())
    missing = [k for k in keys if k not in present]
    if missing:
        hints = []
        for key in missing:
            producer = (producers or {}).get(key)
            hints.append(f"{key!r}" + (f" (produced by {producer})" if producer else ""))
        raise BatchError(
            f"{method} needs field(s) {', '.join(hints)} but the batch has only "
            f"{sorted(present)}. Add them to the batch before calling {method}."
        )


def sequence_lengths(batch: TensorDict) -> torch.Tensor:
    """Number of real tokens per sample (``attention_mask.sum(-1)``) as int64."""
    return batch[ATTENTION_MASK].long().sum(-1)


def patch_counts(grids: torch.Tensor) -> torch.Tensor:
    """Each sample's count of pixel patches, ``[B]``, from its images' grids ``[B, I, 3]``
    (``image_grid_thw``)."""
    return grids.long().prod(-1).sum(-1)


def sample_workloads(batch: TensorDict) -> torch.Tensor:
    """Each sample's work, int64 ``[B]``: its real tokens plus, with images, its pixel patches
    (the vision tower's tokens). DP balancing and the micro-batch token budget count it."""
    work = sequence_lengths(batch)
    if IMAGE_GRID_THW in batch.keys():
        work = work + patch_counts(batch[IMAGE_GRID_THW])
    return work


def require_token_shaped(batch: TensorDict, keys: Iterable[str], *, method: str) -> None:
    """Each of ``keys`` must be per token, shaped like ``input_ids`` ``[batch, seq_len]``; the
    batch must not be empty."""
    ids = batch[INPUT_IDS]
    if ids.shape[0] == 0:
        raise BatchError(f"{method}: the batch is empty (0 samples); pass at least one sample.")
    for key in keys:
        got = tuple(batch[key].shape)
        if got != tuple(ids.shape):
            hint = (
                f"; a per-sequence value of shape [batch] becomes per token with "
                f"{key}.unsqueeze(1) * loss_mask"
                if len(got) == 1
                else ""
            )
            raise BatchError(
                f"{method}: {key} has shape {got}, want [batch, seq_len] = {tuple(ids.shape)} "
                f"like input_ids (one value per token){hint}."
            )


def validate_batch(batch: TensorDict) -> None:
    """Check the shapes every engine relies on; raise :class:`BatchError` otherwise."""
    require_keys(batch, [INPUT_IDS, ATTENTION_MASK], method="validate_batch")
    ids, mask = batch[INPUT_IDS], batch[ATTENTION_MASK]
    if ids.dim() != 2:
        raise BatchError(f"input_ids must be [batch, seq_len], got shape {tuple(ids.shape)}.")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise BatchError(
            f"the batch is empty (input_ids shape {tuple(ids.shape)}); pass at least one sample "
            f"with at least one token."
        )
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise BatchError(
            f"input_ids must hold integer token ids, got dtype {ids.dtype}; convert them with "
            f".long() (token ids are indices, not values)."
        )
    if int(ids.min()) < 0:
        raise BatchError(
            f"input_ids holds a negative token id ({int(ids.min())}); token ids run from 0 to "
            f"the vocabulary size - 1 (pad with a real id, e.g. 0, and mask it out)."
        )
    if mask.shape != ids.shape:
        raise BatchError(
            f"attention_mask shape {tuple(mask.shape)} differs from input_ids {tuple(ids.shape)}."
        )
    if mask.is_floating_point() or not bool(((mask == 0) | (mask == 1)).all()):
        raise BatchError(
            f"attention_mask must hold 0 (padding) and 1 (token) as integers or bools, got "
            f"dtype {mask.dtype} with values {sorted(set(mask.unique().tolist()))[:5]}."
        )
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise BatchError(
            f"samples {empty[:8]} have no token (attention_mask all 0); drop them from the batch "
            f"(a sample with no response still has its prompt tokens)."
        )
    for key in (POSITION_IDS, LOSS_MASK):
        if key in batch.keys() and batch[key].shape != ids.shape:
            raise BatchError(
                f"{key} shape {tuple(batch[key].shape)} differs from input_ids {tuple(ids.shape)}."
            )
