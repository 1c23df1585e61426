"""``Actor``: the policy role — old log-probs, and PPO updates over mini-batches and epochs.

Works with any engine through :class:`engine_core.BaseEngine` only. Batch fields are padded
``[B, L]`` and aligned to ``input_ids`` (see :mod:`engine_core.batch`): ``loss_mask`` marks the
response tokens, ``advantages`` and ``old_log_probs`` are per token, and so is
``rollout_log_probs`` when a mismatch correction is on (:func:`roles.training_batch` carries it
over from the rollout output).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping
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
    EngineCoreError,
    FrozenModel,
    GlobalBatchContext,
    LossAggregation,
    LossFn,
    Metric,
    require_keys,
    require_token_shaped,
    token_mean_metric,
    with_meta,
)
from engine_core.rollout import ROLLOUT_LOG_PROBS
from roles.losses import (
    CorrectionWeights,
    KLEstimator,
    MISLevel,
    MismatchCorrection,
    entropy_loss,
    kl_penalty,
    mis_weights,
    policy_loss,
    tis_weights,
)

__all__ = [
    "ActorConfig",
    "Actor",
    "OLD_LOG_PROBS",
    "REF_LOG_PROBS",
    "ADVANTAGES",
    "ROLLOUT_LOG_PROBS",
    "mean_over_steps",
]

OLD_LOG_PROBS = "old_log_probs"
REF_LOG_PROBS = "ref_log_probs"
ADVANTAGES = "advantages"

PRODUCERS = {
    OLD_LOG_PROBS: "Actor.compute_log_prob",
    REF_LOG_PROBS: "Reference.compute_ref_log_prob",
    ADVANTAGES: "an advantage estimator in roles.advantages",
    LOSS_MASK: "the rollout (response mask)",
    ROLLOUT_LOG_PROBS: "roles.training_batch(rollout_output); mismatch_correction needs it",
}


class ActorConfig(FrozenModel):
    """PPO update settings of the actor."""

    ppo_epochs: PositiveInt = 1
    ppo_mini_batch_size: PositiveInt | None = Field(
        None,
        description="Samples per optimizer step (per call on this rank); None: the whole batch.",
    )
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    clip_ratio_c: float | None = Field(3.0, gt=1, description="Dual-clip bound; None disables it.")
    loss_agg_mode: LossAggregation = LossAggregation.TOKEN_MEAN
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: KLEstimator = KLEstimator.LOW_VAR
    temperature: float = Field(1.0, gt=0)
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
        "read them afterwards with Actor.update_log_probs(). auto: update when the update "
        "is one optimizer step, else recompute.",
    )

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


class Actor:
    """The policy. ``engine`` must have been ``init_model()``-ed."""

    def __init__(self, config: ActorConfig, engine: BaseEngine) -> None:
        self.config = config
        self.engine = engine
        self._update_log_probs: TensorDict | None = None

    def named_full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's (HF name, full tensor) pairs, for a weight sync into a rollout."""
        return self.engine.named_full_params()

    @property
    def max_position_embeddings(self) -> int | None:
        """The longest prompt + response the model takes (None: not limited by its config)."""
        limit = getattr(self.engine.hf_config, "max_position_embeddings", None)
        return None if limit is None else int(limit)

    def update_log_probs(self) -> TensorDict:
        """``old_log_probs`` of the last :meth:`update_actor` with ``old_log_probs=update``: its
        forward's per-token log-probs, before its optimizer step (what
        :meth:`compute_log_prob` would have returned before the update)."""
        if self._update_log_probs is None:
            raise EngineCoreError(
                "update_log_probs() reads the log-probs of an update run with "
                "old_log_probs=update; call update_actor() first, with that setting (now "
                f"old_log_probs={self.config.old_log_probs})."
            )
        return self._update_log_probs

    def _with_meta(self, batch: TensorDict, *, entropy: bool) -> TensorDict:
        """A copy whose metadata carries this role's temperature and entropy switch."""
        return with_meta(batch, temperature=self.config.temperature, compute_entropy=entropy)

    def compute_log_prob(self, batch: TensorDict, *, entropy: bool = False) -> TensorDict:
        """Per-token log-probs of ``input_ids`` under the current policy (``old_log_probs``)."""
        self.engine.set_loss_fn(None)
        with self.engine.eval_mode():
            out = self.engine.forward_backward_step(
                self._with_meta(batch, entropy=entropy), forward_only=True
            )
        result = TensorDict({OLD_LOG_PROBS: out.outputs[LOG_PROBS]}, batch_size=batch.batch_size)
        if entropy:
            result["entropy"] = out.outputs["entropy"]
        return result

    def loss_fn(
        self, mb: TensorDict, out: TensorDict, ctx: GlobalBatchContext
    ) -> tuple[torch.Tensor, Mapping[str, Metric]]:
        cfg = self.config
        mask = mb[LOSS_MASK]
        # on-policy, one optimizer step: the old policy is this forward's, detached
        old = out[LOG_PROBS].detach() if cfg.old_log_probs_from_update else mb[OLD_LOG_PROBS]
        correction = self._mismatch_weights(mb, old, ctx)
        terms = policy_loss(
            out[LOG_PROBS],
            old,
            mb[ADVANTAGES],
            mask,
            ctx,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
            aggregation=cfg.loss_agg_mode,
            weights=None if correction is None else correction.weights,
        )
        loss = terms["pg_loss"]
        metrics: dict[str, Metric] = {k: Metric.of(v, "sum") for k, v in terms.items()}
        if correction is not None:
            metrics.update({k: Metric.of(v, "sum") for k, v in correction.metrics.items()})
        if "entropy" in out.keys():  # always computed during updates: a key health metric
            ent = entropy_loss(out["entropy"], mask, ctx, cfg.loss_agg_mode)
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * ent
            metrics["entropy"] = token_mean_metric(out["entropy"], mask, ctx)
        if cfg.use_kl_loss:
            kl = kl_penalty(out[LOG_PROBS], mb[REF_LOG_PROBS], cfg.kl_loss_type)
            kl_loss = entropy_loss(
                kl, mask, ctx, cfg.loss_agg_mode
            )  # same aggregation as the pg loss
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["kl_loss"] = token_mean_metric(kl, mask, ctx)
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

    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        """PPO epochs over mini-batches; one optimizer step per mini-batch, one LR step per call.

        Under DP each rank walks its own chunk, so global mini-batch ``k`` is the union of every
        rank's ``k``-th local mini-batch (a different composition than one process would use).
        """
        correct = self.config.mismatch_correction is not MismatchCorrection.NONE
        on_policy = self.config.old_log_probs_from_update
        needed = [LOSS_MASK, ADVANTAGES] + ([] if on_policy else [OLD_LOG_PROBS])
        needed += [REF_LOG_PROBS] if self.config.use_kl_loss else []
        needed += [ROLLOUT_LOG_PROBS] if correct else []
        require_keys(batch, needed, method="Actor.update_actor", producers=PRODUCERS)
        require_token_shaped(
            batch, [k for k in needed if k != ROLLOUT_LOG_PROBS], method="Actor.update_actor"
        )
        if correct:
            _require_aligned_rollout_log_probs(batch)
        batch = self._with_meta(batch, entropy=True)
        self._update_log_probs = None
        history, lr, first = run_updates(
            self.engine,
            batch,
            self.loss_fn,
            epochs=self.config.ppo_epochs,
            global_mini_batch_size=self.config.ppo_mini_batch_size,
            log_loss=True,
        )
        if on_policy:
            self._update_log_probs = TensorDict(
                {OLD_LOG_PROBS: first[LOG_PROBS]}, batch_size=batch.batch_size
            )
        out = mean_over_steps("actor", history, lr=lr)
        if out["actor/num_skipped_steps"]:
            warn_skipped(
                "Actor.update_actor", int(out["actor/num_skipped_steps"]), len(history), batch
            )
        return out


def _require_aligned_rollout_log_probs(batch: TensorDict) -> None:
    got, want = tuple(batch[ROLLOUT_LOG_PROBS].shape), tuple(batch[INPUT_IDS].shape)
    if got != want:
        raise BatchError(
            f"Actor.update_actor: {ROLLOUT_LOG_PROBS} has shape {got}, want {want} like "
            f"input_ids. A rollout returns it over the response tokens only ([batch, "
            f"response_len]); roles.training_batch(rollout_output) aligns it to the prompt + "
            f"response (zeros on the prompt)."
        )


def run_updates(
    engine: BaseEngine,
    batch: TensorDict,
    loss_fn: LossFn,
    *,
    epochs: int,
    global_mini_batch_size: int | None,
    log_loss: bool,
) -> tuple[list[dict[str, float]], float, TensorDict]:
    """Epochs × mini-batches of forward/backward + optimizer step, then one LR step.

    Returns one metrics dict per optimizer step, the new learning rate, and the per-token
    outputs of the first mini-batch's forward (before any optimizer step).
    """
    n = int(batch.batch_size[0])
    size = local_mini_batch_size(global_mini_batch_size, n, engine.dp_size)
    engine.set_loss_fn(loss_fn)
    history: list[dict[str, float]] = []
    first: TensorDict | None = None
    with engine.train_mode():
        for _ in range(epochs):
            for start in range(0, n, size):
                out = engine.forward_backward_step(batch[start : start + size])
                first = out.outputs if first is None else first
                grad_norm = engine.optimizer_step()
                engine.optimizer_zero_grad()
                row = {**out.metrics, "grad_norm": grad_norm}
                if log_loss:
                    row["loss"] = float(out.loss or 0.0)
                history.append(row)
        lr = engine.lr_scheduler_step()
    engine.set_loss_fn(None)
    assert first is not None  # epochs >= 1 and a non-empty batch
    return history, lr, first


def local_mini_batch_size(global_size: int | None, local_samples: int, dp_size: int) -> int:
    """This rank's share of a global mini-batch size (the whole local batch when None)."""
    if global_size is None:
        return local_samples
    if global_size % dp_size:
        raise ValueError(
            f"ppo_mini_batch_size={global_size} does not divide by the DP size {dp_size}; "
            f"use a multiple of {dp_size}."
        )
    size = global_size // dp_size
    if local_samples % size:
        works = [d * dp_size for d in range(1, local_samples + 1) if local_samples % d == 0]
        raise ValueError(
            f"ppo_mini_batch_size={global_size} does not divide this update's "
            f"{local_samples * dp_size} samples ({local_samples} on each of {dp_size} DP ranks): "
            f"the last mini-batch would be smaller, and its samples weigh more. Sizes that work: "
            f"{works}."
        )
    return size


def mean_over_steps(prefix: str, history: list[dict[str, Any]], *, lr: float) -> dict[str, float]:
    """Each metric averaged over the optimizer steps of one update (each step weighs the same).

    ``num_optimizer_steps`` counts the updates applied, ``num_skipped_steps`` those the engine
    skipped because the gradient norm was not finite.
    """
    out = {f"{prefix}/{k}": sum(h[k] for h in history) / len(history) for k in history[0]}
    skipped = sum(not math.isfinite(h["grad_norm"]) for h in history)
    out[f"{prefix}/lr"] = lr
    out[f"{prefix}/num_optimizer_steps"] = float(len(history) - skipped)
    out[f"{prefix}/num_skipped_steps"] = float(skipped)
    return out


def non_finite_inputs(batch: TensorDict) -> list[str]:
    """The floating-point fields of ``batch`` that hold NaN or Inf (the usual cause of a
    skipped update: advantages or returns from a reward that was not finite)."""
    return sorted(
        str(k)
        for k in batch.keys()
        if isinstance(batch.get(k), torch.Tensor)
        and batch[k].is_floating_point()
        and not bool(torch.isfinite(batch[k]).all())
    )


def warn_skipped(role: str, skipped: int, total: int, batch: TensorDict) -> None:
    """Warn (once per cause: Python's warning filter) that updates were skipped, and why."""
    causes = non_finite_inputs(batch)
    cause = (
        f"non-finite values in {causes}"
        if causes
        else "the gradients themselves (no input field is non-finite: a loss that overflows?)"
    )
    warnings.warn(
        f"{role}: {skipped} of {total} optimizer steps skipped (non-finite gradient norm); "
        f"cause: {cause}.",
        RuntimeWarning,
        stacklevel=3,
    )
