"""Mixture-of-experts routing in transformers models: which experts each token went to, and a
forward that takes a given choice instead (routing replay).

A rollout and a trainer route tokens independently, and numerics that differ by one rounding
(another kernel, another dtype, another batch) send some tokens to other experts: the trainer
then scores a token with a different network from the one that sampled it. Replay runs the
trainer's forward with the rollout's choice of experts.

transformers' MoE layers take their choice from a router module whose forward returns
``(router_logits, routing_weights, expert_indices)`` for the ``tokens`` rows it is given
(``hidden_states`` flattened to ``[tokens, hidden]``). :class:`RouteRecorder` keeps each
router's ``expert_indices``; :class:`RouteReplay` replaces them with the given ones and computes
the routing weights of the given experts from the router's live logits, as the router would for
its own choice, so the router keeps its gradient. The routers named in :data:`ROUTER_RULES` are
supported; a model with another is refused, naming them.

Routes are one integer tensor ``[layers, tokens, top_k]``: layer ``l`` is the ``l``-th router in
module order (the model's MoE layers, first to last), token ``t`` the ``t``-th row that router
sees in one forward (row-major over the input's batch and sequence).

Under gradient checkpointing a block's forward runs again in the backward, after the ``with``
blocks above have ended. :func:`checkpoint_contexts` (``torch.utils.checkpoint``'s
``context_fn``, which :func:`engine_core.models.build_model` passes for a model with routers)
keeps the experts each router of a checkpointed block was made to use and gives them to it
again when the block is recomputed; the recorders skip the recomputation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from engine_core.batch import LOSS_MASK, MoeAuxLoss, get_meta
from engine_core.errors import BatchError
from engine_core.loss import GlobalBatchContext, Metric, aggregate_loss, token_mean_metric

__all__ = [
    "ROUTER_RULES",
    "RouterRule",
    "RouteRecorder",
    "RouteReplay",
    "RouterLogits",
    "balance_loss",
    "balance_metric",
    "balance_terms",
    "check_routes",
    "checkpoint_contexts",
    "expert_load_spread",
    "num_experts_of",
    "routers",
    "route_mismatch",
    "replayed_weights",
    "replaying",
]


@dataclass(frozen=True)
class RouterRule:
    """How a router turns its logits into the weights of its chosen experts: the softmax over
    every expert (in float32), taken at the chosen ones, renormalised over them when
    ``normalize`` says so (``True``, or the name of the router's attribute that says), then
    multiplied by the router's attribute ``scale`` when it names one, and cast back to the
    logits' dtype when ``to_logits_dtype``."""

    normalize: bool | str
    scale: str | None = None
    to_logits_dtype: bool = True  # the weights are cast back to the logits' dtype


# router class -> its rule, checked against each class's forward (transformers 5.19)
ROUTER_RULES: dict[str, RouterRule] = {
    "Qwen3MoeTopKRouter": RouterRule(normalize="norm_topk_prob"),
    "Qwen2MoeTopKRouter": RouterRule(normalize="norm_topk_prob"),
    "OlmoeTopKRouter": RouterRule(normalize="norm_topk_prob"),
    "MixtralTopKRouter": RouterRule(normalize=True, to_logits_dtype=False),
    # Qwen3-VL-MoE's text experts: always renormalised over the chosen ones
    "Qwen3VLMoeTextTopKRouter": RouterRule(normalize=True),
}


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers in module order (its MoE layers, first to last); empty for a dense
    model. A module whose class name ends in ``Router`` and has no rule is refused."""
    found = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in ROUTER_RULES:
            found.append(module)
        elif kind.lower().endswith("router"):
            raise ValueError(
                f"{name} is a {kind}, a router routing replay has no rule for; supported: "
                f"{', '.join(sorted(ROUTER_RULES))}. Add its rule to "
                f"engine_core.moe.ROUTER_RULES (how its weights follow from its logits)."
            )
    return found


def _rule(router: nn.Module) -> RouterRule:
    return ROUTER_RULES[type(router).__name__]


def replayed_weights(
    router: nn.Module, logits: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """The routing weights ``router`` gives the experts ``experts`` ([tokens, top_k]) from its
    ``logits`` ([tokens, experts]): differentiable in the logits."""
    rule = _rule(router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights = probs.gather(-1, experts.long())
    normalize = rule.normalize
    if isinstance(normalize, str):
        normalize = bool(getattr(router, normalize))
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if rule.scale is not None:
        weights = weights * getattr(router, rule.scale)
    return weights.to(logits.dtype) if rule.to_logits_dtype else weights


# the checkpointed block running now: its forward (experts replayed there are kept in
# ``saving``) or its recomputation in the backward (``restoring``)
_checkpoint = threading.local()


def _recomputing() -> bool:
    return getattr(_checkpoint, "restoring", None) is not None


@contextmanager
def _marked(phase: str, saved: dict[nn.Module, torch.Tensor]) -> Iterator[None]:
    """``_checkpoint.<phase>`` is ``saved`` inside the block (the one before it after)."""
    before = getattr(_checkpoint, phase, None)
    setattr(_checkpoint, phase, saved)
    try:
        yield
    finally:
        setattr(_checkpoint, phase, before)


@contextmanager
def _restoring(saved: dict[nn.Module, torch.Tensor]) -> Iterator[None]:
    """The routers that were given experts in the block's forward are given them again."""

    def again(module: nn.Module, args: Any, output: Any) -> Any:
        experts = saved[module]
        return output[0], replayed_weights(module, output[0], experts), experts

    handles = [m.register_forward_hook(again, prepend=True) for m in saved]
    try:
        with _marked("restoring", saved):
            yield
    finally:
        for h in handles:
            h.remove()


def checkpoint_contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (non-reentrant): the contexts of
    one checkpointed block's forward and of its recomputation, sharing what the routers inside
    were made to use, so that a replayed block is recomputed with the same experts."""
    saved: dict[nn.Module, torch.Tensor] = {}
    return _marked("saving", saved), _restoring(saved)


class _RouterHooks:
    """A forward hook on each of a model's routers while the ``with`` block runs."""

    def __init__(self, model: nn.Module, what: str) -> None:
        self._routers = routers(model)
        if not self._routers:
            raise ValueError(
                f"{type(model).__name__} has no mixture-of-experts router to {what} "
                f"(supported: {', '.join(sorted(ROUTER_RULES))})."
            )
        self._handles: list[Any] = []

    def _hook(self, layer: int) -> Any:
        raise NotImplementedError

    def _attach(self) -> None:
        for i, router in enumerate(self._routers):
            self._handles.append(router.register_forward_hook(self._hook(i)))

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class RouteRecorder(_RouterHooks):
    """Inside ``with RouteRecorder(model) as rec:`` every forward's choice of experts is kept;
    :meth:`routes` stacks them ``[layers, tokens, top_k]`` (int64), the forwards one after
    another along ``tokens``. Hooks run in the order they were registered: a recorder entered
    inside a :class:`RouteReplay` records the experts the forward actually used."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, "record")
        self._seen: list[list[torch.Tensor]] = [[] for _ in self._routers]

    def __enter__(self) -> RouteRecorder:
        self._attach()
        return self

    def _hook(self, layer: int) -> Any:
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            if not _recomputing():  # a checkpointed block's second forward: seen already
                self._seen[layer].append(output[2].detach().to("cpu", torch.int64))

        return keep

    def routes(self) -> torch.Tensor:
        """``[layers, tokens, top_k]`` of every forward recorded, forwards one after another
        along ``tokens``."""
        if not self._seen[0]:
            raise RuntimeError("no forward was recorded: run the model inside the block.")
        return torch.stack([torch.cat(chosen) for chosen in self._seen])

    def forwards(self) -> list[torch.Tensor]:
        """Each recorded forward's routes apart, ``[layers, tokens, top_k]``, in call order (a
        generation: the prompt's forward, then one per new token)."""
        return [torch.stack(chosen) for chosen in zip(*self._seen, strict=True)]


def check_routes(
    routes: torch.Tensor, *, num_experts: int, what: str = "routes", distinct: bool = True
) -> None:
    """Refuse routes (``[..., top_k]``: each token's experts, for each MoE layer) that do not
    hold integer ids, name an expert outside ``0..num_experts - 1``, or (``distinct``) name one
    expert twice for a token and layer. Their shape against the model is the caller's to check
    (layouts differ: ``[layers, tokens, top_k]`` for :class:`RouteReplay`, ``[tokens, layers,
    top_k]`` in a batch). Padding positions may hold repeated ids: check ``distinct`` on real
    tokens only."""
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise BatchError(f"{what} must hold integer expert ids; got {routes.dtype}.")
    if not routes.numel():
        return
    lo, hi = int(routes.min()), int(routes.max())
    if lo < 0 or hi >= num_experts:
        raise BatchError(f"{what} name experts outside 0..{num_experts - 1}: min {lo}, max {hi}.")
    ordered = routes.sort(-1).values
    if distinct and bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise BatchError(
            f"{what} name an expert twice for one token and layer; each token goes to "
            f"top_k={routes.shape[-1]} distinct experts."
        )


class RouteReplay(_RouterHooks):
    """Inside ``with RouteReplay(model, routes):`` the model's routers take the experts
    ``routes`` names (``[layers, tokens, top_k]``) instead of their own, the forwards of the
    block over consecutive slices of ``tokens``. Each router still computes its logits from the
    live weights; the weights of the given experts follow from them (:func:`replayed_weights`),
    so the router's gradient flows. A routes tensor whose layers, top-k or expert ids do not fit
    the model is refused when the replay is made; one with fewer token rows than a forward
    needs, when that forward reaches the first router (before any output)."""

    def __init__(self, model: nn.Module, routes: torch.Tensor) -> None:
        super().__init__(model, "replay into")
        if routes.dim() != 3 or routes.shape[0] != len(self._routers):
            raise ValueError(
                f"routes must be [layers={len(self._routers)}, tokens, top_k], one row of "
                f"experts per token and MoE layer of this model; got {tuple(routes.shape)}."
            )
        experts = []
        for module in self._routers:
            router: Any = module  # transformers' routers carry top_k and num_experts
            k = int(router.top_k)
            if routes.shape[2] != k:
                raise ValueError(
                    f"routes name {routes.shape[2]} experts per token; the model's routers "
                    f"take top_k={k}."
                )
            experts.append(int(router.num_experts))
        # the rows of padding positions may repeat an id: only ids and range are checked here
        check_routes(routes, num_experts=min(experts, default=0), distinct=False)
        self.routes = routes
        self._offset = [0] * len(self._routers)

    def __enter__(self) -> RouteReplay:
        self._attach()
        return self

    def _hook(self, layer: int) -> Any:
        def replace(module: nn.Module, args: Any, output: Any) -> Any:
            if _recomputing():  # given the experts of its forward already (checkpoint_contexts)
                return None
            logits = output[0]
            start = self._offset[layer]
            stop = start + logits.shape[0]
            if stop > self.routes.shape[1]:
                raise ValueError(
                    f"routes hold {self.routes.shape[1]} tokens; MoE layer {layer} has now seen "
                    f"{stop} (this forward: {logits.shape[0]}). Give one route row per token "
                    f"of the input."
                )
            experts = self.routes[layer, start:stop].to(logits.device, torch.int64)
            self._offset[layer] = stop
            saving = getattr(_checkpoint, "saving", None)
            if saving is not None:  # inside a checkpointed block: for its recomputation
                saving[module] = experts
            return logits, replayed_weights(module, logits, experts), experts

        return replace

    def check_consumed(self) -> None:
        """Refuse a replay that left route rows unused (the input had fewer tokens)."""
        if any(o != self.routes.shape[1] for o in self._offset):
            raise ValueError(
                f"routes hold {self.routes.shape[1]} tokens; the forwards used {self._offset} "
                f"per MoE layer. Give one route row per token of the input."
            )


class RouterLogits(_RouterHooks):
    """Inside ``with RouterLogits(model) as rl:`` each router's logits (with their autograd
    graph) and the experts the forward used (after any replay entered before this block) are
    kept, per MoE layer, for the load-balancing loss (:func:`balance_terms`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, "balance")
        self.seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self._routers]
        self.num_experts = int(getattr(self._routers[0], "num_experts"))  # noqa: B009

    def __enter__(self) -> RouterLogits:
        self._attach()
        return self

    def _hook(self, layer: int) -> Any:
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            if not _recomputing():
                self.seen[layer].append((output[0], output[2]))

        return keep

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per MoE layer, ``(logits [tokens, experts], experts used [tokens, top_k])`` of every
        forward of the block, forwards one after another along ``tokens``."""
        return [
            (torch.cat([lg for lg, _ in seen]), torch.cat([ex for _, ex in seen]))
            for seen in self.seen
        ]


def balance_terms(
    layers: list[tuple[torch.Tensor, torch.Tensor]], sequence: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Each token's share of a sequence-level load-balancing loss, ``[tokens]`` (0 where
    ``sequence`` is -1: padding).

    Per MoE layer and sequence ``s``: ``E * sum_e f[s, e] * P[s, e]``, where ``f[s, e]`` is the
    number of ``s``'s tokens routed to expert ``e`` over its token count (no gradient: a count)
    and ``P[s, e]`` the mean of the router's softmax probability of ``e`` over ``s``'s tokens
    (1.0 per top-k slot when perfectly balanced, ``top_k`` in all). A token's term is
    ``E * sum_e f[s, e] * p[t, e]`` averaged over the layers, so a sequence's mean over its
    tokens is the loss: whole sequences never span micro-batches or ranks, so the terms
    aggregated like a per-token loss give the same gradient however the batch is split."""
    real = sequence >= 0
    seq = sequence.clamp_min(0).to(torch.int64)
    count = int(seq.max()) + 1 if seq.numel() else 1
    tokens = torch.zeros(count, device=seq.device).index_add_(0, seq, real.float())
    total: torch.Tensor | None = None
    for logits, experts in layers:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        chosen = torch.zeros_like(probs).scatter_(1, experts.to(probs.device).long(), 1.0)
        chosen = chosen * real[:, None].to(probs.dtype)
        routed = torch.zeros(count, num_experts, device=probs.device).index_add_(0, seq, chosen)
        share = routed / tokens.clamp_min(1.0)[:, None]
        term = num_experts * (share[seq] * probs).sum(-1)
        total = term if total is None else total + term
    assert total is not None
    return (total / len(layers)) * real.to(total.dtype)


def balance_loss(
    terms: torch.Tensor, micro_batch: TensorDict, ctx: GlobalBatchContext
) -> torch.Tensor:
    """The load-balancing loss ``micro_batch``'s ``BatchMeta.moe_aux`` asks for, from balance
    terms ``[B, L]`` (:func:`balance_terms`, all layers or some): ``coef`` times the terms
    aggregated over its ``loss_mask`` as :class:`~engine_core.batch.MoeAuxLoss` says (with the
    terms' gradient). No host sync: a pipeline stage takes it per router, in the forward."""
    spec: MoeAuxLoss | None = get_meta(micro_batch).moe_aux
    if spec is None:
        raise ValueError("balance_loss: the micro-batch's BatchMeta.moe_aux is unset.")
    mask = micro_batch[LOSS_MASK].to(terms.device)
    loss = aggregate_loss(terms, mask, spec.aggregation, ctx, norm_length=spec.norm_length)
    return spec.coef * loss


def balance_metric(terms: torch.Tensor, micro_batch: TensorDict, ctx: GlobalBatchContext) -> Metric:
    """The metric ``moe_aux_loss``: the micro-batch's balance terms ``[B, L]`` (every layer's)
    as a token mean over the global batch's ``loss_mask``."""
    return token_mean_metric(terms, micro_batch[LOSS_MASK].to(terms.device), ctx)


def route_mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of (layer, token) routing decisions in which ``a`` and ``b`` (both
    ``[layers, tokens, top_k]``) chose a different set of experts."""
    if a.shape != b.shape:
        raise ValueError(f"routes of different shapes: {tuple(a.shape)} and {tuple(b.shape)}.")
    if a.numel() == 0:
        return 0.0
    differ = (a.sort(-1).values != b.sort(-1).values).any(-1)
    return float(differ.float().mean())


def expert_load_spread(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per MoE layer, the busiest expert's token count over the mean count per expert, from
    ``routes`` ``[tokens, layers, top_k]``: 1.0 when every expert takes the same number of
    tokens, ``num_experts / top_k`` at worst (every token to the same experts)."""
    tokens, layers, top_k = routes.shape
    if tokens == 0:
        return torch.ones(layers)
    offsets = torch.arange(layers)[None, :, None] * num_experts
    counts = torch.bincount((routes.long() + offsets).reshape(-1), minlength=layers * num_experts)
    per_layer = counts.reshape(layers, num_experts).float()
    return per_layer.max(-1).values / (tokens * top_k / num_experts)


def num_experts_of(hf_config: Any) -> int | None:
    """The number of routed experts of a transformers config (None for a dense model)."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return None


@contextmanager
def replaying(model: nn.Module, routes: torch.Tensor) -> Iterator[RouteReplay]:
    """:class:`RouteReplay` that also refuses unused route rows when the block ends."""
    with RouteReplay(model, routes) as replay:
        yield replay
    replay.check_consumed()
