"""Registers the ``sglang`` rollout. Cheap to import: names and strings only (no sglang import)."""

from __future__ import annotations

from engine_core.backend import (
    BackendRegistry,
    Capability,
    hookimpl,
)

__all__ = ["engine_core_register", "SGLANG_CAPABILITIES"]

# No CPU capability: on a CPU host SGLang needs an environment of its own (`make sglang-env`,
# rollout.device=cpu, reached through rollout_python). SLEEP: release()/resume() free and
# re-allocate GPU memory through SGLang's memory saver (CUDA only). ROUTING_REPLAY: started with
# rollout.return_routes, SGLang returns the experts each token went to
# (enable_return_routed_experts).
# lora: the base once, then each adapter version loaded from a folder (load_lora_adapter).
# stop_strings: each response cut after SGLang answers, with the model's tokenizer (rollout.py)
SGLANG_CAPABILITIES = frozenset(
    {
        Capability.LOGPROBS,
        Capability.SLEEP,
        Capability.ROUTING_REPLAY,
        Capability.LORA,
        Capability.STOP_STRINGS,
        Capability.VISION,  # prompts with images as pixel patches (engine_core_sglang.vision)
        Capability.TOP_LOGPROBS,  # each position's most likely tokens (top_logprobs_num)
    }
)


@hookimpl
def engine_core_register(registry: BackendRegistry) -> None:
    registry.register_rollout(
        "sglang",
        "engine_core_sglang.rollout:SGLangRollout",
        config="engine_core_sglang.rollout:SGLangRolloutConfig",
        capabilities=SGLANG_CAPABILITIES,
        description="SGLang offline engine (CUDA GPUs, or its CPU engine in its own environment), "
        "verified bucketed weight updates.",
    )
