"""How a step's mixture-of-experts routes flow (``trainer.routing_replay``), picked once.

The rollout and the trainer route each token independently, so a share of (token, layer)
decisions differ between them; routing replay makes the trainer's forwards take given experts
(:mod:`engine_core.moe`, replayed by engines that declare ``routing_replay``):

- :class:`OwnRoutes` (``off``): each forward routes on its own;
- :class:`RolloutRoutes` (``rollout``): the rollout returns the experts it sampled with, the
  batch carries them, the old-log-prob pass and the update replay them;
- :class:`MeasuredRoutes` (``measure``): the rollout returns them, nothing is replayed;
- :class:`TrainerRoutes` (``trainer``): the old-log-prob pass routes on its own and the update
  replays that pass's routes (for a rollout that cannot return routes: every epoch and
  mini-batch of the update routes as the old policy did).

With the rollout's routes in hand, ``rollout/route_mismatch`` is the share of (token, layer)
decisions in which the trainer's own routers, at the old-log-prob pass, chose a different set
of experts than the rollout: what replay overrides (``rollout``), or what it would
(``measure``). Counted over every real token that is fed to the model to predict the next
(each row's last token predicts nothing scored).

With the trainer's own routes in hand (``rollout``, ``measure``, ``trainer``) and the number of
experts known, ``moe/load_spread/layer_<i>`` is each MoE layer's busiest expert's token count
over the mean count per expert at the old-log-prob pass (1.0 balanced; what the balance loss
pushes down), and ``moe/load_spread_max`` the largest over the layers.
"""

from __future__ import annotations

from typing import cast

import torch
from tensordict import TensorDict

from engine_core import ATTENTION_MASK, BaseRollout, CapabilityError, EngineCoreError
from engine_core.batch import ROUTED_EXPERTS
from engine_core.capabilities import Capability
from engine_core.moe import expert_load_spread, route_mismatch
from engine_core_roles.batch.keys import TRAINER_ROUTES
from engine_core_roles.trainer.config import TrainerConfig, check_routing_replay
from engine_core_roles.trainer.protocols import PolicyRole

__all__ = [
    "MeasuredRoutes",
    "OwnRoutes",
    "RolloutRoutes",
    "TrainerRoutes",
    "counted_tokens",
    "routing_for",
]


class OwnRoutes:
    """``off``: nothing recorded, nothing replayed."""

    #: whether the old-log-prob pass returns its routers' own choice (``TRAINER_ROUTES``)
    records = False

    def __init__(self, num_experts: int | None = None) -> None:
        self.num_experts = num_experts

    def _load(self, own: torch.Tensor, counted: torch.Tensor) -> dict[str, float]:
        """The expert-load spread of the trainer's own routes, per layer and at worst."""
        if not self.num_experts:
            return {}
        spread = expert_load_spread(own[counted], self.num_experts)
        out = {f"moe/load_spread/layer_{i}": float(s) for i, s in enumerate(spread)}
        out["moe/load_spread_max"] = float(spread.max())
        return out

    def sampled(self, batch: TensorDict) -> torch.Tensor | None:
        """The rollout's routes for the metric, read before the old-log-prob pass."""
        return None

    def after_old_pass(self, batch: TensorDict, sampled: torch.Tensor | None) -> dict[str, float]:
        """Once the old-log-prob pass put ``TRAINER_ROUTES`` in ``batch`` (before the update
        for a separate pass, after it when the update is that pass): take them out and use
        them; returns the step's routing metrics (empty before that)."""
        return {}


class RolloutRoutes(OwnRoutes):
    """``rollout``: the batch's ``routed_experts`` (the rollout's) are replayed throughout."""

    records = True

    def sampled(self, batch: TensorDict) -> torch.Tensor | None:
        if ROUTED_EXPERTS not in batch.keys():
            raise EngineCoreError(
                f"trainer.routing_replay={self._name} needs the rollout's {ROUTED_EXPERTS}, "
                f"and its samples came without them; a rollout that declares routing_replay "
                f"returns them when SamplingParams.return_routes is set."
            )
        return batch[ROUTED_EXPERTS]

    _name = "rollout"

    def after_old_pass(self, batch: TensorDict, sampled: torch.Tensor | None) -> dict[str, float]:
        if TRAINER_ROUTES not in batch.keys():
            return {}
        assert sampled is not None
        own = cast(torch.Tensor, batch.pop(TRAINER_ROUTES))
        counted = counted_tokens(batch[ATTENTION_MASK])
        mismatch = route_mismatch(own[counted], sampled[counted])
        return {"rollout/route_mismatch": mismatch, **self._load(own, counted)}


class MeasuredRoutes(RolloutRoutes):
    """``measure``: the rollout's routes are compared with the trainer's, never replayed."""

    _name = "measure"

    def sampled(self, batch: TensorDict) -> torch.Tensor | None:
        routes = super().sampled(batch)
        del batch[ROUTED_EXPERTS]  # the trainer routes on its own
        return routes


class TrainerRoutes(OwnRoutes):
    """``trainer``: the update replays the old-log-prob pass's own routes."""

    records = True

    def after_old_pass(self, batch: TensorDict, sampled: torch.Tensor | None) -> dict[str, float]:
        if TRAINER_ROUTES not in batch.keys():
            return {}
        own = cast(torch.Tensor, batch.pop(TRAINER_ROUTES))
        batch[ROUTED_EXPERTS] = own
        return self._load(own, counted_tokens(batch[ATTENTION_MASK]))


def counted_tokens(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` bool: the real tokens of each row but its last (which predicts nothing)."""
    real = attention_mask.bool()
    counted = real.clone()
    width = real.shape[1]
    last = width - 1 - real.flip(1).long().argmax(1)
    rows = torch.arange(real.shape[0])
    counted[rows, last] = False
    return counted & real


def routing_for(
    config: TrainerConfig,
    actor: PolicyRole,
    rollout: BaseRollout,
    num_experts: int | None = None,
) -> OwnRoutes:
    """The part for ``config.routing_replay``, after checking that the rollout and the actor can
    do it (before anything runs). ``num_experts`` (the model's routed experts, when known)
    turns on the expert-load metrics."""
    mode = config.routing_replay
    if mode == "off":
        return OwnRoutes()
    if mode in ("rollout", "measure") and Capability.ROUTING_REPLAY not in rollout.capabilities:
        raise CapabilityError(
            f"trainer.routing_replay={mode} needs a rollout that returns the experts it routed "
            f"each token to; {type(rollout).__name__} does not (it does not declare "
            f"routing_replay). Use the hf rollout, or routing_replay=trainer (the update replays "
            f"the old-log-prob pass's routes), or off."
        )
    engine = getattr(actor, "engine", None)  # in this process: its engine's capabilities
    if engine is not None and Capability.ROUTING_REPLAY not in engine.capabilities:
        raise CapabilityError(
            f"trainer.routing_replay={mode} needs an engine that replays and records routes; "
            f"{type(engine).__name__} does not declare routing_replay (fsdp, fsdp2, megatron and "
            f"reference do). Set routing_replay=off or choose such an engine."
        )
    check_routing_replay(mode, actor.config.old_log_probs_from_update)
    if mode == "trainer":
        return TrainerRoutes(num_experts)
    return RolloutRoutes(num_experts) if mode == "rollout" else MeasuredRoutes(num_experts)
