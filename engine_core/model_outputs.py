"""The default outputs of a forward: :class:`ModelOutputs`, a mixin of
:class:`~engine_core.engine.BaseEngine`.

It turns the model's output for one micro-batch into per-token ``log_probs`` (and ``entropy``),
or a value head's ``values``, in the batch's ``[b, L]`` layout
(:meth:`~ModelOutputs.prepare_model_outputs`): log-probs from full logits
(:meth:`~ModelOutputs.token_log_probs`) or from a chunked output layer, each prediction moved
onto the token it predicts (:meth:`~ModelOutputs.place_next_token_outputs`), a row split over
context-parallel ranks gathered whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from engine_core.batch import ATTENTION_MASK, ENTROPY, LOG_PROBS, VALUES, BatchMeta, get_meta
from engine_core.context_parallel import gather_sequence
from engine_core.log_probs import token_log_probs
from engine_core.model_inputs import ModelInputs, next_token_targets, predicted_mask
from engine_core.packing import sequence_start_mask, unpack

if TYPE_CHECKING:
    from engine_core.config import EngineConfig

__all__ = ["ModelOutputs"]


class ModelOutputs:
    """Per-token outputs of a transformers causal LM or value head, in the batch's layout."""

    if TYPE_CHECKING:  # provided by BaseEngine
        config: EngineConfig

    def prepare_model_outputs(
        self, raw: Any, inputs: ModelInputs, micro_batch: TensorDict
    ) -> TensorDict:
        """Per-token ``log_probs`` (and ``entropy``), or ``values`` for a value head, as ``[b, L]``.

        Outputs are aligned to ``input_ids``: position ``t`` holds the prediction of token ``t``
        from positions ``< t``; the first token of each sequence and padding hold 0. With
        ``BatchMeta.values_at_token`` a value head's output is read at each token instead.
        """
        meta: BatchMeta = get_meta(micro_batch)
        logits = raw.logits
        shard = inputs.shard

        def whole_row(x: torch.Tensor) -> torch.Tensor:  # context parallel: gather the slices
            return x if shard is None else gather_sequence(x, shard.group)[:, : shard.length]

        if self.config.model.value_head and meta.values_at_token:
            # the head's output at every real token, no shift: only padding holds 0
            at_token = whole_row(logits[..., 0].float())
            if inputs.packed is not None:
                values = unpack(inputs.packed, at_token)
            else:
                values = at_token.masked_fill(
                    ~micro_batch[ATTENTION_MASK].bool().to(logits.device), 0.0
                )
            return TensorDict({VALUES: values.cpu()}, batch_size=[micro_batch.batch_size[0]])
        # per position of the model's row, each predicting the token after it
        data: dict[str, torch.Tensor] = {}
        if self.config.model.value_head:
            data[VALUES] = logits[..., 0].float()
        elif inputs.head is not None:  # the output layer gave (log-prob, entropy) per position
            data[LOG_PROBS] = logits[..., 0]
            if inputs.head.entropy:
                data[ENTROPY] = logits[..., 1]
        else:
            scores = logits.float()  # divided in float32, as the chunked head does
            if meta.temperature != 1.0:  # x / 1.0 == x: skip a pass over the logits
                scores = (
                    scores.div_(meta.temperature)
                    if scores is not logits
                    else scores / meta.temperature
                )
            lp, ent = self.token_log_probs(
                scores, next_token_targets(inputs, logits.shape[1]), entropy=meta.compute_entropy
            )
            data[LOG_PROBS] = lp
            if ent is not None:
                data[ENTROPY] = ent
        # the row's last position predicts nothing
        data = {k: whole_row(v)[:, :-1] for k, v in data.items()}
        return self.place_next_token_outputs(data, inputs, micro_batch)

    def place_next_token_outputs(
        self, data: dict[str, torch.Tensor], inputs: ModelInputs, micro_batch: TensorDict
    ) -> TensorDict:
        """Per-token outputs ``[b, L]`` from per-position ones ``[b, L' - 1]`` (position ``t``
        predicting token ``t + 1`` of the model's input row, padded or packed).

        The prediction of token ``t`` comes from position ``t - 1``, so each result moves right
        by one; the first token of each sequence and padding hold 0. Shifting the per-token
        results rather than the ``[.., vocab]`` logits saves a copy of the logits and its
        backward. For engines that compute next-token quantities themselves (a fused loss
        kernel, say) and then share this placement.
        """
        shifted = {k: torch.nn.functional.pad(v, (1, 0)) for k, v in data.items()}
        device = next(iter(shifted.values())).device
        if inputs.packed is not None:
            starts = sequence_start_mask(inputs.packed).to(device)
            result = {
                k: unpack(inputs.packed, v.masked_fill(starts, 0.0)) for k, v in shifted.items()
            }
        else:
            valid = predicted_mask(micro_batch[ATTENTION_MASK]).to(device)
            result = {k: v.masked_fill(~valid, 0.0) for k, v in shifted.items()}
        b = micro_batch.batch_size[0]
        return TensorDict({k: v.cpu() for k, v in result.items()}, batch_size=[b])

    def token_log_probs(
        self, logits: torch.Tensor, next_ids: torch.Tensor, *, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-prob of ``next_ids`` (and the entropy) from the model's ``logits``.

        The default reads full-vocabulary logits; engines whose logits are split over the
        vocabulary (tensor parallelism) override it with a vocabulary-parallel computation.
        """
        return token_log_probs(logits, next_ids, entropy=entropy)
