"""Per-token log-probs and entropy from a model's last hidden states, without its full logits.

A causal LM's output projection turns ``[tokens, hidden]`` states into ``[tokens, vocab]``
logits; with 8k tokens and a 152k vocabulary those are 5 GB in fp32 before their gradient,
and the log-softmax, its exponent and their gradients are as large again. RL training needs
two numbers per token from them: the log-prob of the token that came next and the entropy.

:func:`chunked_token_log_probs` computes both over chunks of tokens: each chunk's logits live
only while that chunk is computed, in the forward and again in the backward, which recomputes
them instead of keeping them (one more ``[chunk, hidden] x [hidden, vocab]`` product per chunk)
and applies the derivatives of log-softmax and entropy in closed form. Its values and
gradients are those of :func:`token_log_probs` on the full logits (fp32: within float
rounding).

:func:`chunked_head` applies it inside a transformers model's forward: the output layer
(``get_output_embeddings()``) returns ``[.., 2]`` (log-prob, entropy) instead of logits for the
duration of one call, so wrappers that gather the layer's weight around the model's forward
(FSDP, FSDP2) do so exactly as for the plain layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "ChunkedHead",
    "HeadChunk",
    "HeadGrads",
    "WholeVocabulary",
    "chunk_logits_",
    "chunk_tokens_for",
    "chunked_head",
    "chunked_token_log_probs",
    "head_of",
    "logits_buffer",
    "logits_grad_",
    "token_log_probs",
]

#: logits per chunk when the chunk size is left to the engine: 2**22 fp32 values (16 MiB)
DEFAULT_CHUNK_ELEMENTS = 1 << 22


def token_log_probs(
    logits: torch.Tensor, next_ids: torch.Tensor, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``next_ids`` under ``logits`` (fp32), and optionally the entropy."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = logp.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if entropy else None
    return out, ent


def chunk_tokens_for(vocab: int, elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Tokens per chunk so that one chunk's logits hold about ``elements`` values."""
    return max(1, elements // max(1, vocab))


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` now, or None when it is off."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device autocast does not know (meta, say): never enabled there
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


def logits_buffer(rows: int, weight: torch.Tensor) -> torch.Tensor:
    """An fp32 ``[rows, vocab]`` buffer (``vocab``: ``weight``'s rows) for a chunk's logits or a
    tensor of their shape, made once per call of a chunked head and reused from chunk to chunk:
    on a CPU, allocating tensors of this size per chunk makes malloc map and fault them in
    again and again."""
    return torch.empty(rows, weight.shape[0], dtype=torch.float32, device=weight.device)


def chunk_logits_(
    out: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """The fp32 logits of one chunk, ``(hidden @ weight.T + bias) / temperature``, written into
    the first rows of ``out`` (a :func:`logits_buffer`) and returned. The product is computed
    as the layer computes it: in its (or autocast's) dtype, then widened to fp32."""
    z = out[: hidden.shape[0]]
    if (
        hidden.dtype == weight.dtype == torch.float32
        and bias is None
        and _autocast_dtype(hidden.device.type) is None
    ):
        torch.mm(hidden, weight.t(), out=z)
    else:
        z.copy_(F.linear(hidden, weight, bias))
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _buffers(rows: int, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits_buffer(rows, weight), logits_buffer(rows, weight)


def _chunk_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    buffers: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """fp32 log-softmax of one chunk's logits: the logits go through ``buffers[0]``
    (:func:`chunk_logits_`) and the result is the first rows of ``buffers[1]``."""
    z = chunk_logits_(buffers[0], hidden, weight, bias, temperature)
    return torch.log_softmax(z, dim=-1, out=buffers[1][: z.shape[0]])


def logits_grad_(
    logp: torch.Tensor,
    p: torch.Tensor,
    targets: torch.Tensor,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    entropy: torch.Tensor | None,
    *,
    temperature: float = 1.0,
    on_this_slice: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient in a chunk's logits ``z`` of ``sum g_lp * log p(target) + g_ent * H``,
    written in place over ``logp`` (the chunk's fp32 log-softmax, finite everywhere) and
    returned: ``d log p_t / dz = onehot(t) - p`` and ``d H / dz = -p (log p + H)``, divided by
    ``temperature`` (the logits were). ``p`` is ``exp`` of the log-softmax; ``entropy`` ``[c, 1]``
    is ``H`` per token (None: ``-sum p log p`` over ``logp``, the whole vocabulary). On a
    vocabulary slice (tensor parallelism), ``targets`` index the slice and ``on_this_slice``
    ``[c]`` is 1 where the target is in it, so the one-hot term lands on the rank that holds it.
    ``g_ent`` None: no entropy term."""
    if g_ent is not None:
        h_ent = -(p * logp).sum(-1, keepdim=True) if entropy is None else entropy
        gz = logp.add_(h_ent).mul_(p).mul_(-g_ent[:, None].float())
    else:
        gz = logp.zero_()
    if g_lp is not None:
        g = g_lp[:, None].float()
        gz.addcmul_(p, g, value=-1.0)
        gz.scatter_add_(
            -1, targets[:, None], g if on_this_slice is None else g * on_this_slice[:, None]
        )
    if temperature != 1.0:
        gz.div_(temperature)
    return gz


class HeadGrads:
    """An output layer's gradients (its input, weight and bias; those ``needs`` asks for),
    summed over chunks of tokens from each chunk's gradient in the logits. The weight's and
    bias's sums are kept in fp32 and cast to their dtype once, at :meth:`result`."""

    def __init__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        needs: tuple[bool, ...],
    ) -> None:
        want_h, want_w, want_b = needs[:3]
        self.weight, self.dtype = weight, hidden.dtype
        self.bias_dtype = None if bias is None else bias.dtype
        self.hidden = torch.empty_like(hidden) if want_h else None
        self.w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        )
        self.b = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if bias is not None and want_b
            else None
        )

    def add(self, start: int, h: torch.Tensor, gz: torch.Tensor) -> None:
        """Chunk ``h`` (rows ``start:`` of the input) with ``gz``, its gradient in the logits."""
        gz_model = gz.to(self.dtype)  # the gradient the layer's own backward receives
        if self.hidden is not None:
            self.hidden[start : start + h.shape[0]] = gz_model @ self.weight
        if self.w is not None:
            # summed in place: in fp32 outside autocast, the product goes straight into the
            # sum; otherwise the product in the layer's dtype is added to it (no fp32 copy of
            # it): either way no [vocab, hidden] fp32 temporary per chunk
            if (
                h.dtype == gz_model.dtype == torch.float32
                and _autocast_dtype(h.device.type) is None
            ):
                self.w.addmm_(gz_model.t(), h)
            else:
                self.w.add_(gz_model.t() @ h)
        if self.b is not None:
            self.b += gz_model.float().sum(0)

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(input, weight, bias) gradients; None for those not asked for."""
        return (
            self.hidden,
            None if self.w is None else self.w.to(self.weight.dtype),
            None if self.b is None or self.bias_dtype is None else self.b.to(self.bias_dtype),
        )


@dataclass(frozen=True)
class HeadChunk:
    """One chunk of a chunked head's call, as a vocabulary view sees it: ``h``, its ``[c, H]``
    rows of the input; the layer's ``weight`` and ``bias``; its ``targets`` ``[c]``; the
    ``temperature`` the logits are divided by; and the call's two :func:`logits_buffer` s,
    reused from chunk to chunk."""

    h: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    targets: torch.Tensor
    temperature: float
    buffers: tuple[torch.Tensor, torch.Tensor]

    @property
    def rows(self) -> int:
        return self.h.shape[0]


def _head_chunks(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    size: int,
) -> Iterator[tuple[int, HeadChunk]]:
    """``(start, chunk)`` for each chunk of ``size`` rows of ``rows``, all over the same two
    buffers."""
    buffers = _buffers(min(rows.shape[0], size), weight)
    for s in range(0, rows.shape[0], size):
        yield (
            s,
            HeadChunk(
                rows[s : s + size], weight, bias, targets[s : s + size], temperature, buffers
            ),
        )


class WholeVocabulary:
    """What a chunked head computes per chunk when its weight covers the whole vocabulary (one
    rank): the fp32 log-softmax of the chunk's logits, and in the backward their gradient.

    A head over a slice of the vocabulary (tensor parallelism: megatron's ``VocabSlice``)
    subclasses it: its sums over the vocabulary are reduced over ranks, and its input rows may
    be a sequence-parallel split. The chunk loop, what is saved for the backward, the sums of
    the layer's gradients and autocast are :class:`ChunkedHead`'s, the same for both."""

    #: a call whose tokens fit in one chunk keeps that chunk's log-softmax for the backward
    #: (no more memory than recomputing it would take)
    keeps_one_chunk = True

    def gather_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The ``[N, H]`` rows the logits are computed from (forward and backward)."""
        return hidden

    def scatter_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of the input the head was given, from that of :meth:`gather_rows`'."""
        return grad

    def forward_chunk(
        self, chunk: HeadChunk, out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]
    ) -> torch.Tensor:
        """One chunk's log-probs of ``targets`` into ``out[0]`` and entropy into ``out[1]`` (None:
        not asked for); ``out[2]``, the per-token log-partition, is the vocabulary slice's to
        fill. Returns the chunk's log-softmax (kept when :attr:`keeps_one_chunk` applies)."""
        lp, ent, _ = out
        logp = self._log_softmax(chunk)
        lp.copy_(logp.gather(-1, chunk.targets[:, None]).squeeze(-1))
        if ent is not None:
            p = torch.exp(logp, out=chunk.buffers[0][: chunk.rows])
            ent.copy_(-p.mul_(logp).sum(-1))
        return logp

    def backward_chunk(
        self,
        chunk: HeadChunk,
        saved: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor],
        grads: tuple[torch.Tensor | None, torch.Tensor | None],
    ) -> torch.Tensor:
        """The gradient in one chunk's logits (:func:`logits_grad_`); ``saved``: the kept
        log-softmax (or None), and the forward's log-partition and entropy of the chunk."""
        kept = saved[0]
        logp = kept if kept is not None else self._log_softmax(chunk)
        p = torch.exp(logp, out=chunk.buffers[0][: chunk.rows])
        return logits_grad_(logp, p, chunk.targets, *grads, None, temperature=chunk.temperature)

    @staticmethod
    def _log_softmax(chunk: HeadChunk) -> torch.Tensor:
        return _chunk_log_probs(chunk.h, chunk.weight, chunk.bias, chunk.temperature, chunk.buffers)


class ChunkedHead(torch.autograd.Function):
    """Log-prob and entropy per token from ``hidden @ weight.T + bias``, a chunk of tokens at a
    time, over the vocabulary ``vocab`` describes (:class:`WholeVocabulary` or a slice of it).
    The backward recomputes each chunk's logits from the saved input (unless one chunk held
    them all) and sums the layer's gradients over chunks (:class:`HeadGrads`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        vocab: WholeVocabulary,
        temperature: float,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = vocab.gather_rows(hidden)
        n = rows.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=rows.device)
        ent = torch.zeros(n, dtype=torch.float32, device=rows.device)
        log_z = torch.empty(n, dtype=torch.float32, device=rows.device)
        logp = torch.empty(0)
        for s, part in _head_chunks(rows, weight, bias, targets, temperature, chunk):
            out = (lp[s : s + chunk], ent[s : s + chunk] if with_entropy else None)
            logp = vocab.forward_chunk(part, (*out, log_z[s : s + chunk]))
        kept = logp if n <= chunk and vocab.keeps_one_chunk else None
        del logp, rows  # gathered rows are gathered again in the backward
        ctx.save_for_backward(hidden, weight, bias, targets, kept, log_z, ent)
        ctx.vocab, ctx.temperature, ctx.chunk = vocab, temperature, chunk
        ctx.with_entropy = with_entropy
        ctx.autocast = _autocast_dtype(hidden.device.type)
        ctx.device_type = hidden.device.type
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[Any, ...]:
        if ctx.autocast is None:
            return ChunkedHead._backward(ctx, g_lp, g_ent)
        # The forward ran under autocast (an engine's compute_dtype) and the backward runs
        # outside it: turn it back on, so the recomputed logits and the layer's matmuls run in
        # the forward's dtype, as a plain layer's recorded backward would.
        with torch.autocast(ctx.device_type, ctx.autocast):
            return ChunkedHead._backward(ctx, g_lp, g_ent)

    @staticmethod
    def _backward(
        ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[Any, ...]:
        hidden, weight, bias, targets, kept, log_z, ent = ctx.saved_tensors
        vocab: WholeVocabulary = ctx.vocab
        chunk = ctx.chunk
        rows = vocab.gather_rows(hidden)
        grads = HeadGrads(rows, weight, bias, ctx.needs_input_grad)
        g_ent = g_ent if ctx.with_entropy else None
        for s, part in _head_chunks(rows, weight, bias, targets, ctx.temperature, chunk):
            gz = vocab.backward_chunk(
                part,
                (kept, log_z[s : s + chunk], ent[s : s + chunk]),
                (
                    None if g_lp is None else g_lp[s : s + chunk],
                    None if g_ent is None else g_ent[s : s + chunk],
                ),
            )
            grads.add(s, part.h, gz)
        g_hidden, g_weight, g_bias = grads.result()
        if g_hidden is not None:
            g_hidden = vocab.scatter_grad(g_hidden)
        return (g_hidden, g_weight, g_bias, None, None, None, None, None)


def chunked_token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` (and the entropy) under the logits ``hidden @ weight.T + bias``,
    divided by ``temperature``, without materialising them: ``chunk_tokens`` rows at a time
    (default: :func:`chunk_tokens_for` the vocabulary).

    ``hidden``: ``[..., H]``; ``weight``: ``[V, H]``; ``targets``: ``[...]`` token ids. Returns
    fp32 ``[...]`` tensors, differentiable in ``hidden``, ``weight`` and ``bias``.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} must agree on "
            f"every dimension but the last."
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} must be [vocab, {hidden.shape[-1]}] for hidden "
            f"states of width {hidden.shape[-1]}."
        )
    chunk = chunk_tokens or chunk_tokens_for(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}.")
    lead = targets.shape
    lp, ent = ChunkedHead.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        targets.reshape(-1),
        WholeVocabulary(),
        float(temperature),
        int(chunk),
        bool(entropy),
    )
    return lp.view(lead), (ent.view(lead) if entropy else None)


def head_of(module: torch.nn.Module) -> tuple[torch.nn.Linear | None, str]:
    """The output layer :func:`chunked_head` can replace, or None and why not."""
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, torch.nn.Linear):
        return None, f"the output layer is {type(head).__name__}, not a plain Linear layer"
    config = getattr(module, "config", None)
    if getattr(config, "final_logit_softcapping", None) is not None:
        return None, "the model soft-caps its logits after the output layer"
    if getattr(config, "logit_scale", None) not in (None, 1.0):
        return None, "the model scales its logits after the output layer"
    return head, ""


@contextlib.contextmanager
def chunked_head(
    head: torch.nn.Linear,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int | None = None,
) -> Iterator[None]:
    """For the calls inside it, ``head`` (a model's output layer) returns ``[..., 2]``: the
    log-prob of ``targets`` (``[...]``, one id per position the layer sees) and the entropy (0
    where not asked for), in fp32, instead of ``[..., vocab]`` logits."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        weight = head.weight  # gathered by a sharding wrapper around the model's forward
        if isinstance(weight, DTensor) or isinstance(hidden, DTensor):
            raise NotImplementedError(
                "chunked log-probs need the output layer's whole weight during the forward; "
                "it is a DTensor here (the layer is sharded by tensor parallelism). Set "
                "logits_chunk_tokens: null in the engine config to use full logits."
            )
        lp, ent = chunked_token_log_probs(
            hidden,
            weight,
            targets.to(hidden.device),
            bias=head.bias,
            temperature=temperature,
            entropy=entropy,
            chunk_tokens=chunk_tokens,
        )
        return torch.stack([lp, ent if ent is not None else torch.zeros_like(lp)], dim=-1)

    own = head.__dict__.get("forward")  # a forward set on the instance by someone else
    head.forward = forward  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own  # type: ignore[method-assign]
