"""``MegatronEngine``: a ``BaseEngine`` on megatron-core's ``GPTModel``.

Parallelism comes from megatron-core: tensor parallel (optionally sequence parallel), pipeline
parallel driven by megatron-core's forward-backward schedule (1F1B; interleaved with virtual
stages), data parallel through megatron-core's ``DistributedDataParallel`` and optimizer
(optionally the distributed optimizer). Weights come from a Hugging Face folder or the shared
``ModelConfig`` build, converted and sharded by :mod:`engine_core_megatron.convert`, and go back
out under their HF names through :meth:`MegatronEngine.named_full_params`.

Contract mapping:

- The schedule owns the micro-batch loop (:meth:`run_micro_batches`). The core's micro-batch
  plan and global loss context are used unchanged; megatron-core's own normalisations are
  switched off (``calculate_per_token_loss`` with no token rescaling: no division by the
  number of micro-batches, gradients summed over DP ranks), so the loss each micro-batch
  returns is exactly the core contract's.
- Outputs, losses and metrics exist on the last pipeline stage; they are broadcast to the
  other stages so every rank returns the same results. The collect rank of each DP rank is
  TP rank 0 of the last stage.
- Log-probs and entropy are computed vocabulary-parallel: only ``[tokens]``-sized partial sums
  cross ranks. With ``logits_chunk_tokens`` (the default) the last stage's output layer
  computes them itself, a chunk of tokens at a time, so no rank holds its
  ``[tokens, vocab / tp]`` logits; with ``logits_chunk_tokens: null`` each TP rank keeps its
  slice of the logits (megatron-core's fused cross-entropy where it applies).

On a CPU host (gloo) every call runs inside :func:`engine_core_megatron._cpu_compat.cpu_compat`;
on a GPU host (NCCL) megatron-core runs unmodified.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, ClassVar, TypeVar, cast

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_core.backend import (
    ATTENTION_MASK,
    BUCKET_BYTES,
    DTYPES,
    INPUT_IDS,
    LOG_PROBS,
    MOE_AUX,
    POSITION_IDS,
    ROUTED_EXPERTS,
    BaseEngine,
    BatchError,
    Capability,
    CheckpointError,
    ConfigError,
    EngineConfig,
    EngineCoreError,
    GlobalBatchContext,
    HeadRequest,
    MetricAccumulator,
    MicroBatchResults,
    ModelInputs,
    RoutingInputs,
    all_reduce_cpu,
    balance_loss,
    balance_metric,
    balance_of,
    build_hf_config,
    build_model,
    check_routes,
    chunk_tokens_for,
    get_meta,
    is_dir,
    join,
    lr_lambda,
    model_weight_shapes,
    pack,
    routing_request,
    row_to_batch,
)
from engine_core_megatron._cpu_compat import cpu_compat
from engine_core_megatron._pipeline import broadcast_results
from engine_core_megatron.capabilities import MEGATRON_CAPABILITIES
from engine_core_megatron.config import MegatronEngineConfig
from engine_core_megatron.convert import (
    UNFUSED,
    ModelLayout,
    hf_from_shards,
    layer_parts,
    layout_of,
    local_expert,
    megatron_to_hf_names,
    shard_from_hf,
    transformer_config_kwargs,
)
from engine_core_megatron.routing import RouterHooks, RoutingStep
from engine_core_megatron.vocab_parallel import chunked_output_layer, vocab_parallel_log_probs

__all__ = ["MegatronEngine"]

# megatron-core announces every optional kernel library it does not find, once per module
warnings.filterwarnings(
    "ignore", message=r".*(Apex|Transformer Engine).*not installed", category=UserWarning
)
# a deprecation in megatron-core's own defaults (cuda_graph_scope), not in anything we set
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)

CKPT_DIR = "dist_ckpt"


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


F = TypeVar("F", bound=Callable[..., Any])


def _on_device(fn: F) -> F:
    """Run ``fn`` inside the CPU compatibility layer when the engine runs on the CPU."""

    @functools.wraps(fn)
    def wrapper(self: MegatronEngine, *args: Any, **kwargs: Any) -> Any:
        with self._device_context():
            return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _ensure_process_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _groups_registered(parallel_state: Any) -> bool:
    """Whether megatron-core's model-parallel groups belong to the current process group."""
    try:
        dist.get_rank(group=parallel_state.get_model_parallel_group())
    except (ValueError, RuntimeError, AssertionError):
        return False
    return True


class MegatronEngine(BaseEngine):
    capabilities: ClassVar[frozenset[Capability]] = MEGATRON_CAPABILITIES
    config_class: ClassVar[type[EngineConfig]] = MegatronEngineConfig

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.chunks: list[torch.nn.Module] = []  # DDP-wrapped GPTModel chunks of this rank
        self.optimizer: Any = None
        self.layout: ModelLayout | None = None
        self.skipped_steps = 0
        self._lr_step = 0
        self._parallel_layout: tuple[int, int, int | None, int] | None = None
        self._layer_owner: list[tuple[int, int, int]] = []  # global layer -> (pp, chunk, local)
        self._routing: RouterHooks | None = None  # mixtures of experts: hooks on the routers

    # ------------------------------------------------------------------ layout
    @property
    def device(self) -> torch.device:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _device_context(self) -> contextlib.AbstractContextManager[Any]:
        return cpu_compat() if self.device.type == "cpu" else contextlib.nullcontext()

    @property
    def _ps(self) -> Any:
        from megatron.core import parallel_state

        if self._parallel_layout is not None:
            now = _parallel_sizes(parallel_state)
            if now != self._parallel_layout:
                raise EngineCoreError(
                    f"megatron: model parallelism was re-initialised to (tp, pp, vpp, ep)={now} by "
                    f"another megatron engine in this process; this engine was built with "
                    f"{self._parallel_layout}. megatron-core keeps one layout per process: give "
                    f"every megatron engine in a process the same parallel sizes."
                )
        return parallel_state

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        if self._parallel_layout is None:
            return None
        return self._ps.get_data_parallel_group()

    @property
    def dp_rank(self) -> int:
        return self._ps.get_data_parallel_rank() if self._parallel_layout else 0

    @property
    def dp_size(self) -> int:
        return self._ps.get_data_parallel_world_size() if self._parallel_layout else 1

    @property
    def tp_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_rank() if self._parallel_layout else 0

    @property
    def is_last_stage(self) -> bool:
        return bool(self._ps.is_pipeline_last_stage()) if self._parallel_layout else True

    @property
    def is_collect_rank(self) -> bool:
        return self.is_last_stage and self.tp_rank == 0

    # ------------------------------------------------------------------ build
    @_on_device
    def init_model(self) -> None:
        _ensure_process_group()
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
        self._map_layers()
        self._build_optimizer(tc)

    def _init_parallel_state(self, tp: int, pp: int, vpp: int | None, ep: int) -> None:
        from megatron.core import parallel_state

        want = (tp, pp, vpp, ep)
        if parallel_state.model_parallel_is_initialized():
            now = _parallel_sizes(parallel_state)
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

    # ------------------------------------------------------------------ forward / backward
    def prepare_model_inputs(self, micro_batch: TensorDict) -> ModelInputs:
        """GPTModel kwargs: one packed row with THD sequence boundaries (default), or padded rows
        with their padding mask. With sequence parallelism the packed row is padded to a
        multiple of the TP size with a dummy trailing sequence."""
        from megatron.core.packed_seq_params import PackedSeqParams

        ids, mask = micro_batch[INPUT_IDS], micro_batch[ATTENTION_MASK]
        dev = self.device
        sp = self.config.sequence_parallel  # type: ignore[attr-defined]
        multiple = self.config.tensor_parallel_size if sp else 1  # type: ignore[attr-defined]
        routed, record, balance = self._routing_request(micro_batch)
        if self.config.use_packing:
            packed = pack(ids, mask)
            tokens, positions = packed.input_ids, packed.position_ids
            cu = packed.cu_seqlens.to(torch.int32)
            length = int(tokens.shape[1])
            extra = (-length) % multiple
            if extra:
                tokens = torch.nn.functional.pad(tokens, (0, extra))
                positions = torch.cat([positions, torch.arange(extra).unsqueeze(0)], 1)
                cu = torch.cat([cu, torch.tensor([length + extra], dtype=torch.int32)])
            max_len = int((cu[1:] - cu[:-1]).max())
            params = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu.to(dev),
                cu_seqlens_kv=cu.to(dev),
                max_seqlen_q=max_len,
                max_seqlen_kv=max_len,
            )
            kwargs = {
                "input_ids": tokens.to(dev),
                "position_ids": positions.to(dev),
                "attention_mask": None,
                "packed_seq_params": params,
                "length": length,
            }
            routes = None
            if routed is not None:  # [T + extra, layers, top_k]: the packed row's tokens
                routes = self._pad_routes(routed.flatten(0, 1)[packed.flat_indices], extra)
                routes = routes.transpose(0, 1)  # [layers, tokens, top_k], as ModelInputs holds
            return _with_routing(ModelInputs(kwargs, packed), routes, record, balance)
        length = int(ids.shape[1])
        positions = micro_batch[POSITION_IDS]
        extra = (-length) % multiple
        if extra:  # sequence parallelism splits the sequence: pad it to a multiple of TP
            ids, positions = (torch.nn.functional.pad(x, (0, extra)) for x in (ids, positions))
            mask = torch.nn.functional.pad(mask, (0, extra))
        # rows without padding need only the causal mask, which the attention builds itself
        padding = None if bool(mask.all()) else (~mask.bool()[:, None, None, :]).to(dev)
        kwargs = {
            "input_ids": ids.to(dev),
            "position_ids": positions.to(dev),
            "attention_mask": padding,
            "length": length,
        }
        routes = None
        if routed is not None:  # megatron-core's tokens are sequence-major: [(L + extra) * b]
            real = micro_batch[ATTENTION_MASK].bool()[:, :, None, None]
            routed = self._pad_routes(routed.masked_fill(~real, -1).transpose(0, 1), extra)
            routes = routed.flatten(0, 1).transpose(0, 1)  # [layers, tokens, top_k]
        return _with_routing(ModelInputs(kwargs, None), routes, record, balance)

    def _routing_request(self, micro_batch: TensorDict) -> tuple[torch.Tensor | None, bool, bool]:
        """The batch's routes (checked against the model) and whether to record and balance."""
        assert self.layout is not None
        routed, record, balance = routing_request(micro_batch)
        if not (routed is not None or record or balance):
            return None, False, False
        if not self.layout.moe:
            raise BatchError(
                f"the batch asks for {ROUTED_EXPERTS} or {MOE_AUX}, and this model is dense "
                f"(no mixture-of-experts router); turn routing replay off for it."
            )
        if routed is not None:
            layout = self.layout
            want = (layout.num_layers, layout.top_k)
            if tuple(routed.shape[2:]) != want:
                raise BatchError(
                    f"{ROUTED_EXPERTS} must be [B, L, layers={want[0]}, top_k={want[1]}] for this "
                    f"model; got {tuple(routed.shape)}."
                )
            real = routed[micro_batch[ATTENTION_MASK].bool()]  # padding may hold anything
            check_routes(real, num_experts=layout.num_experts, what=ROUTED_EXPERTS)
        return routed, record, balance

    @staticmethod
    def _pad_routes(routes: torch.Tensor, extra: int) -> torch.Tensor:
        """``routes`` ``[tokens, ...]`` with ``extra`` trailing rows of -1 (the padding sequence
        parallelism adds): a token whose route is -1 goes where its router sends it
        (:class:`~engine_core_megatron.routing.RouterHooks`)."""
        if not extra:
            return routes
        return torch.cat([routes, routes.new_full((extra, *routes.shape[1:]), -1)])

    def _chunked_head_request(
        self, inputs: ModelInputs, micro_batch: TensorDict
    ) -> HeadRequest | None:
        """Whether the last stage's output layer computes log-probs and entropy in chunks for
        this micro-batch (``logits_chunk_tokens``; never for a value head), and how.

        This takes precedence over :meth:`_fused_log_probs`: megatron-core's fused
        cross-entropy still holds each rank's ``[tokens, vocab / tp]`` logits (and their
        softmax for the backward), which is what chunking avoids."""
        assert self.layout is not None
        setting = self.config.logits_chunk_tokens
        if setting is None or self.layout.value_head:
            return None
        tp = self.config.tensor_parallel_size  # type: ignore[attr-defined]
        chunk = (
            chunk_tokens_for(self.layout.padded_vocab_size // tp)
            if setting == "auto"
            else int(setting)
        )
        ids = inputs.kwargs["input_ids"]
        # the next id at each position; the row's last position predicts nothing (dropped)
        targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        meta = get_meta(micro_batch)
        layer = self.chunks[-1].module.output_layer  # a ColumnParallelLinear, not nn.Linear
        return HeadRequest(cast(Any, layer), targets, meta.temperature, meta.compute_entropy, chunk)

    def _fused_log_probs(self, micro_batch: TensorDict) -> bool:
        """Whether the model computes the log-probs itself: ``GPTModel(labels=...)`` runs
        megatron-core's vocabulary-parallel cross-entropy on the ``[s, b, vocab/tp]`` logits,
        which skips the ``[b, s, vocab/tp]`` copy of the logits and uses one fused autograd
        function. Only with full logits (``logits_chunk_tokens: null``, see
        :meth:`_chunked_head_request`) and only log-probs at temperature 1 over an unpadded
        vocabulary: entropy, value heads, temperatures and a vocabulary padded for TP go
        through :meth:`token_log_probs`."""
        assert self.layout is not None
        meta = get_meta(micro_batch)
        return not (
            self.config.logits_chunk_tokens is not None
            or self.layout.value_head
            or meta.compute_entropy
            or meta.temperature != 1.0
            or self.layout.padded_vocab_size != self.layout.vocab_size
        )

    def token_log_probs(
        self, logits: torch.Tensor, next_ids: torch.Tensor, *, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.layout is not None
        return vocab_parallel_log_probs(
            logits,
            next_ids,
            vocab_size=self.layout.vocab_size,
            group=self._ps.get_tensor_model_parallel_group(),
            entropy=entropy,
        )

    def run_micro_batches(
        self, micro_batches: list[TensorDict], ctx: GlobalBatchContext, *, forward_only: bool
    ) -> MicroBatchResults:
        with self._device_context():
            return self._run_schedule(micro_batches, ctx, forward_only=forward_only)

    def _run_schedule(
        self, micro_batches: list[TensorDict], ctx: GlobalBatchContext, *, forward_only: bool
    ) -> MicroBatchResults:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        ps = self._ps
        cfg = self.config
        pp = cfg.pipeline_parallel_size
        n = len(micro_batches)
        if cfg.virtual_pipeline_parallel_size and n % pp:  # type: ignore[attr-defined]
            raise EngineCoreError(
                f"megatron: the interleaved pipeline schedule needs a number of micro-batches "
                f"divisible by pipeline_parallel_size ({pp}); this batch has {n}. Choose "
                f"micro_batch_size so that the batch splits into a multiple of {pp}, or unset "
                f"virtual_pipeline_parallel_size."
            )
        prepared = [(mb, self.prepare_model_inputs(mb)) for mb in micro_batches]
        if self._routing is not None:  # full recompute runs the layers again in the backward
            self._routing.start(recomputed=cfg.model.gradient_checkpointing and not forward_only)
        acc = MetricAccumulator()
        outputs: list[TensorDict] = []
        loss_sum = torch.zeros((), dtype=torch.float64)
        one = torch.ones((), dtype=torch.int, device=self.device)

        def loss_func(
            mb: TensorDict, inputs: ModelInputs, fused: bool, output: torch.Tensor
        ) -> Any:
            nonlocal loss_sum
            # the model's output: logits [b, s, vocab/tp], (log-prob, entropy) [b, s, 2] from
            # a chunked output layer (inputs.head, see _chunked_head_request), or per-token
            # NLL [b, s] of the next token when it computed log-probs itself (_fused_log_probs)
            output = output[:, : inputs.kwargs["length"]]
            if fused:
                out = self.place_next_token_outputs({LOG_PROBS: -output[:, :-1]}, inputs, mb)
            else:
                out = self.prepare_model_outputs(SimpleNamespace(logits=output), inputs, mb)
            outputs.append(out.detach())
            if self.loss_fn is None:
                return torch.zeros((), device=output.device, requires_grad=False), one, {}
            loss, metrics = self.loss_fn(mb, out, ctx)
            acc.update(metrics)
            loss_sum = loss_sum + loss.detach().double().cpu()
            return loss.to(output.device), one, {}

        steps: dict[int, RoutingStep] = {}  # id(micro-batch inputs) -> its routing step

        def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module) -> Any:
            mb, inputs = next(data_iterator)
            kwargs = {k: v for k, v in inputs.kwargs.items() if k != "length"}
            if self._routing is not None:  # what this micro-batch asks of the routers
                if id(inputs) not in steps:  # one per micro-batch, for every model chunk
                    steps[id(inputs)] = self._routing_step(inputs, mb, ctx)
                self._routing.step = steps[id(inputs)]
            # only the chunk that ends the pipeline has the output layer (model: DDP-wrapped)
            head = self._chunked_head_request(inputs, mb) if model.module.post_process else None
            if head is not None:
                inputs.head = head  # prepare_model_outputs reads (log-prob, entropy) from it
                with chunked_output_layer(
                    head.head,
                    head.targets,
                    vocab_size=self.layout.vocab_size,
                    temperature=head.temperature,
                    entropy=head.entropy,
                    chunk_tokens=head.chunk_tokens,
                ):
                    output = model(**kwargs)
                return output, functools.partial(loss_func, mb, inputs, False)
            fused = self._fused_log_probs(mb)
            if fused:  # labels[t] = token t + 1; the last position's label is dropped
                kwargs["labels"] = torch.roll(kwargs["input_ids"], -1, dims=1)
            return model(**kwargs), functools.partial(loss_func, mb, inputs, fused)

        chunk_config = self.chunks[0].module.config
        chunk_config.no_sync_func = (
            [c.no_sync for c in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync
        )
        chunk_config.finalize_model_grads_func = _finalize_without_rescaling
        data: Any = (
            [iter(prepared) for _ in self.chunks] if len(self.chunks) > 1 else iter(prepared)
        )
        grad = torch.no_grad() if forward_only else contextlib.nullcontext()
        with grad:
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=data,
                model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                num_microbatches=n,
                seq_length=max(int(p[1].kwargs["input_ids"].shape[1]) for p in prepared),
                micro_batch_size=max(int(p[1].kwargs["input_ids"].shape[0]) for p in prepared),
                forward_only=forward_only,
            )
        if self._routing is not None:
            self._routing.step = None
        results = MicroBatchResults(outputs, loss_sum, acc) if self.is_last_stage else None
        if pp > 1:
            group = ps.get_pipeline_model_parallel_group()
            last = dist.get_process_group_ranks(group)[-1]
            results = broadcast_results(results, src=last, group=group, device=self.device)
        assert results is not None
        for (mb, inputs), out in zip(prepared, results.outputs, strict=True):
            routing = inputs.part(RoutingInputs)
            if routing is not None and routing.record:
                out[ROUTED_EXPERTS] = self._recorded_routes(steps[id(inputs)], inputs, mb)
            if routing is not None and routing.balance:
                out[MOE_AUX] = self._balance_terms(steps[id(inputs)], mb)
                if self.loss_fn is not None:  # the step's loss includes every stage's share
                    aux = balance_loss(out[MOE_AUX], mb, ctx)
                    results.loss = results.loss + aux.detach().double().cpu()
                    results.metrics.add("moe_aux_loss", balance_metric(out[MOE_AUX], mb, ctx))
        return results

    # ------------------------------------------------------------------ routing
    def _token_slice(self, inputs: ModelInputs) -> slice:
        """The tokens of the model's row (sequence-major) this rank's routers see: all of them,
        or under sequence parallelism this TP rank's share of the sequence."""
        total = int(inputs.kwargs["input_ids"].numel())
        if not self.config.sequence_parallel:  # type: ignore[attr-defined]
            return slice(0, total)
        tp = self.config.tensor_parallel_size
        share = total // tp
        return slice(self.tp_rank * share, (self.tp_rank + 1) * share)

    def _routing_step(
        self, inputs: ModelInputs, micro_batch: TensorDict, ctx: GlobalBatchContext
    ) -> RoutingStep:
        routes = None
        request = inputs.part(RoutingInputs) or RoutingInputs(None)
        if request.routes is not None:
            mine = self._token_slice(inputs)
            assert self._routing is not None
            routes = {layer: request.routes[layer, mine] for layer in self._routing.layers}
        step = RoutingStep(routes=routes, record=request.record)
        if request.balance:
            step.balance = functools.partial(self._layer_balance, step, inputs, micro_batch, ctx)
        return step

    def _row_major(self, per_token: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        """Values per token in megatron-core's sequence-major order over the padded row
        (``[(L + extra) * b, ...]``) in the row-major order of the model's input row without
        the padding sequence parallelism added (what :func:`row_to_batch` takes)."""
        ids = inputs.kwargs["input_ids"]
        b, padded = int(ids.shape[0]), int(ids.shape[1])
        length = int(inputs.kwargs["length"])
        x = per_token.reshape(padded, b, *per_token.shape[1:])[:length]
        return x.transpose(0, 1).reshape(b * length, *per_token.shape[1:])

    def _gather_tokens(self, x: torch.Tensor, *, grad: bool) -> torch.Tensor:
        """This TP rank's tokens joined with the others' (sequence parallelism; else ``x``)."""
        if not self.config.sequence_parallel:  # type: ignore[attr-defined]
            return x
        if grad:  # every TP rank then computes the same loss: the backward keeps its share
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        group = self._ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    def _layer_balance(
        self,
        step: RoutingStep,
        inputs: ModelInputs,
        micro_batch: TensorDict,
        ctx: GlobalBatchContext,
        layer: int,
        logits: torch.Tensor,
        used: torch.Tensor,
    ) -> torch.Tensor:
        """One router's share of the micro-batch's balance loss (``BatchMeta.moe_aux``), from
        its logits and the experts used on this rank's tokens; its terms ``[b, L]`` (this
        layer's of :func:`balance_of`'s mean over the model's layers) are kept in ``step``."""
        assert self.layout is not None
        logits = self._row_major(self._gather_tokens(logits, grad=True), inputs)
        used = self._row_major(self._gather_tokens(used, grad=False), inputs)
        terms = balance_of([(logits, used)], self.layout.num_experts, inputs, micro_batch)
        terms = row_to_batch(terms / self.layout.num_layers, inputs, micro_batch)
        step.terms.setdefault(layer, terms.detach())  # a recomputation's are the same
        return balance_loss(terms, micro_batch, ctx)

    def _balance_terms(self, step: RoutingStep, micro_batch: TensorDict) -> torch.Tensor:
        """The micro-batch's balance terms ``[b, L]``, every layer's: this stage's, summed over
        the pipeline stages."""
        layers = list(step.terms.values())
        device = layers[0].device if layers else torch.device("cpu")
        terms = torch.zeros(micro_batch[INPUT_IDS].shape, dtype=torch.float32, device=device)
        for layer_terms in layers:  # summed where they are: one copy to the host, not one a layer
            terms = terms + layer_terms.float()
        terms = terms.cpu()
        if self.config.pipeline_parallel_size > 1:  # type: ignore[attr-defined]
            terms = all_reduce_cpu(terms, group=self._ps.get_pipeline_model_parallel_group())
        return terms

    def _recorded_routes(
        self, step: RoutingStep, inputs: ModelInputs, micro_batch: TensorDict
    ) -> torch.Tensor:
        """The routers' own choice for the micro-batch, ``[b, L, layers, top_k]``: each stage's
        layers, joined over the TP ranks (sequence parallelism) and the pipeline stages."""
        assert self.layout is not None and self._routing is not None
        mine = torch.stack([step.recorded[layer] for layer in self._routing.layers], dim=1)
        mine = self._row_major(self._gather_tokens(mine.to(self.device), grad=False), inputs)
        full = torch.zeros(
            mine.shape[0], self.layout.num_layers, self.layout.top_k, dtype=torch.int64
        )
        full[:, self._routing.layers] = mine.cpu()
        if self.config.pipeline_parallel_size > 1:  # type: ignore[attr-defined]
            full = all_reduce_cpu(full, group=self._ps.get_pipeline_model_parallel_group())
        return row_to_batch(full, inputs, micro_batch)

    # ------------------------------------------------------------------ optimizer
    @_on_device
    def optimizer_zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    @_on_device
    def optimizer_step(self) -> float:
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        opt = self.optimizer
        opt.prepare_grads()
        norm = float(opt.get_grad_norm())
        if not math.isfinite(norm):
            self.skipped_steps += 1
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            opt.zero_grad()
            return norm
        max_norm = self.config.optim.clip_grad
        if max_norm is not None:
            for sub in getattr(opt, "chained_optimizers", [opt]):
                params = sub.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm, norm)
        opt.step_with_ready_grads()
        return norm

    def lr_scheduler_step(self) -> float:
        self._lr_step += 1
        return self._apply_lr()

    def _apply_lr(self) -> float:
        lr = self.config.optim.lr * lr_lambda(self.config.optim, self._lr_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    # ------------------------------------------------------------------ state
    def to(self, device: torch.device | str, *, model: bool = True, optimizer: bool = True) -> None:
        target = torch.device(device)
        if target.type == self.device.type:
            return  # already there (a CPU-only run has nowhere to offload to)
        raise EngineCoreError(
            f"megatron: moving the engine to {target} is not supported (offload is not declared); "
            f"it lives on {self.device}."
        )

    def _sharded_state_dict(self, *, is_loading: bool) -> dict[str, Any]:
        model_sd: dict[str, Any] = {}
        for i, chunk in enumerate(self.chunks):
            model_sd[f"model{i}"] = chunk.module.sharded_state_dict()
        merged: dict[str, Any] = {}
        for sd in model_sd.values():
            merged.update(sd)
        optim_sd = self.optimizer.sharded_state_dict(merged, is_loading=is_loading)
        return {**model_sd, "optimizer": optim_sd}

    def checkpoint_preflight(self, path: str, *, saving: bool) -> None:
        _require_local(path)
        self._refuse_distributed_optimizer_checkpoint("save" if saving else "load")
        if saving and not any(
            sub.optimizer.state
            for sub in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        ):
            raise CheckpointError(
                "megatron: cannot save a checkpoint before the first optimizer step: "
                "megatron-core has no optimizer state until a step has run, and a checkpoint "
                "without it does not load. Save after a step, or write the weights alone with "
                "export_hf()."
            )

    @_on_device
    def save_shards(self, folder: str) -> None:
        from megatron.core import dist_checkpointing

        if dist.get_rank() == 0:
            os.makedirs(join(folder, CKPT_DIR), exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state_dict(is_loading=False), join(folder, CKPT_DIR))

    def _refuse_distributed_optimizer_checkpoint(self, what: str) -> None:
        if self.config.use_distributed_optimizer:  # type: ignore[attr-defined]
            raise CheckpointError(
                f"megatron: cannot {what} a checkpoint with use_distributed_optimizer=true. "
                f"megatron-core 0.16's distributed-optimizer checkpoints do not round-trip with "
                f"PyTorch's AdamW (no Apex or TransformerEngine optimizer): its default format "
                f"is refused by its own checkpointing, 'fully_reshardable' fails to load, and "
                f"'dp_reshardable' resumes with a different optimizer state. Train with "
                f"use_distributed_optimizer=false when the run saves checkpoints."
            )

    @_on_device
    def load_shards(self, folder: str) -> None:
        from megatron.core import dist_checkpointing

        if not is_dir(join(folder, CKPT_DIR)):
            raise CheckpointError(
                f"{folder} is not a complete megatron checkpoint (no {CKPT_DIR}/); pass a "
                f"global_step_<N> folder written by save_checkpoint()."
            )
        state = dist_checkpointing.load(
            self._sharded_state_dict(is_loading=True), join(folder, CKPT_DIR)
        )
        for i, chunk in enumerate(self.chunks):
            chunk.module.load_state_dict(state[f"model{i}"])
        self.optimizer.load_state_dict(state["optimizer"])

    def rng_state(self) -> dict[str, Any]:
        state = super().rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # the tensor-parallel streams (dropout inside TP regions) of megatron's tracker
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            tracker = get_cuda_rng_tracker().get_states()
            state["megatron_tracker"] = {k: v.cpu() for k, v in tracker.items()}
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        super().set_rng_state(state)
        tracker = state.get("megatron_tracker")
        if tracker and torch.cuda.is_available():
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            get_cuda_rng_tracker().set_states(tracker)

    def checkpoint_extra_state(self) -> dict[str, Any]:
        return {"lr_step": self._lr_step, "skipped_steps": self.skipped_steps}

    def load_checkpoint_extra_state(self, state: dict[str, Any]) -> None:
        try:
            self._lr_step = int(state["lr_step"])
            self.skipped_steps = int(state["skipped_steps"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"the checkpoint's LR-schedule state is missing or malformed ({e!r}); it was not "
                f"written by the megatron engine's save_checkpoint(). Resume from another "
                f"checkpoint."
            ) from e
        self._apply_lr()

    # ------------------------------------------------------------------ export
    def named_full_params(
        self, bucket_bytes: int = BUCKET_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor, full, on every rank, a bucket of megatron parameters at a time.

        Collective over the whole engine: each parameter is gathered from its TP ranks on the
        stage that holds it, then broadcast over the pipeline group. The parameters whose HF
        tensors fit in ``bucket_bytes`` together are gathered, then yielded; a parameter bigger
        than that is a bucket of its own. At most one bucket is held here at a time.
        """
        assert self.layout is not None
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}.")
        shapes, layout = self._hf_shapes(), self.layout
        itemsize = torch.empty((), dtype=DTYPES[self.config.model.dtype]).element_size()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for megatron_name, owner in self._export_plan():
            nbytes = itemsize * sum(
                math.prod(shapes[n]) for n in megatron_to_hf_names(megatron_name, 0, layout)
            )
            if bucket and size + nbytes > bucket_bytes:
                yield from bucket
                bucket, size = [], 0
            with self._device_context():
                gathered = self._gather_param(megatron_name, owner)
            if layout.tied and not layout.value_head:
                # transformers' state_dict() holds a tied head under its own name as well:
                # the same tensor (a rollout's expected weights list both)
                gathered += [("lm_head.weight", t) for n, t in gathered if n == TIED_SOURCE]
            bucket += gathered
            size += nbytes
        yield from bucket

    def _export_plan(self) -> list[tuple[str, tuple[int, int, str]]]:
        """(global megatron name, (owning pp rank, chunk, local name)) in HF order."""
        assert self.layout is not None
        ps = self._ps
        last = ps.get_pipeline_model_parallel_world_size() - 1
        last_chunk = len(self.chunks) - 1
        plan: list[tuple[str, tuple[int, int, str]]] = [
            ("embedding.word_embeddings.weight", (0, 0, "embedding.word_embeddings.weight"))
        ]
        parts = layer_parts(self.layout)
        for layer, (pp_rank, chunk, local) in enumerate(self._layer_owner):
            for part in parts:
                plan.append(
                    (
                        f"decoder.layers.{layer}.{part}",
                        (pp_rank, chunk, f"decoder.layers.{local}.{part}"),
                    )
                )
        plan.append(
            ("decoder.final_layernorm.weight", (last, last_chunk, "decoder.final_layernorm.weight"))
        )
        if self.layout.value_head:
            plan += [
                ("output_layer.weight", (last, last_chunk, "output_layer.weight")),
                ("output_layer.bias", (last, last_chunk, "output_layer.bias")),
            ]
        elif not self.layout.tied:
            plan.append(("output_layer.weight", (last, last_chunk, "output_layer.weight")))
        return plan

    def _gather_param(
        self, name: str, owner: tuple[int, int, str]
    ) -> list[tuple[str, torch.Tensor]]:
        assert self.layout is not None
        ps = self._ps
        pp_rank, chunk, local = owner
        hf_names = megatron_to_hf_names(name, 0, self.layout)
        mine = ps.get_pipeline_model_parallel_rank() == pp_rank
        tensors: tuple[torch.Tensor, ...] = ()
        if mine and name.endswith(_STACKED_EXPERTS):
            tensors = (self._gather_experts(chunk, local),)
        elif mine:
            param = dict(self.chunks[chunk].module.named_parameters())[local].detach()
            tp = ps.get_tensor_model_parallel_world_size()
            if tp > 1:
                shards = [torch.empty_like(param) for _ in range(tp)]
                dist.all_gather(
                    shards, param.contiguous(), group=ps.get_tensor_model_parallel_group()
                )
            else:
                shards = [param]
            tensors = hf_from_shards(name, shards, self.layout)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            group = ps.get_pipeline_model_parallel_group()
            src = dist.get_process_group_ranks(group)[pp_rank]
            shapes = self._hf_shapes()
            dtype = DTYPES[self.config.model.dtype]
            if not mine:
                tensors = tuple(
                    torch.empty(shapes[n], dtype=dtype, device=self.device) for n in hf_names
                )
            for t in tensors:
                dist.broadcast(t, src=src, group=group)
        return [(n, t.cpu()) for n, t in zip(hf_names, tensors, strict=True)]

    def _gather_experts(self, chunk: int, local: str) -> torch.Tensor:
        """A layer's stacked HF expert tensor (``[experts, ...]``) from the local experts of every
        expert-parallel rank (each expert whole there: no expert TP). ``local`` is the export
        name ``decoder.layers.<local>.mlp.experts.linear_fc<1|2>.weight`` of this stage."""
        assert self.layout is not None
        params = dict(self.chunks[chunk].module.named_parameters())
        prefix, part = local.rsplit(".experts.", 1)
        mine = []
        for i in range(self.layout.experts_per_rank):
            name = f"{prefix}.experts.local_experts.{i}.{part}"
            param = params[name].detach().contiguous()
            mine.append(torch.cat(hf_from_shards(name, [param], self.layout)))
        stacked = torch.stack(mine)
        if self.layout.expert_parallel == 1:
            return stacked
        every = [torch.empty_like(stacked) for _ in range(self.layout.expert_parallel)]
        dist.all_gather(every, stacked, group=self._ps.get_expert_model_parallel_group())
        return torch.cat(every)

    @functools.cached_property
    def _hf_shape_table(self) -> dict[str, tuple[int, ...]]:

        return dict(model_weight_shapes(self.config.model))

    def _hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return self._hf_shape_table


TIED_SOURCE = "model.embed_tokens.weight"  # a tied model's head is this tensor
# the export names standing for every expert of a layer (the stacked HF tensors)
_STACKED_EXPERTS = ("mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight")


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


def _parallel_sizes(ps: Any) -> tuple[int, int, int | None, int]:
    """(tp, pp, vpp, ep) of megatron-core's current model-parallel state."""
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
    )


def _finalize_without_rescaling(
    model: list[torch.nn.Module], num_tokens: Any = None, **kwargs: Any
) -> None:
    """megatron-core's gradient finalisation (DP reduction, tied-embedding and sequence-parallel
    all-reduces) without its rescaling by the token count: the core's losses are normalised
    by global counts already."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)


def _with_routing(
    inputs: ModelInputs, routes: torch.Tensor | None, record: bool, balance: bool
) -> ModelInputs:
    """``inputs`` with what the micro-batch asks of the routers, when it asks anything."""
    if routes is not None or record or balance:
        inputs.add(RoutingInputs(routes, record, balance))
    return inputs


def _require_local(path: str) -> None:
    if "://" in str(path) and not str(path).startswith("file://"):
        raise CheckpointError(
            f"megatron: checkpoints are written with megatron-core's dist_checkpointing, which "
            f"needs a local or mounted filesystem; got {path!r}. Use a local path."
        )
