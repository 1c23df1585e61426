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

The class holds the layout, the gradient steps and the LR schedule; each other concern is a
module of this package: :mod:`~engine_core_megatron.build` (model, parallel state, optimizer),
:mod:`~engine_core_megatron.forward` (model inputs, output-layer choices),
:mod:`~engine_core_megatron.schedule` (the pipeline schedule),
:mod:`~engine_core_megatron.schedule_routing` (mixtures of experts in the schedule),
:mod:`~engine_core_megatron.checkpoint` and :mod:`~engine_core_megatron.export`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_core.backend import (
    BaseEngine,
    Capability,
    EngineConfig,
    EngineCoreError,
    GlobalBatchContext,
    MicroBatchResults,
    lr_lambda,
)
from engine_core_megatron._cpu_compat import cpu_compat
from engine_core_megatron._device import on_device
from engine_core_megatron.build import ModelBuilding, parallel_sizes
from engine_core_megatron.capabilities import MEGATRON_CAPABILITIES
from engine_core_megatron.checkpoint import MegatronCheckpoints
from engine_core_megatron.config import MegatronEngineConfig
from engine_core_megatron.convert import ModelLayout
from engine_core_megatron.export import MegatronExport
from engine_core_megatron.forward import ModelForward
from engine_core_megatron.routing import RouterHooks
from engine_core_megatron.schedule import run_schedule
from engine_core_megatron.schedule_routing import ScheduleRouting

__all__ = ["MegatronEngine"]

# megatron-core announces every optional kernel library it does not find, once per module
warnings.filterwarnings(
    "ignore", message=r".*(Apex|Transformer Engine).*not installed", category=UserWarning
)
# a deprecation in megatron-core's own defaults (cuda_graph_scope), not in anything we set
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)


class MegatronEngine(ModelBuilding, ModelForward, MegatronCheckpoints, MegatronExport, BaseEngine):
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
        # a mixture of experts' share of the schedule (set when the model is built)
        self._schedule_routing: ScheduleRouting = ScheduleRouting()

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
            now = parallel_sizes(parallel_state)
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

    # ------------------------------------------------------------------ forward / backward
    def run_micro_batches(
        self, micro_batches: list[TensorDict], ctx: GlobalBatchContext, *, forward_only: bool
    ) -> MicroBatchResults:
        with self._device_context():
            return run_schedule(self, micro_batches, ctx, forward_only=forward_only)

    # ------------------------------------------------------------------ optimizer
    @on_device
    def optimizer_zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    @on_device
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
