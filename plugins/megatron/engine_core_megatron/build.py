"""Building the megatron engine's model: :class:`ModelBuilding`, a mixin of
:class:`~engine_core_megatron.engine.MegatronEngine`.

It owns :meth:`~ModelBuilding.init_model`'s sequence: the layout checks, megatron-core's
parallel state, the ``TransformerConfig``, the layer spec, one ``GPTModel`` chunk per virtual
stage (DDP-wrapped) loaded with the shared HF weights, the map of which rank holds each
decoder layer, the routers' hooks of a mixture of experts, and the optimizer.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from engine_core.backend import (
    DTYPES,
    CheckpointError,
    ConfigError,
    all_reduce_cpu,
    build_hf_config,
    build_model,
)
from engine_core_megatron._device import ensure_process_group, on_device
from engine_core_megatron.config import MegatronEngineConfig
from engine_core_megatron.convert import (
    UNFUSED,
    ModelLayout,
    layout_of,
    local_expert,
    megatron_to_hf_names,
    shard_from_hf,
    transformer_config_kwargs,
)
from engine_core_megatron.routing import RouterHooks
from engine_core_megatron.schedule_routing import MoeScheduleRouting

__all__ = ["ModelBuilding", "parallel_sizes"]


def _define_missing_te_names() -> None:
    """megatron-core 0.16's MoE utilities test ``te_general_gemm is not None`` (and the like)
    but define those names only when TransformerEngine imports: without it the router's
    gating fails with a NameError. Define the missing ones as ``None``, what its own code
    expects when TransformerEngine is absent."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    for name in (
        "te_general_gemm",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
        "fused_permute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_topk_with_score_function",
        "fused_unpermute",
    ):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _groups_registered(parallel_state: Any) -> bool:
    """Whether megatron-core's model-parallel groups belong to the current process group."""
    try:
        dist.get_rank(group=parallel_state.get_model_parallel_group())
    except (ValueError, RuntimeError, AssertionError):
        return False
    return True


def _mark_experts(model: torch.nn.Module) -> None:
    """Reduce every expert's gradient over the experts' data-parallel group, also at
    ``expert_parallel_size: 1``.

    megatron-core marks experts for that group only when it spreads them (EP > 1); at EP 1 they
    are reduced over the dense data-parallel group, which leaves out the tensor-parallel ranks:
    with each expert whole on every TP rank (no expert TP) and the tokens split over them
    (sequence parallel), their gradients then miss the other ranks' tokens. Marked always, the
    gradients are complete, and the optimizer keeps the same two parts (dense, experts) at
    every EP size, so a checkpoint loads at another one."""
    for name, param in model.named_parameters():
        if local_expert(name) is not None:
            param.allreduce = False  # type: ignore[attr-defined]


def parallel_sizes(ps: Any) -> tuple[int, int, int | None, int]:
    """(tp, pp, vpp, ep) of megatron-core's current model-parallel state."""
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
    )


class ModelBuilding:
    """Builds the model chunks, the parallel state and the optimizer of the engine."""

    @on_device
    def init_model(self) -> None:
        ensure_process_group()
        cfg = self.config
        assert isinstance(cfg, MegatronEngineConfig)
        tp, pp, vpp, ep = (
            cfg.tensor_parallel_size,
            cfg.pipeline_parallel_size,
            cfg.virtual_pipeline_parallel_size,
            cfg.expert_parallel_size,
        )
        world = dist.get_world_size()
        if world % (tp * pp):
            raise ConfigError(
                f"megatron: world size {world} does not divide by tensor_parallel_size ({tp}) x "
                f"pipeline_parallel_size ({pp}); choose sizes whose product divides the number "
                f"of processes."
            )
        if (world // pp) % ep:
            raise ConfigError(
                f"megatron: the {world // pp} processes of a pipeline stage do not divide by "
                f"expert_parallel_size ({ep}); choose a divisor of them."
            )
        if vpp and self.device.type == "cpu":
            raise ConfigError(
                f"megatron: virtual_pipeline_parallel_size={vpp} (interleaved 1F1B) does not run "
                f"on gloo: megatron-core 0.16's pipeline send/receive of variable-length "
                f"micro-batches mismatches between the interleaved stages there. Unset "
                f"virtual_pipeline_parallel_size on CPU hosts (plain 1F1B runs)."
            )
        hf_config = build_hf_config(cfg.model)
        layout = layout_of(hf_config, value_head=cfg.model.value_head, tp=tp, ep=ep)
        if layout.moe and tp > 1 and not cfg.sequence_parallel:
            raise ConfigError(
                f"megatron: a mixture of experts with tensor_parallel_size={tp} needs "
                f"sequence_parallel: true (megatron-core's MoE layers take sequence-parallel "
                f"input under tensor parallelism); set it, or tensor_parallel_size: 1."
            )
        chunks = vpp or 1
        if layout.num_layers % (pp * chunks):
            raise ConfigError(
                f"megatron: num_hidden_layers ({layout.num_layers}) must divide by "
                f"pipeline_parallel_size x virtual_pipeline_parallel_size ({pp} x {chunks})."
            )
        self.layout = layout
        if layout.moe:
            _define_missing_te_names()
        self._init_parallel_state(tp, pp, vpp, ep)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(cfg.seed)
        # the full HF weights, built exactly as the other engines build them (same seed)
        torch.manual_seed(cfg.seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf_state = build_model(cfg.model, device="cpu").state_dict()
        tc, model_kwargs = self._transformer_config(hf_config, layout)
        self.chunks = self._build_chunks(tc, model_kwargs, hf_state)
        del hf_state
        self.module = torch.nn.ModuleList(self.chunks)
        if layout.moe:
            self._routing = RouterHooks(
                self.chunks, top_k=layout.top_k, pre_softmax=not layout.normalize_top_k
            )
            self._schedule_routing = MoeScheduleRouting(self, self._routing)
        self._map_layers()
        self._build_optimizer(tc)

    def _init_parallel_state(self, tp: int, pp: int, vpp: int | None, ep: int) -> None:
        from megatron.core import parallel_state

        want = (tp, pp, vpp, ep)
        if parallel_state.model_parallel_is_initialized():
            now = parallel_sizes(parallel_state)
            # megatron-core keeps its groups in module globals: a process group destroyed and
            # made anew since (a second job in one process, a library's own clean-up) leaves
            # them pointing at the old one
            if now != want or not _groups_registered(parallel_state):
                parallel_state.destroy_model_parallel()
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=1,
            )
        self._parallel_layout = want

    def _transformer_config(
        self, hf_config: Any, layout: ModelLayout
    ) -> tuple[Any, dict[str, Any]]:
        from megatron.core.transformer.transformer_config import TransformerConfig

        cfg = self.config
        assert isinstance(cfg, MegatronEngineConfig)
        dtype = DTYPES[cfg.model.dtype]
        config_kwargs, model_kwargs = transformer_config_kwargs(hf_config, layout)
        on_gpu = self.device.type == "cuda"
        recompute: dict[str, Any] = {}
        if cfg.model.gradient_checkpointing:
            recompute = {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            }
        tc = TransformerConfig(
            **config_kwargs,
            **recompute,
            tensor_model_parallel_size=cfg.tensor_parallel_size,
            pipeline_model_parallel_size=cfg.pipeline_parallel_size,
            virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_parallel_size,
            sequence_parallel=cfg.sequence_parallel,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            use_cpu_initialization=not on_gpu,
            # megatron-core marks tensor-parallel weights while initialising them (the grad norm
            # and checkpoints read the marks); the values are then replaced by the HF tensors
            perform_initialization=True,
            **UNFUSED,
            # the core's loss is normalised by global counts already: no extra scaling
            calculate_per_token_loss=True,
            variable_seq_lengths=True,
            moe_token_dispatcher_type="alltoall",  # no MoE; the default refuses variable lengths
            batch_p2p_comm=on_gpu,
            deallocate_pipeline_outputs=False,
        )
        return tc, model_kwargs

    def _layer_spec(self, tc: Any, vp_stage: int | None) -> Any:
        cfg = self.config
        assert isinstance(cfg, MegatronEngineConfig)
        if cfg.transformer_impl == "transformer_engine":
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )

            return get_gpt_layer_with_transformer_engine_spec(
                num_experts=tc.num_moe_experts, moe_grouped_gemm=False
            )
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )

        from engine_core_megatron.attention import SDPACoreAttention
        from engine_core_megatron.norm import LocalRMSNorm

        # megatron-core's local layers with SDPA attention (packed input) and norms that also
        # run under sequence parallelism, the block's final norm included
        spec = get_gpt_layer_local_spec(
            num_experts=tc.num_moe_experts,
            moe_grouped_gemm=False,
            normalization="RMSNorm",
            qk_layernorm=tc.qk_layernorm,
        )
        attention = spec.submodules.self_attention.submodules
        attention.core_attention = SDPACoreAttention
        if tc.qk_layernorm:  # per-head norms of queries and keys (Qwen3)
            attention.q_layernorm = LocalRMSNorm
            attention.k_layernorm = LocalRMSNorm
        spec.submodules.input_layernorm = LocalRMSNorm
        spec.submodules.pre_mlp_layernorm = LocalRMSNorm
        layers = get_num_layers_to_build(tc, vp_stage=vp_stage)
        return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=LocalRMSNorm)

    def _build_chunks(
        self, tc: Any, model_kwargs: dict[str, Any], hf_state: dict[str, torch.Tensor]
    ) -> list[torch.nn.Module]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        cfg = self.config
        assert isinstance(cfg, MegatronEngineConfig) and self.layout is not None
        ps = self._ps
        vpp = cfg.virtual_pipeline_parallel_size
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        chunks = []
        for vp in range(vpp or 1):
            vp_stage = vp if vpp else None
            pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
            model = GPTModel(
                tc,
                self._layer_spec(tc, vp_stage),
                pre_process=pre,
                post_process=post,
                vp_stage=vp_stage,
                **model_kwargs,
            )
            if post and self.layout.value_head:
                from engine_core_megatron.value_head import ValueHead

                model.output_layer = ValueHead(tc)
            if self.device.type == "cuda":
                model.cuda(torch.cuda.current_device())
            offset = get_transformer_layer_offset(tc, vp_stage=vp_stage)
            self._load_hf(model, offset, hf_state)
            if self.layout.moe:
                _mark_experts(model)
            chunks.append(
                DistributedDataParallel(tc, ddp_config, module=model, disable_bucketing=vp > 0)
            )
        return chunks

    def _load_hf(
        self, model: torch.nn.Module, offset: int, hf_state: dict[str, torch.Tensor]
    ) -> None:
        assert self.layout is not None
        tp = self.config.tensor_parallel_size
        ep_rank = self._ps.get_expert_model_parallel_rank() if self.layout.moe else 0
        with torch.no_grad():
            for name, param in model.named_parameters():
                hf_names = megatron_to_hf_names(name, offset, self.layout)
                try:
                    tensors = tuple(hf_state[n] for n in hf_names)
                except KeyError as e:
                    raise CheckpointError(
                        f"megatron: the HF weights have no tensor {e.args[0]!r} for megatron "
                        f"parameter {name!r}; is model.path a {self.layout} checkpoint?"
                    ) from e
                if local_expert(name) is None:
                    shard = shard_from_hf(name, tensors, self.layout, self.tp_rank, tp)
                else:  # each expert whole on its expert-parallel rank (no expert TP)
                    shard = shard_from_hf(name, tensors, self.layout, 0, 1, ep_rank)
                if shard.shape != param.shape:
                    raise CheckpointError(
                        f"megatron: {name} expects shape {tuple(param.shape)} on this rank, the "
                        f"HF weights {hf_names} give {tuple(shard.shape)}."
                    )
                param.copy_(shard)

    def _map_layers(self) -> None:
        """Which pipeline rank, chunk and local index holds each global decoder layer."""
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        assert self.layout is not None
        ps = self._ps
        pp_rank = ps.get_pipeline_model_parallel_rank()
        owner = torch.full((self.layout.num_layers, 3), -1, dtype=torch.int64)
        for c, chunk in enumerate(self.chunks):
            vp_stage = c if self.config.virtual_pipeline_parallel_size else None  # type: ignore[attr-defined]
            offset = get_transformer_layer_offset(chunk.module.config, vp_stage=vp_stage)
            for local in range(len(chunk.module.decoder.layers)):
                owner[offset + local] = torch.tensor([pp_rank, c, local])
        if ps.get_pipeline_model_parallel_world_size() > 1:
            owner = all_reduce_cpu(owner, dist.ReduceOp.MAX, ps.get_pipeline_model_parallel_group())
        self._layer_owner = [tuple(int(x) for x in row) for row in owner]  # type: ignore[misc]

    def _build_optimizer(self, tc: Any) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.config
        assert isinstance(cfg, MegatronEngineConfig)
        o = cfg.optim
        dtype = DTYPES[cfg.model.dtype]
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_eps=o.eps,
            clip_grad=0.0,  # clipping and the non-finite skip are done in optimizer_step()
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.chunks)
        self._lr_step = 0
        self._apply_lr()
        self.skipped_steps = 0
