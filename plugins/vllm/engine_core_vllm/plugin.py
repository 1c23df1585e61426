"""Registers the ``vllm`` rollout. Cheap to import: names and strings only (no vllm import)."""

from __future__ import annotations

from engine_core.backend import (
    BackendRegistry,
    Capability,
    hookimpl,
)

__all__ = ["engine_core_register", "VLLM_CAPABILITIES"]

# routing_replay: started with rollout.return_routes, vLLM returns the experts each token went
# to (enable_return_routed_experts; its Model Runner V2 only, which needs Triton)
VLLM_CAPABILITIES = frozenset(
    {
        Capability.CPU,
        Capability.LOGPROBS,
        Capability.ROUTING_REPLAY,
        Capability.STOP_STRINGS,
        Capability.LORA,  # the base once, then each adapter version as a LoRARequest
        Capability.VISION,  # prompts with images as pixel patches (engine_core_vllm.vision)
        Capability.CONTINUOUS_BATCHING,  # submitted calls join the engine's running batch
        Capability.TOP_LOGPROBS,  # each position's most likely tokens (vLLM's logprobs=k)
    }
)


@hookimpl
def engine_core_register(registry: BackendRegistry) -> None:
    registry.register_rollout(
        "vllm",
        "engine_core_vllm.rollout:VLLMRollout",
        config="engine_core_vllm.rollout:VLLMRolloutConfig",
        capabilities=VLLM_CAPABILITIES,
        description="vLLM offline engine (in-process), verified in-place weight reload.",
    )
