"""Advantage estimators against straightforward reference loops."""

from __future__ import annotations

import pytest
import torch

from engine_core_roles.algorithms.advantages import (
    AdaptiveKLController,
    FixedKLController,
    gae_advantages,
    group_mean_term,
    grpo_advantages,
    rloo_advantages,
    sequence_to_token_rewards,
    signal_groups,
    stalled_groups,
)


def gae_loop(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    adv, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_v = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_a_loop_with_padding(gamma: float, lam: float) -> None:
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    lengths = [6, 4, 1]
    mask = torch.zeros(3, 6)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    adv, ret = gae_advantages(rewards * mask, values, mask, gamma=gamma, lam=lam)
    for i, n in enumerate(lengths):
        want = gae_loop(rewards[i, :n].tolist(), values[i, :n].tolist(), gamma, lam)
        assert torch.allclose(adv[i, :n], torch.tensor(want), atol=1e-5)
        assert (adv[i, n:] == 0).all()
        assert torch.allclose(ret[i, :n], adv[i, :n] + values[i, :n], atol=1e-6)


def test_gae_left_padding_equals_right_padding() -> None:
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.2, 0.1, 9.0], [9.0, 0.5, 0.2, 0.1]])
    m = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    adv, _ = gae_advantages(r, v, m, gamma=0.9, lam=0.8)
    assert torch.allclose(adv[0, :3], adv[1, 1:])


def test_grpo_against_a_loop() -> None:
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 3.0, 7.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3])
    got = grpo_advantages(scores, groups)
    for gid in range(4):
        idx = (groups == gid).nonzero().squeeze(-1)
        s = scores[idx]
        if len(s) == 1:
            assert got[idx].abs().max() == 0
            continue
        want = (s - s.mean()) / (s.std() + 1e-6)
        assert torch.allclose(got[idx], want, atol=1e-5)
    no_std = grpo_advantages(scores, groups, normalize_std=False)
    assert torch.allclose(no_std[:3], scores[:3] - scores[:3].mean())


def test_the_group_mean_term_pushes_a_group_that_scored_alike_below_the_batch() -> None:
    """A group whose samples all scored the same gets no GRPO advantage, right or wrong; the
    group-mean term (GRPOParams.group_mean_weight) moves it by its mean against the batch's."""
    from engine_core_roles.algorithms.base import AdvantageInputs
    from engine_core_roles.algorithms.builtin import GRPO, GRPOParams

    scores = torch.tensor([0.75, 0.75, 0.75, 1.0, 1.0, 1.0, 0.5, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    term = group_mean_term(scores, groups)
    means = torch.tensor([0.75] * 3 + [1.0] * 3 + [0.75] * 2)
    assert torch.allclose(term, (means - scores.mean()) / (scores.std() + 1e-6))
    assert (term[:3] < 0).all() and (term[3:6] > 0).all()
    assert group_mean_term(torch.tensor([0.3]), torch.tensor([0])).tolist() == [0.0]
    mask = torch.ones(8, 2)

    def estimate(weight: float) -> torch.Tensor:
        estimator = GRPO(GRPOParams(group_mean_weight=weight))
        inputs = AdvantageInputs(scores=scores, mask=mask, group_ids=groups)
        return estimator(inputs).advantages

    plain, mixed = estimate(0.0), estimate(0.5)
    assert (plain[:6] == 0).all()  # the all-alike groups: no gradient under plain GRPO
    assert torch.allclose(mixed, plain + 0.5 * term.unsqueeze(1) * mask)
    # the contrast inside a group is GRPO's, unchanged
    assert torch.allclose(mixed[7] - mixed[6], plain[7] - plain[6])


def test_signal_scale_sizes_the_update_as_if_the_uniform_groups_were_not_there() -> None:
    """GRPOParams.signal_scale: every advantage times the batch's samples over those in groups
    with two different scores (here 8 over 2), the advantages' contrast unchanged."""
    from engine_core_roles.algorithms.base import AdvantageInputs
    from engine_core_roles.algorithms.builtin import GRPO, GRPOParams

    scores = torch.tensor([0.75, 0.75, 0.75, 1.0, 1.0, 1.0, 0.5, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    assert signal_groups(scores, groups).tolist() == [False] * 6 + [True] * 2
    inputs = AdvantageInputs(scores=scores, mask=torch.ones(8, 2), group_ids=groups)
    plain = GRPO(GRPOParams())(inputs).advantages
    scaled = GRPO(GRPOParams(signal_scale=True))(inputs).advantages
    assert torch.allclose(scaled, plain * 4.0) and plain.abs().sum() > 0
    alike = AdvantageInputs(scores=torch.ones(4), mask=torch.ones(4, 2), group_ids=groups[:4])
    assert (GRPO(GRPOParams(signal_scale=True))(alike).advantages == 0).all()


def test_stalled_unlikelihood_weighs_only_the_groups_that_scored_alike_below_the_best() -> None:
    """GRPOParams.stalled_unlikelihood: the samples of a group all at one score below the
    batch's best (group 0, all 0.75) get the weight on every loss token; a group all at the best
    (group 1, all 1.0, maybe all right) and a group whose scores differ (group 2) get none, and
    the advantages are plain GRPO's."""
    from engine_core_roles.algorithms.base import AdvantageInputs
    from engine_core_roles.algorithms.builtin import GRPO, GRPOParams

    scores = torch.tensor([0.75, 0.75, 0.75, 1.0, 1.0, 1.0, 0.5, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    assert stalled_groups(scores, groups).tolist() == [True] * 3 + [False] * 5
    assert stalled_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 8)
    inputs = AdvantageInputs(scores=scores, mask=mask, group_ids=groups)
    plain = GRPO(GRPOParams())(inputs)
    assert plain.unlikelihood_weights is None and "stalled_frac" not in plain.metrics
    got = GRPO(GRPOParams(stalled_unlikelihood=0.3))(inputs)
    assert torch.equal(got.advantages, plain.advantages)
    assert got.unlikelihood_weights is not None
    want = torch.zeros(8, 3)
    want[:3, :2] = 0.3
    assert torch.equal(got.unlikelihood_weights, want)
    assert got.metrics["stalled_frac"] == pytest.approx(3 / 8)
    with pytest.raises(ValueError, match="stalled_unlikelihood"):
        GRPOParams(stalled_unlikelihood=-0.1)


def test_rloo_against_a_loop() -> None:
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0, 3.0])
    groups = torch.tensor([5, 5, 5, 9, 9, 1])
    got = rloo_advantages(scores, groups)
    for i in range(len(scores)):
        others = [scores[j] for j in range(len(scores)) if groups[j] == groups[i] and j != i]
        want = scores[i] - sum(others) / len(others) if others else torch.tensor(0.0)
        assert float(got[i]) == pytest.approx(float(want))


def test_sequence_rewards_land_on_the_last_token() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    r = sequence_to_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert r.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]


def test_kl_controllers() -> None:
    assert FixedKLController(0.1).update(5.0, 10) == 0.1
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=100)
    assert ctl.update(2.0, 10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))  # error clipped at 0.2
    before = ctl.value
    assert ctl.update(0.5, 10) == pytest.approx(before * (1 - 0.2 * 10 / 100))  # clipped at -0.2
    with pytest.raises(ValueError, match="init_coef"):
        AdaptiveKLController(-1, 1, 1)
