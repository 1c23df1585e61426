"""``RLTrainer``: the GRPO / PPO loop over the roles, a rollout and a reward function.

One :meth:`RLTrainer.step`: take the next prompts → generate ``samples_per_prompt`` responses
each → score them with the reward function → old (and reference) log-probs → advantages
(``grpo``: group-normalized scores; ``ppo``: whitened GAE over the critic's values, then a
critic update) → actor update → verified weight sync into the rollout → one row of metrics.
:meth:`RLTrainer.fit` repeats it and hands every row to the callbacks (logging, checkpoints).

With ``max_staleness >= 1`` the loop is asynchronous: while the actor trains on step ``t``'s
samples, the rollout already generates step ``t + 1``'s with the weights of before that update
(one version old): a non-blocking call to a rollout running in other processes
(:meth:`engine_core.remote_rollout.ProcessRollout.generate_async`), no thread here. Every
sample's weight version is known; a batch more than ``max_staleness`` versions old is never
trained on; the generation in flight is part of :meth:`RLTrainer.state_dict`, so a resumed run
trains on exactly the samples a straight one would.

``engine-core run`` (:mod:`engine_core_roles.rl_job`) is this trainer plus config files, checkpoints and
plots; a script builds the same object from its own roles, rollout, prompts and reward.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

import torch
from pydantic import Field, PositiveInt, model_validator
from tensordict import TensorDict

from engine_core import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOSS_MASK,
    BaseRollout,
    EngineCoreError,
    FrozenModel,
    SamplingParams,
    make_batch,
)
from engine_core.remote_rollout import ProcessRollout
from engine_core.rollout import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_LOSS_MASK,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ROLLOUT_REPLICA,
)
from engine_core_roles.actor import (
    ADVANTAGES,
    OLD_LOG_PROBS,
    REF_LOG_PROBS,
    ActorConfig,
    ActorUpdate,
)
from engine_core_roles.advantages import gae_advantages, grpo_advantages, sequence_to_token_rewards
from engine_core_roles.agents import episode_metrics
from engine_core_roles.batches import prompt_batch, training_batch
from engine_core_roles.critic import OLD_VALUES, RETURNS
from engine_core_roles.reward_model import RM_SCORES
from engine_core_roles.updates import non_finite_inputs
from engine_core_roles.weights import WeightLink

_log = logging.getLogger(__name__)

__all__ = [
    "TrainerConfig",
    "RLTrainer",
    "RewardFn",
    "SampleReward",
    "Rewards",
    "PromptSource",
    "StepCallback",
    "plot_keys",
    "SEED_STRIDE",
    "PromptsExhausted",
    "LogProbGapError",
    "PolicyRole",
    "ValueRole",
    "ReferenceRole",
    "RewardRole",
    "TIMING_KEYS",
]

# rollout seed of step s: seed * SEED_STRIDE + s, so a resumed run samples what a straight one did
SEED_STRIDE = 100003
EXTRA_DRAW_STRIDE = 10_000_019  # filter_groups' extra draws: seeds apart from every step's


class RewardFn(Protocol):
    """Scores one step's samples: ``[B*n]`` floats (a sample's reward sits on its last token).

    ``prompt_ids`` ``[B*n, P]`` is left-padded (the ``n`` samples of a prompt are adjacent);
    ``response_ids`` ``[B*n, R]`` is right-padded where ``response_mask`` is 0.
    """

    def __call__(
        self,
        prompt_ids: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        /,
    ) -> torch.Tensor: ...


@dataclass
class Rewards:
    """What a :class:`SampleReward` returns for one step's samples.

    ``scores`` ``[B*n]`` (any value where the sample failed); ``metrics``: means to log (e.g.
    ``reward/<component>``); ``failures``: one sentence per sample that could not be scored,
    naming it and the function (a step with any is not trained on); ``samples``: a few decoded
    samples for people to read (dicts of plain values), passed on in the step's row.
    """

    scores: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)


class SampleReward(ABC):
    """A reward that reads the prompts' batch as well as the samples (a text reward looks up
    each prompt's dataset row through extra fields of the prompt batch). The trainer computes it
    on a thread of its own while the reference's log-probs are computed."""

    @abstractmethod
    def __call__(self, prompts: TensorDict, samples: TensorDict) -> Rewards:
        """Score ``samples`` (``n`` adjacent samples per row of ``prompts``)."""


PromptBatch = torch.Tensor | TensorDict
PromptSource = Iterable[PromptBatch] | Callable[[int], PromptBatch]
"""Each step's prompts: an iterable, or a callable taking the step number. A prompt batch is a
``[B, P]`` tensor of token ids, or the :func:`engine_core_roles.prompt_batch` of left-padded ones."""

StepCallback = Callable[["RLTrainer", dict[str, Any]], None]
"""Called by :meth:`RLTrainer.fit` after every step with the trainer and that step's row."""


Algorithm = Annotated[
    Literal["grpo", "ppo"],
    Field(
        description="grpo: group-normalized scores as advantages, no critic; ppo: GAE over a "
        "critic's values (whitened), and a critic update every step."
    ),
]


def check_group_size(algorithm: str, samples_per_prompt: int) -> None:
    """grpo needs at least two samples per prompt to normalize within a group."""
    if algorithm == "grpo" and samples_per_prompt < 2:
        raise ValueError(
            f"grpo normalizes rewards within each prompt's group, so samples_per_prompt must "
            f"be >= 2 (got {samples_per_prompt}); raise it, or use algorithm=ppo."
        )


class TrainerConfig(FrozenModel):
    """How each step samples, and which advantage estimator it uses."""

    algorithm: Algorithm = "grpo"
    samples_per_prompt: PositiveInt = 8
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollout.")
    max_new_tokens: PositiveInt = 32
    stop_token_ids: list[int] = Field(default_factory=list)
    gamma: float = Field(1.0, ge=0, le=1, description="ppo: GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="ppo: GAE lambda.")
    max_consecutive_skipped_updates: int = Field(
        3,
        ge=0,
        description="Stop with an error when this many steps in a row applied no actor update "
        "(every optimizer step skipped for a non-finite gradient norm); 0: never stop.",
    )
    seed: int | None = Field(
        0,
        description="Step s samples with seed * 100003 + s (a resumed run repeats a straight "
        "one); None: unseeded.",
    )
    reward_model_weight: float = Field(
        1.0,
        description="With a reward_model: each sample's reward is reward_fn's score (0 without "
        "one) plus this times the reward model's score.",
    )
    filter_groups: bool = Field(
        False,
        description="Dynamic sampling: drop the prompts whose samples all scored the same "
        "(under grpo they carry no gradient) and draw more prompts, up to max_extra_draws "
        "times, until the step has prompts_per_step groups that differ; still short, it is "
        "topped up with dropped groups. Synchronous runs only.",
    )
    max_extra_draws: int = Field(
        3, ge=0, description="filter_groups: the most extra generations per step."
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="0: synchronous (each step generates with the weights of the step before). "
        ">= 1: asynchronous; step t+1 is generated while step t trains, so samples are one "
        "weight version old, never more than max_staleness. Needs a rollout that generates in "
        "another process (rollout_placement: process).",
    )

    logprob_gap_limit: float | None = Field(
        1e-2,
        gt=0,
        description="The gap guard: stop when the mean |rollout - trainer| log-prob gap over "
        "the response tokens exceeds this in one of the first logprob_gap_steps steps (of "
        "samples drawn with the trainer's current weights). Both sides compute the same "
        "distribution, so the gap is float noise (about 1e-6 in fp32); a larger one means they "
        "disagree on the temperature, the tokenizer or the weights. None: never check.",
    )
    logprob_gap_steps: int = Field(
        3,
        ge=0,
        description="How many steps of a run (counted from its start, or from a resume) the "
        "gap guard checks.",
    )

    @model_validator(mode="after")
    def _check_groups(self) -> TrainerConfig:
        check_group_size(self.algorithm, self.samples_per_prompt)
        if self.filter_groups and self.max_staleness:
            raise ValueError(
                f"filter_groups draws more prompts within a step, which an asynchronous run "
                f"(max_staleness={self.max_staleness}) has already generated; set "
                f"filter_groups=false or max_staleness=0."
            )
        return self

    def sampling_params(self, step: int, draw: int = 0) -> SamplingParams:
        """Step ``step``'s sampling; ``draw`` > 0: filter_groups' extra generations, each with
        a seed of its own."""
        seed = (
            None if self.seed is None else self.seed * SEED_STRIDE + step + draw * EXTRA_DRAW_STRIDE
        )
        return SamplingParams(
            temperature=self.temperature,
            max_new_tokens=self.max_new_tokens,
            n=self.samples_per_prompt,
            stop_token_ids=list(self.stop_token_ids),
            seed=seed,
        )


class PolicyRole(Protocol):
    """What the trainer calls on the policy: an :class:`Actor`, or an
    :class:`engine_core_roles.placement.ActorGroup` (the same calls on a data-parallel worker group).

    Its weights reach the rollout through a :class:`engine_core_roles.weights.WeightLink`."""

    config: ActorConfig

    def compute_log_prob(self, batch: TensorDict) -> TensorDict: ...

    def update_actor(self, batch: TensorDict) -> ActorUpdate: ...

    @property
    def max_position_embeddings(self) -> int | None: ...


class ValueRole(Protocol):
    """A :class:`Critic` or a :class:`engine_core_roles.placement.CriticGroup`."""

    def compute_values(self, batch: TensorDict) -> TensorDict: ...

    def update_critic(self, batch: TensorDict) -> dict[str, float]: ...


class ReferenceRole(Protocol):
    """A :class:`Reference` or a :class:`engine_core_roles.placement.ReferenceGroup`."""

    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict: ...


class RewardRole(Protocol):
    """A :class:`engine_core_roles.RewardModel` or a :class:`engine_core_roles.placement.RewardModelGroup`."""

    def compute_rm_score(self, batch: TensorDict) -> TensorDict: ...


TIMING_KEYS = ("time_s", "tokens_per_s", "weight_sync/time_s", "episode/env_wait_s")
"""Row keys that measure time: they differ between otherwise identical runs."""


class LogProbGapError(EngineCoreError):
    """The rollout's log-probs of its samples are not the trainer's (the gap guard)."""


_Step = tuple[TensorDict, TensorDict, int]  # prompts, their samples, the weight version


class _Generation(Protocol):
    """A generation in flight: its result() waits for it."""

    def result(self) -> _Step: ...


class _Settled:
    """A generation already done (restored by a resume) or that could not start."""

    def __init__(self, value: _Step | None = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def result(self) -> _Step:
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value


class PromptsExhausted(RuntimeError):
    """The prompt source (an iterable) has no prompts left for the step asked for."""


class RLTrainer:
    """GRPO or PPO on an :class:`Actor` (plus optional :class:`Reference` and :class:`Critic`).

    ``rollout`` generates with the actor's weights, synced and verified before the first step and
    after every update. ``reward_fn`` scores each sample (see :class:`RewardFn`), and/or
    ``reward_model`` (a :class:`engine_core_roles.RewardModel` on the actor's vocabulary) does: a sample's
    reward is the first plus ``config.reward_model_weight`` times the second; ``prompts``
    gives each step's prompts (see :data:`PromptSource`). A ``reference`` is required when the
    actor uses a KL loss; a ``critic`` exactly when ``config.algorithm`` is ``ppo``.
    ``global_step`` is the number of steps already taken (set it when resuming a checkpoint).
    ``responses``, when given, takes every generation's samples before anything reads them and
    returns them (e.g. :class:`engine_core_roles.text.StopStrings`, which ends responses at
    stop strings of several tokens by masking what follows).

    >>> trainer = RLTrainer(TrainerConfig(), actor=actor, rollout=rollout,
    ...                     reward_fn=my_reward, prompts=my_prompts)  # doctest: +SKIP
    >>> history = trainer.fit(100, callbacks=[lambda t, row: print(row["reward"])])  # doctest: +SKIP
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        actor: PolicyRole,
        rollout: BaseRollout | ProcessRollout,
        reward_fn: RewardFn | SampleReward | None = None,
        prompts: PromptSource,
        reference: ReferenceRole | None = None,
        critic: ValueRole | None = None,
        reward_model: RewardRole | None = None,
        global_step: int = 0,
        weights: WeightLink | None = None,
        responses: Callable[[TensorDict], TensorDict] | None = None,
    ) -> None:
        if reward_fn is None and reward_model is None:
            raise ValueError(
                "nothing scores the samples: pass reward_fn= (a callable scoring each sample), "
                "reward_model= (a RewardModel), or both."
            )
        if config.algorithm == "ppo" and critic is None:
            raise ValueError("algorithm='ppo' estimates advantages with a critic; pass critic=.")
        if config.algorithm == "grpo" and critic is not None:
            raise ValueError(
                "a critic was passed but algorithm='grpo' trains none; drop critic= or set "
                "algorithm='ppo'."
            )
        if actor.config.use_kl_loss and reference is None:
            raise ValueError(
                "the actor has use_kl_loss=True, which needs reference log-probs; pass "
                "reference=Reference(engine) (a frozen copy of the initial policy)."
            )
        if config.max_staleness and not isinstance(rollout, ProcessRollout):
            raise ValueError(
                f"max_staleness={config.max_staleness} overlaps generation with training, which "
                f"needs a rollout that generates in another process; "
                f"{type(rollout).__name__} generates in this one. Use a ProcessRollout "
                f"(engine-core run: rollout_placement=process), or max_staleness=0."
            )
        self.config = config
        self.actor = actor
        self.rollout = rollout
        self.reward_fn = reward_fn
        self.reward_model = reward_model
        self.reference = reference
        self.critic = critic
        self.global_step = global_step
        self._next_prompts = _prompt_reader(prompts)
        self._skipped_in_a_row = 0
        self._steps_run = 0  # by this object: the gap guard checks the first ones
        # the actor's weight version the rollout holds (None: not synced since this object,
        # or a resume, started); asynchronous mode: also the generation in flight
        self._rollout_version: int | None = None
        self._pending: _Generation | None = None
        if weights is not None and (weights.policy is not actor or weights.rollout is not rollout):
            raise ValueError(
                "weights= must be the WeightLink of this trainer's actor and rollout; build it "
                "as WeightLink(actor, rollout), or leave weights= out and the trainer builds it."
            )
        self._weights = weights  # built on the first sync when not given (and then owned)
        self._owns_weights = weights is None
        self._last_sync: dict[str, float] = {}
        self._reward_failures_in_a_row = 0
        self._reward_pool: ThreadPoolExecutor | None = None  # a SampleReward's thread
        # applied to every generation's samples before anything reads them (the text job's
        # multi-token stop strings, text.StopStrings)
        self._responses = responses

    def sync_weights(self) -> None:
        """Push the actor's weights into the rollout (names, shapes and checksums verified).

        :meth:`step` calls it before its first generation and after every update; call it again
        after changing the actor's weights yourself (e.g. loading a checkpoint).
        """
        if self._pending is not None:  # never swap weights under a generation in flight
            self._pending.result()
        if self._weights is None:
            self._weights = WeightLink(self.actor, self.rollout)  # type: ignore[arg-type]
        self._last_sync = self._weights.sync()
        self._rollout_version = self.global_step

    def _prompts(self, step: int) -> TensorDict:
        """Step ``step``'s prompts, drawn in step order and checked against the model's length."""
        prompts = self._next_prompts(step)
        self._check_length(prompts)
        return prompts

    def _generate(self, step: int) -> tuple[TensorDict, TensorDict, int]:
        """Step ``step``'s prompts, their samples, and the weight version that generated them."""
        prompts = self._prompts(step)
        samples = self._generated(self.rollout.generate(prompts, self.config.sampling_params(step)))
        return prompts, samples, self._synced_version()

    def _generated(self, samples: TensorDict) -> TensorDict:
        return samples if self._responses is None else self._responses(samples)

    def _synced_version(self) -> int:
        assert self._rollout_version is not None  # step() syncs before any generation
        return self._rollout_version

    def _submit(self, step: int) -> _Generation:
        """Start step ``step``'s generation on the rollout's processes (prompts drawn here, in
        order) without waiting for it."""
        try:
            prompts = self._prompts(step)
        except PromptsExhausted as e:  # raised when (and if) that step is run
            return _Settled(error=e)
        assert isinstance(self.rollout, ProcessRollout)  # checked in __init__
        params, version = self.config.sampling_params(step), self._synced_version()
        return self.rollout.generate_async(prompts, params).map(
            lambda gen: (prompts, self._generated(gen), version)
        )

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> TensorDict:
        """Samples of ``prompts`` with the weights of the latest update (for evaluation); in
        asynchronous mode after the generation in flight, which stays the next step's."""
        if self._pending is not None:
            with contextlib.suppress(Exception):  # its error is the next step's to raise
                self._pending.result()
        if self._rollout_version != self.global_step:
            self.sync_weights()
        return self._generated(self.rollout.generate(_as_prompts(prompts), params))

    def step(self) -> dict[str, Any]:
        """One RL step; returns its metrics row (``step``, ``reward``, ``actor/*``, ...)."""
        if self._rollout_version is None:
            self.sync_weights()
        step = self.global_step + 1
        t0 = time.perf_counter()
        if not self.config.max_staleness:
            prompts, gen, version = self._generate(step)
        else:
            pending, self._pending = self._pending or self._submit(step), None
            prompts, gen, version = pending.result()
            if self._rollout_version != self.global_step:
                self.sync_weights()  # the previous update, before the next generation starts
            self._pending = self._submit(step + 1)
        staleness = self.global_step - version
        if staleness > self.config.max_staleness:  # a broken invariant, never a user error
            raise EngineCoreError(
                f"step {step}: samples generated by weight version {version} are {staleness} "
                f"versions old, more than max_staleness={self.config.max_staleness}."
            )
        filled: dict[str, float] = {}
        if self.config.filter_groups:
            prompts, gen, scoring, filled = self._fill_groups(step, prompts, gen)
        batch = training_batch(gen, self.config.sampling_params(step))
        if not self.config.filter_groups:
            scoring = self._score(prompts, gen, batch)  # on a thread for a SampleReward
        # on-policy with one optimizer step (old_log_probs=update), the update's own forward
        # gives the old log-probs: returned with it, for the same checks
        on_policy = self.actor.config.old_log_probs_from_update
        if not on_policy:
            batch[OLD_LOG_PROBS] = self.actor.compute_log_prob(batch)[OLD_LOG_PROBS]
            gap, mismatch = self._guard_gap(step, staleness, gen, batch)  # before the update
        if self.reference is not None:
            batch[REF_LOG_PROBS] = self.reference.compute_ref_log_prob(batch)[REF_LOG_PROBS]
        rewards = scoring.result()
        scores = rewards.scores
        if rewards.failures:
            return self._unscored_step(step, t0, rewards, gen, batch)
        self._reward_failures_in_a_row = 0
        reward_parts = {
            **rewards.metrics,
            **_group_spread(scores, self.config.samples_per_prompt),
            **filled,
        }
        critic_metrics: dict[str, float] = {}
        mask = batch[LOSS_MASK]
        if self.critic is None:
            groups = torch.arange(prompts.batch_size[0]).repeat_interleave(
                self.config.samples_per_prompt
            )
            batch[ADVANTAGES] = grpo_advantages(scores, groups).unsqueeze(1) * mask
        else:
            batch[OLD_VALUES] = self.critic.compute_values(batch)[OLD_VALUES]
            token_rewards = sequence_to_token_rewards(scores, mask)
            adv, batch[RETURNS] = gae_advantages(
                token_rewards, batch[OLD_VALUES], mask, gamma=self.config.gamma, lam=self.config.lam
            )
            batch[ADVANTAGES] = _whiten(adv, mask)
            critic_metrics = self.critic.update_critic(batch)
        update = self.actor.update_actor(batch)
        metrics = update.metrics
        if on_policy:
            assert update.old_log_probs is not None  # old_log_probs_from_update
            batch[OLD_LOG_PROBS] = update.old_log_probs
            gap, mismatch = self._guard_gap(step, staleness, gen, batch)
        self._count_skipped(step, metrics, batch)
        self.global_step = step  # the actor's weights are version `step` now
        if not self.config.max_staleness:
            self.sync_weights()
        resp_mask = gen[RESPONSE_MASK].bool()
        dt = time.perf_counter() - t0
        return {
            "step": step,
            "reward": float(scores.mean()),
            **reward_parts,
            "response_length": float(resp_mask.sum(-1).float().mean()),
            "rollout/logprob_diff_max": float(mismatch.max()),
            "rollout/logprob_diff_mean": float(mismatch.mean()),
            # asynchronous: the weights that generated the samples, how many updates old
            **(
                {"rollout/weight_version": float(version), "rollout/staleness": float(staleness)}
                if self.config.max_staleness
                else {}
            ),
            **_per_replica(gen, gap, _sampled_mask(gen)),
            **episode_metrics(gen),
            **self._last_sync,
            **metrics,
            **critic_metrics,
            "time_s": dt,
            "tokens_per_s": float(batch[ATTENTION_MASK].sum()) / dt,
            **({"samples": rewards.samples} if rewards.samples else {}),
        }

    def _fill_groups(
        self, step: int, prompts: TensorDict, gen: TensorDict
    ) -> tuple[TensorDict, TensorDict, Future[Rewards], dict[str, float]]:
        """filter_groups: the step's prompts and samples with the groups whose scores all match
        replaced by ones that differ, drawn from more prompts (at most max_extra_draws more
        generations); their rewards, and the figures to log."""
        n, want = self.config.samples_per_prompt, int(prompts.batch_size[0])
        kept_p: list[TensorDict] = []
        kept_g: list[TensorDict] = []
        kept_r: list[Rewards] = []
        # dropped groups: the top-up when still short
        flat_p: list[TensorDict] = []
        flat_g: list[TensorDict] = []
        flat_r: list[Rewards] = []
        first_spread: dict[str, float] = {}
        draw, have = 0, 0
        while True:
            rewards = self._score(
                prompts, gen, training_batch(gen, self.config.sampling_params(step))
            ).result()
            if rewards.failures:  # the step is not trained on: nothing to fill
                done: Future[Rewards] = Future()
                done.set_result(rewards)
                return prompts, gen, done, {}
            if draw == 0:
                first_spread = _group_spread(rewards.scores, n)
            groups = rewards.scores.view(-1, n)
            differs = (groups.max(-1).values - groups.min(-1).values) != 0
            for keep, into in (
                (differs, (kept_p, kept_g, kept_r)),
                (~differs, (flat_p, flat_g, flat_r)),
            ):
                idx = keep.nonzero().flatten()
                if idx.numel():
                    rows = (idx.unsqueeze(1) * n + torch.arange(n)).flatten()
                    into[0].append(prompts[idx])
                    into[1].append(gen[rows])
                    into[2].append(_take(rewards, rows))
            have += int(differs.sum())
            if have >= want or draw >= self.config.max_extra_draws:
                break
            draw += 1
            prompts = self._prompts(step)
            gen = self._generated(
                self.rollout.generate(prompts, self.config.sampling_params(step, draw))
            )
        p_all, g_all, r_all = kept_p + flat_p, kept_g + flat_g, kept_r + flat_r
        prompts = _cat_left_padded(p_all)[:want]
        gen = _cat_left_padded(g_all)[: want * n]
        rewards = _cat_rewards(r_all, want * n)
        done = Future()
        done.set_result(rewards)
        figures = {
            **{k.replace("reward/", "filter/first_draw_"): v for k, v in first_spread.items()},
            "filter/extra_draws": float(draw),
            "filter/groups_that_differ": min(have, want) / want,
        }
        return prompts, gen, done, figures

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
        self.global_step = step  # the step's prompts are spent; the weights did not change
        if not self.config.max_staleness:
            self.sync_weights()
        finite = rewards.scores[torch.isfinite(rewards.scores)]
        dt = time.perf_counter() - t0
        return {
            "step": step,
            "reward": float(finite.mean()) if finite.numel() else float("nan"),
            "reward/failed_samples": float(len(failures)),
            "response_length": float(gen[RESPONSE_MASK].sum(-1).float().mean()),
            "actor/num_optimizer_steps": 0.0,
            "time_s": dt,
            "tokens_per_s": float(batch[ATTENTION_MASK].sum()) / dt,
            **({"samples": rewards.samples} if rewards.samples else {}),
        }

    def _guard_gap(
        self, step: int, staleness: int, gen: TensorDict, batch: TensorDict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """|trainer - rollout| log-prob per response column ``[B, R]``, and its values on the
        real response tokens; the gap guard runs on the first steps of samples drawn with the
        trainer's current weights (their gap is float noise)."""
        trainer_lp = batch[OLD_LOG_PROBS][:, gen[PROMPT_IDS].shape[1] :]
        gap = (trainer_lp - gen[ROLLOUT_LOG_PROBS]).abs()
        values = gap[_sampled_mask(gen)]
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

    def _check_length(self, prompts: TensorDict) -> None:
        limit = self.actor.max_position_embeddings
        longest = int(prompts[PROMPT_MASK].sum(-1).max()) if PROMPT_MASK in prompts.keys() else 0
        longest = longest or int(prompts[PROMPT_IDS].shape[1])
        if limit is not None and longest + self.config.max_new_tokens > limit:
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={self.config.max_new_tokens} "
                f"exceeds the model's max_position_embeddings ({limit}); shorten the prompts "
                f"or lower max_new_tokens."
            )

    def _count_skipped(self, step: int, metrics: dict[str, float], batch: TensorDict) -> None:
        if metrics.get("actor/num_optimizer_steps", 1.0) > 0:
            self._skipped_in_a_row = 0
            return
        self._skipped_in_a_row += 1
        limit = self.config.max_consecutive_skipped_updates
        if limit and self._skipped_in_a_row >= limit:
            causes = non_finite_inputs(batch)
            raise EngineCoreError(
                f"step {step}: {self._skipped_in_a_row} steps in a row applied no actor update "
                f"(every optimizer step skipped: non-finite gradient norm; "
                f"{'non-finite values in ' + str(causes) if causes else 'no input field is non-finite'}"
                f"). Stopping before the run goes on without learning; checkpoints already "
                f"saved are kept. Check the reward function and the learning rate, or raise "
                f"max_consecutive_skipped_updates."
            )

    def fit(
        self, max_steps: int, *, callbacks: Sequence[StepCallback] = ()
    ) -> list[dict[str, Any]]:
        """Step until ``global_step`` reaches ``max_steps``; returns the rows of the steps run.

        Each callback gets ``(trainer, row)`` after every step, in order: log, plot, save a
        checkpoint there. A trainer resumed at step ``k`` runs steps ``k+1 .. max_steps``.
        """
        history = []
        while self.global_step < max_steps:
            row = self.step()
            history.append(row)
            for callback in callbacks:
                callback(self, row)
        return history

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs beyond the engines' checkpoints, as plain data: the step, the
        count of skipped updates in a row and, in asynchronous mode, the generation in flight
        (waited for: its prompts, samples and weight version)."""
        pending = None
        if self._pending is not None:
            try:
                prompts, gen, version = self._pending.result()
            except Exception:  # its error belongs to a step never run: nothing to resume
                pass
            else:
                pending = {"prompts": _plain(prompts), "samples": _plain(gen), "version": version}
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
        if pending is not None and self.config.max_staleness:
            self._pending = _Settled(
                (_batch(pending["prompts"]), _batch(pending["samples"]), int(pending["version"]))
            )

    def close(self) -> None:
        """Wait for a generation in flight (asynchronous mode) and close the weight link the
        trainer built; safe to call twice."""
        if self._pending is not None:
            with contextlib.suppress(Exception):  # an error there belongs to a step never run
                self._pending.result()
            self._pending = None
        if self._weights is not None and self._owns_weights:
            self._weights.close()
            self._weights = None
        if self._reward_pool is not None:
            self._reward_pool.shutdown(wait=True)
            self._reward_pool = None

    def _score(self, prompts: TensorDict, gen: TensorDict, batch: TensorDict) -> Future[Rewards]:
        """Each sample's reward, with the means of its parts to log. A :class:`SampleReward`
        runs on the trainer's reward thread (the caller computes log-probs meanwhile); a
        reward model's scores, the same thread's result or a plain ``reward_fn``'s, now."""
        n = int(gen.batch_size[0])
        done: Future[Rewards] = Future()
        if isinstance(self.reward_fn, SampleReward):
            if self._reward_pool is None:
                self._reward_pool = ThreadPoolExecutor(1, thread_name_prefix="engine-core-reward")
            fn = self.reward_fn
            scored = self._reward_pool.submit(lambda: _checked(fn(prompts, gen), n))
        else:
            scored = done
            scores = torch.zeros(n)
            if self.reward_fn is not None:
                scores = self.reward_fn(gen[PROMPT_IDS], gen[RESPONSE_IDS], gen[RESPONSE_MASK])
                scores = torch.as_tensor(scores, dtype=torch.float32)
                if scores.shape != (n,):
                    raise ValueError(
                        f"reward_fn must return one score per sample, shape ({n},); got "
                        f"{tuple(scores.shape)}. Score each row of response_ids."
                    )
            done.set_result(Rewards(scores))
        if self.reward_model is None:
            return scored
        # prompt + response, as the actor reads them; the model scores each at its last token
        rm_input = make_batch(batch[INPUT_IDS], batch[ATTENTION_MASK])
        rm = self.reward_model.compute_rm_score(rm_input)[RM_SCORES].float().cpu()
        if rm.shape != (n,):
            raise ValueError(
                f"the reward model returned scores of shape {tuple(rm.shape)} for {n} samples; "
                f"it must return one per sample ({RM_SCORES} [B])."
            )
        rewards = scored.result()
        parts = {**rewards.metrics, "reward/model": float(rm.mean())}
        if self.reward_fn is not None:
            parts["reward/fn"] = float(rewards.scores.mean())
        combined: Future[Rewards] = Future()
        combined.set_result(
            Rewards(
                rewards.scores + self.config.reward_model_weight * rm,
                parts,
                rewards.failures,
                rewards.samples,
            )
        )
        return combined


def _take(rewards: Rewards, rows: torch.Tensor) -> Rewards:
    """The rewards of the samples ``rows`` (metrics and shown samples kept as they are)."""
    return Rewards(rewards.scores[rows], rewards.metrics, [], rewards.samples)


def _cat_rewards(parts: list[Rewards], limit: int) -> Rewards:
    scores = torch.cat([p.scores for p in parts])[:limit]
    return Rewards(scores, parts[0].metrics, [], parts[0].samples)


_LEFT_PADDED = (PROMPT_IDS, PROMPT_MASK)


def _cat_left_padded(parts: list[TensorDict]) -> TensorDict:
    """Prompt or sample batches of different widths as one: prompts padded on the left,
    responses (and every other ``[B, L]`` field) on the right."""
    if len(parts) == 1:
        return parts[0]
    widths: dict[str, int] = {}
    for td in parts:
        for key, value in td.items():
            if isinstance(value, torch.Tensor) and value.dim() == 2:
                widths[key] = max(widths.get(key, 0), value.shape[1])
    padded = []
    for td in parts:
        td = td.clone()
        for key, width in widths.items():
            value = td[key]
            extra = width - value.shape[1]
            if extra:
                pad = (extra, 0) if key in _LEFT_PADDED else (0, extra)
                td[key] = torch.nn.functional.pad(value, pad)
        padded.append(td)
    return torch.cat(padded)  # type: ignore[return-value,arg-type]


def _checked(rewards: Rewards, n: int) -> Rewards:
    scores = torch.as_tensor(rewards.scores, dtype=torch.float32)
    if scores.shape != (n,):
        raise ValueError(
            f"a SampleReward returned scores of shape {tuple(scores.shape)} for {n} samples; "
            f"it must return one per sample."
        )
    rewards.scores = scores
    return rewards


def _group_spread(scores: torch.Tensor, n: int) -> dict[str, float]:
    """The share of prompts whose samples all scored the same (no GRPO gradient from them)."""
    if n < 2 or scores.numel() % n:
        return {}
    groups = scores.view(-1, n)
    same = (groups.max(-1).values - groups.min(-1).values) == 0
    return {"reward/zero_variance_groups": float(same.float().mean())}


def plot_keys(rows: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The metrics worth a plot panel for these rows.

    Always how the run goes (reward, response length, grad norm, step time, tokens/s, pg loss,
    entropy, rollout-vs-trainer log-prob difference); the clip fraction and the policy's
    approximate KL only where an update took more than one optimizer step (with one on-policy
    step they are exactly 0); the KL loss and the value loss where they were logged; skipped
    (non-finite) updates where there were any; the share of prompts whose samples all scored
    the same, steps not trained on for unscored samples, episodes' turns, tool errors and the
    share ended by the environment, and the validation figures where they were logged.
    """
    keys = [
        "reward",
        "response_length",
        "actor/pg_loss",
        "actor/entropy",
        "actor/grad_norm",
        "rollout/logprob_diff_max",
        "time_s",
        "tokens_per_s",
    ]
    if any(r.get("actor/num_optimizer_steps", 1.0) > 1 for r in rows):
        keys += ["actor/clipfrac", "actor/approx_kl"]
    keys += [k for k in ("actor/kl_loss", "critic/vf_loss") if any(k in r for r in rows)]
    if any(r.get("actor/num_skipped_steps", 0.0) for r in rows):
        keys.append("actor/num_skipped_steps")
    keys += [
        k
        for k in (
            "reward/zero_variance_groups",
            "reward/failed_samples",
            "episode/turns",
            "episode/tool_errors",
            "episode/end_done",
        )
        if any(k in r for r in rows)
    ]
    keys += sorted({k for r in rows for k in r if k.startswith("val/")})
    return tuple(keys)


def _sampled_mask(gen: TensorDict) -> torch.Tensor:
    """The response tokens the rollout sampled (in an episode, not the environment's)."""
    key = RESPONSE_LOSS_MASK if RESPONSE_LOSS_MASK in gen.keys() else RESPONSE_MASK
    return gen[key].bool()


def _per_replica(gen: TensorDict, gap: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
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


def _prompt_reader(source: PromptSource) -> Callable[[int], TensorDict]:
    if callable(source):
        fn = source
        return lambda step: _as_prompts(fn(step))
    it: Iterator[PromptBatch] = iter(source)

    def read(step: int) -> TensorDict:
        try:
            return _as_prompts(next(it))
        except StopIteration:
            raise PromptsExhausted(
                f"the prompt source ran out before step {step}; give an endless iterable "
                "(e.g. a generator with a `while True` loop) or a callable taking the step."
            ) from None

    return read


def _as_prompts(batch: PromptBatch) -> TensorDict:
    return batch if isinstance(batch, TensorDict) else prompt_batch(batch)


def _whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero-mean, unit-variance over the masked entries (0 elsewhere)."""
    m = mask.bool()
    vals = x[m]
    std = vals.std(unbiased=False) if vals.numel() > 1 else torch.ones(())
    return ((x - vals.mean()) / (std + eps)) * m


def _plain(td: TensorDict) -> dict[str, Any]:
    """A flat batch as plain data (tensors, and lists for non-tensor fields) for a checkpoint."""
    out: dict[str, Any] = {"batch_size": list(td.batch_size)}
    for key in td.keys():
        value = td.get(key)
        out[str(key)] = value if isinstance(value, torch.Tensor) else list(value.tolist())
    return out


def _batch(plain: dict[str, Any]) -> TensorDict:
    from tensordict import NonTensorStack

    td = TensorDict({}, batch_size=plain["batch_size"])
    for key, value in plain.items():
        if key != "batch_size":
            td[key] = value if isinstance(value, torch.Tensor) else NonTensorStack.from_list(value)
    return td
