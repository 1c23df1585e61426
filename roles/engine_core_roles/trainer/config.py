"""``TrainerConfig``: how each RL step samples, which advantage estimator it uses, and its guards."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, PositiveInt, model_validator

from engine_core import SamplingParams
from engine_core.config import Seeded
from engine_core.errors import EngineCoreError
from engine_core.rollout import SamplingSettings
from engine_core_roles.algorithms.select import AlgorithmConfig, check_needs, resolve_algorithm

__all__ = [
    "SEED_STRIDE",
    "EXTRA_DRAW_STRIDE",
    "RoutingReplay",
    "check_routing_replay",
    "TrainerConfig",
]

# rollout seed of step s: seed * SEED_STRIDE + s, so a resumed run samples what a straight one did
SEED_STRIDE = 100003


EXTRA_DRAW_STRIDE = 10_000_019  # filter_groups' extra draws: seeds apart from every step's


def _routing_mode(value: object) -> object:
    """YAML reads a bare ``off`` as false: take it as "off"; refuse true, which names no mode."""
    if value is False:
        return "off"
    if value is True:
        raise ValueError(
            "routing_replay takes a mode, not true: rollout (replay the rollout's routes), "
            "trainer (replay the old-log-prob pass's), measure (log the mismatch only) or off."
        )
    return value


RoutingReplay = Annotated[
    Literal["off", "rollout", "trainer", "measure"],
    BeforeValidator(_routing_mode),
    Field(
        description="Mixtures of experts: which experts the trainer's forwards route each token "
        "to. off: its own routers' choice. rollout: the ones the rollout chose while sampling "
        "(the rollout returns them; the old-log-prob pass and the update replay them), and "
        "rollout/route_mismatch logs the share of (token, layer) decisions where the trainer's "
        "routers would have chosen otherwise. trainer: the old-log-prob pass routes on its own "
        "and the update replays that pass's routes (for a rollout that cannot return routes; "
        "needs a separate old-log-prob pass). measure: nothing replayed, "
        "rollout/route_mismatch logged. The engine, and for rollout/measure the rollout, must "
        "declare routing_replay."
    ),
]


def check_routing_replay(mode: str, old_log_probs_from_update: bool) -> None:
    """routing_replay=trainer replays the old-log-prob pass's routes in the update: it needs
    that pass to be a forward of its own."""
    if mode == "trainer" and old_log_probs_from_update:
        raise ValueError(
            "trainer.routing_replay=trainer replays the old-log-prob pass's routes in the "
            "update, but this actor takes its old log-probs from the update's own forward (one "
            "epoch, one mini-batch: actor.old_log_probs=auto or update), so the two are one "
            "forward and there is nothing to replay. Set actor.old_log_probs=recompute, or "
            "routing_replay=off."
        )


class TrainerConfig(SamplingSettings, Seeded):
    """How each step samples, and which advantage estimator it uses.

    ``temperature``, ``max_new_tokens`` and ``stop_token_ids`` are
    :class:`engine_core.rollout.SamplingSettings`' own fields, inherited: each step's
    :class:`engine_core.SamplingParams` is built from them (:meth:`sampling_params`), not from
    a second declaration. ``seed`` (:class:`engine_core.config.Seeded`): step ``s`` samples
    with ``seed * 100003 + s``, so a resumed run repeats a straight one.
    """

    algorithm: AlgorithmConfig = Field(
        default_factory=lambda: AlgorithmConfig(preset="grpo"),
        description="The advantage estimator and policy loss: a preset (grpo, ppo, dr_grpo, "
        "rloo, reinforce_pp, reinforce_pp_baseline, gspo, cispo) or {advantage, policy_loss, "
        "advantage_params, policy_loss_params, overlong}; any registered plugin's names "
        "(`engine-core plugins`).",
    )
    samples_per_prompt: PositiveInt = 8
    gamma: float = Field(1.0, ge=0, le=1, description="Discount (gae, reinforce_pp).")
    lam: float = Field(0.95, ge=0, le=1, description="gae: GAE lambda.")
    max_consecutive_skipped_updates: int = Field(
        3,
        ge=0,
        description="Stop with an error when this many steps in a row applied no actor update "
        "(every optimizer step skipped for a non-finite gradient norm); 0: never stop.",
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
    routing_replay: RoutingReplay = "off"

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
    def _sampled(self) -> TrainerConfig:
        if self.temperature == 0:
            raise ValueError(
                "trainer.temperature=0 samples greedily: every sample of a prompt is the same "
                "answer, and its log-probs come from no sampling distribution to train on; set "
                "a temperature > 0 (1.0: the model's own distribution)."
            )
        return self

    @model_validator(mode="after")
    def _check_groups(self) -> TrainerConfig:
        try:
            resolved = resolve_algorithm(self.algorithm, path="algorithm")
        except EngineCoreError as e:  # an unknown name, a plugin that cannot be imported
            raise ValueError(str(e)) from None
        # a critic is the caller's to give (RLTrainer, the job check it); groups are ours
        check_needs(resolved, has_critic=None, samples_per_prompt=self.samples_per_prompt)
        if "max_new_tokens" in self.model_fields_set:  # else a job derives it: checked then
            self.check_overlong()
        if self.filter_groups and self.max_staleness:
            raise ValueError(
                f"filter_groups draws more prompts within a step, which an asynchronous run "
                f"(max_staleness={self.max_staleness}) has already generated; set "
                f"filter_groups=false or max_staleness=0."
            )
        return self

    def check_overlong(self) -> None:
        """The overlong buffer must leave room below the generation budget."""
        overlong = self.algorithm.overlong
        if overlong is not None and overlong.buffer >= self.max_new_tokens:
            raise ValueError(
                f"trainer.algorithm.overlong.buffer={overlong.buffer} must be below "
                f"max_new_tokens={self.max_new_tokens} (the penalty starts buffer tokens before "
                f"the budget); lower the buffer."
            )

    def sampling_params(self, step: int, draw: int = 0) -> SamplingParams:
        """Step ``step``'s sampling; ``draw`` > 0: filter_groups' extra generations, each with
        a seed of its own."""
        seed = self.seed * SEED_STRIDE + step + draw * EXTRA_DRAW_STRIDE
        return SamplingParams(
            temperature=self.temperature,
            max_new_tokens=self.max_new_tokens,
            n=self.samples_per_prompt,
            stop_token_ids=list(self.stop_token_ids),
            stop_strings=list(self.stop_strings),
            seed=seed,
            return_routes=self.routing_replay in ("rollout", "measure"),
        )
