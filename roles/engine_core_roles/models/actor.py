"""``Actor``: the policy role — old log-probs, and PPO updates over mini-batches and epochs.

Works with any engine through :class:`engine_core.BaseEngine` only. Batch fields are padded
``[B, L]`` and aligned to ``input_ids`` (see :mod:`engine_core.batch`): ``loss_mask`` marks the
response tokens, ``advantages`` and ``old_log_probs`` are per token, and so is
``rollout_log_probs`` when a mismatch correction is on (:func:`engine_core_roles.training_batch` carries it
over from the rollout output).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field, PositiveInt, model_validator
from tensordict import TensorDict

from engine_core import (
    INPUT_IDS,
    LOG_PROBS,
    LOSS_MASK,
    BaseEngine,
    BatchError,
    FrozenModel,
    GlobalBatchContext,
    LossAggregation,
    Metric,
    require_keys,
    require_token_shaped,
    token_mean_metric,
    with_meta,
)
from engine_core.batch import ROUTED_EXPERTS, MoeAuxLoss
from engine_core.config import BUCKET_BYTES
from engine_core.rollout import ROLLOUT_LOG_PROBS
from engine_core_roles.algorithms.base import PolicyLossInputs
from engine_core_roles.algorithms.losses import (
    CorrectionWeights,
    KLEstimator,
    MISLevel,
    MismatchCorrection,
    entropy_loss,
    kl_penalty,
    mis_weights,
    tis_weights,
    unlikelihood_loss,
)
from engine_core_roles.algorithms.select import AlgorithmConfig, build_policy_loss
from engine_core_roles.algorithms.updates import mean_over_steps, run_updates, warn_skipped
from engine_core_roles.batch.keys import (
    ADVANTAGES,
    OLD_LOG_PROBS,
    REF_LOG_PROBS,
    UNLIKELIHOOD_WEIGHTS,
)

__all__ = [
    "ActorConfig",
    "Actor",
    "ActorUpdate",
]


# keys the actor section refuses, each group with where its keys live, why, and how to set them
_MOVED_KEYS = (
    (
        ("policy_loss", "policy_loss_params", "loss_agg_mode"),
        "trainer.algorithm.",
        "the policy loss, its parameters and the loss aggregation are the algorithm's, not the "
        "actor's",
        "engine-core run: in the trainer section; a script: TrainerConfig(algorithm=...) and "
        "Actor(config, engine, algorithm=trainer_config.algorithm)",
    ),
    (  # the clip range is the policy loss's parameter (ppo_clip, gspo and cispo each have one)
        ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"),
        "trainer.algorithm.policy_loss_params.",
        "the clip range is the policy loss's parameter, not the actor's",
        "ppo_clip, gspo and cispo each take their own",
    ),
)

PRODUCERS = {
    OLD_LOG_PROBS: "Actor.compute_log_prob",
    REF_LOG_PROBS: "Reference.compute_ref_log_prob",
    ADVANTAGES: "an advantage estimator in engine_core_roles.algorithms.advantages",
    LOSS_MASK: "the rollout (response mask)",
    ROLLOUT_LOG_PROBS: "engine_core_roles.training_batch(rollout_output); mismatch_correction needs it",
}


class ActorConfig(FrozenModel):
    """PPO update settings of the actor.

    The policy loss, its parameters and the loss aggregation are the algorithm's
    (:class:`~engine_core_roles.algorithms.select.AlgorithmConfig`, ``trainer.algorithm``), handed
    to :class:`Actor` with its config; they are not settings of this section.
    """

    ppo_epochs: PositiveInt = 1
    ppo_mini_batch_size: PositiveInt | None = Field(
        None,
        description="Samples per optimizer step (per call on this rank); None: the whole batch.",
    )
    loss_norm_length: PositiveInt | None = Field(
        None,
        description="trainer.algorithm.loss_agg_mode seq-mean-token-sum-norm: the constant each "
        "sequence's token sum is divided by (Dr. GRPO: the generation budget; the job sets "
        "trainer.max_new_tokens).",
    )
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0)
    moe_aux_loss_coef: float = Field(
        0.0,
        ge=0,
        description="A mixture of experts: weight of the routers' load-balancing loss in the "
        "update (per sequence and MoE layer, E * sum_e f_e * P_e, aggregated over the loss "
        "tokens like the policy loss; logged as actor/moe_aux_loss). 0: not computed. Needs an "
        "engine that declares routing_replay.",
    )
    kl_loss_type: KLEstimator = KLEstimator.LOW_VAR
    mismatch_correction: MismatchCorrection = Field(
        MismatchCorrection.NONE,
        description=(
            "Correct the policy loss for rollout/trainer log-prob mismatch, with ratio = "
            "exp(old_log_probs - rollout_log_probs): 'tis' weights each token by "
            "min(ratio, tis_cap), 'mis' drops the tokens whose ratio leaves [mis_low, mis_high] "
            "(they still count in the mean's denominator). Needs the batch field "
            "rollout_log_probs (training_batch carries it)."
        ),
    )
    tis_cap: float = Field(
        2.0, gt=0, description="TIS: the largest token weight; inf: untruncated weights."
    )
    mis_low: float = Field(
        0.5, ge=0, le=1, description="MIS: lower end of the kept ratios; 0: no lower end."
    )
    mis_high: float = Field(
        2.0, ge=1, description="MIS: upper end of the kept ratios; inf: no upper end."
    )
    mis_level: MISLevel = Field(
        MISLevel.TOKEN,
        description=(
            "MIS: 'token' drops single tokens; 'sequence' drops a whole response when its "
            "geometric-mean ratio (exp of its mean log-ratio) leaves the band."
        ),
    )
    old_log_probs: Literal["recompute", "update", "auto"] = Field(
        "recompute",
        description="recompute: the old log-probs come from a forward of their own before the "
        "update (Actor.compute_log_prob; any ppo_epochs and mini-batches). update: the update "
        "is one on-policy optimizer step (ppo_epochs=1, ppo_mini_batch_size unset), so the "
        "old log-probs are its own forward's, detached: the same values, one forward fewer; "
        "returned in ActorUpdate.old_log_probs. auto: update when the update "
        "is one optimizer step, else recompute.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_temperature(cls, data: Any) -> Any:
        for keys, home, why, how in _MOVED_KEYS:
            moved = sorted(set(keys) & set(data)) if isinstance(data, Mapping) else []
            if moved:
                got = ", ".join(f"actor.{k}={data[k]!r}" for k in moved)
                where = ", ".join(f"{home}{k}" for k in moved)
                raise ValueError(f"got {got}: {why}. Set {where} instead ({how}).")
        if isinstance(data, Mapping) and "temperature" in data:
            raise ValueError(
                "the actor has no temperature of its own: it computes log-probs at the "
                "temperature its samples were drawn at (the batch's metadata, set by "
                "training_batch(rollout_output, sampling_params)); set the sampling temperature "
                "once, in TrainerConfig.temperature (engine-core run: trainer.temperature), and "
                "drop actor.temperature."
            )
        return data

    @model_validator(mode="after")
    def _check_old_log_probs(self) -> ActorConfig:
        if self.old_log_probs == "update" and (
            self.ppo_epochs != 1 or self.ppo_mini_batch_size is not None
        ):
            raise ValueError(
                f"old_log_probs=update takes the old log-probs from the update's own forward, "
                f"exact only when the update is one optimizer step on the whole batch; got "
                f"ppo_epochs={self.ppo_epochs}, ppo_mini_batch_size={self.ppo_mini_batch_size}. "
                f"Set ppo_epochs=1 and leave ppo_mini_batch_size unset, or "
                f"old_log_probs=recompute."
            )
        return self

    @property
    def old_log_probs_from_update(self) -> bool:
        """Whether the update takes the old log-probs from its own forward (no separate one)."""
        if self.old_log_probs == "auto":
            return self.ppo_epochs == 1 and self.ppo_mini_batch_size is None
        return self.old_log_probs == "update"


@dataclass(frozen=True)
class ActorUpdate:
    """What one :meth:`Actor.update_actor` call produced."""

    metrics: dict[str, float]
    """``actor/*`` metrics averaged over its optimizer steps."""
    old_log_probs: torch.Tensor | None = None
    """With ``old_log_probs=update``: the update's own forward's per-token log-probs ``[B, L]``,
    before its optimizer step (what :meth:`Actor.compute_log_prob` would have returned before
    the update); ``None`` otherwise."""
    routes: torch.Tensor | None = None
    """With ``old_log_probs=update`` and ``BatchMeta.return_routes``: the experts that forward's
    own routers chose, ``[B, L, layers, top_k]``; ``None`` otherwise."""


class Actor:
    """The policy. ``engine`` must have been ``init_model()``-ed.

    ``algorithm`` names the policy loss, its parameters and the loss aggregation (the run's
    ``TrainerConfig.algorithm``; None: the grpo preset, TrainerConfig's default).
    """

    def __init__(
        self, config: ActorConfig, engine: BaseEngine, algorithm: AlgorithmConfig | None = None
    ) -> None:
        algorithm = AlgorithmConfig(preset="grpo") if algorithm is None else algorithm
        if (
            algorithm.loss_agg_mode is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM
            and config.loss_norm_length is None
        ):
            raise ValueError(
                "trainer.algorithm.loss_agg_mode=seq-mean-token-sum-norm divides each "
                "sequence's token sum by actor.loss_norm_length, which is unset; set it (Dr. "
                "GRPO: the generation budget, trainer.max_new_tokens)."
            )
        self.config = config
        self.engine = engine
        self.algorithm = algorithm
        self.aggregation = algorithm.loss_agg_mode
        self.policy_loss = build_policy_loss(algorithm.policy_loss, algorithm.policy_loss_params)

    def named_full_params(
        self, bucket_bytes: int = BUCKET_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's (HF name, full tensor) pairs, for a weight sync into a rollout, gathered
        ``bucket_bytes`` at a time."""
        return self.engine.named_full_params(bucket_bytes)

    @property
    def max_position_embeddings(self) -> int | None:
        """The longest prompt + response the model takes (None: not limited by its config)."""
        limit = getattr(self.engine.hf_config, "max_position_embeddings", None)
        return None if limit is None else int(limit)

    def compute_log_prob(self, batch: TensorDict, *, entropy: bool = False) -> TensorDict:
        """Per-token log-probs of ``input_ids`` under the current policy (``old_log_probs``), at
        the temperature in the batch's metadata (the sampling temperature, from
        :func:`engine_core_roles.training_batch`)."""
        self.engine.set_loss_fn(None)
        with self.engine.eval_mode():
            out = self.engine.forward_backward_step(
                with_meta(batch, compute_entropy=entropy), forward_only=True
            )
        result = TensorDict({OLD_LOG_PROBS: out.outputs[LOG_PROBS]}, batch_size=batch.batch_size)
        if entropy:
            result["entropy"] = out.outputs["entropy"]
        if ROUTED_EXPERTS in out.outputs.keys():  # asked for by BatchMeta.return_routes
            result[ROUTED_EXPERTS] = out.outputs[ROUTED_EXPERTS]
        return result

    def loss_fn(
        self, mb: TensorDict, out: TensorDict, ctx: GlobalBatchContext
    ) -> tuple[torch.Tensor, Mapping[str, Metric]]:
        cfg = self.config
        mask = mb[LOSS_MASK]
        # on-policy, one optimizer step: the old policy is this forward's, detached
        old = out[LOG_PROBS].detach() if cfg.old_log_probs_from_update else mb[OLD_LOG_PROBS]
        correction = self._mismatch_weights(mb, old, ctx)
        norm = cfg.loss_norm_length
        terms = self.policy_loss(
            PolicyLossInputs(
                log_probs=out[LOG_PROBS],
                old_log_probs=old,
                advantages=mb[ADVANTAGES],
                mask=mask,
                ctx=ctx,
                weights=None if correction is None else correction.weights,
                aggregation=self.aggregation,
                norm_length=norm,
            )
        )
        if "pg_loss" not in terms:
            raise ValueError(
                f"policy loss {self.algorithm.policy_loss!r} returned {sorted(terms)} without "
                f"'pg_loss'; return the loss as pg_loss."
            )
        loss = terms["pg_loss"]
        metrics: dict[str, Metric] = {k: Metric.of(v, "sum") for k, v in terms.items()}
        if correction is not None:
            metrics.update({k: Metric.of(v, "sum") for k, v in correction.metrics.items()})
        if "entropy" in out.keys():  # always computed during updates: a key health metric
            ent = entropy_loss(out["entropy"], mask, ctx, self.aggregation, norm_length=norm)
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * ent
            metrics["entropy"] = token_mean_metric(out["entropy"], mask, ctx)
        if cfg.use_kl_loss:
            kl = kl_penalty(out[LOG_PROBS], mb[REF_LOG_PROBS], cfg.kl_loss_type)
            # same aggregation as the pg loss
            kl_loss = entropy_loss(kl, mask, ctx, self.aggregation, norm_length=norm)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["kl_loss"] = token_mean_metric(kl, mask, ctx)
        if UNLIKELIHOOD_WEIGHTS in mb.keys():  # the advantage estimator asked for it
            weights = mb[UNLIKELIHOOD_WEIGHTS]
            ul = unlikelihood_loss(
                out[LOG_PROBS], weights, mask, ctx, self.aggregation, norm_length=norm
            )
            loss = loss + ul
            metrics["unlikelihood_loss"] = Metric.of(ul.detach(), "sum")
        # moe_aux_loss_coef > 0: the engine adds the routers' balance loss itself, aggregated as
        # this loss is (BatchMeta.moe_aux, see update_actor), and reports moe_aux_loss
        return loss, metrics

    def _mismatch_weights(
        self, mb: TensorDict, old: torch.Tensor, ctx: GlobalBatchContext
    ) -> CorrectionWeights | None:
        cfg = self.config
        if cfg.mismatch_correction is MismatchCorrection.NONE:
            return None
        args = (old, mb[ROLLOUT_LOG_PROBS], mb[LOSS_MASK], ctx)
        if cfg.mismatch_correction is MismatchCorrection.TIS:
            return tis_weights(*args, cap=cfg.tis_cap)
        return mis_weights(*args, low=cfg.mis_low, high=cfg.mis_high, level=cfg.mis_level)

    def _balance_loss(self) -> MoeAuxLoss | None:
        """The routers' load-balancing loss the engine adds, weighted by moe_aux_loss_coef and
        aggregated as the policy loss is (None: not computed)."""
        cfg = self.config
        if cfg.moe_aux_loss_coef <= 0:
            return None
        return MoeAuxLoss(
            coef=cfg.moe_aux_loss_coef,
            aggregation=self.aggregation,
            norm_length=cfg.loss_norm_length,
        )

    def update_actor(self, batch: TensorDict) -> ActorUpdate:
        """PPO epochs over mini-batches; one optimizer step per mini-batch, one LR step per call.

        Returns the update's metrics and, with ``old_log_probs=update``, the old log-probs its
        forward computed (see :class:`ActorUpdate`).

        Under DP each rank walks its own chunk, so global mini-batch ``k`` is the union of every
        rank's ``k``-th local mini-batch (a different composition than one process would use).
        """
        correct = self.config.mismatch_correction is not MismatchCorrection.NONE
        on_policy = self.config.old_log_probs_from_update
        needed = [LOSS_MASK, ADVANTAGES] + ([] if on_policy else [OLD_LOG_PROBS])
        needed += [REF_LOG_PROBS] if self.config.use_kl_loss else []
        needed += [ROLLOUT_LOG_PROBS] if correct else []
        needed += [UNLIKELIHOOD_WEIGHTS] if UNLIKELIHOOD_WEIGHTS in batch.keys() else []
        require_keys(batch, needed, method="Actor.update_actor", producers=PRODUCERS)
        require_token_shaped(
            batch, [k for k in needed if k != ROLLOUT_LOG_PROBS], method="Actor.update_actor"
        )
        if correct:
            _require_aligned_rollout_log_probs(batch)
        batch = with_meta(batch, compute_entropy=True, moe_aux=self._balance_loss())
        history, lr, first = run_updates(
            self.engine,
            batch,
            self.loss_fn,
            epochs=self.config.ppo_epochs,
            global_mini_batch_size=self.config.ppo_mini_batch_size,
            log_loss=True,
        )
        out = mean_over_steps("actor", history, lr=lr)
        if out["actor/num_skipped_steps"]:
            warn_skipped(
                "Actor.update_actor", int(out["actor/num_skipped_steps"]), len(history), batch
            )
        if not on_policy:
            return ActorUpdate(out)
        return ActorUpdate(out, first[LOG_PROBS], first.get(ROUTED_EXPERTS, None))


def _require_aligned_rollout_log_probs(batch: TensorDict) -> None:
    got, want = tuple(batch[ROLLOUT_LOG_PROBS].shape), tuple(batch[INPUT_IDS].shape)
    if got != want:
        raise BatchError(
            f"Actor.update_actor: {ROLLOUT_LOG_PROBS} has shape {got}, want {want} like "
            f"input_ids. A rollout returns it over the response tokens only ([batch, "
            f"response_len]); engine_core_roles.training_batch(rollout_output) aligns it to the prompt + "
            f"response (zeros on the prompt)."
        )
