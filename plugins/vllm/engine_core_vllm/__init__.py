"""The vLLM rollout for engine-core (``rollout.backend: vllm``)."""
