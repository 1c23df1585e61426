"""Mixture-of-experts routing in the generic micro-batch loop, as its one forward extension.

An engine that declares ``routing_replay`` gets :class:`RoutingReplay`
(:meth:`BaseEngine.forward_extension <engine_core.engine.BaseEngine.forward_extension>`): each
micro-batch's :class:`RoutingInputs` (the batch's ``routed_experts`` in the model row's order,
whether to return the routers' own choice, whether to keep their logits for the load-balancing
loss) is built with its inputs; around the model call the routers replay, record and keep their
logits (:mod:`engine_core.moe`); the routes recorded and the balance terms go into the
micro-batch's outputs, and the balance loss is added to the loss function's. An engine that
does not declare it gets the base extension, which does nothing, and a batch that asks it for
any of this is refused before the step runs (:func:`refuse_routing`).

The functions :func:`routing_request` and :func:`balance_of` serve engines whose own loop does
the same (megatron's pipeline schedule).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from engine_core.batch import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOSS_MASK,
    MOE_AUX,
    ROUTED_EXPERTS,
    BatchMeta,
    get_meta,
)
from engine_core.comm import collective_device
from engine_core.context_parallel import SequenceShard, gather_sequence
from engine_core.errors import BatchError, CapabilityError
from engine_core.forward_extension import NO_HOOKS, ForwardExtension, MicroBatchHooks
from engine_core.model_inputs import InputPart, ModelInputs, row_to_batch
from engine_core.moe import (
    RouteRecorder,
    RouterLogits,
    balance_loss,
    balance_metric,
    balance_terms,
    replaying,
)
from engine_core.packing import pack_tensor

if TYPE_CHECKING:
    from engine_core.loss import GlobalBatchContext, Metric

__all__ = [
    "RoutingInputs",
    "RoutingReplay",
    "balance_of",
    "refuse_routing",
    "routing_request",
]


def routing_request(
    micro_batch: TensorDict, *, unsupported: str | None = None
) -> tuple[torch.Tensor | None, bool, bool]:
    """What ``micro_batch`` asks of the model's routers: ``(routes, record, balance)`` — the
    experts to replay (its ``routed_experts``, ``[B, L, layers, top_k]``, checked against its
    ``input_ids``; None without), whether to return the routers' own choice
    (``BatchMeta.return_routes``) and whether to keep their logits for the load-balancing loss
    (``BatchMeta.moe_aux``). ``unsupported`` names a setting of the engine under which any of
    it is refused (a forward that would route on its own)."""
    routed = micro_batch.get(ROUTED_EXPERTS, None)
    meta: BatchMeta = get_meta(micro_batch)
    record, balance = meta.return_routes, meta.moe_aux is not None
    if (routed is not None or record or balance) and unsupported:
        raise BatchError(
            f"{ROUTED_EXPERTS} (replayed or returned) or {MOE_AUX} with {unsupported} is not "
            f"supported yet (a recomputed or split forward would route on its own): run "
            f"routing replay without it."
        )
    if routed is not None:
        ids = micro_batch[INPUT_IDS]
        if routed.dim() != 4 or tuple(routed.shape[:2]) != tuple(ids.shape):
            raise BatchError(
                f"{ROUTED_EXPERTS} must be [B, L, layers, top_k] with [B, L] = "
                f"{tuple(ids.shape)} of {INPUT_IDS}; got {tuple(routed.shape)}."
            )
    return routed, record, balance


def balance_of(
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    num_experts: int,
    inputs: ModelInputs,
    micro_batch: TensorDict,
) -> torch.Tensor:
    """The load-balancing terms of each token of the model's row (:func:`balance_terms`), from
    each MoE layer's ``(router logits [tokens, experts], experts used [tokens, top_k])`` over
    the row (packed or padded, row-major)."""
    if inputs.packed is not None:  # each packed token's row of the batch
        sequence = inputs.packed.flat_indices // inputs.packed.seq_len
    else:
        b, length = micro_batch[INPUT_IDS].shape
        rows = torch.arange(b)[:, None].expand(b, length)
        sequence = rows.masked_fill(~micro_batch[ATTENTION_MASK].bool(), -1).reshape(-1)
    return balance_terms(layers, sequence.to(layers[0][0].device), num_experts)


@dataclass(frozen=True)
class RoutingInputs(InputPart):
    """What a micro-batch asks of the model's routers, in the model row's order."""

    #: the experts to route each token of the model's row to, ``[layers, tokens, top_k]``
    #: (the batch's ``routed_experts`` in the row's order); None: the routers choose
    routes: torch.Tensor | None
    #: return the routers' own choice (``BatchMeta.return_routes``)
    record: bool = False
    #: keep the routers' logits for the load-balancing loss (``BatchMeta.moe_aux``)
    balance: bool = False

    @classmethod
    def build(cls, micro_batch: TensorDict, inputs: ModelInputs) -> RoutingInputs | None:
        routed, record, balance = routing_request(micro_batch)
        if routed is None and not record and not balance:
            return None
        routes = None
        packed, shard = inputs.packed, inputs.shard
        if routed is not None and packed is not None:  # [layers, tokens, top_k] of the row
            routes = pack_tensor(packed, routed)
            if shard is not None:  # the padding sequence goes to the first experts
                extra = shard.padded - shard.length
                filler = torch.arange(routes.shape[-1], dtype=routes.dtype)
                routes = torch.cat([routes, filler.expand(1, extra, *routes.shape[2:])], 1)
                routes = shard.local(routes)
            routes = routes[0].transpose(0, 1)
        elif routed is not None:
            routes = routed.flatten(0, 1).transpose(0, 1)
        return cls(routes, record, balance)


def _whole_routes(routes: torch.Tensor, shard: SequenceShard | None) -> torch.Tensor:
    """Routes ``[layers, tokens, top_k]`` recorded on this rank's slice of a row split over
    context-parallel ranks, as the whole row's (``routes`` itself without a split)."""
    if shard is None:
        return routes
    mine = routes.to(collective_device(shard.group)).contiguous()
    parts = [torch.empty_like(mine) for _ in range(shard.size)]
    dist.all_gather(parts, mine, group=shard.group)
    return torch.cat(parts, dim=1)[:, : shard.length].to(routes.device)


def _whole_layer(
    layer: tuple[torch.Tensor, torch.Tensor], shard: SequenceShard | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE layer's ``(router logits, experts used)`` over the whole row, the logits with
    their gradient (context parallelism: each rank saw a slice)."""
    if shard is None:
        return layer
    logits, experts = layer
    whole = gather_sequence(logits[None], shard.group)[0, : shard.length]
    used = _whole_routes(experts[None].to(logits.device), shard)[0]
    return whole, used


class _RoutingStep(MicroBatchHooks):
    """One micro-batch's routing: replay, record and balance around the model call, and what
    the call left (the routes recorded, the routers' logits, the balance terms)."""

    def __init__(self, request: RoutingInputs, shard: SequenceShard | None) -> None:
        self.request, self.shard = request, shard
        self._recorder: RouteRecorder | None = None
        self.recorded: torch.Tensor | None = None  # [layers, tokens, top_k] of the whole row
        self.router_logits: RouterLogits | None = None
        self.terms: torch.Tensor | None = None  # [b, L]

    @contextlib.contextmanager
    def model_context(self, module: nn.Module) -> Iterator[None]:
        request = self.request
        # entered before the replay, the recorder sees each router's own choice
        recorder = RouteRecorder(module) if request.record else None
        replay = (
            contextlib.nullcontext()
            if request.routes is None
            else replaying(module, request.routes)
        )
        # entered after the replay, the router logits come with the experts actually used
        balance = RouterLogits(module) if request.balance else None
        with (
            recorder if recorder is not None else contextlib.nullcontext(),
            replay,
            balance if balance is not None else contextlib.nullcontext(),
        ):
            yield
        self._recorder, self.router_logits = recorder, balance

    def after_model(self) -> None:
        if self._recorder is not None:
            self.recorded = _whole_routes(self._recorder.routes(), self.shard)

    def add_outputs(self, out: TensorDict, inputs: ModelInputs, micro_batch: TensorDict) -> None:
        if self.recorded is not None:
            out[ROUTED_EXPERTS] = row_to_batch(self.recorded.transpose(0, 1), inputs, micro_batch)
        if self.router_logits is not None:
            balance = self.router_logits
            layers = [_whole_layer(x, inputs.shard) for x in balance.layers()]
            self.terms = row_to_batch(
                balance_of(layers, balance.num_experts, inputs, micro_batch), inputs, micro_batch
            )
            out[MOE_AUX] = self.terms.detach()

    def add_loss(
        self,
        loss: torch.Tensor,
        metrics: Mapping[str, Metric],
        micro_batch: TensorDict,
        ctx: GlobalBatchContext,
    ) -> tuple[torch.Tensor, Mapping[str, Metric]]:
        if self.terms is None:
            return loss, metrics
        # BatchMeta.moe_aux: the engine adds the balance loss
        loss = loss + balance_loss(self.terms, micro_batch, ctx)
        return loss, {**metrics, "moe_aux_loss": balance_metric(self.terms, micro_batch, ctx)}


class RoutingReplay(ForwardExtension):
    """Routing replay, routes returned and the balance loss, for a transformers MoE model."""

    input_parts: ClassVar[tuple[type[InputPart], ...]] = (RoutingInputs,)

    def check_batch(self, batch: TensorDict, engine: str) -> None:
        meta: BatchMeta = get_meta(batch)
        if meta.moe_aux is not None and LOSS_MASK not in batch.keys():
            raise BatchError(
                f"BatchMeta.moe_aux asks for the routers' load-balancing loss, aggregated over "
                f"the batch's {LOSS_MASK}, and the batch has none (keys: {sorted(batch.keys())}); "
                f"add {LOSS_MASK} or unset moe_aux."
            )

    def begin(self, inputs: ModelInputs, micro_batch: TensorDict) -> MicroBatchHooks:
        request = inputs.part(RoutingInputs)
        return NO_HOOKS if request is None else _RoutingStep(request, inputs.shard)


def refuse_routing(batch: TensorDict, engine: str) -> None:
    """Refuse a ``batch`` that asks for routes or the balance loss of an engine (named
    ``engine``) that does not declare ``routing_replay``."""
    meta: BatchMeta = get_meta(batch)
    if ROUTED_EXPERTS in batch.keys():
        raise CapabilityError(
            f"the batch carries {ROUTED_EXPERTS} (a rollout's choice of experts), which "
            f"{engine} does not replay (it does not declare "
            f"routing_replay); drop the key or use an engine that declares it."
        )
    if meta.moe_aux is not None:
        raise CapabilityError(
            f"BatchMeta.moe_aux asks for the routers' load-balancing loss, which "
            f"{engine} does not compute (it does not declare "
            f"routing_replay); set moe_aux_loss_coef=0 or use an engine that declares it."
        )
    if meta.return_routes:
        raise CapabilityError(
            f"BatchMeta(return_routes=True) asks for the experts the model's routers "
            f"chose, which {engine} does not record (it does not declare "
            f"routing_replay); turn routing replay off or use an engine that declares it."
        )
