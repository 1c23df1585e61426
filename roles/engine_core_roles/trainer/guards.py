"""The trainer's guards, and the stage that gives a step its old log-probs.

- :class:`GapGuard`: the rollout and the trainer compute one distribution, so the mean gap
  between their log-probs of the sampled tokens is float noise; over a limit in the first steps
  of samples drawn with the trainer's current weights, the run stops (:class:`LogProbGapError`).
- :class:`SeparateForward` and :class:`FromUpdate`: where a step's old log-probs come from, chosen
  once by the actor's config — a forward before the update, or (on-policy, one optimizer step)
  the update's own forward; the gap guard runs on them either way, and the routing part reads
  that pass's routes once.
- :func:`check_skipped`: a run of steps in a row that applied no update stops the run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDict

from engine_core import EngineCoreError, with_meta
from engine_core.batch import ROUTED_EXPERTS
from engine_core.rollout import (
    PROMPT_IDS,
    RESPONSE_LOSS_MASK,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ROLLOUT_REPLICA,
)
from engine_core_roles.algorithms.updates import non_finite_inputs
from engine_core_roles.batch.keys import OLD_LOG_PROBS, TRAINER_ROUTES
from engine_core_roles.models.actor import ActorUpdate
from engine_core_roles.trainer.config import TrainerConfig
from engine_core_roles.trainer.protocols import PolicyRole
from engine_core_roles.trainer.routing import OwnRoutes

__all__ = [
    "FromUpdate",
    "Gap",
    "GapGuard",
    "LogProbGapError",
    "OldLogProbs",
    "OldPass",
    "SeparateForward",
    "check_skipped",
    "old_log_probs_stage",
    "per_replica",
    "sampled_mask",
]


class LogProbGapError(EngineCoreError):
    """The rollout's log-probs of its samples are not the trainer's (the gap guard)."""


Gap = tuple[torch.Tensor, torch.Tensor]
"""|trainer - rollout| log-prob per response column ``[B, R]``, and its values on the sampled
response tokens."""


class GapGuard:
    """Checks the first ``logprob_gap_steps`` steps a trainer runs (from its start or a resume)."""

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self._steps_run = 0

    def __call__(self, step: int, staleness: int, gen: TensorDict, batch: TensorDict) -> Gap:
        trainer_lp = batch[OLD_LOG_PROBS][:, gen[PROMPT_IDS].shape[1] :]
        gap = (trainer_lp - gen[ROLLOUT_LOG_PROBS]).abs()
        values = gap[sampled_mask(gen)]
        self._steps_run += 1
        limit = self.config.logprob_gap_limit
        if limit is None or staleness or self._steps_run > self.config.logprob_gap_steps:
            return gap, values
        mean = float(values.mean()) if values.numel() else 0.0
        if not mean <= limit:  # NaN too
            raise LogProbGapError(
                f"step {step}: the rollout and the trainer disagree on the sampled tokens' "
                f"log-probs: mean gap {mean:.3g} (largest {float(values.max()):.3g}) over the "
                f"response tokens, above logprob_gap_limit={limit:g}, where the two compute one "
                f"distribution and differ by float noise. Likely causes: the rollout samples at "
                f"another temperature than trainer temperature={self.config.temperature:g}, its "
                f"tokenizer or chat template is not the actor's, or the weights it generates "
                f"with are not the actor's. Stopped before going on; checkpoints already saved "
                f"are kept. If such a gap is expected (a bf16 rollout against an fp32 trainer), "
                f"raise logprob_gap_limit (engine-core run: trainer.logprob_gap_limit), or set "
                f"it to null."
            )
        return gap, values


OldPass = Callable[[ActorUpdate], tuple[Gap, dict[str, float]]]
"""A step's old-log-prob pass, begun: called with the actor's update, it gives the step's gap
and routing metrics (computed before the update by a separate forward, from the update's own
forward otherwise)."""


class OldLogProbs:
    """Where a step's old log-probs come from, with the step's routing bookkeeping
    (:mod:`engine_core_roles.trainer.routing`, read once each step): calling the stage begins
    the pass before the update and returns it as an :data:`OldPass`. Where ``routing`` records
    them (a mixture of experts under ``routing_replay``) the pass's forward also puts the experts
    its own routers chose in the batch (:data:`TRAINER_ROUTES`), for ``routing`` to take."""

    def __init__(self, actor: PolicyRole, guard: GapGuard, routing: OwnRoutes) -> None:
        self.actor, self.guard, self.routing = actor, guard, routing

    def update_batch(self, batch: TensorDict) -> TensorDict:
        """What the update takes: ``batch`` (asking for routes where the update's forward is
        the old-log-prob pass)."""
        return batch

    def __call__(self, step: int, staleness: int, gen: TensorDict, batch: TensorDict) -> OldPass:
        raise NotImplementedError


class SeparateForward(OldLogProbs):
    """A forward of the actor before the update; the gap is checked before the update."""

    def __call__(self, step: int, staleness: int, gen: TensorDict, batch: TensorDict) -> OldPass:
        sampled = self.routing.sampled(batch)
        records = self.routing.records
        asked = with_meta(batch, return_routes=True) if records else batch
        out = self.actor.compute_log_prob(asked)
        batch[OLD_LOG_PROBS] = out[OLD_LOG_PROBS]
        if records:
            batch[TRAINER_ROUTES] = out[ROUTED_EXPERTS]
        gap = self.guard(step, staleness, gen, batch)
        # before the reference's forward, which replays the routes this leaves in the batch
        routes = self.routing.after_old_pass(batch, sampled)
        return lambda update: (gap, routes)


class FromUpdate(OldLogProbs):
    """On-policy with one optimizer step: the update's own forward gives the old log-probs
    (one forward fewer), returned with the update for the same checks."""

    def __call__(self, step: int, staleness: int, gen: TensorDict, batch: TensorDict) -> OldPass:
        sampled = self.routing.sampled(batch)  # before the update, which may not see them

        def after(update: ActorUpdate) -> tuple[Gap, dict[str, float]]:
            assert update.old_log_probs is not None  # old_log_probs_from_update
            batch[OLD_LOG_PROBS] = update.old_log_probs
            if self.routing.records:
                assert update.routes is not None  # asked for in update_batch
                batch[TRAINER_ROUTES] = update.routes
            gap = self.guard(step, staleness, gen, batch)
            return gap, self.routing.after_old_pass(batch, sampled)

        return after

    def update_batch(self, batch: TensorDict) -> TensorDict:
        return with_meta(batch, return_routes=True) if self.routing.records else batch


def old_log_probs_stage(actor: PolicyRole, guard: GapGuard, routing: OwnRoutes) -> OldLogProbs:
    """The actor's config decides: ``old_log_probs_from_update`` or a separate forward."""
    stage = FromUpdate if actor.config.old_log_probs_from_update else SeparateForward
    return stage(actor, guard, routing)


def check_skipped(step: int, in_a_row: int, limit: int, batch: TensorDict) -> None:
    """Stop when ``in_a_row`` steps applied no actor update (``limit`` 0: never)."""
    if limit and in_a_row >= limit:
        causes = non_finite_inputs(batch)
        raise EngineCoreError(
            f"step {step}: {in_a_row} steps in a row applied no actor update "
            f"(every optimizer step skipped: non-finite gradient norm; "
            f"{'non-finite values in ' + str(causes) if causes else 'no input field is non-finite'}"
            f"). Stopping before the run goes on without learning; checkpoints already "
            f"saved are kept. Check the reward function and the learning rate, or raise "
            f"max_consecutive_skipped_updates."
        )


def sampled_mask(gen: TensorDict) -> torch.Tensor:
    """The response tokens the rollout sampled (in an episode, not the environment's)."""
    key = RESPONSE_LOSS_MASK if RESPONSE_LOSS_MASK in gen.keys() else RESPONSE_MASK
    return gen[key].bool()


def per_replica(gen: TensorDict, gap: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """With several rollout replicas: each one's largest rollout-vs-trainer log-prob gap."""
    if ROLLOUT_REPLICA not in gen.keys():
        return {}
    replica = gen[ROLLOUT_REPLICA]
    ids = sorted({int(i) for i in replica.tolist()})
    if len(ids) < 2:
        return {}
    out = {}
    for i in ids:
        rows = replica == i
        out[f"rollout/replica{i}/logprob_diff_max"] = float(gap[rows][mask[rows]].max())
    return out
