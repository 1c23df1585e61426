"""Capabilities an engine or rollout may declare, and the check that refuses what it lacks."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from engine_core.errors import CapabilityError

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - py3.10 fallback
    from enum import Enum

    class StrEnum(str, Enum):  # the one fallback every module imports from here
        def __str__(self) -> str:
            return str(self.value)


__all__ = ["Capability", "StrEnum", "check_capabilities"]


class Capability(StrEnum):
    """A feature a backend supports. Engines list theirs in ``BaseEngine.capabilities``."""

    VALUE_HEAD = "value_head"
    # engines: trains LoRA adapters (model.lora); rollouts: serves them unmerged, so a sync
    # sends the base once and the adapters alone after that
    LORA = "lora"
    TENSOR_PARALLEL = "tensor_parallel"
    PIPELINE_PARALLEL = "pipeline_parallel"
    CONTEXT_PARALLEL = "context_parallel"
    PACKING = "packing"
    DYNAMIC_BATCH = "dynamic_batch"
    OFFLOAD = "offload"
    WEIGHT_EXPORT = "weight_export"
    CPU = "cpu"
    DATA_PARALLEL = "data_parallel"
    GRADIENT_CHECKPOINTING = "gradient_checkpointing"
    BF16 = "bf16"  # trains and exports a model held in bfloat16 (model.dtype: bfloat16)
    # float32 master weights computing in a narrower dtype (compute_dtype: bfloat16)
    MIXED_PRECISION = "mixed_precision"
    # activations saved for the backward wait in host memory (activation_offload)
    ACTIVATION_OFFLOAD = "activation_offload"
    # engines: a batch's routed_experts (a mixture of experts' choice per token and MoE layer)
    # are replayed in the model's forward (engine_core.moe)
    ROUTING_REPLAY = "routing_replay"
    # engines: a batch's images (engine_core.vision: pixel_values, image_grid_thw,
    # rope_positions) reach a vision-language model's forward; rollouts: prompts with images
    VISION = "vision"
    # rollout capabilities
    SLEEP = "sleep"  # release() frees weights and KV cache, resume() brings them back
    LOGPROBS = "logprobs"
    # generate_async() returns a future of the batch while the generation runs elsewhere (a
    # rollout's replicas), so a trainer can train meanwhile (trainer.max_staleness)
    ASYNC_GENERATION = "async_generation"
    # the weights are received by the rollout's own processes, which join a weight-sync group
    # (join_weight_sync / receive_weights / leave_weight_sync) instead of load_weights() here
    WEIGHT_SYNC_GROUP = "weight_sync_group"
    # SamplingParams.stop_strings end a sample after the token that completes one of them in
    # its decoded text (the rollout decodes with the model folder's tokenizer as it generates)
    STOP_STRINGS = "stop_strings"
    # submit() queues a generate call and returns at once; each advance() runs one engine step
    # of every call not finished, so a call joins a batch already running (a server's clients
    # each sending one prompt keep the batch full, as a batching engine's own server does)
    CONTINUOUS_BATCHING = "continuous_batching"
    # SamplingParams.top_logprobs: each response position's most likely tokens and their
    # log-probs beside the sampled one's (rollout_top_ids, rollout_top_log_probs)
    TOP_LOGPROBS = "top_logprobs"


def check_capabilities(
    backend: str, declared: Iterable[Capability], required: Iterable[Capability]
) -> None:
    """Raise :class:`CapabilityError` naming every required capability ``backend`` lacks."""
    declared_set = {Capability(c) for c in declared}
    missing = sorted({Capability(c) for c in required} - declared_set)
    if missing:
        names = ", ".join(str(m) for m in missing)
        raise CapabilityError(
            f"backend {backend!r} does not support: {names}. It declares: "
            f"{', '.join(sorted(str(c) for c in declared_set)) or '(nothing)'}. "
            f"Turn the option off in the config or choose a backend that supports it "
            f"(`engine-core plugins` lists each backend's capabilities)."
        )
