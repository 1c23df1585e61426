"""Actor and Critic through an engine: field checks, PPO semantics, metric invariance."""

from __future__ import annotations

from math import inf

import pytest
import torch

from engine_core import BatchError, CapabilityError, predicted_mask
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from engine_core.rollout import ROLLOUT_LOG_PROBS
from engine_core_roles.batch.keys import ADVANTAGES, OLD_LOG_PROBS, OLD_VALUES, RETURNS
from engine_core_roles.models.actor import Actor, ActorConfig
from engine_core_roles.models.critic import Critic, CriticConfig
from tests._models import engine_config, random_batch


def engine(**overrides: object) -> ReferenceEngine:
    e = ReferenceEngine(ReferenceEngineConfig(**engine_config(**overrides)))
    e.init_model()
    return e


def ppo_batch(n: int = 8, seed: int = 0):  # type: ignore[no-untyped-def]
    batch = random_batch(n, seed=seed)
    mask = predicted_mask(batch["attention_mask"])
    mask[:, :3] = False  # the "prompt" part carries no loss
    batch["loss_mask"] = mask.long()
    g = torch.Generator().manual_seed(seed + 1)
    batch[ADVANTAGES] = torch.randn(batch["input_ids"].shape, generator=g) * mask
    return batch


def test_update_actor_names_the_missing_field_and_its_producer() -> None:
    actor = Actor(ActorConfig(), engine())
    with pytest.raises(BatchError, match="old_log_probs.*Actor.compute_log_prob"):
        actor.update_actor(ppo_batch())
    with pytest.raises(BatchError, match="ref_log_probs.*Reference.compute_ref_log_prob"):
        b = ppo_batch()
        b[OLD_LOG_PROBS] = torch.zeros_like(b[ADVANTAGES])
        Actor(ActorConfig(use_kl_loss=True), engine()).update_actor(b)


def test_on_policy_step_semantics() -> None:
    actor = Actor(ActorConfig(), engine())
    batch = ppo_batch()
    batch[OLD_LOG_PROBS] = actor.compute_log_prob(batch)[OLD_LOG_PROBS]
    before = [p.detach().clone() for p in actor.engine.module.parameters()]
    update = actor.update_actor(batch)
    m = update.metrics
    assert update.old_log_probs is None  # recomputed before the update, not returned by it
    mask = batch["loss_mask"].bool()
    assert m["actor/pg_loss"] == pytest.approx(-float(batch[ADVANTAGES][mask].mean()), rel=1e-5)
    assert m["actor/clipfrac"] == 0.0 and 0.0 <= m["actor/approx_kl"] < 1e-6
    assert m["actor/num_optimizer_steps"] == 1.0
    assert any(
        not torch.equal(a, b) for a, b in zip(before, actor.engine.module.parameters(), strict=True)
    )


def test_old_log_probs_from_the_update_equal_a_separate_forward() -> None:
    """old_log_probs=update: one forward fewer, the same old log-probs, loss, metrics and
    weights as recomputing them first (ratio 1 exactly instead of to rounding)."""
    batch = ppo_batch()
    recompute = Actor(ActorConfig(), engine())
    batch[OLD_LOG_PROBS] = recompute.compute_log_prob(batch)[OLD_LOG_PROBS]
    want = recompute.update_actor(batch).metrics
    on_policy = Actor(ActorConfig(old_log_probs="update"), engine())
    update = on_policy.update_actor(batch.exclude(OLD_LOG_PROBS))
    got = update.metrics
    mask = batch["loss_mask"].bool()
    assert update.old_log_probs is not None
    old = update.old_log_probs
    assert torch.allclose(old[mask], batch[OLD_LOG_PROBS][mask], atol=1e-6)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    for a, b in zip(
        on_policy.engine.module.parameters(), recompute.engine.module.parameters(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="old_log_probs=update.*ppo_epochs=2"):
        ActorConfig(old_log_probs="update", ppo_epochs=2)
    with pytest.raises(ValueError, match="ppo_mini_batch_size=4"):
        ActorConfig(old_log_probs="update", ppo_mini_batch_size=4)
    assert ActorConfig(old_log_probs="auto").old_log_probs_from_update
    assert not ActorConfig(old_log_probs="auto", ppo_epochs=2).old_log_probs_from_update


def test_mini_batches_and_epochs() -> None:
    actor = Actor(ActorConfig(ppo_epochs=2, ppo_mini_batch_size=2), engine())
    batch = ppo_batch()
    batch[OLD_LOG_PROBS] = actor.compute_log_prob(batch)[OLD_LOG_PROBS]
    m = actor.update_actor(batch).metrics
    assert m["actor/num_optimizer_steps"] == 8.0
    assert m["actor/clipfrac"] >= 0.0  # later steps are off-policy
    assert m["actor/approx_kl"] > 0.0  # ... so the policy has moved away from the old one


@pytest.mark.parametrize(
    "batching",
    [{"micro_batch_size": 1}, {"micro_batch_size": 3}, {"max_tokens_per_micro_batch": 40}],
)
@pytest.mark.parametrize(
    "correction", [{}, {"mismatch_correction": "tis", "tis_cap": 1.2}], ids=["plain", "tis"]
)
def test_logged_metrics_do_not_depend_on_micro_batching(batching: dict, correction: dict) -> None:
    cfg = ActorConfig(entropy_coeff=0.01, use_kl_loss=True, ppo_mini_batch_size=4, **correction)
    batch = ppo_batch()
    ref = Actor(cfg, engine())
    batch[OLD_LOG_PROBS] = ref.compute_log_prob(batch)[OLD_LOG_PROBS] + 0.05  # slightly off-policy
    batch["ref_log_probs"] = batch[OLD_LOG_PROBS] - 0.1
    g = torch.Generator().manual_seed(5)  # some ratios above the cap, some below
    batch[ROLLOUT_LOG_PROBS] = batch[OLD_LOG_PROBS] + 0.3 * torch.randn(
        batch[OLD_LOG_PROBS].shape, generator=g
    )
    want = ref.update_actor(batch).metrics
    got = Actor(cfg, engine(**batching)).update_actor(batch).metrics
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k
    if correction:
        assert 0.0 < want["actor/tis_truncated_frac"] < 1.0


def test_mismatch_correction_needs_token_aligned_rollout_log_probs() -> None:
    actor = Actor(ActorConfig(mismatch_correction="tis"), engine())
    batch = ppo_batch()
    batch[OLD_LOG_PROBS] = torch.zeros_like(batch[ADVANTAGES])
    with pytest.raises(BatchError, match="rollout_log_probs.*training_batch"):
        actor.update_actor(batch)
    batch[ROLLOUT_LOG_PROBS] = torch.zeros(8, 4)  # as a rollout returns it: response tokens only
    with pytest.raises(BatchError, match=r"rollout_log_probs has shape \(8, 4\).*training_batch"):
        actor.update_actor(batch)
    with pytest.raises(ValueError, match="mis_low"):
        ActorConfig(mismatch_correction="mis", mis_low=1.5)
    with pytest.raises(ValueError, match="mis_level"):
        ActorConfig(mis_level="response")


def test_mismatch_corrections_that_change_nothing_leave_the_update_exact() -> None:
    """TIS with an infinite cap on matching log-probs, and MIS with an infinitely wide band on
    mismatched ones, give the uncorrected update bit for bit; a tiny cap scales the gradient."""
    batch = ppo_batch()
    batch[OLD_LOG_PROBS] = Actor(ActorConfig(), engine()).compute_log_prob(batch)[OLD_LOG_PROBS]

    def update(rollout_log_probs: torch.Tensor, **cfg: object) -> tuple[dict, list]:
        actor = Actor(ActorConfig(**cfg), engine())  # type: ignore[arg-type]
        b = batch.clone()
        b[ROLLOUT_LOG_PROBS] = rollout_log_probs
        metrics = actor.update_actor(b).metrics
        return metrics, [p.detach().clone() for p in actor.engine.module.parameters()]

    g = torch.Generator().manual_seed(3)
    off = batch[OLD_LOG_PROBS] + 0.5 * torch.randn(batch[ADVANTAGES].shape, generator=g)
    want, want_params = update(batch[OLD_LOG_PROBS])
    cases = {
        "tis_truncated_frac": update(batch[OLD_LOG_PROBS], mismatch_correction="tis", tis_cap=inf),
        "mis_masked_frac": update(off, mismatch_correction="mis", mis_low=0.0, mis_high=inf),
    }
    for extra, (got, params) in cases.items():
        assert got.pop(f"actor/{extra}") == 0.0
        assert got == want
        assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))
    got, params = update(batch[OLD_LOG_PROBS], mismatch_correction="tis", tis_cap=1e-3)
    assert got["actor/tis_truncated_frac"] == 1.0  # every ratio, 1, exceeds the cap: w = 1e-3
    assert got["actor/pg_loss"] == pytest.approx(1e-3 * want["actor/pg_loss"], rel=1e-4)
    assert got["actor/grad_norm"] == pytest.approx(1e-3 * want["actor/grad_norm"], rel=1e-4)
    assert any(not torch.equal(a, b) for a, b in zip(params, want_params, strict=True))


def test_critic_learns_returns_and_refuses_a_policy_engine() -> None:
    with pytest.raises(CapabilityError, match="value_head"):
        Critic(CriticConfig(), engine())
    critic = Critic(
        CriticConfig(cliprange_value=None),
        engine(model={"config": {**engine_config()["model"]["config"]}, "value_head": True}),
    )
    batch = ppo_batch()
    batch[RETURNS] = torch.ones_like(batch[ADVANTAGES]) * batch["loss_mask"]
    losses = []
    for _ in range(5):
        batch[OLD_VALUES] = critic.compute_values(batch)[OLD_VALUES]
        losses.append(critic.update_critic(batch)["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0]
    with pytest.raises(BatchError, match="returns"):
        critic.update_critic(ppo_batch())


def test_stalled_unlikelihood_goes_from_the_advantages_into_the_actor_loss() -> None:
    """grpo's stalled_unlikelihood: the trainer's advantage stage writes the weights of the
    samples whose group scored alike below the batch's best, and the actor's loss adds
    w * -log(1 - p) over them, the same value whatever the micro-batching."""
    from engine_core_roles.batch.keys import UNLIKELIHOOD_WEIGHTS
    from engine_core_roles.trainer.config import TrainerConfig
    from engine_core_roles.trainer.estimators import Advantages

    config = TrainerConfig(
        algorithm={"preset": "grpo", "advantage_params": {"stalled_unlikelihood": 0.5}},
        samples_per_prompt=4,
    )
    batch = ppo_batch()
    scores = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.0, 1.0, 1.0, 0.5])  # group 0 stalled
    metrics = Advantages(config, critic=None)(batch, scores)
    mask = batch["loss_mask"].float()
    weights = batch[UNLIKELIHOOD_WEIGHTS]
    assert torch.equal(weights[:4], 0.5 * mask[:4]) and (weights[4:] == 0).all()
    assert metrics["advantage/stalled_frac"] == pytest.approx(0.5)
    lp = Actor(ActorConfig(), engine()).compute_log_prob(batch)[OLD_LOG_PROBS]
    batch[OLD_LOG_PROBS] = lp
    p = lp.exp().clamp(max=1 - 1e-6)  # off the mask lp is 0: p = 1 there
    want = float((-torch.log1p(-p) * weights).sum() / mask.sum())
    for batching in ({}, {"micro_batch_size": 3}):
        got = Actor(ActorConfig(), engine(**batching)).update_actor(batch).metrics
        assert got["actor/unlikelihood_loss"] == pytest.approx(want, rel=1e-5)
    del batch[UNLIKELIHOOD_WEIGHTS]
    plain = Actor(ActorConfig(), engine()).update_actor(batch).metrics
    assert "actor/unlikelihood_loss" not in plain
