"""What the ``fsdp`` and ``fsdp2`` engines share: config fields, process-group setup, mixed
precision, device moves, DCP checkpoints and full-parameter export (:class:`FSDPEngineBase`).

Both engines keep gradients in the core's loss contract (sum over DP ranks) by scaling each
micro-batch loss by the DP size, since FSDP averages over ranks when it reduces gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import Field, model_validator
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh

from engine_core.backend import (
    BUCKET_BYTES,
    DTYPES,
    BaseEngine,
    CheckpointError,
    CutBuckets,
    EngineConfig,
    FrozenModel,
    SingleOptimizerMixin,
    WeightPart,
    is_adapter_name,
    is_dir,
    iter_buckets,
    join,
    merged_lora_tensors,
)

__all__ = [
    "MixedPrecisionConfig",
    "FSDPCommonConfig",
    "ensure_process_group",
    "decoder_blocks",
    "FSDPEngineBase",
    "full_tensors",
    "move_optimizer_state",
]

DCP_DIR = "dcp"
DtypeName = Literal["float32", "bfloat16", "float16"]


class MixedPrecisionConfig(FrozenModel):
    """Compute in ``param_dtype``, reduce gradients in ``reduce_dtype``; master weights and
    optimizer state stay in ``model.dtype``."""

    param_dtype: DtypeName = "bfloat16"
    reduce_dtype: DtypeName = "float32"

    @property
    def torch_param_dtype(self) -> torch.dtype:
        return DTYPES[self.param_dtype]

    @property
    def torch_reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce_dtype]


class FSDPCommonConfig(EngineConfig):
    """Fields both FSDP engines understand, on top of the common engine fields."""

    mixed_precision: MixedPrecisionConfig | None = Field(
        None,
        description=(
            "Mixed precision policy. None: compute_dtype's, if set (param_dtype compute_dtype, "
            "reduce_dtype float32), else compute in model.dtype."
        ),
    )
    init: Literal["all_ranks", "rank0_broadcast", "meta"] = Field(
        "all_ranks",
        description=(
            "all_ranks: every rank builds/loads the full model, then shards it (small models). "
            "rank0_broadcast: rank 0 loads, the others build on the meta device and receive "
            "their shards. meta: every rank builds on the meta device and reads only its own "
            "shards from model.path's safetensors (no rank ever holds the full model)."
        ),
    )

    @property
    def precision_policy(self) -> MixedPrecisionConfig | None:
        """The mixed precision in force: ``mixed_precision``, else the core's ``compute_dtype``
        (computing in it, reducing gradients in float32), else None (compute in model.dtype)."""
        if self.mixed_precision is not None:
            return self.mixed_precision
        if self.compute_dtype is not None:
            return MixedPrecisionConfig(param_dtype=self.compute_dtype, reduce_dtype="float32")
        return None

    @model_validator(mode="after")
    def _one_compute_dtype(self) -> FSDPCommonConfig:
        mixed, compute = self.mixed_precision, self.compute_dtype
        if mixed is not None and compute is not None and mixed.param_dtype != compute:
            raise ValueError(
                f"compute_dtype={compute!r} and mixed_precision.param_dtype="
                f"{mixed.param_dtype!r} disagree on the dtype the model computes in; set only "
                f"one of them (compute_dtype alone reduces gradients in float32), or the same "
                f"dtype in both."
            )
        return self

    @model_validator(mode="after")
    def _init_needs_path(self) -> FSDPCommonConfig:
        if self.init == "meta":
            if self.model.path is None:
                raise ValueError(
                    "init='meta' reads weights from a saved Hugging Face folder: set model.path, "
                    "or use init='all_ranks' to build model.config from scratch."
                )
            if self.model.value_head or self.model.lora is not None:
                raise ValueError(
                    "init='meta' loads every weight from model.path; a value head or LoRA "
                    "adapters are not in that checkpoint. Use init='rank0_broadcast' instead."
                )
        return self


def ensure_process_group() -> None:
    """A one-rank gloo group, so the same code path runs in a plain single process."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def decoder_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (transformers lists their class in ``_no_split_modules``)."""
    names: set[str] = set()
    for m in module.modules():  # a peft wrapper hides the attribute on the inner model
        names.update(getattr(m, "_no_split_modules", None) or [])
    return [m for m in module.modules() if type(m).__name__ in names]


def full_tensor_buckets(
    state_dict: dict[str, Any], bucket_bytes: int = BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Lists of (name, full tensor) of at most ``bucket_bytes`` of full size (a bigger tensor
    alone: :func:`iter_buckets` over the entries, a DTensor's numel being its full size), each
    gathered when asked for: its sharded (DTensor) entries back to back (their collectives in
    flight together). At most one bucket of full tensors is held here.

    Collective for sharded entries: every rank must consume the whole iterator.
    """
    for bucket in iter_buckets(state_dict.items(), bucket_bytes):
        yield [
            (name, (t.full_tensor() if hasattr(t, "full_tensor") else t).detach())
            for name, t in bucket
        ]


def full_tensors(
    state_dict: dict[str, Any], bucket_bytes: int = BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor), gathered a bucket at a time (:func:`full_tensor_buckets`)."""
    for bucket in full_tensor_buckets(state_dict, bucket_bytes):
        yield from bucket


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move every tensor of the optimizer state (e.g. Adam moments) to ``device``."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)


class FSDPEngineBase(SingleOptimizerMixin, BaseEngine):
    """The parts of both FSDP engines that do not depend on the wrapper: gradient scaling,
    device moves, DCP checkpoints and full-parameter export. Subclasses implement ``init_model``
    (setting ``self.mesh`` and ``self.module``) and ``no_sync``.

    Checkpoints: every rank writes its shards of model and optimizer under ``dcp/``, plus one
    small file of schedule, counters and RNG; the folder is staged and renamed into place by
    rank 0, so an interrupted save never leaves a half-written ``global_step_<N>``.
    """

    backend_name: ClassVar[str] = "fsdp"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.mesh: DeviceMesh | None = None
        self.optimizer = None
        self.scheduler = None
        self.skipped_steps = 0

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group() if self.mesh is not None else None

    @property
    def device(self) -> torch.device:
        # follows the process group: NCCL means one GPU per rank, gloo means CPU
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def backward(self, loss: torch.Tensor) -> None:
        # The gradient reduction averages over ranks; the loss contract wants the sum. Scaling
        # the loss (not a custom divide factor, whose PREMUL_SUM op gloo lacks) works everywhere.
        (loss * self.dp_size).backward()

    def to(self, device: torch.device | str, *, model: bool = True, optimizer: bool = True) -> None:
        target = torch.device(device)
        if target.type == "cpu" and self.device.type == "cpu":
            return  # a CPU-only run has nowhere to offload to: documented no-op
        if model:
            self.require_module().to(target)
        if optimizer and self.optimizer is not None:
            move_optimizer_state(self.optimizer, target)

    def sharded_state_dict(self) -> dict[str, Any]:
        """The model's state dict with sharded entries (DTensors), never gathered whole."""
        return get_model_state_dict(self.require_module())

    def named_full_params(
        self, bucket_bytes: int = BUCKET_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # a bucket of full tensors at a time (and at most one LoRA layer with adapters merged):
        # never the whole unsharded model. Collective: every rank must consume the iterator.
        tensors = full_tensors(self.sharded_state_dict(), bucket_bytes)
        if self.config.model.lora is not None:
            tensors = merged_lora_tensors(tensors, self.config.model.lora)
        yield from tensors

    def named_lora_params(
        self, bucket_bytes: int = BUCKET_BYTES, *, adapters_only: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # the peft model's own names, unmerged; with adapters_only the frozen base is not even
        # gathered. Collective like named_full_params (every rank filters the same names).
        for bucket in self.weight_buckets("adapters" if adapters_only else "peft", bucket_bytes):
            yield from bucket

    def weight_buckets(
        self, part: WeightPart = "model", bucket_bytes: int = BUCKET_BYTES
    ) -> CutBuckets:
        # each bucket as gathered, the next one not gathered before this one is handed on;
        # merging LoRA layers regroups the tensors, so the merged model takes the default
        if part == "model" and self.config.model.lora is not None:
            return super().weight_buckets(part, bucket_bytes)
        self._check_weight_part(part)
        state = self.sharded_state_dict()
        if part == "adapters":
            state = {name: t for name, t in state.items() if is_adapter_name(name)}
        return CutBuckets(full_tensor_buckets(state, bucket_bytes))

    def save_shards(self, folder: str) -> None:
        assert self.optimizer is not None, "call init_model() first"
        model_sd, optim_sd = get_state_dict(self.require_module(), self.optimizer)
        # collective; a local path uses DCP's file writer, a URL its fsspec writer
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=join(folder, DCP_DIR))

    def load_shards(self, folder: str) -> None:
        assert self.optimizer is not None, "call init_model() first"
        if not is_dir(join(folder, DCP_DIR)):
            raise CheckpointError(
                f"{folder} is not a complete {self.backend_name} checkpoint (no {DCP_DIR}/); pass "
                f"a global_step_<N> folder written by save_checkpoint()."
            )
        module = self.require_module()
        model_sd, optim_sd = get_state_dict(module, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=join(folder, DCP_DIR))
        set_state_dict(
            module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
