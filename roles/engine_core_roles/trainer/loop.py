"""``RLTrainer``: the RL loop (any registered algorithm) over the roles, a rollout and a reward function.

One :meth:`RLTrainer.step` reads as the algorithm: generate → score → old log-probs (the
routes with them) → reference log-probs → values → advantages → critic update → actor update →
sync, then one row of metrics. What varies is a part picked once, when the trainer is built,
never an ``if`` in the step:

- generation: :class:`~engine_core_roles.trainer.generation.Synchronous`, or
  :class:`~engine_core_roles.trainer.generation.Asynchronous` with ``max_staleness >= 1``
  (step ``t + 1`` generates while step ``t`` trains, one weight version old);
- scoring: :class:`~engine_core_roles.trainer.scoring.ScoreAsDrawn`, or dynamic sampling
  (:class:`~engine_core_roles.trainer.dynamic_sampling.FilteredGroups`);
- old log-probs: a forward before the update, or the update's own
  (:mod:`engine_core_roles.trainer.guards`), with the log-prob gap guard on either;
- routes of a mixture of experts: each forward's own, the rollout's replayed, or the old-log-prob
  pass's replayed in the update (:mod:`engine_core_roles.trainer.routing`), read by the
  old-log-prob stage;
- the reference's log-probs, the critic's values and its update: the role's call, or nothing
  where the run has no such role (:mod:`engine_core_roles.trainer.auxiliary`);
- advantages: the estimator of ``config.algorithm``
  (:mod:`engine_core_roles.trainer.estimators`: group-normalized scores, or GAE over the
  critic's values, with the returns it is then trained on);
- sync: the update's weights reach the rollout at the step's end, or (asynchronous) before the
  next generation starts.

:meth:`RLTrainer.fit` repeats the step and hands every row to the callbacks (logging,
checkpoints). ``engine-core run`` (:mod:`engine_core_roles.jobs.rl`) is this trainer plus config
files, checkpoints and plots; a script builds the same object from its own roles, rollout,
prompts and reward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from engine_core import ATTENTION_MASK, BaseRollout, EngineCoreError, SamplingParams
from engine_core.capabilities import Capability
from engine_core.rollout import RESPONSE_MASK
from engine_core_roles.data.rewards.functions import RewardFn, Rewards, SampleReward
from engine_core_roles.distributed.weights import WeightLink
from engine_core_roles.episodes.metrics import episode_metrics
from engine_core_roles.models.actor import ActorUpdate
from engine_core_roles.trainer.auxiliary import critic_stage, reference_stage
from engine_core_roles.trainer.config import TrainerConfig
from engine_core_roles.trainer.dynamic_sampling import FilteredGroups
from engine_core_roles.trainer.estimators import Advantages
from engine_core_roles.trainer.generation import (
    Asynchronous,
    Drawn,
    Generation,
    PromptReader,
    Synchronous,
    as_prompts,
)
from engine_core_roles.trainer.guards import (
    Gap,
    GapGuard,
    check_skipped,
    old_log_probs_stage,
    per_replica,
    sampled_mask,
)
from engine_core_roles.trainer.protocols import (
    PolicyRole,
    PromptBatch,
    PromptSource,
    ReferenceRole,
    RewardRole,
    ValueRole,
)
from engine_core_roles.trainer.routing import routing_for
from engine_core_roles.trainer.scoring import ScoreAsDrawn, Scorer, group_spread
from engine_core_roles.trainer.state import batch_of, plain
from engine_core_roles.trainer.steps import run_steps

__all__ = ["StepCallback", "RLTrainer"]

_log = logging.getLogger(__name__)


StepCallback = Callable[["RLTrainer", dict[str, Any]], None]
"""Called by :meth:`RLTrainer.fit` after every step with the trainer and that step's row."""


def _check_algorithm(config: TrainerConfig, actor: PolicyRole) -> None:
    """The actor computes the policy loss of the algorithm it was built with: this trainer's."""
    if actor.algorithm == config.algorithm:
        return
    raise ValueError(
        f"the trainer runs trainer.algorithm {config.algorithm.name!r} "
        f"({config.algorithm.model_dump(exclude_defaults=True)}), but the actor was built with "
        f"{actor.algorithm.name!r} ({actor.algorithm.model_dump(exclude_defaults=True)}); build "
        f"it as Actor(actor_config, engine, algorithm=trainer_config.algorithm)."
    )


class RLTrainer:
    """An RL algorithm (GRPO, PPO, RLOO, GSPO, ...: any registered one, ``config.algorithm``) on
    an :class:`Actor` (plus optional :class:`Reference` and :class:`Critic`).

    ``rollout`` generates with the actor's weights, synced and verified before the first step and
    after every update. ``reward_fn`` scores each sample (see :class:`RewardFn`), and/or
    ``reward_model`` (a :class:`engine_core_roles.RewardModel` on the actor's vocabulary) does: a sample's
    reward is the first plus ``config.reward_model_weight`` times the second; ``prompts``
    gives each step's prompts (see :data:`PromptSource`). A ``reference`` is required when the
    actor uses a KL loss; a ``critic`` exactly when the advantage estimator of
    ``config.algorithm`` needs one (``gae``: ``algorithm="ppo"``).
    ``global_step`` is the number of steps already taken (set it when resuming a checkpoint).
    ``num_experts``, for a mixture of
    experts under routing replay, turns on the expert-load metrics (``moe/load_spread*``).

    >>> trainer = RLTrainer(TrainerConfig(), actor=actor, rollout=rollout,
    ...                     reward_fn=my_reward, prompts=my_prompts)  # doctest: +SKIP
    >>> history = trainer.fit(100, callbacks=[lambda t, row: print(row["reward"])])  # doctest: +SKIP
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        actor: PolicyRole,
        rollout: BaseRollout,
        reward_fn: RewardFn | SampleReward | None = None,
        prompts: PromptSource,
        reference: ReferenceRole | None = None,
        critic: ValueRole | None = None,
        reward_model: RewardRole | None = None,
        global_step: int = 0,
        weights: WeightLink | None = None,
        num_experts: int | None = None,
    ) -> None:
        if reward_fn is None and reward_model is None:
            raise ValueError(
                "nothing scores the samples: pass reward_fn= (a callable scoring each sample), "
                "reward_model= (a RewardModel), or both."
            )
        # the algorithm's parts, found and checked against what it needs (a critic, groups)
        advantages = Advantages(config, critic, has_reference=reference is not None)
        _check_algorithm(config, actor)
        if config.algorithm.kl_in_reward is not None and reference is None:
            raise ValueError(
                "trainer.algorithm.kl_in_reward puts the KL to a reference in the reward, which "
                "needs reference log-probs; pass reference=Reference(engine) (a frozen copy of "
                "the initial policy)."
            )
        if actor.config.use_kl_loss and reference is None:
            raise ValueError(
                "the actor has use_kl_loss=True, which needs reference log-probs; pass "
                "reference=Reference(engine) (a frozen copy of the initial policy)."
            )
        asynchronous = Capability.ASYNC_GENERATION in rollout.capabilities
        if config.max_staleness and not asynchronous:
            raise ValueError(
                f"max_staleness={config.max_staleness} overlaps generation with training, which "
                f"needs a rollout that declares async_generation (one that generates in other "
                f"processes); {type(rollout).__name__} does not. Use a ProcessRollout (an "
                f"AgentRollout over one; engine-core run: rollout_placement=process), or "
                f"max_staleness=0."
            )
        self.config = config
        self.actor = actor
        self.rollout = rollout
        self.reward_fn = reward_fn
        self.reward_model = reward_model
        self.reference = reference
        self.critic = critic
        self.global_step = global_step
        self._skipped_in_a_row = 0
        self._reward_failures_in_a_row = 0
        # the actor's weight version the rollout holds (None: not synced since this object,
        # or a resume, started)
        self._rollout_version: int | None = None
        if weights is not None and (weights.policy is not actor or weights.rollout is not rollout):
            raise ValueError(
                "weights= must be the WeightLink of this trainer's actor and rollout; build it "
                "as WeightLink(actor, rollout), or leave weights= out and the trainer builds it."
            )
        # the one weight path from the actor to the rollout: given, or built (and owned) here
        self._owns_weights = weights is None
        self._weights: WeightLink | None = weights or WeightLink(actor, rollout)
        self._last_sync: dict[str, float] = {}
        # the step's parts, each picked once here
        params = config.sampling_params
        reader = PromptReader(
            prompts,
            max_positions=lambda: actor.max_position_embeddings,
            max_new_tokens=config.max_new_tokens,
        )
        self._generation: Generation
        # when an update's weights reach the rollout
        self._push_update: Callable[[], None]
        if asynchronous and config.max_staleness:
            self._generation = Asynchronous(
                rollout,
                reader,
                params,
                self._synced_version,
                before_next=self._sync_if_stale,
            )
            self._push_update = _later  # before the next generation starts (before_next)
        else:
            self._generation = Synchronous(rollout, reader, params, self._synced_version)
            self._push_update = self.sync_weights  # now: the next step generates with them
        self._scorer = Scorer(reward_fn, reward_model, config.reward_model_weight)
        self._scoring = (
            FilteredGroups(
                self._scorer,
                self._generation,
                params,
                samples_per_prompt=config.samples_per_prompt,
                max_extra_draws=config.max_extra_draws,
            )
            if config.filter_groups and isinstance(self._generation, Synchronous)
            else ScoreAsDrawn(self._scorer, params)
        )
        routing = routing_for(config, actor, rollout, num_experts)
        self._old_log_probs = old_log_probs_stage(actor, GapGuard(config), routing)
        self._reference = reference_stage(reference)
        self._critic = critic_stage(critic, trained=advantages.trains_critic)
        self._advantages = advantages

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> dict[str, Any]:
        """One RL step; returns its metrics row (``step``, ``reward``, ``actor/*``, ...)."""
        if self._rollout_version is None:
            self.sync_weights()
        step, t0 = self.global_step + 1, time.perf_counter()
        drawn = self._generation.draw(step)
        staleness = self._staleness(step, drawn)
        drawn, batch, scoring, figures = self._scoring(step, drawn)
        old_pass = self._old_log_probs(step, staleness, drawn.samples, batch)  # routes inside
        self._reference(batch)
        rewards = scoring()
        if rewards.failures:
            return self._unscored_step(step, t0, rewards, drawn.samples, batch)
        self._reward_failures_in_a_row = 0
        values = self._critic.values(batch)
        advantage_metrics = self._advantages(batch, rewards.scores, values)
        critic_metrics = self._critic.update(batch)
        update = self.actor.update_actor(self._old_log_probs.update_batch(batch))
        gap, routing = old_pass(update)
        self._count_skipped(step, update, batch)
        self._sync(step)
        row = self._row(step, drawn, staleness, rewards, figures, gap, update.metrics)
        return {
            **row,
            **routing,
            **advantage_metrics,
            **critic_metrics,
            **self._timing(t0, batch),
            **_shown(rewards),
        }

    def _staleness(self, step: int, drawn: Drawn) -> int:
        """How many updates old the step's samples are: never more than ``max_staleness``."""
        staleness = self.global_step - drawn.version
        if staleness > self.config.max_staleness:  # a broken invariant, never a user error
            raise EngineCoreError(
                f"step {step}: samples generated by weight version {drawn.version} are "
                f"{staleness} versions old, more than max_staleness={self.config.max_staleness}."
            )
        return staleness

    def _sync(self, step: int) -> None:
        """The step is spent: the actor's weights are version ``step``; a synchronous run syncs
        them now, an asynchronous one before its next generation starts."""
        self.global_step = step
        self._push_update()

    def _row(
        self,
        step: int,
        drawn: Drawn,
        staleness: int,
        rewards: Rewards,
        figures: dict[str, float],
        gap: Gap,
        update: dict[str, float],
    ) -> dict[str, Any]:
        gen, (per_column, mismatch) = drawn.samples, gap
        if not mismatch.numel():  # no sampled token this step (every agent failed first): none
            mismatch = torch.zeros(1)
        return {
            "step": step,
            "reward": float(rewards.scores.mean()),
            **rewards.metrics,
            **group_spread(rewards.scores, self.config.samples_per_prompt),
            **figures,
            "response_length": float(gen[RESPONSE_MASK].bool().sum(-1).float().mean()),
            "rollout/logprob_diff_max": float(mismatch.max()),
            "rollout/logprob_diff_mean": float(mismatch.mean()),
            **self._generation.version_metrics(drawn, staleness),
            **per_replica(gen, per_column, sampled_mask(gen)),
            **episode_metrics(gen),
            **self._last_sync,
            **update,
        }

    def _timing(self, t0: float, batch: TensorDict) -> dict[str, float]:
        dt = time.perf_counter() - t0
        return {"time_s": dt, "tokens_per_s": float(batch[ATTENTION_MASK].sum()) / dt}

    def _unscored_step(
        self, step: int, t0: float, rewards: Rewards, gen: TensorDict, batch: TensorDict
    ) -> dict[str, Any]:
        """A step whose samples could not all be scored: not trained on, counted, logged; the
        run stops when ``max_consecutive_skipped_updates`` steps in a row end so."""
        self._reward_failures_in_a_row += 1
        failures = rewards.failures
        _log.warning(
            "step %d is not trained on: %d sample(s) could not be scored; first: %s",
            step,
            len(failures),
            failures[0],
        )
        limit = self.config.max_consecutive_skipped_updates
        if limit and self._reward_failures_in_a_row >= limit:
            raise EngineCoreError(
                f"step {step}: {self._reward_failures_in_a_row} steps in a row were not trained "
                f"on because samples could not be scored; the last: {failures[0]}. Stopping "
                f"before the run goes on without learning; checkpoints already saved are kept. "
                f"Fix the reward function, or raise max_consecutive_skipped_updates."
            )
        self._sync(step)  # the step's prompts are spent; the weights did not change
        finite = rewards.scores[torch.isfinite(rewards.scores)]
        return {
            "step": step,
            "reward": float(finite.mean()) if finite.numel() else float("nan"),
            "reward/failed_samples": float(len(failures)),
            "response_length": float(gen[RESPONSE_MASK].sum(-1).float().mean()),
            "actor/num_optimizer_steps": 0.0,
            **self._timing(t0, batch),
            **_shown(rewards),
        }

    def _count_skipped(self, step: int, update: ActorUpdate, batch: TensorDict) -> None:
        if update.metrics.get("actor/num_optimizer_steps", 1.0) > 0:
            self._skipped_in_a_row = 0
            return
        self._skipped_in_a_row += 1
        check_skipped(
            step, self._skipped_in_a_row, self.config.max_consecutive_skipped_updates, batch
        )

    # -- weights ---------------------------------------------------------------------------

    def sync_weights(self) -> None:
        """Push the actor's weights into the rollout (names, shapes and checksums verified).

        :meth:`step` calls it before its first generation and after every update; call it again
        after changing the actor's weights yourself (e.g. loading a checkpoint).
        """
        self._generation.settle()  # never swap weights under a generation in flight
        if self._weights is None:
            raise EngineCoreError("this trainer was closed; build a new one to sync weights.")
        self._last_sync = self._weights.sync()
        self._rollout_version = self.global_step

    def _sync_if_stale(self) -> None:
        if self._rollout_version != self.global_step:
            self.sync_weights()

    def _synced_version(self) -> int:
        assert self._rollout_version is not None  # step() syncs before any generation
        return self._rollout_version

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> TensorDict:
        """Samples of ``prompts`` with the weights of the latest update (for evaluation); in
        asynchronous mode after the generation in flight, which stays the next step's."""
        self._generation.settle(quiet=True)
        self._sync_if_stale()
        return self._generation.generate(as_prompts(prompts), params)

    # -- the run ---------------------------------------------------------------------------

    def fit(
        self,
        max_steps: int,
        *,
        callbacks: Sequence[StepCallback] = (),
        should_stop: Callable[[], object] | None = None,
    ) -> list[dict[str, Any]]:
        """Step until ``global_step`` reaches ``max_steps``; returns the rows of the steps run.

        Each callback gets ``(trainer, row)`` after every step, in order: log, plot, save a
        checkpoint there. A trainer resumed at step ``k`` runs steps ``k+1 .. max_steps``.
        ``should_stop``, asked after each step's callbacks, ends the loop early when it returns
        something true (a stop request: the caller checkpoints).
        """
        return run_steps(self, max_steps, callbacks, should_stop)

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs beyond the engines' checkpoints, as plain data: the step, the
        count of skipped updates in a row and, in asynchronous mode, the generation in flight
        (waited for: its prompts, samples and weight version)."""
        drawn = self._generation.in_flight()
        pending = None
        if drawn is not None:
            pending = {
                "prompts": plain(drawn.prompts),
                "samples": plain(drawn.samples),
                "version": drawn.version,
            }
        return {
            "global_step": self.global_step,
            "skipped_in_a_row": self._skipped_in_a_row,
            "unscored_in_a_row": self._reward_failures_in_a_row,
            "pending": pending,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (after the engines' checkpoints were loaded)."""
        self.global_step = int(state["global_step"])
        self._skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
        self._reward_failures_in_a_row = int(state.get("unscored_in_a_row", 0))
        self._rollout_version = None
        pending = state.get("pending")
        if pending is not None:
            self._generation.restore(
                Drawn(
                    batch_of(pending["prompts"]),
                    batch_of(pending["samples"]),
                    int(pending["version"]),
                )
            )

    def close(self) -> None:
        """Wait for a generation in flight (asynchronous mode) and close the weight link the
        trainer built; safe to call twice."""
        self._generation.close()
        if self._weights is not None and self._owns_weights:
            self._weights.close()
            self._weights = None
        self._scorer.close()


def _later() -> None:
    """An asynchronous run's update sync: none at the step's end (the generation part syncs
    before it starts the next generation)."""


def _shown(rewards: Rewards) -> dict[str, Any]:
    """A few decoded samples for people to read, where the reward gave any."""
    return {"samples": rewards.samples} if rewards.samples else {}
