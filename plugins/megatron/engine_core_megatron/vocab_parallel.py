"""Token log-probs and entropy from logits split over the vocabulary (tensor parallelism).

Each TP rank holds ``logits[..., vocab_slice]``. The log-partition function, the target logit
and the expected logit are sums over the vocabulary, so each rank computes its partial sum and
one all-reduce per quantity combines them (megatron-core's, whose backward is the identity:
the loss downstream is replicated on every TP rank, so each rank's gradient for its own slice
is already complete): only ``[tokens]``-sized tensors cross
ranks, never the logits. Vocabulary rows added to make the vocabulary divide by the TP size are
masked out.

:func:`vocab_parallel_chunked_log_probs` does the same from the output layer's input and this
rank's weight shard, a chunk of tokens at a time, so that no rank ever holds its
``[tokens, vocab / tp]`` logits: each chunk's logits live while that chunk is reduced, in the
forward and again in the backward, which recomputes them and applies the derivatives of
log-softmax and entropy in closed form (as :mod:`engine_core.log_probs` does on one rank): :class:`VocabSlice` is the vocabulary
view of :class:`engine_core.log_probs.ChunkedHead`, which runs the chunk loop for both.
:func:`chunked_output_layer` puts it in place of a ``GPTModel``'s output layer for one call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from engine_core.backend import (
    ChunkedHead,
    HeadChunk,
    WholeVocabulary,
    chunk_logits_,
    chunk_tokens_for,
    logits_grad_,
)

__all__ = [
    "VocabSlice",
    "chunked_output_layer",
    "vocab_parallel_chunked_log_probs",
    "vocab_parallel_log_probs",
]


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    next_ids: torch.Tensor,
    *,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``next_ids`` and optionally the entropy, from this rank's vocabulary slice.

    ``logits``: ``[..., V / tp]`` (this rank's slice, in rank order); ``next_ids``: ``[...]``
    global token ids. Differentiable; equal to a full-vocabulary ``log_softmax`` in fp32.
    """
    tp = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    rank = dist.get_rank(group) if tp > 1 else 0
    local = logits.float()
    width = local.shape[-1]
    start = rank * width
    valid = torch.arange(start, start + width, device=local.device) < vocab_size
    if not bool(valid.all()):
        local = local.masked_fill(~valid, float("-inf"))

    def total(x: torch.Tensor) -> torch.Tensor:
        if tp == 1:
            return x
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(x, group=group)

    with torch.no_grad():
        peak = local.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = local - peak.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = total(exp.sum(-1))
    log_z = sum_exp.log()
    in_slice = (next_ids >= start) & (next_ids < start + width)
    idx = (next_ids - start).clamp(0, width - 1)
    target = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * in_slice
    log_probs = total(target) - log_z
    ent = None
    if entropy:
        # H = log Z - E_p[shifted]; padded vocabulary rows have p = 0
        p_shifted = (exp * shifted.masked_fill(~valid, 0.0)).sum(-1)
        ent = log_z - total(p_shifted) / sum_exp
    return log_probs, ent


def _vocab_slice(
    targets: torch.Tensor, width: int, vocab_size: int, group: dist.ProcessGroup | None
) -> tuple[int, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """This rank's view of the vocabulary: the TP size, its padded rows (None: none), whether
    each target is in its slice, and each target's row there (clamped where it is not)."""
    tp = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    start = (dist.get_rank(group) if tp > 1 else 0) * width
    rows = torch.arange(start, start + width, device=targets.device)
    padding = None if start + width <= vocab_size else rows >= vocab_size
    in_slice = (targets >= start) & (targets < start + width)
    return tp, padding, in_slice, (targets - start).clamp(0, width - 1)


def _chunk_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    padding: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """fp32 logits of one chunk on this rank's vocabulary slice (:func:`chunk_logits_` into
    ``out``, a :func:`logits_buffer` reused from chunk to chunk), padded rows at -inf."""
    z = chunk_logits_(out, hidden, weight, bias, temperature)
    if padding is not None:
        z.masked_fill_(padding, float("-inf"))
    return z


def _gather_rows(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The ``[N, H]`` rows of a sequence-parallel split from this rank's ``[N / tp, H]``."""
    local = local.contiguous()
    out = local.new_empty((local.shape[0] * dist.get_world_size(group), *local.shape[1:]))
    dist.all_gather_into_tensor(out, local, group=group)
    return out


def _scatter_rows(full: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's rows of the sum over ``group`` of ``full`` (``[N, H]``, a partial sum)."""
    full = full.contiguous()
    out = full.new_empty((full.shape[0] // dist.get_world_size(group), *full.shape[1:]))
    dist.reduce_scatter_tensor(out, full, group=group)
    return out


class VocabSlice(WholeVocabulary):
    """The chunked head of :mod:`engine_core.log_probs` on this rank's slice of the vocabulary:
    each chunk's sums over the vocabulary (of ``exp(z)``, the target's ``z`` and ``exp(z) z``)
    are reduced over ``group`` in one all-reduce, after one all-reduce of the chunk's peak, and
    the backward recomputes the chunk's logits from the saved input and the forward's per-token
    log-partition and entropy (no collective in it). ``rows_split``: the head's input is this
    rank's rows of a sequence-parallel split, gathered over the group in the forward and again
    in the backward (so that only the rows are kept), and its gradient is reduce-scattered back
    to them, as megatron-core's own layer does."""

    keeps_one_chunk = False

    def __init__(self, vocab_size: int, group: dist.ProcessGroup | None, rows_split: bool) -> None:
        self.vocab_size, self.group, self.rows_split = vocab_size, group, rows_split

    def gather_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.rows_split:
            return hidden
        assert self.group is not None
        return _gather_rows(hidden, self.group)

    def scatter_grad(self, grad: torch.Tensor) -> torch.Tensor:
        # the gradient of the input: a partial sum over this rank's slice; the input's TP
        # mapping (an all-reduce), or with split rows this reduce-scatter, completes it
        return _scatter_rows(grad, self.group) if self.rows_split else grad

    def _logits(
        self, chunk: HeadChunk
    ) -> tuple[int, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chunk's fp32 logits on this slice, in ``chunk.buffers[0]`` (padded rows at -inf),
        with :func:`_vocab_slice`'s view of its targets: ``(tp, padding, in_slice, local
        targets, logits)``."""
        width = chunk.weight.shape[0]
        tp, padding, in_slice, local_t = _vocab_slice(
            chunk.targets, width, self.vocab_size, self.group
        )
        z = _chunk_logits(
            chunk.h, chunk.weight, chunk.bias, chunk.temperature, padding, chunk.buffers[0]
        )
        return tp, padding, in_slice, local_t, z

    def forward_chunk(
        self, chunk: HeadChunk, out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]
    ) -> torch.Tensor:
        lp, ent, log_z = out
        group = self.group
        tp, padding, in_slice, local_t, z = self._logits(chunk)
        peak = z.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        z.sub_(peak.unsqueeze(-1))
        e = torch.exp(z, out=chunk.buffers[1][: chunk.rows])
        # the sums over the vocabulary, one all-reduce for all of them: sum exp(z), the
        # target's z (on the rank that holds it, 0 elsewhere) and sum exp(z) * z
        sums = [e.sum(-1), z.gather(-1, local_t[:, None]).squeeze(-1) * in_slice]
        if ent is not None:
            if padding is not None:
                z.masked_fill_(padding, 0.0)  # exp(-inf) * -inf would be nan; p = 0 there
            sums.append(e.mul_(z).sum(-1))  # e's own sum is taken above
        total = torch.stack(sums, dim=-1)
        if tp > 1:
            dist.all_reduce(total, group=group)
        log_sum = total[:, 0].log()
        lp.copy_(total[:, 1] - log_sum)
        log_z.copy_(peak + log_sum)
        if ent is not None:
            # H = -sum p (z - log Z) = log sum exp(z - max) - E_p[z - max]
            ent.copy_(log_sum - total[:, 2] / total[:, 0])
        return z

    def backward_chunk(
        self,
        chunk: HeadChunk,
        saved: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor],
        grads: tuple[torch.Tensor | None, torch.Tensor | None],
    ) -> torch.Tensor:
        _, log_z, ent = saved
        _, padding, in_slice, local_t, logp = self._logits(chunk)
        logp.sub_(log_z[:, None])  # the global log-softmax on this slice
        p = torch.exp(logp, out=chunk.buffers[1][: chunk.rows])
        if padding is not None:
            logp.masked_fill_(padding, 0.0)  # p = 0 there: no gradient, and no nan
        return logits_grad_(
            logp,
            p,
            local_t,
            *grads,
            ent[:, None],  # the forward's, over the whole vocabulary
            temperature=chunk.temperature,
            on_this_slice=in_slice,
        )


def vocab_parallel_chunked_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int | None = None,
    sequence_parallel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` (and the entropy) under the logits ``hidden @ weight.T + bias``
    divided by ``temperature``, with the vocabulary split over ``group``, ``chunk_tokens``
    tokens at a time (default: :func:`~engine_core.log_probs.chunk_tokens_for` the slice).

    ``hidden``: ``[N, H]``, the same on every TP rank; ``weight``: ``[V / tp, H]``, this rank's
    rows in rank order; ``bias``: ``[V / tp]`` or None; ``targets``: ``[N]`` global ids; rows at
    or past ``vocab_size`` are padding. Returns fp32 ``[N]`` tensors, the same on every rank,
    differentiable in ``weight``, ``bias`` and (as a partial sum over this slice, which the
    caller reduces over TP) ``hidden``. Only ``[chunk]``-sized tensors cross ranks.

    ``sequence_parallel``: ``hidden`` is this rank's ``[N / tp, H]`` rows of a sequence-parallel
    split (rank order); they are gathered for the forward and again for the backward, only they
    are kept in between, and their gradient is complete (reduce-scattered over ``group``).
    """
    tp = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    rows = hidden.shape[0] * (tp if sequence_parallel else 1)
    if hidden.dim() != 2 or tuple(targets.shape) != (rows,):
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [tokens, hidden] (with sequence_parallel, "
            f"this rank's [tokens / {tp}, hidden]) and targets {tuple(targets.shape)} [tokens]."
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} must be [vocab / tp, {hidden.shape[1]}] for hidden "
            f"states of width {hidden.shape[1]}."
        )
    chunk = chunk_tokens or chunk_tokens_for(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}.")
    lp, ent = ChunkedHead.apply(
        hidden,
        weight,
        bias,
        targets,
        VocabSlice(int(vocab_size), group, bool(sequence_parallel) and tp > 1),
        float(temperature),
        int(chunk),
        bool(entropy),
    )
    return lp, (ent if entropy else None)


@contextlib.contextmanager
def chunked_output_layer(
    layer: torch.nn.Module,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int | None = None,
) -> Iterator[None]:
    """For the calls inside it, ``layer`` (a ``GPTModel``'s ``ColumnParallelLinear`` output
    layer) returns ``([s, b, 2], bias)``: the log-prob of ``targets`` (``[b, s]``, the next id
    at each position of the model's row) and the entropy (0 where not asked for), the same on
    every TP rank, instead of ``[s, b, vocab / tp]`` logits.

    The input goes through the TP mapping megatron-core's layer applies: with sequence
    parallelism the ``[s / tp, b, h]`` slices are gathered (a reduce-scatter of the gradient;
    like megatron-core's layer, only the slice is kept for the backward, which gathers it
    again), else an identity whose backward all-reduces the gradient over TP. A ``weight``
    argument (tied embeddings) replaces the layer's own, as in megatron-core.
    """
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    def forward(
        input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if weight is None:
            weight = layer.weight
        group = layer.tp_group
        split = bool(layer.sequence_parallel) and dist.get_world_size(group) > 1
        hidden = input_ if split else copy_to_tensor_model_parallel_region(input_, group=group)
        local, b, h = hidden.shape
        s = local * dist.get_world_size(group) if split else local
        if tuple(targets.shape) != (b, s):
            raise ValueError(
                f"targets {tuple(targets.shape)} must be [batch, sequence] = {(b, s)} for the "
                f"output layer's input {tuple(input_.shape)}."
            )
        bias = None if layer.skip_bias_add else layer.bias
        lp, ent = vocab_parallel_chunked_log_probs(
            hidden.reshape(local * b, h),
            weight,
            targets.to(hidden.device).t().reshape(-1),
            vocab_size=vocab_size,
            group=group,
            bias=bias,
            temperature=temperature,
            entropy=entropy,
            chunk_tokens=chunk_tokens,
            sequence_parallel=split,
        )
        out = torch.stack([lp, ent if ent is not None else torch.zeros_like(lp)], dim=-1)
        return out.view(s, b, 2), (layer.bias if layer.skip_bias_add else None)

    own = layer.__dict__.get("forward")  # a forward set on the instance by someone else
    layer.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del layer.forward
        else:
            layer.forward = own  # type: ignore[method-assign]
