"""``FSDP2Engine``: parameters sharded with ``fully_shard`` over a data-parallel mesh.

The device mesh has up to four named axes, outermost first: ``dp_replicate`` (HSDP replica
groups), ``dp_shard`` (parameter sharding), ``cp`` (context parallelism: each packed row split
over its ranks, Ulysses attention, :mod:`engine_core.context_parallel`) and ``tp`` (tensor
parallelism of the decoder blocks). Parallelism is applied in a fixed order by
:func:`parallelize`: tensor parallel, then ``fully_shard`` per decoder block, then the root;
parameters are sharded over ``dp_shard`` × ``cp``. Data is split over the ``dp_replicate`` ×
``dp_shard`` ranks; the ``cp`` and ``tp`` ranks of one DP rank see the same data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from pydantic import Field, PositiveInt, model_validator
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from engine_core.backend import (
    CP_GROUP_ATTR,
    Capability,
    ConfigError,
    EngineConfig,
    StrEnum,
    build_hf_config,
    build_model,
)
from engine_core_fsdp._common import (
    FSDPCommonConfig,
    FSDPEngineBase,
    MixedPrecisionConfig,
    decoder_blocks,
    ensure_process_group,
)
from engine_core_fsdp._init import build_skeleton, materialize
from engine_core_fsdp.capabilities import FSDP2_CAPABILITIES

__all__ = ["FSDP2Engine", "FSDP2EngineConfig", "MeshAxis", "compile_blocks", "parallelize"]


class MeshAxis(StrEnum):
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"


# Llama/Qwen2-style decoder blocks: column-split the input projections, row-split the outputs,
# so each block needs one all-reduce after attention and one after the MLP.
LLAMA_TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}


class FSDP2EngineConfig(FSDPCommonConfig):
    """FSDP2 settings on top of the common engine fields."""

    reshard_after_forward: bool = Field(
        True, description="Free unsharded params after forward (ZeRO-3); False keeps them (ZeRO-2)."
    )
    data_parallel_replicate_size: PositiveInt | None = Field(
        None,
        description=(
            "HSDP: number of replica groups on a 2-D (replicate, shard) mesh; parameters are "
            "sharded within a group and replicated across groups. None: a 1-D mesh sharding "
            "over every DP rank."
        ),
    )
    compile: bool = Field(
        False,
        description=(
            "torch.compile (inductor) each decoder block before sharding, so its norms, rotary "
            "embeddings, SwiGLU and dtype casts run as a few fused kernels; sdpa_varlen "
            "attention stays eager between the compiled parts. The first steps pay the "
            "compilation (tens of seconds), and each new number of tokens in a micro-batch "
            "may recompile until shapes go dynamic."
        ),
    )

    @model_validator(mode="after")
    def _tp_limits(self) -> FSDP2EngineConfig:
        if self.tensor_parallel_size > 1 and self.context_parallel_size > 1:
            raise ValueError(
                f"fsdp2 runs context parallelism or tensor parallelism, not both at once; got "
                f"context_parallel_size={self.context_parallel_size} and "
                f"tensor_parallel_size={self.tensor_parallel_size}. Set one of them to 1."
            )
        if self.context_parallel_size > 1 and self.data_parallel_replicate_size is not None:
            raise ValueError(
                "fsdp2 does not combine context parallelism with HSDP "
                "(data_parallel_replicate_size); leave data_parallel_replicate_size unset to "
                "shard over every data-parallel rank, or set context_parallel_size=1."
            )
        if self.tensor_parallel_size > 1 and self.model.lora is not None:
            raise ValueError(
                "tensor_parallel_size > 1 with model.lora is not supported by fsdp2; "
                "set tensor_parallel_size=1 to train LoRA adapters."
            )
        return self


class FSDP2Engine(FSDPEngineBase):
    capabilities: ClassVar[frozenset[Capability]] = FSDP2_CAPABILITIES
    config_class: ClassVar[type[EngineConfig]] = FSDP2EngineConfig
    backend_name: ClassVar[str] = "fsdp2"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.dp_mesh: DeviceMesh | None = None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.dp_mesh.get_group() if self.dp_mesh is not None else None

    @property
    def sharded(self) -> bool:
        """Whether the module is sharded (``fully_shard``); a one-rank mesh without mixed
        precision (``mixed_precision`` or ``compute_dtype``) keeps it plain."""
        return isinstance(self.module, FSDPModule)

    @property
    def tp_rank(self) -> int:
        return self.mesh[MeshAxis.TP].get_local_rank() if self._has_tp else 0

    @property
    def context_parallel_group(self) -> dist.ProcessGroup | None:
        if self.mesh is None or MeshAxis.CP not in (self.mesh.mesh_dim_names or ()):
            return None
        return self.mesh[str(MeshAxis.CP)].get_group()

    @property
    def is_collect_rank(self) -> bool:
        group = self.context_parallel_group
        return self.tp_rank == 0 and (group is None or dist.get_rank(group) == 0)

    @property
    def _has_tp(self) -> bool:
        return self.mesh is not None and MeshAxis.TP in (self.mesh.mesh_dim_names or ())

    def init_model(self) -> None:
        ensure_process_group()
        cfg = self.config
        assert isinstance(cfg, FSDP2EngineConfig)
        self.mesh, self.dp_mesh = build_mesh(cfg, self.device.type)
        torch.manual_seed(cfg.seed)  # identical initialisation on every rank before sharding
        precision = cfg.precision_policy
        if self.mesh.size() == 1 and precision is None:
            # one rank holds the whole model whatever the init mode; model.path loads as usual
            self.module = build_model(cfg.model, device=self.device)
            if cfg.compile:
                compile_blocks(self.module)
            self.init_optimizer(self.module)
            return
        full_state = None
        if cfg.init == "all_ranks":
            module = build_model(cfg.model, device=self.device)
        else:
            if cfg.init == "rank0_broadcast" and dist.get_rank() == 0:
                full_state = build_model(cfg.model, device="cpu").state_dict()
            module = build_skeleton(cfg.model)
        cp = self.context_parallel_group
        if cp is not None:  # each attention layer splits its heads over the group
            for block in decoder_blocks(module):
                setattr(block.self_attn, CP_GROUP_ATTR, cp)
        parallelize(
            module,
            mesh=self.mesh,
            reshard_after_forward=cfg.reshard_after_forward,
            mixed_precision=precision,
            compile=cfg.compile,
        )
        if cfg.init != "all_ranks":
            materialize(
                module, device=self.device, source=cfg.init, cfg=cfg.model, full_state=full_state
            )
            del full_state
        self.module = module
        self.init_optimizer(module)

    def sharded_state_dict(self) -> dict[str, Any]:
        if not self.sharded:  # plain tensors: the module's own state dict, without the DCP walk
            return self.require_module().state_dict()
        return super().sharded_state_dict()

    @contextlib.contextmanager
    def _no_sync(self, module: FSDPModule) -> Iterator[None]:
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        module = self.require_module()
        if not isinstance(module, FSDPModule):  # one rank: there is no gradient sync to skip
            return contextlib.nullcontext()
        return self._no_sync(module)


def build_mesh(cfg: FSDP2EngineConfig, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The full mesh and its data-parallel part (flattened when HSDP makes it 2-D)."""
    world = dist.get_world_size()
    hsdp = cfg.data_parallel_replicate_size is not None
    replicate, tp = cfg.data_parallel_replicate_size or 1, cfg.tensor_parallel_size
    cp = cfg.context_parallel_size
    if world % (replicate * cp * tp):
        raise ConfigError(
            f"fsdp2: world size {world} does not divide by data_parallel_replicate_size "
            f"({replicate}) x context_parallel_size ({cp}) x tensor_parallel_size ({tp}); "
            f"choose sizes whose product divides the number of processes."
        )
    for size, name in ((tp, "tensor_parallel_size"), (cp, "context_parallel_size")):
        if size == 1:
            continue
        hf = build_hf_config(cfg.model)
        heads = hf.num_attention_heads
        kv = getattr(hf, "num_key_value_heads", None) or heads
        if heads % size or kv % size:
            raise ConfigError(
                f"fsdp2: {name}={size} must divide num_attention_heads ({heads}) and "
                f"num_key_value_heads ({kv}): each rank takes a whole share of the heads. "
                f"Choose a divisor of both."
            )
    shape, names = [], []
    for size, axis in (
        (replicate, MeshAxis.DP_REPLICATE),
        (world // (replicate * cp * tp), MeshAxis.DP_SHARD),
        (cp, MeshAxis.CP),
        (tp, MeshAxis.TP),
    ):
        if axis == MeshAxis.DP_SHARD or (axis == MeshAxis.DP_REPLICATE and hsdp) or size > 1:
            shape.append(size)
            names.append(str(axis))
    mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    dp_names = tuple(n for n in names if n not in (MeshAxis.TP, MeshAxis.CP))
    dp_mesh = mesh[dp_names] if len(dp_names) == 1 else mesh[dp_names]._flatten("dp")
    return mesh, dp_mesh


def parallelize(
    module: torch.nn.Module,
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    mixed_precision: MixedPrecisionConfig | None,
    compile: bool = False,
) -> None:
    """Apply tensor parallelism (when the mesh has a ``tp`` axis), then ``torch.compile`` per
    block (when asked), then FSDP, in that order."""
    names = mesh.mesh_dim_names or ()
    blocks = decoder_blocks(module)
    if MeshAxis.TP in names:
        tp_mesh = mesh[str(MeshAxis.TP)]
        for block in blocks:
            plan = {path: style() for path, style in LLAMA_TP_PLAN.items()}
            parallelize_module(block, tp_mesh, plan)
    # HSDP: a 2-D (replicate, shard) mesh; otherwise the 1-D shard mesh. Context-parallel ranks
    # shard parameters too: their gradients are reduced with the data-parallel ranks'
    # (HSDP is refused with context parallelism by the config)
    dp_names = tuple(n for n in names if n not in (MeshAxis.TP, MeshAxis.CP))
    if MeshAxis.CP in names:
        fsdp_mesh = mesh[(str(MeshAxis.DP_SHARD), str(MeshAxis.CP))]._flatten("dp_shard_cp")
    else:
        fsdp_mesh = mesh[dp_names]
    kwargs: dict[str, Any] = {"mesh": fsdp_mesh, "reshard_after_forward": reshard_after_forward}
    if mixed_precision is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=mixed_precision.torch_param_dtype,
            reduce_dtype=mixed_precision.torch_reduce_dtype,
        )
    if compile:
        compile_blocks(module)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)


def compile_blocks(module: torch.nn.Module) -> None:
    """``torch.compile`` each decoder block in place (parameter names do not change, so
    checkpoints and weight sync see the same keys). Blocks of one class share their graphs."""
    for block in decoder_blocks(module):
        block.compile()
