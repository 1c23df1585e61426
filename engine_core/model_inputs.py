"""What one micro-batch hands the model: :class:`ModelInputs`, and how its rows are laid out.

A :class:`ModelInputs` holds the model's keyword arguments, the layout of the model's input
row (packed: :class:`~engine_core.packing.PackedSequences`; split over context-parallel ranks:
:class:`~engine_core.context_parallel.SequenceShard`), the next token at each position and, when
the output layer computes log-probs itself, a :class:`HeadRequest`. Everything a feature adds
(a mixture of experts' routes, say) is an :class:`InputPart`: a small class whose
:meth:`InputPart.build` reads the micro-batch once the row is laid out, kept in
:attr:`ModelInputs.parts` under its own type. A new input is a new part, registered with the
engine (:attr:`BaseEngine.input_parts <engine_core.engine.BaseEngine.input_parts>`), not an
edit of the micro-batch loop.

The functions below place values between the model's row and the batch's ``[b, L]`` layout.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from tensordict import TensorDict
from torch import nn

from engine_core.batch import ATTENTION_MASK, INPUT_IDS, LOSS_MASK
from engine_core.context_parallel import SequenceShard
from engine_core.packing import PackedSequences, unpack

__all__ = [
    "HeadRequest",
    "InputPart",
    "ModelInputs",
    "loss_mask_of",
    "next_token_targets",
    "predicted_mask",
    "row_to_batch",
]

P = TypeVar("P", bound="InputPart")


class InputPart(abc.ABC):
    """One feature's share of a micro-batch's model inputs (routes to replay, images, ...).

    Built by :meth:`build` after the micro-batch's row is laid out (packed or padded, split over
    context-parallel ranks), so a part that follows the tokens can follow the row; what it adds
    to the model call is :meth:`model_kwargs`. Read back with :meth:`ModelInputs.part`."""

    @classmethod
    @abc.abstractmethod
    def build(cls, micro_batch: TensorDict, inputs: ModelInputs) -> InputPart | None:
        """This feature's inputs for ``micro_batch``, laid out as ``inputs``' row; ``None``
        when the micro-batch does not ask for the feature."""

    def model_kwargs(self, device: torch.device) -> dict[str, Any]:
        """Keyword arguments this part adds to the model call, on ``device`` (default: none)."""
        return {}


@dataclass
class HeadRequest:
    """What the output layer computes instead of logits: the log-prob of ``targets`` (the next
    id at each position of the model's input row) and, with ``entropy``, the entropy."""

    head: nn.Linear
    targets: torch.Tensor
    temperature: float
    entropy: bool
    chunk_tokens: int | None


@dataclass
class ModelInputs:
    """Model keyword arguments for one micro-batch, the row's layout and each feature's part."""

    kwargs: dict[str, Any]
    packed: PackedSequences | None = None
    #: set when the output layer computes log-probs in chunks (:meth:`BaseEngine.forward_model`)
    head: HeadRequest | None = None
    #: the next token id at each position of the model's input row (None: read from
    #: ``input_ids``, whose last position has none)
    targets: torch.Tensor | None = None
    #: with context parallelism, which slice of the packed row this rank's model call sees
    shard: SequenceShard | None = None
    #: what features add (:class:`InputPart`), one per type
    parts: dict[type[InputPart], InputPart] = field(default_factory=dict)

    def part(self, kind: type[P]) -> P | None:
        """The part of type ``kind``, or ``None`` when the micro-batch has none."""
        found = self.parts.get(kind)
        return found if isinstance(found, kind) else None

    def add(self, part: InputPart) -> None:
        """Keep ``part`` under its type (replacing one of that type)."""
        self.parts[type(part)] = part


def predicted_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Real tokens that have a prefix: every real token but each sequence's first."""
    mask = attention_mask.bool()
    first = mask & ~torch.nn.functional.pad(mask, (1, 0))[:, :-1]
    return mask & ~first


def loss_mask_of(batch: TensorDict) -> torch.Tensor:
    """``loss_mask`` if present, else :func:`predicted_mask` of the attention mask."""
    if LOSS_MASK in batch.keys():
        return batch[LOSS_MASK].bool()
    return predicted_mask(batch[ATTENTION_MASK])


def next_token_targets(inputs: ModelInputs, length: int | None = None) -> torch.Tensor:
    """The next token id at each of the first ``length`` positions of the model's input row
    (0 where the row has none)."""
    if inputs.targets is not None:
        return inputs.targets[:, :length]
    ids = inputs.kwargs["input_ids"]
    return torch.nn.functional.pad(ids[:, 1:], (0, 1))[:, :length]


def row_to_batch(
    per_token: torch.Tensor, inputs: ModelInputs, micro_batch: TensorDict
) -> torch.Tensor:
    """Values per token of the model's row (``[tokens, ...]``, packed or padded, row-major over
    the batch's rows) as the batch's ``[b, L, ...]``, unshifted: a token's value stays under
    that token; padding holds 0."""
    if inputs.packed is not None:
        return unpack(inputs.packed, per_token, fill=0)
    b, length = micro_batch[INPUT_IDS].shape
    placed = per_token.reshape(b, length, *per_token.shape[1:])
    real = micro_batch[ATTENTION_MASK].bool().to(placed.device)
    return placed.masked_fill(~real.reshape(b, length, *[1] * (placed.dim() - 2)), 0)
