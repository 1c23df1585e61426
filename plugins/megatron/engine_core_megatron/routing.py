"""Routing replay, the routers' own choice and their logits, on megatron-core's ``TopKRouter``.

megatron-core's router returns, for the ``tokens`` rows it sees (its input ``[s, b, hidden]``
flattened sequence-major; under sequence parallelism only this TP rank's slice of ``s``),
``(probs, routing_map)``: each token's routing weights scattered over every expert
``[tokens, experts]`` and the boolean map of its chosen experts. A forward hook on each router
of this rank's model chunks (:class:`RouterHooks`) reads the experts it chose from the map and,
for a replay, computes the router's logits again from its input and live weight and returns
the weights of the given experts from them, the way megatron-core computes them for its own
choice (a softmax over every expert gathered at the chosen ones with
``moe_router_pre_softmax``, else a softmax over the chosen logits): the router keeps its
gradient, and replaying the router's own choice changes nothing.

The load-balancing loss (``BatchMeta.moe_aux``) is taken per router, in its own forward: the
hook computes the layer's share of the loss from the router's logits (with their graph) and the
experts used, and attaches it to the router's output with megatron-core's
``MoEAuxLossAutoScaler``, whose backward adds the loss's gradient when the output's gradient
arrives. So each pipeline stage backpropagates the loss of its own routers, with no logits
crossing stages.

Under megatron-core's full recompute (``model.gradient_checkpointing``), each checkpointed
layer runs its forward again in the backward, where its graph is built. A replayed router then
takes again the experts its first forward took, and a balanced one attaches its loss again
(both kept in order per router: every schedule here runs a router's backwards in the order of
its forwards), with logits computed again from the live weight, so the router's gradient is
that of the forward it recomputes; the routers' own choice and the balance terms returned are
read in the first forward only.

Its own ``moe_enable_routing_replay`` is not used: it keeps its routers in one process-wide
list (every model of the process, the reference's too), and a router either records or
replays, while the engine returns the routers' own choice while it replays another.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Balance", "RouterHooks", "RoutingStep"]

#: one router's share of the balance loss: ``(layer, logits [tokens, experts] with their graph,
#: experts used [tokens, top_k]) -> loss`` (a scalar with gradient)
Balance = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RoutingStep:
    """What one micro-batch's forward asks of the routers on this rank, and what they left.

    ``routes``: per global MoE layer the experts to replay for the tokens this rank's routers
    see, ``{layer: [tokens, top_k]}`` (-1 for a token without a route: padding).
    ``recorded``: the routers' own choice, ``{layer: [tokens, top_k]}`` (experts ascending).
    ``balance``: the balance loss of one router (:data:`Balance`), attached to its output.
    ``terms``: what ``balance`` leaves, each layer's balance terms ``[b, L]``, detached."""

    routes: dict[int, torch.Tensor] | None = None
    record: bool = False
    balance: Balance | None = None
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)
    terms: dict[int, torch.Tensor] = field(default_factory=dict)


class RouterHooks:
    """A forward hook on every router of ``chunks`` (DDP-wrapped ``GPTModel`` chunks); it acts
    on the :class:`RoutingStep` set in :attr:`step` and lets the router be otherwise."""

    def __init__(self, chunks: list[torch.nn.Module], *, top_k: int, pre_softmax: bool) -> None:
        self.top_k = top_k
        self.pre_softmax = pre_softmax
        self.step: RoutingStep | None = None
        self.layers: list[int] = []  # global MoE layer index of each hooked router
        # with recompute: per layer, the experts each replayed forward used and the balance
        # loss it attached, until its backward
        self.recomputed = False
        self._again_of: dict[int, deque[tuple[torch.Tensor | None, Balance | None]]] = {}
        for chunk in chunks:
            for layer in chunk.module.decoder.layers:
                global_layer = int(layer.layer_number) - 1
                layer.mlp.router.register_forward_hook(self._hook(global_layer))
                self.layers.append(global_layer)

    def start(self, recomputed: bool) -> None:
        """A new ``forward_backward_step``: ``recomputed``, whether its layers' forwards run
        again in its backward (training under full recompute)."""
        self.recomputed = recomputed
        self._again_of.clear()

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if torch._C._current_graph_task_id() != -1:  # a layer recomputed in the backward
                return self._again(module, args, output, layer)
            step = self.step
            if step is None:
                return None
            probs, routing_map = output
            own = self._chosen(routing_map)
            if step.record:
                step.recorded[layer] = own.detach().to("cpu", torch.int64)
            if step.routes is None and step.balance is None:
                return None
            logits = self._logits(module, args)
            used: torch.Tensor | None = None
            if step.routes is not None:
                given = step.routes[layer].to(logits.device, torch.int64)
                if given.shape[0] != logits.shape[0]:
                    raise ValueError(
                        f"routes hold {given.shape[0]} tokens for MoE layer {layer} on this "
                        f"rank; its router sees {logits.shape[0]}."
                    )
                # padding has no given route (-1): it goes where the router sends it, so that
                # replaying the router's own choice computes exactly what no replay does
                used = torch.where(given >= 0, given, own)
                output = self._replayed(logits, used)
            if step.balance is not None:
                output = _with_loss(
                    output, step.balance(layer, logits, own if used is None else used)
                )
            if self.recomputed:
                again = self._again_of.setdefault(layer, deque())
                again.append((None if used is None else used.detach(), step.balance))
            return output

        return hook

    def _again(self, module: torch.nn.Module, args: Any, output: Any, layer: int) -> Any:
        """A router's recomputation: a replayed one takes the experts its forward took, from
        live logits; a balanced one attaches its balance loss again, now with its graph."""
        queue = self._again_of.get(layer)
        if not queue:  # neither replayed nor balanced: the router chooses again as it chose
            return None
        used, balance = queue.popleft()
        logits = self._logits(module, args)
        if used is not None:
            used = used.to(logits.device)
            if used.shape[0] != logits.shape[0]:
                raise RuntimeError(
                    f"recomputing MoE layer {layer}: its forward replayed {used.shape[0]} "
                    f"tokens, the recomputation sees {logits.shape[0]}."
                )
            output = self._replayed(logits, used)
        if balance is not None:
            chosen = self._chosen(output[1]) if used is None else used
            output = _with_loss(output, balance(layer, logits, chosen))
        return output

    def _chosen(self, routing_map: torch.Tensor) -> torch.Tensor:
        """The experts a routing map marks, ``[tokens, top_k]`` (ascending expert ids)."""
        return routing_map.nonzero()[:, 1].view(-1, self.top_k)

    @staticmethod
    def _logits(module: torch.nn.Module, args: Any) -> torch.Tensor:
        """The router's logits for its input, ``[tokens, experts]``, from its live weight."""
        router: Any = module
        logits = router.gating(args[0])
        return logits.reshape(-1, logits.shape[-1])

    def _replayed(
        self, logits: torch.Tensor, experts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron-core's ``(probs, routing_map)`` for the given experts, from live logits."""
        if self.pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            weights = scores.gather(1, experts)
        else:
            weights = torch.softmax(logits.gather(1, experts), dim=-1, dtype=torch.float32)
            weights = weights.type_as(logits)
        probs = torch.zeros_like(logits).scatter(1, experts, weights)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True)
        return probs, routing_map


def _with_loss(output: tuple[torch.Tensor, torch.Tensor], loss: torch.Tensor) -> Any:
    """The router's ``(probs, routing_map)`` with ``loss`` attached to ``probs``: its gradient
    (times the schedule's loss scale) is added when ``probs``' gradient arrives."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    probs, routing_map = output
    return MoEAuxLossAutoScaler.apply(probs, loss), routing_map
