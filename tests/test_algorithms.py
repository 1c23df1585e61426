"""The algorithm plugins: each advantage estimator and policy loss against hand-written
formulas, the loss contract at 1 and 2 DP ranks, refusals before anything is built, presets and
the registry.

Expected values are written with plain Python loops and arithmetic, never by calling the code
under test.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

from engine_core import GlobalBatchContext, LossAggregation
from engine_core.errors import ConfigError, DuplicateBackendError, PluginError
from engine_core.hookspecs import AlgorithmKind, AlgorithmNeed, BackendRegistry, hookimpl
from engine_core.plugins import PluginManager, load_plugins
from engine_core.settings import Settings
from engine_core_roles.algorithms import plugin as shipped_plugin
from engine_core_roles.algorithms.base import (
    AdvantageEstimator,
    AdvantageInputs,
    NoParams,
    PolicyLoss,
    PolicyLossInputs,
)
from engine_core_roles.algorithms.builtin import (
    CISPO,
    GAE,
    GRPO,
    GSPO,
    RLOO,
    CISPOParams,
    GRPOParams,
    GSPOParams,
    PPOClip,
    PPOClipParams,
    ReinforcePP,
    ReinforcePPBaseline,
)
from engine_core_roles.algorithms.select import (
    PRESETS,
    AlgorithmConfig,
    build_policy_loss,
    check_needs,
    resolve_algorithm,
)
from engine_core_roles.batch.keys import OLD_LOG_PROBS
from engine_core_roles.jobs.cli import RECIPES, load_recipe
from engine_core_roles.jobs.rl.config import RLJobConfig
from engine_core_roles.models.actor import Actor, ActorConfig
from engine_core_roles.models.critic import CriticConfig
from engine_core_roles.trainer.config import TrainerConfig
from tests._dist import run_distributed
from tests.test_roles import engine, ppo_batch

MODES = list(LossAggregation)
NORM_LENGTH = 7
SHIPPED_ADVANTAGES = ["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
SHIPPED_LOSSES = ["ppo_clip", "gspo", "cispo"]

# -- 1. advantage estimators ---------------------------------------------------------------------

# three groups of unequal size, their ids interleaved: 7 (4 samples, unequal scores), 3 (3
# samples, all 2.0), 11 (2 samples, a wide spread)
GROUPS = [7, 3, 7, 11, 3, 7, 11, 3, 7]
SCORES = [1.0, 2.0, 0.0, -1.0, 2.0, 0.5, 4.0, 2.0, 3.0]
EQUAL_GROUP = [1, 4, 7]
# ragged responses: full, holes in the middle, left padding, a single token
MASK = [
    [1, 1, 1, 1, 1, 1],
    [1, 1, 0, 1, 0, 0],
    [0, 0, 1, 1, 1, 0],
    [1, 0, 0, 0, 0, 0],
    [1, 0, 1, 0, 1, 1],
    [1, 1, 1, 1, 0, 0],
    [0, 1, 1, 0, 1, 0],
    [1, 1, 1, 1, 1, 0],
    [0, 0, 0, 0, 0, 1],
]
N, L = len(MASK), len(MASK[0])
GAMMA, LAM = 0.9, 0.8


def _values() -> list[list[float]]:
    """The critic's values: arbitrary on the loss tokens, 50 elsewhere (must be skipped)."""
    return [
        [0.1 * ((3 * i + 5 * t) % 7) - 0.3 if MASK[i][t] else 50.0 for t in range(L)]
        for i in range(N)
    ]


def _members(i: int) -> list[float]:
    return [SCORES[j] for j in range(N) if GROUPS[j] == GROUPS[i]]


def _on_tokens(per_sample: list[float]) -> list[list[float]]:
    return [[per_sample[i] if MASK[i][t] else 0.0 for t in range(L)] for i in range(N)]


def _whiten(x: list[list[float]], eps: float = 1e-8) -> list[list[float]]:
    vals = [x[i][t] for i in range(N) for t in range(L) if MASK[i][t]]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))  # biased
    return [
        [(x[i][t] - mean) / (std + eps) if MASK[i][t] else 0.0 for t in range(L)] for i in range(N)
    ]


def _loss_positions(i: int) -> list[int]:
    return [t for t in range(L) if MASK[i][t]]


def want_grpo(normalize_std: bool) -> list[list[float]]:
    adv = []
    for i in range(N):
        members = _members(i)
        mean = sum(members) / len(members)
        a = SCORES[i] - mean
        if normalize_std:
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
            a = a / (std + 1e-6)
        adv.append(a)
    return _on_tokens(adv)


def want_rloo() -> list[list[float]]:
    adv = []
    for i in range(N):
        members = _members(i)
        adv.append(SCORES[i] - (sum(members) - SCORES[i]) / (len(members) - 1))
    return _on_tokens(adv)


def want_reinforce_pp() -> list[list[float]]:
    returns = [[0.0] * L for _ in range(N)]
    for i in range(N):
        pos = _loss_positions(i)
        running = 0.0
        for t in reversed(pos):
            reward = SCORES[i] if t == pos[-1] else 0.0
            running = reward + GAMMA * running
            returns[i][t] = running
    return _whiten(returns)


def want_reinforce_pp_baseline() -> list[list[float]]:
    centered = [SCORES[i] - sum(_members(i)) / len(_members(i)) for i in range(N)]
    return _whiten(_on_tokens(centered))


def want_gae() -> tuple[list[list[float]], list[list[float]]]:
    values = _values()
    adv = [[0.0] * L for _ in range(N)]
    ret = [[0.0] * L for _ in range(N)]
    for i in range(N):
        pos = _loss_positions(i)
        running, next_value = 0.0, 0.0
        for t in reversed(pos):
            reward = SCORES[i] if t == pos[-1] else 0.0
            delta = reward + GAMMA * next_value - values[i][t]
            running = delta + GAMMA * LAM * running
            adv[i][t] = running
            ret[i][t] = running + values[i][t]
            next_value = values[i][t]
    return _whiten(adv), ret


ESTIMATORS: dict[str, tuple[AdvantageEstimator, Any]] = {
    "grpo": (GRPO(GRPOParams()), lambda: want_grpo(True)),
    "dr_grpo": (GRPO(GRPOParams(normalize_std=False)), lambda: want_grpo(False)),
    "rloo": (RLOO(NoParams()), want_rloo),
    "reinforce_pp": (ReinforcePP(NoParams()), want_reinforce_pp),
    "reinforce_pp_baseline": (ReinforcePPBaseline(NoParams()), want_reinforce_pp_baseline),
    "gae": (GAE(NoParams()), lambda: want_gae()[0]),
}


def _advantage_inputs() -> AdvantageInputs:
    return AdvantageInputs(
        scores=torch.tensor(SCORES),
        group_ids=torch.tensor(GROUPS),
        mask=torch.tensor(MASK),
        values=torch.tensor(_values()),
        gamma=GAMMA,
        lam=LAM,
    )


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_estimator_matches_its_formula(name: str) -> None:
    estimator, want = ESTIMATORS[name]
    result = estimator(_advantage_inputs())
    adv = result.advantages
    assert adv.shape == (N, L) and adv.is_floating_point()
    assert torch.allclose(adv, torch.tensor(want()), atol=1e-5), (adv - torch.tensor(want())).abs()
    off = ~torch.tensor(MASK).bool()
    assert (adv[off] == 0).all()  # exactly 0 off the mask
    if name in ("grpo", "dr_grpo", "rloo"):
        assert (adv[EQUAL_GROUP] == 0).all()  # a group of equal scores carries no signal
    if name == "gae":
        assert result.returns is not None
        assert torch.allclose(result.returns, torch.tensor(want_gae()[1]), atol=1e-5)
    else:
        assert result.returns is None


def test_gae_refuses_to_run_without_values() -> None:
    inputs = AdvantageInputs(torch.tensor(SCORES), torch.tensor(GROUPS), torch.tensor(MASK))
    with pytest.raises(ValueError, match="critic"):
        GAE(NoParams())(inputs)


# -- 2. policy losses -----------------------------------------------------------------------------

# per-token ratios exp(log_probs - old_log_probs) and advantages, on both sides of every clip
# bound; the third token of row 0 and the first of row 2 are off the mask (garbage values that
# must not count)
LOSS_MASK = [[1, 1, 0, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
RATIOS = [[1.5, 1.1, math.e**2, 0.5, 0.7], [5.0, 1.5, 0.9, 3.0, 3.0], [9.0, 1.2, 1.4, 0.6, 2.0]]
ADVS = [[1.0, -0.5, 9.0, -2.0, 0.5], [-1.0, -1.5, 2.0, 4.0, 4.0], [9.0, 0.3, 0.8, -0.4, -0.1]]
B, T = len(LOSS_MASK), len(LOSS_MASK[0])
PPO_PARAMS = PPOClipParams(
    clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0
)  # [0.8, 1.28]
GSPO_PARAMS = GSPOParams(clip_ratio_low=0.1, clip_ratio_high=0.2)  # [0.9, 1.2]
CISPO_PARAMS = CISPOParams(clip_ratio_low=0.35, clip_ratio_high=0.28)  # [0.65, 1.28]
LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": PPOClip(PPO_PARAMS),
    "gspo": GSPO(GSPO_PARAMS),
    "cispo": CISPO(CISPO_PARAMS),
}


def _old(i: int, t: int) -> float:
    return -1.0 - 0.1 * (i * T + t)


def _agg_weights(mode: LossAggregation) -> list[list[float]]:
    """d(aggregated loss)/d(per-token value) for every token of the fixed batch."""
    lengths = [sum(row) for row in LOSS_MASK]
    n_tokens, n_seqs = sum(lengths), sum(1 for n in lengths if n)
    out = []
    for i in range(B):
        if mode is LossAggregation.TOKEN_MEAN:
            w = 1 / n_tokens
        elif mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
            w = 1 / (lengths[i] * n_seqs)
        elif mode is LossAggregation.SEQ_MEAN_TOKEN_SUM:
            w = 1 / n_seqs
        else:
            w = 1 / (NORM_LENGTH * n_seqs)
        out.append([w if LOSS_MASK[i][t] else 0.0 for t in range(T)])
    return out


def _ppo_token(r: float, a: float) -> tuple[float, float, bool, bool]:
    """(value, d value / d log_prob, clipped, dual-clipped)."""
    lo, hi = 1 - PPO_PARAMS.clip_ratio_low, 1 + PPO_PARAMS.clip_ratio_high
    unclipped, clipped = -a * r, -a * min(max(r, lo), hi)
    if lo <= r <= hi or unclipped >= clipped:
        value, grad, was_clipped = unclipped, -a * r, False
    else:
        value, grad, was_clipped = clipped, 0.0, True
    bound = None if PPO_PARAMS.clip_ratio_c is None else -a * PPO_PARAMS.clip_ratio_c
    dual = bound is not None and a < 0 and value > bound
    if dual and bound is not None:
        value, grad = bound, 0.0
    return value, grad, was_clipped, dual


def _gspo_token(s: float, a: float) -> tuple[float, float, bool]:
    """(value, d value / d s, clipped) for the sequence ratio s."""
    lo, hi = 1 - GSPO_PARAMS.clip_ratio_low, 1 + GSPO_PARAMS.clip_ratio_high
    unclipped, clipped = -a * s, -a * min(max(s, lo), hi)
    if lo <= s <= hi or unclipped >= clipped:
        return unclipped, -a, False
    return clipped, 0.0, True


def want_policy_loss(name: str, mode: LossAggregation) -> dict[str, Any]:
    weights = _agg_weights(mode)
    n_tokens = sum(map(sum, LOSS_MASK))
    loss, clipfrac, dual_frac, kl = 0.0, 0.0, 0.0, 0.0
    grad = [[0.0] * T for _ in range(B)]
    for i in range(B):
        pos = [t for t in range(T) if LOSS_MASK[i][t]]
        seq_ratio = math.exp(sum(math.log(RATIOS[i][t]) for t in pos) / len(pos))
        for t in pos:
            r, a, w = RATIOS[i][t], ADVS[i][t], weights[i][t]
            logp = _old(i, t) + math.log(r)
            kl += (r - 1 - math.log(r)) / n_tokens
            if name == "ppo_clip":
                value, g, clipped, dual = _ppo_token(r, a)
                dual_frac += dual / n_tokens
            elif name == "gspo":
                value, dvalue_ds, clipped = _gspo_token(seq_ratio, a)
                g = dvalue_ds * seq_ratio  # d s_t / d log_prob_t = s
            else:
                lo = 1 - CISPO_PARAMS.clip_ratio_low
                hi = 1 + CISPO_PARAMS.clip_ratio_high
                weight = min(max(r, lo), hi)
                value, g, clipped = -weight * a * logp, -weight * a, not lo <= r <= hi
            loss += w * value
            grad[i][t] = w * g
            clipfrac += clipped / n_tokens
    out = {"pg_loss": loss, "clipfrac": clipfrac, "approx_kl": kl, "grad": grad}
    if name == "ppo_clip":
        out["dual_clipfrac"] = dual_frac
    return out


def _loss_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.tensor([[_old(i, t) for t in range(T)] for i in range(B)], dtype=torch.float64)
    log_probs = old + torch.tensor(RATIOS, dtype=torch.float64).log()
    return log_probs, old, torch.tensor(ADVS, dtype=torch.float64), torch.tensor(LOSS_MASK)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(LOSSES))
def test_policy_loss_matches_its_formula(name: str, mode: LossAggregation) -> None:
    log_probs, old, adv, mask = _loss_tensors()
    log_probs.requires_grad_(True)
    ctx = GlobalBatchContext(global_num_tokens=11, global_num_samples=3)
    terms = LOSSES[name](
        PolicyLossInputs(
            log_probs=log_probs,
            old_log_probs=old,
            advantages=adv,
            mask=mask,
            ctx=ctx,
            aggregation=mode,
            norm_length=NORM_LENGTH,
        )
    )
    terms["pg_loss"].backward()
    want = want_policy_loss(name, mode)
    assert set(terms) == set(want) - {"grad"}
    for key, value in terms.items():
        assert float(value.detach()) == pytest.approx(want[key], abs=1e-6), key
        assert key == "pg_loss" or not value.requires_grad, key  # diagnostics are detached
    assert log_probs.grad is not None
    assert torch.allclose(
        log_probs.grad, torch.tensor(want["grad"], dtype=torch.float64), atol=1e-6
    )
    # the fixed batch exercises both branches: some tokens clipped, some not
    assert 0 < want["clipfrac"] < 1


# -- 3. the loss contract: invariance to micro-batches and DP ranks -------------------------------

INV_MASK = [
    [1, 1, 1, 0, 0, 0],
    [0, 1, 0, 1, 1, 1],
    [1, 1, 1, 1, 1, 1],
    [0, 0, 0, 0, 0, 0],  # no loss token: counts in no denominator
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 1, 1, 0],
    [0, 0, 1, 1, 1, 1],
]
MICRO_BATCHES = [[0, 1, 2], [3], [4, 5], [6]]  # sizes 3, 1, 2, 1
RANK_MICRO_BATCHES = [[[0, 1, 2], [3]], [[4, 5], [6]]]  # rank 0 holds 4 sequences, rank 1 3
INV_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": PPOClip(PPO_PARAMS),
    "gspo": GSPO(GSPOParams(clip_ratio_low=0.05, clip_ratio_high=0.05)),
    "cispo": CISPO(CISPOParams()),
}


def _inv_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    mask = torch.tensor(INV_MASK)
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    log_probs = old + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    return log_probs, old, adv, mask


def _summed_terms(
    name: str, mode: LossAggregation, micro_batches: list[list[int]], dp_size: int
) -> tuple[dict[str, float], torch.Tensor]:
    """Each term summed over ``micro_batches`` (this rank's), and the gradient they leave on
    the whole batch's log-probs; the context holds the whole batch's counts."""
    log_probs, old, adv, mask = _inv_batch()
    log_probs.requires_grad_(True)
    ctx = GlobalBatchContext(
        global_num_tokens=int(mask.sum()),
        global_num_samples=int((mask.sum(-1) > 0).sum()),
        dp_size=dp_size,
        num_micro_batches=len(micro_batches),
    )
    sums: dict[str, float] = {}
    for rows in micro_batches:
        idx = torch.tensor(rows)
        terms = INV_LOSSES[name](
            PolicyLossInputs(
                log_probs=log_probs[idx],
                old_log_probs=old[idx],
                advantages=adv[idx],
                mask=mask[idx],
                ctx=ctx,
                aggregation=mode,
                norm_length=NORM_LENGTH,
            )
        )
        terms["pg_loss"].backward()
        for k, v in terms.items():
            sums[k] = sums.get(k, 0.0) + float(v.detach())
    assert log_probs.grad is not None
    return sums, log_probs.grad


def _dp_worker(rank: int, world_size: int) -> dict[tuple[str, str], Any]:
    out = {}
    for name in INV_LOSSES:
        for mode in MODES:
            sums, grad = _summed_terms(name, mode, RANK_MICRO_BATCHES[rank], world_size)
            keys = sorted(sums)
            values = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
            dist.all_reduce(values)
            dist.all_reduce(grad)
            out[name, str(mode)] = (dict(zip(keys, values.tolist(), strict=True)), grad)
    return out


def _assert_same(got: tuple[dict[str, float], torch.Tensor], want: Any, what: str) -> None:
    (got_terms, got_grad), (want_terms, want_grad) = got, want
    assert got_terms.keys() == want_terms.keys(), what
    for k, v in want_terms.items():
        assert got_terms[k] == pytest.approx(v, abs=1e-6), (what, k)
    assert torch.allclose(got_grad, want_grad, atol=1e-6), (what, (got_grad - want_grad).abs())


def test_losses_do_not_depend_on_micro_batches_or_dp_ranks() -> None:
    whole = {
        (name, str(mode)): _summed_terms(name, mode, [list(range(len(INV_MASK)))], 1)
        for name in INV_LOSSES
        for mode in MODES
    }
    for (name, mode), want in whole.items():
        assert want[1].abs().sum() > 0, (name, mode)  # a gradient to compare
        one_rank = _summed_terms(name, LossAggregation(mode), MICRO_BATCHES, 1)
        _assert_same(one_rank, want, f"1 rank, {name}, {mode}")
    ranks = run_distributed(_dp_worker, 2)
    for rank, results in enumerate(ranks):
        assert results.keys() == whole.keys()
        for key, want in whole.items():
            _assert_same(results[key], want, f"rank {rank} of 2, {key}")


@pytest.mark.parametrize(
    ("policy_loss", "params"),
    [
        ("gspo", {"clip_ratio_low": 0.01, "clip_ratio_high": 0.01}),
        ("cispo", {"clip_ratio_low": 0.5, "clip_ratio_high": 0.03}),
    ],
)
def test_actor_metrics_do_not_depend_on_micro_batching(
    policy_loss: str, params: dict[str, float]
) -> None:
    cfg = ActorConfig(loss_norm_length=NORM_LENGTH, ppo_mini_batch_size=4, entropy_coeff=0.01)
    algorithm = AlgorithmConfig(
        policy_loss=policy_loss,
        policy_loss_params=params,
        loss_agg_mode="seq-mean-token-sum-norm",
    )
    batch = ppo_batch()
    ref = Actor(cfg, engine(), algorithm)
    g = torch.Generator().manual_seed(4)
    noise = 0.05 * torch.randn(batch["loss_mask"].shape, generator=g)
    batch[OLD_LOG_PROBS] = ref.compute_log_prob(batch)[OLD_LOG_PROBS] + noise  # off-policy
    want = ref.update_actor(batch).metrics
    got = Actor(cfg, engine(micro_batch_size=1), algorithm).update_actor(batch).metrics
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k
    assert 0.0 < want["actor/clipfrac"] < 1.0  # both branches of the clip are exercised


# -- 4. refusals before anything is built ---------------------------------------------------------


@pytest.mark.parametrize(
    ("trainer", "match"),
    [
        (
            {"algorithm": {"advantage": "rloo", "advantage_params": {"bogus": 1}}},
            r"advantage_params\.bogus",
        ),
        (
            {"algorithm": {"policy_loss": "gspo", "policy_loss_params": {"clip_ratio_low": -1}}},
            r"policy_loss_params\.clip_ratio_low\s.*greater than or equal to 0",
        ),
        (
            {"algorithm": {"advantage": "rlooo"}},
            r"unknown advantage 'rlooo'; registered: .*grpo.*reinforce_pp_baseline.*; "
            r"did you mean 'rloo'\?",
        ),
        (
            {"algorithm": {"policy_loss": "gspoo"}},
            r"unknown policy_loss 'gspoo'; registered: .*cispo.*ppo_clip.*did you mean 'gspo'\?",
        ),
        ({"algorithm": "grpoo"}, r"unknown algorithm preset 'grpoo'.*did you mean 'grpo'\?"),
        (
            {"algorithm": "gspo", "samples_per_prompt": 1},
            r"samples_per_prompt must be >= 2 \(got 1\)",
        ),
        (
            {
                "algorithm": {"advantage": "reinforce_pp", "policy_loss": "gspo"},
                "samples_per_prompt": 1,
            },
            r"policy loss 'gspo'.*samples_per_prompt must be >= 2",
        ),
    ],
    ids=[
        "unknown-param",
        "bad-param-value",
        "unknown-advantage",
        "unknown-loss",
        "unknown-preset",
        "preset-needs-groups",
        "loss-needs-groups",
    ],
)
def test_trainer_config_refuses_bad_algorithms(trainer: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainerConfig(**trainer)


def test_registered_names_are_all_listed_when_one_is_unknown() -> None:
    with pytest.raises(ValueError) as info:
        TrainerConfig(algorithm={"advantage": "rlooo"})
    assert all(name in str(info.value) for name in SHIPPED_ADVANTAGES)


def test_check_needs_names_the_missing_critic() -> None:
    ppo = resolve_algorithm(AlgorithmConfig.model_validate("ppo"))
    with pytest.raises(ConfigError, match=r"advantage 'gae'.*no\s+critic"):
        check_needs(ppo, has_critic=False, samples_per_prompt=4)
    check_needs(ppo, has_critic=True, samples_per_prompt=4)
    check_needs(ppo, has_critic=None, samples_per_prompt=1)  # ppo needs no groups
    grpo = resolve_algorithm(AlgorithmConfig.model_validate("grpo"))
    with pytest.raises(ConfigError, match="a critic is configured"):
        check_needs(grpo, has_critic=True, samples_per_prompt=4)


def test_roles_refuse_bad_loss_settings() -> None:
    e = engine()
    with pytest.raises(ValueError, match="loss_norm_length"):
        Actor(ActorConfig(), e, AlgorithmConfig(loss_agg_mode="seq-mean-token-sum-norm"))
    with pytest.raises(
        ConfigError, match=r"trainer\.algorithm\.policy_loss: .*did you mean 'cispo'\?"
    ):
        Actor(ActorConfig(), e, AlgorithmConfig(policy_loss="cispoo"))
    with pytest.raises(ValueError, match=r"trainer\.algorithm\.policy_loss_params\.clip_ratio_low"):
        bad = {"clip_ratio_low": 2}
        Actor(ActorConfig(), e, AlgorithmConfig(policy_loss="cispo", policy_loss_params=bad))
    with pytest.raises(ValueError, match=r"critic\.loss_agg_mode=seq-mean-token-sum-norm"):
        CriticConfig(loss_agg_mode="seq-mean-token-sum-norm")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("policy_loss", "gspo"),
        ("policy_loss_params", {"clip_ratio_high": 0.3}),
        ("loss_agg_mode", "seq-mean-token-mean"),
    ],
)
def test_the_actor_refuses_the_algorithms_keys(key: str, value: Any) -> None:
    """The policy loss, its parameters and the aggregation are declared by the algorithm
    alone: the actor section refuses them, saying what it got and where they live."""
    with pytest.raises(ValidationError) as info:
        ActorConfig(**{key: value})
    assert f"got actor.{key}={value!r}" in str(info.value)
    assert f"Set trainer.algorithm.{key} instead" in str(info.value)
    with pytest.raises(ValueError, match=rf"got actor\.{key}=.*trainer\.algorithm\.{key}"):
        _job(f"actor.{key}={value if isinstance(value, str) else '{clip_ratio_high: 0.3}'}")


@pytest.mark.parametrize("key", ["clip_ratio_low", "clip_ratio_high", "clip_ratio_c"])
def test_the_clip_range_is_the_policy_losss(key: str) -> None:
    """The clip range is declared once, by the policy loss (ppo_clip's PPOClipParams): the actor
    refuses it, naming where it lives, and the loss reads its own parameter."""
    with pytest.raises(
        ValueError, match=rf"got actor\.{key}=0\.3.*trainer\.algorithm\.policy_loss_params\.{key}"
    ):
        _job(f"actor.{key}=0.3")
    assert "clip_ratio_high" not in ActorConfig.model_fields
    loss = resolve_algorithm(
        _job(f"trainer.algorithm.policy_loss_params.{key}=1.5").trainer.algorithm
    ).build_policy_loss()
    assert isinstance(loss, PPOClip) and getattr(loss.params, key) == 1.5


def _job(*overrides: str) -> RLJobConfig:
    return RLJobConfig.model_validate(load_recipe(RECIPES / "grpo_tiny.yaml", list(overrides)))


def test_rl_job_config_checks_the_algorithm() -> None:
    with pytest.raises(ValueError, match=r"samples_per_prompt must be >= 2 \(got 1\)"):
        _job("trainer.algorithm=gspo", "trainer.samples_per_prompt=1")
    assert _job("trainer.algorithm=ppo").needs_critic
    assert not _job("trainer.algorithm=grpo").needs_critic
    # the digit task's budget (its response length, 4) is known before anything is built
    with pytest.raises(ValueError, match=r"overlong.buffer=4 must be below the generation budget"):
        _job("trainer.algorithm.overlong.buffer=4")
    assert _job("trainer.algorithm.kl_in_reward.coef=0.1").needs_reference
    assert not _job().needs_reference
    gspo = _job("trainer.algorithm=gspo").trainer.algorithm
    assert (gspo.policy_loss, gspo.loss_agg_mode) == ("gspo", "seq-mean-token-mean")
    dr = _job("trainer.algorithm=dr_grpo")
    assert dr.trainer.algorithm.loss_agg_mode is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM
    assert dr.actor_config().loss_norm_length == dr.generation_budget
    # the algorithm's own aggregation wins over its preset's
    kept = _job("trainer.algorithm={preset: dr_grpo, loss_agg_mode: token-mean}")
    assert kept.trainer.algorithm.loss_agg_mode is LossAggregation.TOKEN_MEAN
    assert kept.actor_config().loss_norm_length is None


# -- 5. presets -----------------------------------------------------------------------------------


def test_presets_fill_the_algorithm() -> None:
    dr = AlgorithmConfig.model_validate("dr_grpo")
    assert (dr.advantage, dr.advantage_params) == ("grpo", {"normalize_std": False})
    assert dr.policy_loss == "ppo_clip"
    assert dr.loss_agg_mode is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM
    estimator = resolve_algorithm(dr).build_estimator()
    assert isinstance(estimator, GRPO) and estimator.params.normalize_std is False

    gspo = AlgorithmConfig.model_validate("gspo")
    assert (gspo.advantage, gspo.policy_loss) == ("grpo", "gspo")

    tuned = AlgorithmConfig.model_validate(
        {"preset": "gspo", "policy_loss_params": {"clip_ratio_high": 5e-4}}
    )
    assert (tuned.policy_loss, tuned.policy_loss_params) == ("gspo", {"clip_ratio_high": 5e-4})
    loss = resolve_algorithm(tuned).build_policy_loss()
    assert isinstance(loss, GSPO)
    assert (loss.params.clip_ratio_low, loss.params.clip_ratio_high) == (3e-4, 5e-4)
    assert tuned.loss_agg_mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN
    plain = AlgorithmConfig.model_validate("grpo")
    assert (plain.policy_loss, plain.policy_loss_params) == ("ppo_clip", {})
    assert plain.loss_agg_mode is LossAggregation.TOKEN_MEAN


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_resolves_and_builds(preset: str) -> None:
    resolved = resolve_algorithm(AlgorithmConfig.model_validate(preset))
    assert resolved.advantage.name == PRESETS[preset].advantage
    assert resolved.policy_loss.name == PRESETS[preset].policy_loss
    assert isinstance(resolved.build_estimator(), AdvantageEstimator)
    assert isinstance(resolved.build_policy_loss(), PolicyLoss)


# -- 6. the registry ------------------------------------------------------------------------------


class _AlgorithmPlugin:
    def __init__(
        self, kind: str, name: str, target: str, needs: tuple[str, ...] = (), override: bool = False
    ) -> None:
        self.kind, self.name, self.target = kind, name, target
        self.needs, self.override = needs, override

    @hookimpl
    def engine_core_register(self, registry: BackendRegistry) -> None:
        register = (
            registry.register_advantage
            if self.kind == "advantage"
            else registry.register_policy_loss
        )
        register(self.name, self.target, needs=self.needs, override=self.override)


@pytest.fixture
def manager() -> PluginManager:
    m = PluginManager(Settings(disable_plugin_autoload=True))
    m.register(shipped_plugin, "algorithms")
    return m


def test_the_shipped_algorithms_are_registered() -> None:
    registry = load_plugins().registry
    assert set(SHIPPED_ADVANTAGES) <= set(registry.algorithm_names("advantage"))
    assert set(SHIPPED_LOSSES) <= set(registry.algorithm_names("policy_loss"))
    needs = {
        s.name: s.needs
        for s in registry.algorithm_specs()
        if s.name in SHIPPED_ADVANTAGES + SHIPPED_LOSSES
    }
    assert needs["gae"] == {AlgorithmNeed.CRITIC}
    assert needs["grpo"] == needs["rloo"] == needs["gspo"] == {AlgorithmNeed.GROUPS}
    assert needs["reinforce_pp"] == needs["ppo_clip"] == needs["cispo"] == frozenset()
    built = build_policy_loss("cispo", {"clip_ratio_high": 0.1})
    assert isinstance(built, CISPO) and built.params.clip_ratio_high == 0.1


def test_duplicate_algorithm_needs_override(manager: PluginManager) -> None:
    target = "engine_core_roles.algorithms.builtin:RLOO"
    with pytest.raises(DuplicateBackendError, match=r"'grpo' is already registered.*override"):
        manager.register(_AlgorithmPlugin("advantage", "grpo", target), "dup")
    assert manager.get_algorithm(AlgorithmKind.ADVANTAGE, "grpo").plugin == "algorithms"
    manager.register(_AlgorithmPlugin("advantage", "grpo", target, override=True), "winner")
    spec = manager.get_algorithm(AlgorithmKind.ADVANTAGE, "grpo")
    assert (spec.plugin, spec.target) == ("winner", target)


def test_unknown_need_is_refused(manager: PluginManager) -> None:
    target = "engine_core_roles.algorithms.builtin:RLOO"
    with pytest.raises(PluginError, match=r"unknown need 'gpu'; allowed: critic, groups"):
        manager.register(_AlgorithmPlugin("advantage", "needy", target, needs=("gpu",)), "bad")
    assert "needy" not in manager.registry.algorithm_names("advantage")


def test_a_target_of_the_wrong_base_class_is_refused_when_built(manager: PluginManager) -> None:
    builtin = "engine_core_roles.algorithms.builtin"
    manager.register(_AlgorithmPlugin("advantage", "lossy", f"{builtin}:PPOClip"), "p1")
    manager.register(_AlgorithmPlugin("policy_loss", "estimating", f"{builtin}:RLOO"), "p2")
    manager.register(_AlgorithmPlugin("advantage", "my_rloo", f"{builtin}:RLOO"), "p3")
    resolved = resolve_algorithm(AlgorithmConfig(advantage="lossy"), manager)  # found, not built
    with pytest.raises(
        PluginError, match=r"'lossy' from plugin 'p1'.*not a subclass of .*AdvantageEstimator"
    ):
        resolved.build_estimator()
    with pytest.raises(PluginError, match=r"not a subclass of .*PolicyLoss"):
        build_policy_loss("estimating", {}, manager)
    good = resolve_algorithm(AlgorithmConfig(advantage="my_rloo"), manager).build_estimator()
    assert isinstance(good, RLOO)


# -- DAPO's overlong shaping ------------------------------------------------------------------


def test_overlong_penalty_is_linear_over_the_buffer_and_reaches_the_scores() -> None:
    from tensordict import TensorDict

    from engine_core import LOSS_MASK
    from engine_core_roles.algorithms.select import OverlongShaping
    from engine_core_roles.batch.keys import ADVANTAGES
    from engine_core_roles.trainer.estimators import Advantages, overlong_penalty

    shaping = OverlongShaping(buffer=4, penalty=0.5)
    lengths = torch.tensor([3, 6, 7, 8, 10])  # budget 10: the penalty starts after 6 tokens
    want = [0.0, 0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty(lengths, 10, shaping).tolist() == pytest.approx(want)

    config = TrainerConfig(
        algorithm={"advantage": "rloo", "overlong": {"buffer": 4, "penalty": 0.5}},
        samples_per_prompt=2,
        max_new_tokens=10,
    )
    mask = torch.zeros(2, 12)
    mask[0, :3] = 1  # 3 tokens: no penalty
    mask[1, :10] = 1  # the whole budget: -0.5
    batch = TensorDict({LOSS_MASK: mask}, batch_size=[2])
    metrics = Advantages(config, critic=None)(batch, torch.tensor([1.0, 1.0]))
    # equal scores, but the long one is shaped down: rloo gives it -0.5, the short one +0.5
    assert batch[ADVANTAGES][0, :3].tolist() == pytest.approx([0.5] * 3)
    assert batch[ADVANTAGES][1, :10].tolist() == pytest.approx([-0.5] * 10)
    assert metrics["reward/overlong_penalty"] == pytest.approx(-0.25)


def test_overlong_buffer_must_leave_room_below_the_budget() -> None:
    with pytest.raises(ValueError, match=r"overlong.buffer=8 must be below max_new_tokens=8"):
        TrainerConfig(algorithm={"overlong": {"buffer": 8}}, max_new_tokens=8)
    with pytest.raises(ValueError, match="buffer"):
        TrainerConfig(algorithm={"overlong": {"buffer": 0}})


# -- KL in the reward ---------------------------------------------------------------------------


def test_token_rewards_reach_every_estimator() -> None:
    """With token rewards (KL in the reward), a sequence-level estimator sees the score plus the
    sample's total, a token-level one sees each token's own."""
    mask = torch.tensor([[0.0, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 0, 0]])
    extra = torch.tensor(
        [[9.0, -0.1, -0.2, 9], [-0.3, 0.1, 9, 9], [9, 0.0, -0.1, -0.4], [0.2, 9, 9, 9]]
    )
    scores, groups = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    inputs = AdvantageInputs(scores=scores, group_ids=groups, mask=mask, token_rewards=extra)
    totals = [1.0 - 0.3, 0.0 - 0.2, 1.0 - 0.5, 1.0 + 0.2]  # off-mask entries (9) never count
    assert inputs.sequence_rewards().tolist() == pytest.approx(totals)
    plain = AdvantageInputs(scores=torch.tensor(totals), group_ids=groups, mask=mask)
    for estimator in (GRPO(GRPOParams()), RLOO(NoParams()), ReinforcePPBaseline(NoParams())):
        got, want = estimator(inputs).advantages, estimator(plain).advantages
        assert torch.allclose(got, want, atol=1e-6), type(estimator).__name__
    # token level: the score on the last loss token, each token's own reward where it is
    per_token = [[0, -0.1, 0.8, 0], [-0.3, 0.1, 0, 0], [0, 0.0, -0.1, 0.6], [1.2, 0, 0, 0]]
    assert inputs.per_token_rewards().tolist() == [pytest.approx(r) for r in per_token]
    gamma = 0.5
    returns = [[0, -0.1 + gamma * 0.8, 0.8, 0], [-0.3 + gamma * 0.1, 0.1, 0, 0]]
    returns += [[0, gamma * (-0.1 + gamma * 0.6), -0.1 + gamma * 0.6, 0.6], [1.2, 0, 0, 0]]
    pairs = zip(returns, mask.tolist(), strict=True)
    flat = [v for row, m in pairs for v, on in zip(row, m, strict=True) if on]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((v - mean) ** 2 for v in flat) / len(flat))
    got = ReinforcePP(NoParams())(dataclasses.replace(inputs, gamma=gamma)).advantages
    for i, row in enumerate(returns):
        for t, v in enumerate(row):
            want_v = (v - mean) / (std + 1e-8) if mask[i, t] else 0.0
            assert got[i, t].item() == pytest.approx(want_v, abs=1e-6), (i, t)


# -- recipes built on another recipe ------------------------------------------------------------


def test_a_recipe_takes_its_base_and_merges_over_it(tmp_path: Path) -> None:
    from engine_core.errors import ConfigError
    from engine_core_roles.jobs.cli import read_recipe

    (tmp_path / "base.yaml").write_text(
        "steps: 5\ntrainer: {samples_per_prompt: 4, temperature: 0.7}\ndata: {demos: [./d.jsonl]}\n"
    )
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "child.yaml").write_text(
        "base: ../base.yaml\ntrainer: {algorithm: rloo, temperature: 1.0}\n"
    )
    got = read_recipe(sub / "child.yaml")
    # the base's paths stay relative to the base; the child's keys merge into its mappings
    assert got == {
        "steps": 5,
        "trainer": {"samples_per_prompt": 4, "temperature": 1.0, "algorithm": "rloo"},
        "data": {"demos": [str((tmp_path / "d.jsonl").resolve())]},
    }
    (tmp_path / "a.yaml").write_text("base: ./b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: ./a.yaml\n")
    with pytest.raises(ConfigError, match=r"cycle \(a.yaml -> b.yaml -> a.yaml\)"):
        read_recipe(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: ./nowhere.yaml\n")
    with pytest.raises(ConfigError, match="nowhere.yaml does not exist"):
        read_recipe(tmp_path / "c.yaml")
    (tmp_path / "e.yaml").write_text("base: [x]\n")
    with pytest.raises(ConfigError, match="base must be the path of another recipe"):
        read_recipe(tmp_path / "e.yaml")


@pytest.mark.parametrize("recipe", ["rloo_text_tiny.yaml", "gspo_text_tiny.yaml"])
def test_the_algorithm_recipes_are_the_text_recipe_with_their_algorithm(recipe: str) -> None:
    text = load_recipe(RECIPES / "text_tiny.yaml")
    raw = load_recipe(RECIPES / recipe)
    job = RLJobConfig.model_validate(raw)
    assert job.trainer.algorithm.name == recipe.split("_")[0]
    # everything else is the text recipe's
    assert {k: v for k, v in raw.items() if k not in ("trainer", "output_dir")} == {
        k: v for k, v in text.items() if k not in ("trainer", "output_dir")
    }


def test_a_gspo_job_runs_and_logs_its_loss(tmp_path: Path) -> None:
    import json

    from engine_core_roles.jobs.rl.run import run_rl_job

    overrides = ["steps=2", "warmup_sft_steps=0", "eval.every=0", f"output_dir={tmp_path}"]
    run_rl_job(load_recipe(RECIPES / "gspo_text_tiny.yaml", overrides), load_plugins())
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    # one optimizer step on fresh samples: every sequence ratio is 1, nothing is clipped
    assert rows[0]["actor/clipfrac"] == 0.0
    assert rows[0]["actor/approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert "actor/dual_clipfrac" not in rows[0]  # ppo_clip's, not GSPO's


# -- an estimator that needs the reference --------------------------------------------------------


class KLAdvantage(AdvantageEstimator):
    """A test estimator that reads the reference: the advantage is ``ref - policy`` per token."""

    def __call__(self, inputs: AdvantageInputs) -> Any:
        from engine_core_roles.algorithms.base import AdvantageResult

        assert inputs.log_probs is not None and inputs.ref_log_probs is not None
        return AdvantageResult((inputs.ref_log_probs - inputs.log_probs) * inputs.mask)


def test_an_estimator_that_needs_the_reference_gets_its_log_probs(manager: PluginManager) -> None:
    from tensordict import TensorDict

    from engine_core import LOSS_MASK
    from engine_core.rollout import ROLLOUT_LOG_PROBS
    from engine_core_roles.batch.keys import ADVANTAGES, REF_LOG_PROBS
    from engine_core_roles.trainer.estimators import Advantages

    target = f"{__name__}:KLAdvantage"
    manager.register(_AlgorithmPlugin("advantage", "kl_adv", target, needs=("reference",)), "p")
    resolved = resolve_algorithm(AlgorithmConfig(advantage="kl_adv"), manager)
    assert resolved.needs == {AlgorithmNeed.REFERENCE}
    with pytest.raises(ConfigError, match="advantage 'kl_adv' reads the reference policy's"):
        check_needs(resolved, has_critic=False, samples_per_prompt=2, has_reference=False)
    config = TrainerConfig(samples_per_prompt=2)
    with pytest.raises(ConfigError, match="pass reference="):
        Advantages(config, None, resolved, has_reference=False)
    mask = torch.tensor([[1.0, 1, 0], [0, 1, 1]])
    policy, ref = torch.tensor([[-1.0, -2, 9], [9, -0.5, -1]]), torch.full((2, 3), -1.0)
    # no old-log-prob pass (the update computes them): the rollout's are the policy's
    batch = TensorDict(
        {LOSS_MASK: mask, ROLLOUT_LOG_PROBS: policy, REF_LOG_PROBS: ref}, batch_size=[2]
    )
    Advantages(config, None, resolved, has_reference=True)(batch, torch.zeros(2))
    assert batch[ADVANTAGES].tolist() == [[0.0, 1.0, 0.0], [0.0, -0.5, 0.0]]
