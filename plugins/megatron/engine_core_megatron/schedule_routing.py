"""The mixture-of-experts share of the megatron engine's pipeline schedule.

:func:`schedule_routing` picks it once, when the model is built: :class:`ScheduleRouting`
(nothing to do) for a dense model, :class:`MoeScheduleRouting` for a mixture of experts. The
schedule (:mod:`engine_core_megatron.schedule`) calls it at fixed points: before the schedule
runs (:meth:`~ScheduleRouting.start`), at each forward of a micro-batch
(:meth:`~ScheduleRouting.enter`: what the routers of this rank replay, record and balance,
:class:`~engine_core_megatron.routing.RoutingStep`), when it ends
(:meth:`~ScheduleRouting.finish`) and once the results are on every rank
(:meth:`~ScheduleRouting.add_outputs`: the routes recorded and the balance terms, joined over
the TP ranks and the pipeline stages, and the balance loss added to the step's).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_core.backend import (
    ATTENTION_MASK,
    INPUT_IDS,
    MOE_AUX,
    ROUTED_EXPERTS,
    BatchError,
    GlobalBatchContext,
    MicroBatchResults,
    ModelInputs,
    RoutingInputs,
    all_reduce_cpu,
    balance_loss,
    balance_metric,
    balance_of,
    check_routes,
    routing_request,
    row_to_batch,
)
from engine_core_megatron.convert import ModelLayout
from engine_core_megatron.routing import RouterHooks, RoutingStep

__all__ = ["MoeScheduleRouting", "ScheduleRouting", "megatron_routing_request"]


def megatron_routing_request(
    layout: ModelLayout | None, micro_batch: TensorDict
) -> tuple[torch.Tensor | None, bool, bool]:
    """The batch's routes (checked against the model) and whether to record and balance."""
    assert layout is not None
    routed, record, balance = routing_request(micro_batch)
    if not (routed is not None or record or balance):
        return None, False, False
    if not layout.moe:
        raise BatchError(
            f"the batch asks for {ROUTED_EXPERTS} or {MOE_AUX}, and this model is dense "
            f"(no mixture-of-experts router); turn routing replay off for it."
        )
    if routed is not None:
        want = (layout.num_layers, layout.top_k)
        if tuple(routed.shape[2:]) != want:
            raise BatchError(
                f"{ROUTED_EXPERTS} must be [B, L, layers={want[0]}, top_k={want[1]}] for this "
                f"model; got {tuple(routed.shape)}."
            )
        real = routed[micro_batch[ATTENTION_MASK].bool()]  # padding may hold anything
        check_routes(real, num_experts=layout.num_experts, what=ROUTED_EXPERTS)
    return routed, record, balance


class ScheduleRouting:
    """A dense model's: nothing to replay, record or balance."""

    def start(self, *, forward_only: bool) -> None:
        """Called before the schedule runs."""

    def enter(self, inputs: ModelInputs, micro_batch: TensorDict, ctx: GlobalBatchContext) -> None:
        """Called at each forward of a micro-batch (once per model chunk)."""

    def finish(self) -> None:
        """Called when the schedule has run."""

    def add_outputs(
        self,
        prepared: list[tuple[TensorDict, ModelInputs]],
        results: MicroBatchResults,
        ctx: GlobalBatchContext,
    ) -> None:
        """Add the routing outputs to ``results`` (on every rank)."""


class MoeScheduleRouting(ScheduleRouting):
    """A mixture of experts': the routers' hooks driven by each micro-batch's request."""

    def __init__(self, engine: Any, hooks: RouterHooks) -> None:
        self.engine, self.hooks = engine, hooks
        self.steps: dict[int, RoutingStep] = {}  # id(micro-batch inputs) -> its routing step

    @property
    def config(self) -> Any:
        return self.engine.config

    @property
    def layout(self) -> ModelLayout | None:
        return self.engine.layout

    def start(self, *, forward_only: bool) -> None:
        self.steps = {}
        # full recompute runs the layers again in the backward
        self.hooks.start(recomputed=self.config.model.gradient_checkpointing and not forward_only)

    def enter(self, inputs: ModelInputs, micro_batch: TensorDict, ctx: GlobalBatchContext) -> None:
        if id(inputs) not in self.steps:  # one per micro-batch, for every model chunk
            self.steps[id(inputs)] = self._routing_step(inputs, micro_batch, ctx)
        self.hooks.step = self.steps[id(inputs)]

    def finish(self) -> None:
        self.hooks.step = None

    def add_outputs(
        self,
        prepared: list[tuple[TensorDict, ModelInputs]],
        results: MicroBatchResults,
        ctx: GlobalBatchContext,
    ) -> None:
        loss_fn = self.engine.loss_fn
        for (mb, inputs), out in zip(prepared, results.outputs, strict=True):
            routing = inputs.part(RoutingInputs)
            if routing is not None and routing.record:
                out[ROUTED_EXPERTS] = self._recorded_routes(self.steps[id(inputs)], inputs, mb)
            if routing is not None and routing.balance:
                out[MOE_AUX] = self._balance_terms(self.steps[id(inputs)], mb)
                if loss_fn is not None:  # the step's loss includes every stage's share
                    aux = balance_loss(out[MOE_AUX], mb, ctx)
                    results.loss = results.loss + aux.detach().double().cpu()
                    results.metrics.add("moe_aux_loss", balance_metric(out[MOE_AUX], mb, ctx))

    def _token_slice(self, inputs: ModelInputs) -> slice:
        """The tokens of the model's row (sequence-major) this rank's routers see: all of them,
        or under sequence parallelism this TP rank's share of the sequence."""
        total = int(inputs.kwargs["input_ids"].numel())
        if not self.config.sequence_parallel:  # type: ignore[attr-defined]
            return slice(0, total)
        tp = self.config.tensor_parallel_size
        share = total // tp
        return slice(self.engine.tp_rank * share, (self.engine.tp_rank + 1) * share)

    def _routing_step(
        self, inputs: ModelInputs, micro_batch: TensorDict, ctx: GlobalBatchContext
    ) -> RoutingStep:
        routes = None
        request = inputs.part(RoutingInputs) or RoutingInputs(None)
        if request.routes is not None:
            mine = self._token_slice(inputs)
            routes = {layer: request.routes[layer, mine] for layer in self.hooks.layers}
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
        group = self.engine._ps.get_tensor_model_parallel_group()
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
            terms = all_reduce_cpu(terms, group=self.engine._ps.get_pipeline_model_parallel_group())
        return terms

    def _recorded_routes(
        self, step: RoutingStep, inputs: ModelInputs, micro_batch: TensorDict
    ) -> torch.Tensor:
        """The routers' own choice for the micro-batch, ``[b, L, layers, top_k]``: each stage's
        layers, joined over the TP ranks (sequence parallelism) and the pipeline stages."""
        assert self.layout is not None
        mine = torch.stack([step.recorded[layer] for layer in self.hooks.layers], dim=1)
        mine = self._row_major(self._gather_tokens(mine.to(self.engine.device), grad=False), inputs)
        full = torch.zeros(
            mine.shape[0], self.layout.num_layers, self.layout.top_k, dtype=torch.int64
        )
        full[:, self.hooks.layers] = mine.cpu()
        if self.config.pipeline_parallel_size > 1:  # type: ignore[attr-defined]
            full = all_reduce_cpu(full, group=self.engine._ps.get_pipeline_model_parallel_group())
        return row_to_batch(full, inputs, micro_batch)
