"""The megatron engine's model inputs and output-layer choices: :class:`ModelForward`, a mixin
of :class:`~engine_core_megatron.engine.MegatronEngine`.

It owns what one micro-batch hands ``GPTModel`` (one packed THD row or padded rows, padded to a
multiple of the TP size under sequence parallelism, with the micro-batch's
:class:`~engine_core.backend.RoutingInputs` in megatron-core's token order), whether the last
stage's output layer computes log-probs in chunks or the model runs its fused cross-entropy,
and the vocabulary-parallel log-probs of full logits.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from tensordict import TensorDict

from engine_core.backend import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    HeadRequest,
    ModelInputs,
    RoutingInputs,
    chunk_tokens_for,
    get_meta,
    pack,
)
from engine_core_megatron.schedule_routing import megatron_routing_request
from engine_core_megatron.vocab_parallel import vocab_parallel_log_probs

__all__ = ["ModelForward"]


class ModelForward:
    """GPTModel's inputs for a micro-batch, and how its output layer gives log-probs."""

    def prepare_model_inputs(self, micro_batch: TensorDict) -> ModelInputs:
        """GPTModel kwargs: one packed row with THD sequence boundaries (default), or padded rows
        with their padding mask. With sequence parallelism the packed row is padded to a
        multiple of the TP size with a dummy trailing sequence."""
        from megatron.core.packed_seq_params import PackedSeqParams

        ids, mask = micro_batch[INPUT_IDS], micro_batch[ATTENTION_MASK]
        dev = self.device
        sp = self.config.sequence_parallel  # type: ignore[attr-defined]
        multiple = self.config.tensor_parallel_size if sp else 1  # type: ignore[attr-defined]
        routed, record, balance = megatron_routing_request(self.layout, micro_batch)
        if self.config.use_packing:
            packed = pack(ids, mask)
            tokens, positions = packed.input_ids, packed.position_ids
            cu = packed.cu_seqlens.to(torch.int32)
            length = int(tokens.shape[1])
            extra = (-length) % multiple
            if extra:
                tokens = torch.nn.functional.pad(tokens, (0, extra))
                positions = torch.cat([positions, torch.arange(extra).unsqueeze(0)], 1)
                cu = torch.cat([cu, torch.tensor([length + extra], dtype=torch.int32)])
            max_len = int((cu[1:] - cu[:-1]).max())
            params = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu.to(dev),
                cu_seqlens_kv=cu.to(dev),
                max_seqlen_q=max_len,
                max_seqlen_kv=max_len,
            )
            kwargs = {
                "input_ids": tokens.to(dev),
                "position_ids": positions.to(dev),
                "attention_mask": None,
                "packed_seq_params": params,
                "length": length,
            }
            routes = None
            if routed is not None:  # [T + extra, layers, top_k]: the packed row's tokens
                routes = pad_routes(routed.flatten(0, 1)[packed.flat_indices], extra)
                routes = routes.transpose(0, 1)  # [layers, tokens, top_k], as ModelInputs holds
            return _with_routing(ModelInputs(kwargs, packed), routes, record, balance)
        length = int(ids.shape[1])
        positions = micro_batch[POSITION_IDS]
        extra = (-length) % multiple
        if extra:  # sequence parallelism splits the sequence: pad it to a multiple of TP
            ids, positions = (torch.nn.functional.pad(x, (0, extra)) for x in (ids, positions))
            mask = torch.nn.functional.pad(mask, (0, extra))
        # rows without padding need only the causal mask, which the attention builds itself
        padding = None if bool(mask.all()) else (~mask.bool()[:, None, None, :]).to(dev)
        kwargs = {
            "input_ids": ids.to(dev),
            "position_ids": positions.to(dev),
            "attention_mask": padding,
            "length": length,
        }
        routes = None
        if routed is not None:  # megatron-core's tokens are sequence-major: [(L + extra) * b]
            real = micro_batch[ATTENTION_MASK].bool()[:, :, None, None]
            routed = pad_routes(routed.masked_fill(~real, -1).transpose(0, 1), extra)
            routes = routed.flatten(0, 1).transpose(0, 1)  # [layers, tokens, top_k]
        return _with_routing(ModelInputs(kwargs, None), routes, record, balance)

    def _chunked_head_request(
        self, inputs: ModelInputs, micro_batch: TensorDict
    ) -> HeadRequest | None:
        """Whether the last stage's output layer computes log-probs and entropy in chunks for
        this micro-batch (``logits_chunk_tokens``; never for a value head), and how.

        This takes precedence over :meth:`_fused_log_probs`: megatron-core's fused
        cross-entropy still holds each rank's ``[tokens, vocab / tp]`` logits (and their
        softmax for the backward), which is what chunking avoids."""
        assert self.layout is not None
        setting = self.config.logits_chunk_tokens
        if setting is None or self.layout.value_head:
            return None
        tp = self.config.tensor_parallel_size  # type: ignore[attr-defined]
        chunk = (
            chunk_tokens_for(self.layout.padded_vocab_size // tp)
            if setting == "auto"
            else int(setting)
        )
        ids = inputs.kwargs["input_ids"]
        # the next id at each position; the row's last position predicts nothing (dropped)
        targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        meta = get_meta(micro_batch)
        layer = self.chunks[-1].module.output_layer  # a ColumnParallelLinear, not nn.Linear
        return HeadRequest(cast(Any, layer), targets, meta.temperature, meta.compute_entropy, chunk)

    def _fused_log_probs(self, micro_batch: TensorDict) -> bool:
        """Whether the model computes the log-probs itself: ``GPTModel(labels=...)`` runs
        megatron-core's vocabulary-parallel cross-entropy on the ``[s, b, vocab/tp]`` logits,
        which skips the ``[b, s, vocab/tp]`` copy of the logits and uses one fused autograd
        function. Only with full logits (``logits_chunk_tokens: null``, see
        :meth:`_chunked_head_request`) and only log-probs at temperature 1 over an unpadded
        vocabulary: entropy, value heads, temperatures and a vocabulary padded for TP go
        through :meth:`token_log_probs`."""
        assert self.layout is not None
        meta = get_meta(micro_batch)
        return not (
            self.config.logits_chunk_tokens is not None
            or self.layout.value_head
            or meta.compute_entropy
            or meta.temperature != 1.0
            or self.layout.padded_vocab_size != self.layout.vocab_size
        )

    def token_log_probs(
        self, logits: torch.Tensor, next_ids: torch.Tensor, *, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.layout is not None
        return vocab_parallel_log_probs(
            logits,
            next_ids,
            vocab_size=self.layout.vocab_size,
            group=self._ps.get_tensor_model_parallel_group(),
            entropy=entropy,
        )


def pad_routes(routes: torch.Tensor, extra: int) -> torch.Tensor:
    """``routes`` ``[tokens, ...]`` with ``extra`` trailing rows of -1 (the padding sequence
    parallelism adds): a token whose route is -1 goes where its router sends it
    (:class:`~engine_core_megatron.routing.RouterHooks`)."""
    if not extra:
        return routes
    return torch.cat([routes, routes.new_full((extra, *routes.shape[1:]), -1)])


def _with_routing(
    inputs: ModelInputs, routes: torch.Tensor | None, record: bool, balance: bool
) -> ModelInputs:
    """``inputs`` with what the micro-batch asks of the routers, when it asks anything."""
    if routes is not None or record or balance:
        inputs.add(RoutingInputs(routes, record, balance))
    return inputs
