"""``FSDP2Engine``: parameters sharded with ``fully_shard`` over a data-parallel mesh.

The device mesh has up to four named axes, outermost first: ``dp_replicate`` (HSDP replica
groups), ``dp_shard`` (parameter sharding), ``cp`` (context parallelism: each packed row split
over its ranks, Ulysses attention, :mod:`engine_core.context_parallel`) and ``tp`` (tensor
parallelism of the decoder blocks); any of them combine. Parallelism is applied in a fixed order
by :func:`parallelize`: tensor parallel, then ``fully_shard`` per decoder block, then the root.
``fully_shard`` shards parameters over ``dp_shard`` × ``cp`` (one flattened ``dp_shard_cp``
axis), replicated over ``dp_replicate`` under HSDP (a 2-D ``(dp_replicate, dp_shard_cp)`` mesh,
:func:`fsdp_mesh`); never over ``tp``. Data is split over the ``dp_replicate`` × ``dp_shard``
ranks; the ``cp`` and ``tp`` ranks of one DP rank see the same data, and its rank with
``cp`` and ``tp`` rank 0 is the one collected.

Under tensor parallelism the q/k/v projections are column-split, so each rank's attention holds
``1/tp`` of the heads; context parallelism spreads those over its ``cp`` ranks, so the heads and
the key/value heads must divide by ``tp × cp``. Gradients: FSDP averages over ``dp_replicate`` ×
``dp_shard`` × ``cp`` (the context-parallel ranks' sum being ``cp`` times the row's gradient, that
average is the data-parallel mean), which the loss scaled by the DP size turns into the
contract's sum; a tensor-parallel weight's gradient is its own shard's, reduced over the same
ranks and never over ``tp``, and a weight that is not split (norms, embeddings) gets the same
whole gradient on every ``tp`` rank (the column-split layers' backward all-reduces their input
gradient over ``tp``).
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

__all__ = [
    "FSDP2Engine",
    "FSDP2EngineConfig",
    "MeshAxis",
    "compile_blocks",
    "fsdp_mesh",
    "parallelize",
]


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
            "sharded within a group (over its data- and context-parallel ranks) and replicated "
            "across groups. None: a 1-D mesh sharding over every DP rank."
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
        self._dp_group: dist.ProcessGroup | None = None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        # the group object, resolved once when the mesh is made: a mesh resolves its groups by
        # name, and a name can be taken back when an older group of that name is collected
        # (a process group destroyed and made anew earlier in the same process)
        if self._dp_group is None and self.dp_mesh is not None:
            self._dp_group = self.dp_mesh.get_group()
        return self._dp_group

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
        self._dp_group = self.dp_mesh.get_group()
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
        if cp is not None:  # each decoder attention layer splits its heads over the group
            for block in decoder_blocks(module):
                # a vision tower's blocks (attention `attn`) see whole images on every rank
                if hasattr(block, "self_attn"):
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
    if tp * cp > 1:
        # tensor parallelism gives each rank 1/tp of the heads (q/k/v are column-split);
        # context parallelism spreads those local heads over its cp ranks around attention
        hf = build_hf_config(cfg.model).get_text_config()  # a VLM's decoder's
        heads = hf.num_attention_heads
        kv = getattr(hf, "num_key_value_heads", None) or heads
        if heads % (tp * cp) or kv % (tp * cp):
            named = [
                f"{name}={size}"
                for size, name in ((tp, "tensor_parallel_size"), (cp, "context_parallel_size"))
                if size > 1
            ]
            if len(named) == 1:
                split, fix = named[0], "a divisor of both"
            else:
                split, fix = f"{' x '.join(named)} = {tp * cp}", "sizes whose product divides both"
            raise ConfigError(
                f"fsdp2: {split} must divide num_attention_heads ({heads}) and "
                f"num_key_value_heads ({kv}): each rank takes a whole share of the heads "
                f"(tensor parallelism splits them, context parallelism splits each share "
                f"again). Choose {fix}."
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


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``fully_shard`` shards over: ``dp_shard`` flattened with ``cp`` (context-parallel
    ranks shard parameters too, and their gradients are averaged with the data-parallel ranks'),
    preceded by ``dp_replicate`` under HSDP (2-D: replicate, shard). ``tp`` is never part of it.
    """
    names = mesh.mesh_dim_names or ()
    replicate, shard, cp = str(MeshAxis.DP_REPLICATE), str(MeshAxis.DP_SHARD), str(MeshAxis.CP)
    if cp not in names:
        return mesh[tuple(n for n in names if n in (replicate, shard))]
    shard_cp = mesh[(shard, cp)]._flatten(f"{shard}_{cp}")
    if replicate not in names:
        return shard_cp
    # a 2-D (replicate, flattened shard) mesh: fully_shard's own HSDP path joins a flattened
    # shard mesh to its replicate mesh the same way (slicing the flattened name out of the root
    # mesh instead is deprecated)
    return DeviceMesh._concatenate([mesh[replicate], shard_cp])


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
    kwargs: dict[str, Any] = {
        "mesh": fsdp_mesh(mesh),
        "reshard_after_forward": reshard_after_forward,
    }
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
