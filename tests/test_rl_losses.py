"""RL losses against hand-computed values on small tensors."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from engine_core import GlobalBatchContext
from engine_core_roles.algorithms.losses import (
    entropy_loss,
    kl_penalty,
    mis_weights,
    tis_weights,
    unlikelihood_loss,
    value_loss,
)
from engine_core_roles.algorithms.losses import (
    policy_loss as ppo_loss,
)

# PPO's symmetric clip [0.8, 1.2] and dual bound 3 (the figures below are worked for it)
policy_loss = functools.partial(ppo_loss, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
CTX1 = GlobalBatchContext(global_num_tokens=1, global_num_samples=1)


def one(x: float) -> torch.Tensor:
    return torch.tensor([[x]])


def pg(log_ratio: float, adv: float, **kw: float | None) -> dict[str, float]:
    terms = policy_loss(one(log_ratio), one(0.0), one(adv), one(1.0), CTX1, **kw)  # type: ignore[arg-type]
    return {k: float(v) for k, v in terms.items()}


def test_clip_inactive_inside_the_trust_region() -> None:
    r = math.exp(0.1)  # ratio 1.105 < 1.2
    out = pg(0.1, 2.0)
    assert out["pg_loss"] == pytest.approx(-2.0 * r)
    assert out["clipfrac"] == 0.0


def test_clip_active_for_positive_advantage() -> None:
    out = pg(math.log(1.5), 2.0)  # ratio 1.5 clipped to 1.2
    assert out["pg_loss"] == pytest.approx(-2.0 * 1.2)
    assert out["clipfrac"] == 1.0


def test_clip_active_for_negative_advantage() -> None:
    out = pg(math.log(0.5), -1.0)  # ratio 0.5: max(0.5, 0.8) -> 0.8 * 1
    assert out["pg_loss"] == pytest.approx(0.8)
    assert out["clipfrac"] == 1.0


def test_dual_clip_bounds_large_ratios_with_negative_advantage() -> None:
    out = pg(math.log(5.0), -1.0, clip_ratio_c=3.0)  # unclipped 5.0 -> capped at 3.0
    assert out["pg_loss"] == pytest.approx(3.0)
    assert out["dual_clipfrac"] == 1.0
    assert pg(math.log(5.0), -1.0, clip_ratio_c=None)["pg_loss"] == pytest.approx(5.0)
    assert pg(math.log(5.0), 1.0, clip_ratio_c=3.0)["pg_loss"] == pytest.approx(-1.2)


def test_dual_clip_constant_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        pg(0.0, 1.0, clip_ratio_c=0.5)


def test_aggregation_modes() -> None:
    lp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    ctx = GlobalBatchContext(global_num_tokens=4, global_num_samples=2)
    tm = policy_loss(lp, lp, adv, mask, ctx, aggregation="token-mean")["pg_loss"]
    smtm = policy_loss(lp, lp, adv, mask, ctx, aggregation="seq-mean-token-mean")["pg_loss"]
    smts = policy_loss(lp, lp, adv, mask, ctx, aggregation="seq-mean-token-sum")["pg_loss"]
    assert float(tm) == pytest.approx(-(1 + 2 + 3 + 4) / 4)
    assert float(smtm) == pytest.approx(-((6 / 3) + 4) / 2)
    assert float(smts) == pytest.approx(-(6 + 4) / 2)


@pytest.mark.parametrize("log_ratio", [0.3, -0.3, 2.0, -5.0, 0.01])
def test_approx_kl_is_the_non_negative_k3_estimator(log_ratio: float) -> None:
    want = math.exp(log_ratio) - 1 - log_ratio
    assert pg(log_ratio, 1.0)["approx_kl"] == pytest.approx(want, rel=1e-5)
    assert pg(log_ratio, -1.0)["approx_kl"] > 0.0


def test_approx_kl_is_zero_for_equal_policies_and_never_negative() -> None:
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 6, generator=g) - 2
    mask = torch.ones(4, 6)
    ctx = GlobalBatchContext(global_num_tokens=24, global_num_samples=4)
    adv = torch.randn(4, 6, generator=g)
    assert float(policy_loss(lp, lp, adv, mask, ctx)["approx_kl"]) == 0.0
    for scale in (1e-7, 1e-3, 0.1, 3.0):
        new = lp + scale * torch.randn(4, 6, generator=g)
        assert float(policy_loss(new, lp, adv, mask, ctx)["approx_kl"]) >= 0.0


@pytest.mark.parametrize(
    ("estimator", "want"),
    [
        ("k1", 0.5),
        ("abs", 0.5),
        ("k2", 0.125),
        ("k3", math.exp(-0.5) + 0.5 - 1),
        ("low_var_kl", math.exp(-0.5) + 0.5 - 1),
    ],
)
def test_kl_estimators(estimator: str, want: float) -> None:
    assert float(kl_penalty(one(0.0), one(-0.5), estimator)) == pytest.approx(want)


def test_low_var_kl_is_clamped() -> None:
    assert float(kl_penalty(one(-30.0), one(0.0), "low_var_kl")) == 10.0
    assert float(kl_penalty(one(-30.0), one(0.0), "k3")) > 1e6


def test_value_clipping() -> None:
    # v moved from 0 to 1, clip 0.2 -> clipped value 0.2; return 2: max((1-2)^2, (0.2-2)^2)/2
    out = value_loss(one(1.0), one(0.0), one(2.0), one(1.0), CTX1, clip_range=0.2)
    assert float(out["vf_loss"]) == pytest.approx(0.5 * 1.8**2)
    assert float(out["vf_clipfrac"]) == 1.0
    out = value_loss(one(1.0), one(0.0), one(0.0), one(1.0), CTX1, clip_range=0.2)
    assert float(out["vf_loss"]) == pytest.approx(0.5 * 1.0)  # unclipped error is larger
    assert float(out["vf_clipfrac"]) == 0.0
    out = value_loss(one(1.0), one(0.0), one(2.0), one(1.0), CTX1, clip_range=None)
    assert float(out["vf_loss"]) == pytest.approx(0.5)


def test_entropy_mean() -> None:
    ent = torch.tensor([[1.0, 3.0, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    ctx = GlobalBatchContext(global_num_tokens=2, global_num_samples=1)
    assert float(entropy_loss(ent, mask, ctx)) == pytest.approx(2.0)


# ------------------------------------------------------------- rollout/trainer mismatch correction
def row(*xs: float) -> torch.Tensor:
    return torch.tensor([list(xs)])


def test_tis_weights_are_the_ratio_truncated_at_the_cap() -> None:
    old = row(0.0, 0.0, 0.0, 0.0)
    rollout = row(0.0, math.log(2.0), -math.log(3.0), 5.0)  # ratios 1, 0.5, 3, e^-5
    mask = row(1, 1, 1, 0)  # the last token carries no loss: not counted as truncated
    ctx = GlobalBatchContext(global_num_tokens=3, global_num_samples=1)
    weights, metrics = tis_weights(old, rollout, mask, ctx, cap=2.0)
    assert weights.tolist()[0] == pytest.approx([1.0, 0.5, 2.0, math.exp(-5.0)])
    assert float(metrics["tis_truncated_frac"]) == pytest.approx(1 / 3)
    weights, metrics = tis_weights(old, rollout, mask, ctx, cap=math.inf)
    assert weights.tolist()[0] == pytest.approx([1.0, 0.5, 3.0, math.exp(-5.0)])
    assert float(metrics["tis_truncated_frac"]) == 0.0


@pytest.mark.parametrize("cap", [0.0, -1.0, math.nan])
def test_tis_cap_must_be_positive(cap: float) -> None:
    with pytest.raises(ValueError, match="tis cap must be > 0"):
        tis_weights(one(0.0), one(0.0), one(1.0), CTX1, cap=cap)


def test_mis_token_level_drops_the_tokens_outside_the_band() -> None:
    old = row(0.0, 0.0, 0.0, 0.0, 0.0)
    # ratios 1, 0.4 (below 0.5), 2.5 (above 2), 0.5 and 2 (the ends, kept)
    rollout = row(0.0, -math.log(0.4), -math.log(2.5), math.log(2.0), -math.log(2.0))
    mask = row(1, 1, 1, 1, 1)
    ctx = GlobalBatchContext(global_num_tokens=10, global_num_samples=2)  # a second micro-batch
    weights, metrics = mis_weights(old, rollout, mask, ctx, low=0.5, high=2.0)
    assert weights.tolist() == [[1.0, 0.0, 0.0, 1.0, 1.0]]
    assert float(metrics["mis_masked_frac"]) == pytest.approx(2 / 10)  # this share of the mean
    weights, metrics = mis_weights(old, rollout, mask, ctx, low=0.0, high=math.inf)
    assert weights.tolist() == [[1.0] * 5] and float(metrics["mis_masked_frac"]) == 0.0


def test_mis_sequence_level_uses_the_geometric_mean_ratio() -> None:
    old = torch.zeros(2, 4)
    # row 0: log-ratios 1.0, -0.2 (prompt position 0 ignored): mean 0.4, ratio e^0.4 = 1.49, kept
    # row 1: log-ratios 1.0, 0.6, 0.5: mean 0.7, ratio e^0.7 = 2.01 > 2, dropped whole
    rollout = -torch.tensor([[9.0, 1.0, -0.2, 0.0], [9.0, 1.0, 0.6, 0.5]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])
    ctx = GlobalBatchContext(global_num_tokens=5, global_num_samples=2)
    weights, metrics = mis_weights(old, rollout, mask, ctx, level="sequence")
    assert (weights * mask).tolist() == [[0, 1, 1, 0], [0, 0, 0, 0]]
    assert float(metrics["mis_masked_frac"]) == pytest.approx(3 / 5)
    # token level drops only the tokens of log-ratio 1 (e^1 = 2.72 > 2): one in each row
    weights, metrics = mis_weights(old, rollout, mask, ctx, level="token")
    assert (weights * mask).tolist() == [[0, 0, 1, 0], [0, 0, 1, 1]]
    assert float(metrics["mis_masked_frac"]) == pytest.approx(2 / 5)


@pytest.mark.parametrize(("low", "high"), [(-0.1, 2.0), (1.5, 2.0), (0.5, 0.9), (math.nan, 2.0)])
def test_mis_band_must_hold_one(low: float, high: float) -> None:
    with pytest.raises(ValueError, match="0 <= low <= 1 <= high"):
        mis_weights(one(0.0), one(0.0), one(1.0), CTX1, low=low, high=high)


def test_policy_loss_weights_scale_tokens_but_keep_the_denominator() -> None:
    lp = torch.zeros(1, 3)
    adv = row(1.0, 2.0, 3.0)
    mask = row(1, 1, 1)
    ctx = GlobalBatchContext(global_num_tokens=3, global_num_samples=1)
    # on policy: per-token loss -adv; weights 2, 0, 0.5 -> -(2 + 0 + 1.5) / 3 (not / 2)
    for agg in ("token-mean", "seq-mean-token-mean"):
        terms = policy_loss(lp, lp, adv, mask, ctx, aggregation=agg, weights=row(2.0, 0.0, 0.5))
        assert float(terms["pg_loss"]) == pytest.approx(-3.5 / 3)
    with pytest.raises(ValueError, match="one weight per token"):
        policy_loss(lp, lp, adv, mask, ctx, weights=torch.ones(3))


def test_policy_loss_weights_are_constants_to_the_gradient() -> None:
    lp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[3.0, 0.0]], requires_grad=True)
    ctx = GlobalBatchContext(global_num_tokens=2, global_num_samples=1)
    policy_loss(lp, lp.detach(), row(1.0, 1.0), row(1, 1), ctx, weights=w)["pg_loss"].backward()
    # d/dlp of -adv * exp(lp - old) * w / 2 at lp = old: -w / 2
    assert lp.grad is not None and lp.grad.tolist() == [[-1.5, 0.0]]
    assert w.grad is None


def test_unlikelihood_moves_a_sure_token_where_the_policy_gradient_vanishes() -> None:
    """A token the policy is sure of (p = 1 - 1e-5): a negative advantage's gradient in its
    logit is -A * (1 - p), about 1e-5; the unlikelihood term's is w * p, about w. Weight 0 and
    masked tokens add nothing; the value is -w * log(1 - p) over the loss tokens."""
    logits = torch.tensor([[[12.0, 0.5, 0.5], [0.0, 0.0, 0.0]]], requires_grad=True)
    log_probs = torch.log_softmax(logits, -1)[..., 0]  # the sampled token: index 0
    p = float(log_probs[0, 0].exp())
    assert 1 - p < 1e-4
    mask = torch.tensor([[1.0, 1.0]])
    ctx = GlobalBatchContext(global_num_tokens=2, global_num_samples=1)
    ul = unlikelihood_loss(log_probs, torch.tensor([[0.5, 0.0]]), mask, ctx)
    assert float(ul) == pytest.approx(0.5 * -math.log1p(-p) / 2, rel=1e-4)
    (grad,) = torch.autograd.grad(ul, logits, retain_graph=True)
    assert float(grad[0, 0, 0]) == pytest.approx(0.5 * p / 2, rel=1e-4)  # pushed down
    assert (grad[0, 1] == 0).all()  # weight 0: untouched
    adv = torch.tensor([[-1.0, 0.0]])
    pg = policy_loss(log_probs, log_probs.detach(), adv, mask, ctx)["pg_loss"]
    (pg_grad,) = torch.autograd.grad(pg, logits)
    assert 0 < float(pg_grad[0, 0, 0]) < 1e-4 < float(grad[0, 0, 0])
    off = unlikelihood_loss(log_probs, torch.ones(1, 2), torch.zeros(1, 2), ctx)
    assert float(off) == 0.0
