"""``MegatronEngineConfig``: the megatron engine's settings on top of the common engine fields."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from engine_core.backend import (
    EngineConfig,
)
from engine_core_megatron.convert import SUPPORTED_MODEL_TYPES

__all__ = ["MegatronEngineConfig"]


class MegatronEngineConfig(EngineConfig):
    """Tensor, pipeline and data parallelism through megatron-core.

    ``tensor_parallel_size`` × ``pipeline_parallel_size`` must divide the number of processes;
    the remaining factor is the data-parallel size. A mixture of experts can also spread its
    experts over ``expert_parallel_size`` ranks.
    """

    sequence_parallel: bool = Field(
        False,
        description="Split activations outside attention/MLP along the sequence over the TP ranks "
        "(needs tensor_parallel_size > 1).",
    )
    expert_parallel_size: PositiveInt = Field(
        1,
        description="Mixture-of-experts models: spread each layer's experts over this many ranks "
        "(megatron-core's all-to-all token dispatcher); must divide the number of experts, and "
        "tensor_parallel_size x expert_parallel_size must divide the processes of a pipeline "
        "stage. The experts' data-parallel size is what remains.",
    )
    virtual_pipeline_parallel_size: PositiveInt | None = Field(
        None,
        description="Interleaved 1F1B: model chunks per pipeline rank (needs "
        "pipeline_parallel_size > 1 and num_hidden_layers divisible by pp × vpp).",
    )
    use_distributed_optimizer: bool = Field(
        False, description="Shard optimizer state over the data-parallel ranks (ZeRO-1)."
    )
    transformer_impl: Literal["local", "transformer_engine"] = Field(
        "local",
        description="local: megatron-core's own layers (any device); transformer_engine: "
        "TransformerEngine layers (GPU hosts with transformer-engine installed).",
    )
    grad_reduce_in_fp32: bool = Field(
        True, description="Accumulate and reduce gradients in fp32 (bf16/fp16 models)."
    )

    @model_validator(mode="after")
    def _layout(self) -> MegatronEngineConfig:
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "sequence_parallel=true needs tensor_parallel_size > 1; got tensor_parallel_size=1. "
                "Set tensor_parallel_size >= 2 or sequence_parallel=false."
            )
        if self.virtual_pipeline_parallel_size is not None and self.pipeline_parallel_size == 1:
            raise ValueError(
                "virtual_pipeline_parallel_size needs pipeline_parallel_size > 1; got "
                "pipeline_parallel_size=1. Unset virtual_pipeline_parallel_size."
            )
        self._mapped_family()
        return self

    def _mapped_family(self) -> None:
        """The model's family must be one megatron-core builds here, checked from the config
        alone (the folder's config.json), before any process starts: a vision-language model
        (or any other family) is refused with the list of those mapped."""
        raw = self.model.raw_config()
        if not raw:
            return  # missing or unreadable: the model's own loader says which
        kind, vision = raw.get("model_type"), raw.get("vision_config") is not None
        if kind in SUPPORTED_MODEL_TYPES and not vision:
            return
        what = "a vision-language model" if vision else "a model"
        raise ValueError(
            f"megatron maps the families {', '.join(SUPPORTED_MODEL_TYPES)} (text decoders) "
            f"and got {what} of model_type {kind!r}; train it with engine.backend=fsdp2 or "
            f"fsdp, which build any transformers model (vision-language ones included)."
        )
