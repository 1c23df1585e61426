"""Typed configuration shared by every engine: model, optimizer, micro-batching.

Each backend subclasses :class:`EngineConfig` with its own fields (``extra="forbid"`` keeps typos
out). Configs are frozen: derived values come from the resolve step in :mod:`engine_core.resolve`,
never from mutating a config.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PositiveInt,
    ValidationError,
    model_validator,
)

from engine_core.capabilities import Capability
from engine_core.configio import explain_unknown_keys

BUCKET_BYTES = 256 << 20
"""The one default bucket size of a weight stream: what an engine's ``named_full_params`` gathers
at once and what a weight sync sends at once (a bigger tensor goes alone)."""

__all__ = ["FrozenModel", "Seeded", "ModelConfig", "LoraConfig", "OptimConfig", "EngineConfig"]

DtypeName = Literal["float32", "bfloat16", "float16"]
# bytes per element: a compute dtype must be narrower than the dtype the weights are held in
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_log = logging.getLogger(__name__)


class FrozenModel(BaseModel):
    """Base of every config model: immutable, unknown keys refused (naming the close matches)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    @model_validator(mode="wrap")
    @classmethod
    def _explain_unknown_keys(
        cls, data: Any, handler: ModelWrapValidatorHandler[FrozenModel]
    ) -> FrozenModel:
        try:
            return handler(data)
        except ValidationError as e:
            valid = [f.alias or name for name, f in cls.model_fields.items()]
            raise explain_unknown_keys(e, valid) from None

    def validated_copy(self, **update: Any) -> Self:
        """This config with ``update`` applied, validated as a new one would be: every field
        check and rule between fields runs again (``model_copy(update=...)`` runs none). The
        fields this config was given stay the ones it was given, plus ``update``'s."""
        return self.model_validate({**self.model_dump(exclude_unset=True), **update})


class Seeded(FrozenModel):
    """A section with a seed of its own: the one declaration of ``seed`` that the engine, rollout,
    trainer, data and task sections inherit. What it seeds is each section's to say. In a job,
    the run's ``seed`` is every section's default; a section's own, set in the recipe or on the
    command line, wins for that section alone."""

    seed: int = Field(
        0, description="This section's seed (in a job: the run's seed unless set here)."
    )


class LoraConfig(FrozenModel):
    """LoRA adapters (through ``peft``); only adapter weights train."""

    rank: PositiveInt = 8
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"


class ModelConfig(FrozenModel):
    """Which transformers model to train: a local folder, or a config built from scratch."""

    path: str | None = Field(None, description="Local folder with a Hugging Face checkpoint.")
    config: dict[str, Any] | None = Field(
        None,
        description="transformers config kwargs (must include model_type) to build from scratch.",
    )
    tokenizer: str | None = Field(
        None,
        description="Local folder with the model's tokenizer (default: path). Engines train on "
        "token ids and never read it; a text job (and a rollout that decodes) does.",
    )
    dtype: DtypeName = "float32"
    value_head: bool = Field(False, description="Add a scalar value head (critic).")
    gradient_checkpointing: bool = False
    attn_implementation: Literal["eager", "sdpa", "sdpa_varlen", "flash_attention_2"] | None = (
        Field(
            None,
            description=(
                "transformers attention kernel; None: in a packed engine (use_packing) or "
                "under context parallelism the engine config sets it to sdpa_varlen (and logs "
                "it), elsewhere the model's default (sdpa). "
                "sdpa_varlen: SDPA per packed sequence, no dense mask (engine_core.attention). "
                "flash_attention_2 needs a GPU, the flash-attn package and bf16/fp16 compute."
            ),
        )
    )
    lora: LoraConfig | None = None
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.config is None):
            raise ValueError(
                "set exactly one of model.path (a saved HF folder) or model.config "
                "(transformers config kwargs with model_type); got "
                f"path={self.path!r}, config={'set' if self.config else None}"
            )
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config must include 'model_type' (e.g. 'qwen2', 'llama').")
        return self

    def raw_config(self) -> dict[str, Any]:
        """The model's config as plain data, read without building it: ``config``, or the
        folder's ``config.json`` (empty when it cannot be read: the loader then says why)."""
        if self.config is not None:
            return dict(self.config)
        import json
        from pathlib import Path

        assert self.path is not None
        try:
            raw = json.loads((Path(self.path) / "config.json").read_text())
        except (OSError, ValueError):
            return {}
        return raw if isinstance(raw, dict) else {}

    @property
    def is_vision(self) -> bool:
        """Whether this is a vision-language model: its config has a vision tower's."""
        return self.raw_config().get("vision_config") is not None


class OptimConfig(FrozenModel):
    """AdamW with an optional warmup followed by a constant or cosine schedule."""

    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    clip_grad: float | None = Field(1.0, gt=0, description="Max grad norm; None disables clipping.")
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    total_steps: PositiveInt | None = Field(None, description="Needed by the cosine schedule.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    prelude_steps: int = Field(
        0,
        ge=0,
        description=(
            "The first prelude_steps optimizer steps run at prelude_lr, constant; the schedule "
            "(warmup_steps, then constant or cosine over total_steps) counts the steps after "
            "them. The RL job sets both from warmup_sft_steps and warmup_lr: a supervised "
            "warm-up at its own rate, RL at lr."
        ),
    )
    prelude_lr: float | None = Field(None, gt=0, description="The prelude steps' lr.")

    @model_validator(mode="after")
    def _check_schedule(self) -> OptimConfig:
        if self.schedule == "cosine" and self.total_steps is None:
            raise ValueError("optim.schedule='cosine' needs optim.total_steps (a positive int).")
        if (self.prelude_steps > 0) != (self.prelude_lr is not None):
            raise ValueError(
                f"optim.prelude_steps={self.prelude_steps} and optim.prelude_lr="
                f"{self.prelude_lr} go together: set both (steps at their own rate before the "
                f"schedule), or neither."
            )
        return self


class EngineConfig(Seeded):
    """Fields every training engine understands. Backends subclass this with their own.

    ``seed``: the model's initialisation (a model built from a config) and the engine's random
    state."""

    backend: str = Field(..., description="Registered engine name, e.g. 'fsdp2'.")
    model: ModelConfig
    optim: OptimConfig = OptimConfig()
    micro_batch_size: PositiveInt | None = Field(
        None,
        description="Samples per micro-batch. Neither this nor a token budget: one micro-batch.",
    )
    max_tokens_per_micro_batch: PositiveInt | None = Field(
        None, description="Token budget per micro-batch (dynamic batching); a strict cap."
    )
    use_packing: bool = Field(True, description="Padding-free execution with packed sequences.")
    offload: bool = Field(False, description="Offload params/optimizer outside train/eval mode.")
    activation_offload: bool = Field(
        False,
        description=(
            "Keep the activations the backward needs in host memory between the forward and "
            "the backward (saved tensors of 64 KiB and more, parameters excepted), copied back "
            "as the backward reads them. Frees device memory for two copies over the host link "
            "per activation; on a CPU device nothing moves."
        ),
    )
    tensor_parallel_size: PositiveInt = 1
    pipeline_parallel_size: PositiveInt = 1
    context_parallel_size: PositiveInt = 1
    logits_chunk_tokens: PositiveInt | Literal["auto"] | None = Field(
        "auto",
        description=(
            "Log-probs and entropy computed from the output layer this many tokens at a time, "
            "never holding the full [tokens, vocab] logits; 'auto': chunks of about 2**22 "
            "logits (engines with the default output layer: full logits when a micro-batch's "
            "fit in one chunk, where chunks save nothing); null: full logits (the output "
            "layer's plain forward)."
        ),
    )
    compute_dtype: DtypeName | None = Field(
        None,
        description=(
            "Mixed precision: parameters (master weights), gradients' accumulation and optimizer "
            "state stay in model.dtype; forward and backward compute in compute_dtype (in "
            "practice bfloat16 with a float32 model). None: compute in model.dtype; "
            "model.dtype itself is read as None (and logged). Nothing scales the loss, so "
            "prefer bfloat16 to float16."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _derived(cls, data: Any) -> Any:
        """Values derived from others, computed on the input so the frozen config is built
        once with them (never rewritten after): packing and context parallelism attend through
        ``sdpa_varlen`` when the model names no attention; ``compute_dtype`` equal to the
        model's dtype is no mixed precision (None).

        Both are kept as rewrites, not refused: every packed recipe leaves the attention unset
        and relies on the first, and a bfloat16 model given ``compute_dtype: bfloat16`` (a
        model-agnostic override) on the second. Each rewrite is logged (info) and documented
        in the fields' descriptions."""
        if not isinstance(data, dict):
            return data
        model_cls = cls.model_fields["model"].annotation
        if not (isinstance(model_cls, type) and issubclass(model_cls, ModelConfig)):
            return data
        try:
            model = model_cls.model_validate(data.get("model"))
        except ValidationError:
            return data  # the field's own validation names what is wrong
        packing = data.get("use_packing", cls.model_fields["use_packing"].default)
        cp = data.get("context_parallel_size", 1)
        split = isinstance(cp, int) and cp > 1
        if (packing is True or split) and model.attn_implementation is None:
            # transformers attends over a packed row with one dense [T, T] mask: quadratic in
            # the whole row, several times the cost of the padded batch for many short samples
            varlen = model.validated_copy(attn_implementation="sdpa_varlen")
            data = {**data, "model": varlen}
            _log.info(
                "engine config: model.attn_implementation unset, set to sdpa_varlen (%s); "
                "name another one to use it instead.",
                "use_packing" if packing is True else f"context_parallel_size={cp}",
            )
        if data.get("compute_dtype") is not None and data["compute_dtype"] == model.dtype:
            data = {**data, "compute_dtype": None}  # computing in the weights' own dtype
            _log.info(
                "engine config: compute_dtype=%s equals model.dtype, read as None (no mixed "
                "precision: the model computes in its own dtype).",
                model.dtype,
            )
        return data

    @model_validator(mode="after")
    def _one_batching_mode(self) -> EngineConfig:
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch is not None:
            raise ValueError(
                "set micro_batch_size (fixed) or max_tokens_per_micro_batch (token budget), not "
                f"both; got {self.micro_batch_size} and {self.max_tokens_per_micro_batch}."
            )
        if self.context_parallel_size > 1:
            # a row split over ranks runs its whole sequences through sdpa_varlen
            attn = self.model.attn_implementation
            if attn not in (None, "sdpa_varlen"):
                raise ValueError(
                    f"context_parallel_size={self.context_parallel_size} needs "
                    f"model.attn_implementation sdpa_varlen (or unset), got {attn!r}: the "
                    f"context-parallel attention runs each whole sequence through it."
                )
        return self

    @model_validator(mode="after")
    def _narrower_compute_dtype(self) -> EngineConfig:
        compute, held = self.compute_dtype, self.model.dtype
        if compute is not None and _DTYPE_BYTES[compute] >= _DTYPE_BYTES[held]:
            wider = "wider than" if _DTYPE_BYTES[compute] > _DTYPE_BYTES[held] else "as wide as"
            raise ValueError(
                f"compute_dtype={compute!r} is {wider} model.dtype={held!r}: the "
                f"weights are held in model.dtype and computed in compute_dtype, so set "
                f"compute_dtype to a narrower dtype (bfloat16 with model.dtype float32) or unset "
                f"it."
            )
        return self

    def required_capabilities(self) -> set[Capability]:
        """Capabilities this config asks of its engine; checked when the config is resolved."""
        need: set[Capability] = set()
        if self.model.value_head:
            need.add(Capability.VALUE_HEAD)
        if self.model.is_vision:
            need.add(Capability.VISION)
        if self.model.lora is not None:
            need.add(Capability.LORA)
        if self.model.gradient_checkpointing:
            need.add(Capability.GRADIENT_CHECKPOINTING)
        if self.tensor_parallel_size > 1:
            need.add(Capability.TENSOR_PARALLEL)
        if self.pipeline_parallel_size > 1:
            need.add(Capability.PIPELINE_PARALLEL)
        if self.context_parallel_size > 1:
            need.add(Capability.CONTEXT_PARALLEL)
        if self.use_packing:
            need.add(Capability.PACKING)
        if self.max_tokens_per_micro_batch is not None:
            need.add(Capability.DYNAMIC_BATCH)
        if self.offload:
            need.add(Capability.OFFLOAD)
        if self.activation_offload:
            need.add(Capability.ACTIVATION_OFFLOAD)
        if self.model.dtype == "bfloat16":
            need.add(Capability.BF16)
        if self.compute_dtype is not None:
            need.add(Capability.MIXED_PRECISION)
        return need
