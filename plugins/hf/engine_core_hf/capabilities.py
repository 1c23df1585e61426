"""The HF rollout's capability set: one declaration for the registry and the class."""

from __future__ import annotations

from engine_core.backend import (
    Capability,
)

__all__ = ["HF_CAPABILITIES"]

# routing_replay: a mixture of experts' routes are recorded while generating and returned
# lora: with model.lora the rollout holds the same peft model as the actor and takes the
# adapters alone at each sync (the base once)
HF_CAPABILITIES = frozenset(
    {
        Capability.CPU,
        Capability.LOGPROBS,
        Capability.SLEEP,
        Capability.LORA,
        Capability.ROUTING_REPLAY,  # returns routed_experts (SamplingParams.return_routes)
        Capability.STOP_STRINGS,  # decodes with the model's tokenizer as it generates
        Capability.VISION,  # prompts with images (engine_core.vision) on a vision-language model
        Capability.TOP_LOGPROBS,  # each position's most likely tokens (SamplingParams.top_logprobs)
    }
)
