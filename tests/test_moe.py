"""Routing replay on transformers mixtures of experts (``engine_core.moe``), and MoE models
trained by fsdp2 as transformers builds them.

Tiny unseen models of two router families built from configs (odd vocabularies, 8 experts,
top-2): Qwen3-MoE (softmax, top-k renormalised by ``norm_topk_prob``) and Mixtral (always
renormalised, weights kept in float32).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from engine_core.batch import (
    ATTENTION_MASK,
    LOG_PROBS,
    LOSS_MASK,
    POSITION_IDS,
    ROUTED_EXPERTS,
    with_meta,
)
from engine_core.config import ModelConfig
from engine_core.models import build_model
from engine_core.moe import RouteRecorder, RouteReplay, replaying, route_mismatch, routers
from engine_core.testing.distributed import run_distributed
from engine_core.testing.kit import build, eval_batch, forward, plain_log_probs
from engine_core.testing.models import train_steps
from engine_core.testing.moe import TINY_MIXTRAL, TINY_QWEN3_MOE, own_routes, routed_batch

QWEN3_MOE = TINY_QWEN3_MOE
MIXTRAL = TINY_MIXTRAL
FAMILIES = {"qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}


def _model(config: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    return build_model(ModelConfig(config=dict(config))).eval()


def _ids(config: dict[str, Any], rows: int = 4, width: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(1, config["vocab_size"], (rows, width), generator=g)


def _router_grads(model: nn.Module) -> list[torch.Tensor]:
    return [r.weight.grad.clone() for r in routers(model)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replaying_a_models_own_routes_changes_nothing(family: str) -> None:
    config = FAMILIES[family]
    model, ids = _model(config), _ids(config)
    with RouteRecorder(model) as rec:
        logits = model(ids).logits
    routes = rec.routes()
    assert routes.shape == (2, ids.numel(), 2)
    assert len(routes.unique()) == 8  # the routers spread tokens over every expert
    logits.logsumexp(-1).sum().backward()
    own = _router_grads(model)
    model.zero_grad()
    with replaying(model, routes):
        again = model(ids).logits
    assert torch.equal(again, logits)
    again.logsumexp(-1).sum().backward()
    for a, b in zip(own, _router_grads(model), strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replay_forces_the_given_experts_and_keeps_the_router_gradient(family: str) -> None:
    config = FAMILIES[family]
    model, ids = _model(config), _ids(config)
    with RouteRecorder(model) as rec, torch.no_grad():
        own = model(ids).logits
    other = (rec.routes() + 3) % 8  # every token to other experts
    with RouteReplay(model, other), RouteRecorder(model) as used:
        forced = model(ids).logits
    assert torch.equal(used.routes(), other)  # what the experts were given
    assert not torch.allclose(forced, own, atol=1e-3)
    forced.logsumexp(-1).sum().backward()
    for grad in _router_grads(model):
        assert grad.abs().sum() > 0  # the router still learns under replay


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_routes_replayed_in_fp32_leave_no_mismatch(family: str) -> None:
    """The rollout-vs-trainer case: a bf16 copy picks some other experts than the fp32 model
    (measured); replaying its routes in the fp32 model makes the two agree exactly."""
    config = FAMILIES[family]
    fp32 = _model(config)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)  # the same weights, rounded
    ids = _ids(config, rows=16, width=24)
    with torch.no_grad():
        with RouteRecorder(fp32) as a:
            fp32(ids)
        with RouteRecorder(bf16) as b:
            bf16(ids)
        before = route_mismatch(a.routes(), b.routes())
        with RouteReplay(fp32, b.routes()), RouteRecorder(fp32) as c:
            fp32(ids)
    print(f"{family}: bf16 vs fp32 route mismatch {before:.4f} without replay")
    assert 0 < before < 0.5
    assert route_mismatch(c.routes(), b.routes()) == 0.0


def test_routes_that_do_not_fit_are_refused() -> None:
    model, ids = _model(QWEN3_MOE), _ids(QWEN3_MOE)
    with RouteRecorder(model) as rec, torch.no_grad():
        model(ids)
    routes = rec.routes()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"\[layers=2, tokens, top_k\].*\(1, 48, 2\)"):
        RouteReplay(model, routes[:1])
    with pytest.raises(ValueError, match="3 experts per token.*top_k=2"):
        RouteReplay(model, torch.cat([routes, routes[..., :1]], -1))
    with pytest.raises(ValueError, match=r"outside 0\.\.7: min 0, max 8"):
        RouteReplay(model, routes.clamp(max=6) + (routes == 7).long() * 2)
    with pytest.raises(ValueError, match="integer expert ids"):
        RouteReplay(model, routes.float())
    with (
        pytest.raises(ValueError, match="routes hold 47 tokens"),
        RouteReplay(model, routes[:, 1:]),
    ):
        model(ids)
    with pytest.raises(ValueError, match="routes hold 48 tokens; the forwards used"):
        with replaying(model, routes), torch.no_grad():
            model(ids[:, 1:])
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    with pytest.raises(ValueError, match="different shapes"):
        route_mismatch(routes, routes[:1])


def test_dense_models_and_unknown_routers_are_named() -> None:
    from engine_core.testing.models import TINY_QWEN2

    dense = _model(TINY_QWEN2)
    with pytest.raises(ValueError, match="Qwen2ForCausalLM has no mixture-of-experts router"):
        RouteRecorder(dense)

    class FancyRouter(nn.Module):
        pass

    dense.model.layers[0].mlp.add_module("gate_router", FancyRouter())
    with pytest.raises(ValueError, match="FancyRouter.*supported: MixtralTopKRouter, "):
        routers(dense)


# -- fsdp2 trains the MoE models as transformers builds them ------------------------------
PRELOAD = (
    "engine_core_fsdp.fsdp2",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.mixtral.modeling_mixtral",
)


def _fsdp2_moe(rank: int, world: int, config: dict[str, Any], folder: str) -> Any:
    engine = build("fsdp2", model={"path": folder}, optim={"lr": 1e-2, "clip_grad": 1.0})
    log_probs = forward(engine, eval_batch())[LOG_PROBS]
    return log_probs, train_steps(engine, range(3))


def _reference_moe(rank: int, world: int, folder: str) -> Any:
    engine = build("reference", model={"path": folder}, optim={"lr": 1e-2, "clip_grad": 1.0})
    return train_steps(engine, range(3))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fsdp2_at_dp2_trains_the_moe_as_transformers_builds_it(family: str, tmp_path: Any) -> None:
    """fsdp2 wraps each decoder layer, its whole MoE block (router and stacked experts) in one
    unit: log-probs equal transformers' and three steps at dp=2 equal one process's."""
    config = FAMILIES[family]
    model = _model(config)
    model.save_pretrained(tmp_path)
    want, _ = plain_log_probs(model, eval_batch())
    ranks = run_distributed(_fsdp2_moe, 2, config, str(tmp_path), preload=PRELOAD)
    (one,) = run_distributed(_reference_moe, 1, str(tmp_path), preload=PRELOAD)
    for log_probs, steps in ranks:
        assert float((log_probs - want).abs().max()) <= 1e-5
        for (loss, norm), (want_loss, want_norm) in zip(steps, one, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-4)
            assert norm == pytest.approx(want_norm, rel=1e-4)


# -- engines replay the routes a batch carries ----------------------------------------------
REPLAY_LAYOUTS = {
    "packed": {},
    "padded": {"use_packing": False},
    "mbs2": {"micro_batch_size": 2},
}
CP_LAYOUTS = {"cp2": {"context_parallel_size": 2}}  # each row split over the two ranks


def _replaying_engine(
    rank: int, world: int, folder: str, batch: Any, routes: Any, layouts: Any = None
) -> Any:
    out: dict[str, Any] = {}
    batch = with_meta(batch, return_routes=True)  # and give back the routers' own choice
    for name, settings in (layouts or REPLAY_LAYOUTS).items():
        engine = build("fsdp2", model={"path": folder}, optim={"lr": 1e-2}, **settings)
        with_routes = batch.clone()
        with_routes[ROUTED_EXPERTS] = routes
        replayed = forward(engine, with_routes)  # forward shards it
        own = forward(engine, batch.clone())
        out[name], out[f"{name}/chosen"] = replayed[LOG_PROBS], replayed[ROUTED_EXPERTS]
        out[f"{name}/own"], out[f"{name}/own_chosen"] = own[LOG_PROBS], own[ROUTED_EXPERTS]
    # the update under replay: the routers get a gradient
    engine = build("fsdp2", model={"path": folder}, optim={"lr": 1e-2}, **settings)
    with_routes = batch.clone()
    with_routes[ROUTED_EXPERTS] = routes
    with engine.train_mode():
        engine.forward_backward_step(engine.shard_data(with_routes))
    grads = [
        p.grad for n, p in engine.require_module().named_parameters() if n.endswith(".gate.weight")
    ]
    full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
    out["router_grads"] = [float(g.abs().sum()) for g in full]
    return out


@pytest.mark.parametrize("world", [1, 2, "cp2"])
def test_fsdp2_replays_the_routes_a_batch_carries(world: Any, tmp_path: Any) -> None:
    """Packed, padded and in micro-batches, on one rank and split over two, and with each row
    split over two context-parallel ranks: the engine's log-probs are transformers' with the
    same routes replayed, the routes it returns are its routers' own, and the routers train."""
    layouts = CP_LAYOUTS if world == "cp2" else REPLAY_LAYOUTS
    world = 2 if world == "cp2" else world
    model = _model(QWEN3_MOE)
    model.save_pretrained(tmp_path)
    batch, routes = routed_batch(model)
    want, _ = plain_log_probs(model, batch, routes)
    own, _ = plain_log_probs(model, batch)
    assert float((want - own).abs().max()) > 1e-3  # the routes given are not the model's
    # what the routers choose on their own, and while the given routes are replayed
    chosen, chosen_under_replay = own_routes(model, batch), own_routes(model, batch, routes)
    real = batch[ATTENTION_MASK].bool()
    assert route_mismatch(chosen[real], routes[real]) > 0.2  # what replay overrides
    ranks = run_distributed(
        _replaying_engine, world, str(tmp_path), batch, routes, layouts, preload=PRELOAD
    )
    for got in ranks:  # the outputs gathered back over DP ranks
        for name in layouts:
            assert float((got[name] - want).abs().max()) <= 1e-5, name
            assert float((got[f"{name}/own"] - own).abs().max()) <= 1e-5, name
            # BatchMeta.return_routes: the routers' own choice, before the replay replaced it
            assert torch.equal(got[f"{name}/own_chosen"][real], chosen[real]), name
            assert torch.equal(got[f"{name}/chosen"][real], chosen_under_replay[real]), name
        assert len(got["router_grads"]) == 2 and all(g > 0 for g in got["router_grads"])


def test_routes_are_refused_by_an_engine_that_does_not_replay_and_when_misshaped(
    tmp_path: Any,
) -> None:
    from engine_core.errors import BatchError, CapabilityError
    from engine_core.reference_engine import ReferenceEngine

    model = _model(QWEN3_MOE)
    model.save_pretrained(tmp_path)
    batch, routes = routed_batch(model)
    engine = build("reference", model={"path": str(tmp_path)}, optim={"lr": 1e-2})
    bad = batch.clone()
    bad[ROUTED_EXPERTS] = routes[:, :-1]
    with pytest.raises(BatchError, match=r"\[B, L, layers, top_k\].*\(6, 15, 2, 2\)"):
        forward(engine, bad)
    no_replay = type("NoReplay", (ReferenceEngine,), {"capabilities": frozenset()})
    engine.__class__ = no_replay
    good = batch.clone()
    good[ROUTED_EXPERTS] = routes
    with pytest.raises(CapabilityError, match="does not replay"):
        forward(engine, good)
    with pytest.raises(CapabilityError, match="does not record"):
        forward(engine, with_meta(batch, return_routes=True))


# -- the hf rollout returns the routes it sampled with -------------------------------------
def _rollout_then_engine(rank: int, world: int, folder: str) -> Any:
    from engine_core_hf.rollout import HFRollout, HFRolloutConfig
    from tensordict import TensorDict

    from engine_core.batch import BatchMeta, make_batch, set_meta
    from engine_core.rollout import (
        PROMPT_IDS,
        PROMPT_MASK,
        RESPONSE_IDS,
        RESPONSE_MASK,
        ROLLOUT_LOG_PROBS,
        SamplingParams,
    )

    rollout = HFRollout(
        HFRolloutConfig(backend="hf", model={"path": folder}, generation_batch_size=2)
    )
    ids = torch.randint(1, 60, (3, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    prompts = TensorDict({PROMPT_IDS: ids * mask, PROMPT_MASK: mask}, batch_size=[3])
    params = SamplingParams(max_new_tokens=6, n=2, seed=1, stop_token_ids=[7, 11, 13])
    out = rollout.generate(prompts, params.model_copy(update={"return_routes": True}))
    plain = rollout.generate(prompts, params)
    engine = build("fsdp2", model={"path": folder}, optim={"lr": 1e-2})
    batch = make_batch(
        torch.cat([out[PROMPT_IDS], out[RESPONSE_IDS]], 1),
        torch.cat([out[PROMPT_MASK], out[RESPONSE_MASK]], 1),
    )
    set_meta(batch, BatchMeta())
    width = out[PROMPT_IDS].shape[1]
    results = {"own": forward(engine, batch.clone())[LOG_PROBS][:, width:]}
    batch[ROUTED_EXPERTS] = out[ROUTED_EXPERTS]
    results["replayed"] = forward(engine, batch.clone())[LOG_PROBS][:, width:]
    batch[ROUTED_EXPERTS] = (out[ROUTED_EXPERTS] + 1) % 8
    results["shifted"] = forward(engine, batch)[LOG_PROBS][:, width:]
    results.update(
        rollout=out[ROLLOUT_LOG_PROBS],
        mask=out[RESPONSE_MASK].bool(),
        routes_shape=tuple(out[ROUTED_EXPERTS].shape),
        width=(width, out[RESPONSE_IDS].shape[1]),
        same_samples=torch.equal(out[RESPONSE_IDS], plain[RESPONSE_IDS]),
        plain_keys=sorted(plain.keys()),
    )
    return results


def test_hf_rollout_routes_replayed_by_fsdp2_give_the_rollouts_log_probs(tmp_path: Any) -> None:
    """The hf rollout records its routers while generating (prompt forward, then one per
    fed-back token, over two generate calls of different lengths and with stops); an fsdp2
    engine given those routes scores every sampled token as the rollout did, and the routes
    matter (shifted ones give other log-probs)."""
    _model(QWEN3_MOE).save_pretrained(tmp_path)
    (got,) = run_distributed(_rollout_then_engine, 1, str(tmp_path), preload=PRELOAD)
    prompt, response = got["width"]
    assert got["routes_shape"] == (6, prompt + response, 2, 2)
    assert got["same_samples"] and ROUTED_EXPERTS not in got["plain_keys"]
    mask = got["mask"]
    assert float((got["replayed"] - got["rollout"]).abs()[mask].max()) <= 1e-5
    assert float((got["own"] - got["rollout"]).abs()[mask].max()) <= 1e-5  # fp32 both sides
    assert float((got["shifted"] - got["rollout"]).abs()[mask].max()) > 1e-3


def test_rollouts_that_do_not_return_routes_refuse_to() -> None:
    from engine_core.errors import CapabilityError
    from engine_core.rollout import BaseRollout, RolloutConfig, SamplingParams

    class Plain(BaseRollout):
        def generate(self, prompts: Any, params: SamplingParams) -> Any:
            self.check_params(params)

        def expected_weights(self) -> dict[str, tuple[int, ...]]:
            return {}

        def load_weight_bucket(self, bucket: Any) -> str:
            return ""

    rollout = Plain(RolloutConfig(backend="plain", model={"config": dict(QWEN3_MOE)}))
    with pytest.raises(CapabilityError, match="Plain does not return the experts"):
        rollout.generate(None, SamplingParams(return_routes=True))


def test_a_rollouts_routes_are_placed_under_their_tokens() -> None:
    """``place_routes``: per-sample routes (real prompt tokens, then response tokens, the last
    sampled token's row absent or present) land under their tokens of a left-padded prompt and
    a right-padded response; anything else is refused. ``unplace_routes`` takes them back."""
    from tensordict import TensorDict

    from engine_core.errors import BatchError
    from engine_core.rollout import PROMPT_MASK, RESPONSE_MASK, place_routes, unplace_routes

    out = TensorDict(
        {
            PROMPT_MASK: torch.tensor([[0, 1, 1], [1, 1, 1]]),
            RESPONSE_MASK: torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]),
        },
        batch_size=[2],
    )
    first = torch.arange(1, 5 * 3 * 2 + 1).reshape(5, 3, 2)  # 2 + 3 tokens, all rows
    second = torch.arange(1, 3 * 3 * 2 + 1).reshape(3, 3, 2) + 100  # 3 + 1 tokens, last absent
    placed = place_routes(out, [first, second])
    assert placed.shape == (2, 7, 3, 2) and placed.dtype == torch.int64
    assert torch.equal(placed[0, 1:6], first) and not placed[0, [0, 6]].any()
    assert torch.equal(placed[1, :3], second) and not placed[1, 3:].any()
    out[ROUTED_EXPERTS] = placed
    back = unplace_routes(out, [2, 3], [3, 0])
    assert torch.equal(back[0], first) and torch.equal(back[1], second)
    assert back[0].untyped_storage().data_ptr() != placed.untyped_storage().data_ptr()
    fed = unplace_routes(out, [2, 3], [2, 1])  # the response's first rows; an absent one is 0
    assert torch.equal(fed[0], first[:4]) and torch.equal(fed[1][:3], second)
    assert not fed[1][3].any()
    with pytest.raises(BatchError, match="sample 1: routes of shape \\(2, 3, 2\\)"):
        place_routes(out, [first, second[:2]])


# -- the routers' load-balancing loss through the loss contract -----------------------------
def _hand_balance(model: nn.Module, batch: Any) -> torch.Tensor:
    """The policy's NLL plus the aux loss, written out: per sequence and MoE layer
    E * sum_e f_e * P_e, each token's share E * sum_e f_e * p_te averaged over layers; both
    summed over the loss tokens over their count."""
    from engine_core.batch import INPUT_IDS
    from engine_core.moe import RouterLogits

    ids, mask = batch[INPUT_IDS], batch[ATTENTION_MASK].bool()
    loss_mask = batch[LOSS_MASK].bool()
    total = torch.zeros(())
    for i in range(ids.shape[0]):
        row = ids[i][mask[i]]
        with RouterLogits(model) as rl:
            logits = model(row.unsqueeze(0)).logits[0]
        # with the policy's negative log-likelihood, as in an update (FSDP's backward needs the
        # loss to flow through the layers' outputs, which a router-only loss would not)
        nll = -logits[:-1].log_softmax(-1).gather(-1, row[1:, None])[:, 0]
        total = total + nll[loss_mask[i][mask[i]][1:]].sum()
        layers = rl.layers()
        share = torch.zeros(int(mask[i].sum()))
        for logits, experts in layers:
            probs = torch.softmax(logits.float(), -1)
            experts_n = probs.shape[1]
            f = torch.stack([(experts == e).any(-1).float().mean() for e in range(experts_n)])
            share = share + experts_n * (probs * f).sum(-1) / len(layers)
        total = total + share[loss_mask[i][mask[i]]].sum()
    return total / loss_mask.sum()


def _balance_grads(
    rank: int, world: int, folder: str, batch: Any, mbs: int | None, cp: int = 1
) -> Any:
    from engine_core.loss import aggregate_loss

    settings: dict[str, Any] = (
        {} if mbs is None else {"micro_batch_size": mbs, "use_packing": False}
    )
    if cp > 1:
        settings["context_parallel_size"] = cp
    engine = build("fsdp2", model={"path": folder}, optim={"lr": 1e-2}, **settings)

    def loss(mb: Any, out: Any, ctx: Any) -> Any:  # the engine adds the balance loss
        return aggregate_loss(-out[LOG_PROBS], mb[LOSS_MASK], "token-mean", ctx), {}

    engine.set_loss_fn(loss)
    given = with_meta(batch, moe_aux={"coef": 1.0})
    with engine.train_mode():
        result = engine.forward_backward_step(engine.shard_data(given))
    grads = [
        p.grad for n, p in engine.require_module().named_parameters() if n.endswith(".gate.weight")
    ]
    full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
    return result.loss, full


@pytest.mark.parametrize(
    ("world", "mbs", "cp"),
    [(1, None, 1), (1, 2, 1), (2, 1, 1), (2, None, 2)],
    ids=["packed", "mbs2", "dp2", "cp2"],
)
def test_the_balance_loss_is_one_loss_however_the_batch_is_split(
    world: int, mbs: int | None, cp: int, tmp_path: Any
) -> None:
    """``BatchMeta(moe_aux=...)``: the engine's per-token balance terms, aggregated as the
    policy loss is and added to it by the engine, give the hand-written loss and its router
    gradients,
    packed, padded in micro-batches of 2, split over two ranks, and with each row split over
    two context-parallel ranks."""
    model = _model(QWEN3_MOE)
    model.save_pretrained(tmp_path)
    batch, _ = routed_batch(model)
    # the loss on each sequence's tokens after its first three (a prompt's are not trained)
    batch[LOSS_MASK] = (batch[ATTENTION_MASK].bool() & (batch[POSITION_IDS] >= 3)).long()
    model.zero_grad()
    want = _hand_balance(model.train(), batch)
    want.backward()
    want_grads = _router_grads(model)
    assert all(float(g.abs().sum()) > 0 for g in want_grads)
    ranks = run_distributed(_balance_grads, world, str(tmp_path), batch, mbs, cp, preload=PRELOAD)
    for loss, grads in ranks:
        assert loss == pytest.approx(float(want), rel=1e-5)
        for got, expected in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)


def test_the_balance_loss_setting_is_refused_where_it_is_given() -> None:
    """``BatchMeta.moe_aux`` is validated when it is set on a batch: a weight of 0, an
    aggregation that needs a length without one, or the old boolean."""
    from pydantic import ValidationError

    from engine_core.batch import MoeAuxLoss, get_meta
    from engine_core.testing.kit import train_batch

    batch = train_batch()
    for bad, words in (
        ({"coef": 0.0}, "greater than 0"),
        ({"coef": 0.1, "aggregation": "seq-mean-token-sum-norm"}, "norm_length"),
        (True, "MoeAuxLoss"),
    ):
        with pytest.raises(ValidationError, match=words):
            with_meta(batch, moe_aux=bad)
    spec = MoeAuxLoss(coef=0.1, aggregation="seq-mean-token-sum-norm", norm_length=8)
    assert get_meta(with_meta(batch, moe_aux=spec)).moe_aux == spec
    assert get_meta(batch).moe_aux is None  # the batch given is left as it was


def test_balance_terms_are_top_k_when_perfectly_balanced() -> None:
    from engine_core.moe import balance_terms

    logits = torch.zeros(8, 4)  # uniform probabilities over 4 experts
    experts = torch.tensor([[0, 1], [2, 3]] * 4)  # each expert chosen by half the tokens
    sequence = torch.tensor([0, 0, 0, 0, 1, 1, 1, -1])
    terms = balance_terms([(logits, experts)], sequence, 4)
    assert terms[-1] == 0.0
    assert torch.allclose(terms[:4], torch.full((4,), 2.0))  # top_k = 2 for a balanced sequence


def test_expert_load_spread_is_one_when_balanced_and_experts_over_top_k_at_worst() -> None:
    from engine_core.moe import expert_load_spread

    balanced = torch.tensor([[[0, 1]], [[2, 3]]] * 3)  # [tokens=6, layers=1, top_k=2], 4 experts
    worst = torch.tensor([[[0, 1]]] * 6)
    both = torch.cat([balanced, worst], dim=1)  # two layers
    assert torch.allclose(expert_load_spread(both, 4), torch.tensor([1.0, 2.0]))
    assert float(expert_load_spread(torch.tensor([[[0, 1]], [[0, 2]]]), 4)[0]) == 2.0  # 2 of 1


def _checkpointed_update(rank: int, world: int, folder: str, batch: Any, routes: Any) -> Any:
    from engine_core.loss import aggregate_loss

    def loss(mb: Any, out: Any, ctx: Any) -> Any:  # the engine adds the balance loss
        return aggregate_loss(-out[LOG_PROBS], mb[LOSS_MASK], "token-mean", ctx), {}

    out = {}
    for checkpointed in (False, True):
        model = {"path": folder, "gradient_checkpointing": checkpointed}
        engine = build("fsdp2", model=model, optim={"lr": 1e-2}, micro_batch_size=2)
        engine.set_loss_fn(loss)
        given = with_meta(batch, moe_aux={"coef": 0.1}, return_routes=True)
        given[ROUTED_EXPERTS] = routes
        with engine.train_mode():
            result = engine.forward_backward_step(engine.shard_data(given))
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in engine.require_module().named_parameters()
            if p.grad is not None
        }
        out[checkpointed] = (result.loss, result.outputs[ROUTED_EXPERTS], grads)
    return out


def test_gradient_checkpointing_recomputes_a_replayed_block_with_the_same_experts(
    tmp_path: Any,
) -> None:
    """A checkpointed decoder block runs again in the backward, after the replay has ended: it
    is given the experts of its forward again (``checkpoint_contexts``), so the update under
    replay, the routes returned and the balance loss are those of the same run without
    checkpointing, every gradient included."""
    model = _model(QWEN3_MOE)
    model.save_pretrained(tmp_path)
    batch, routes = routed_batch(model)
    batch[LOSS_MASK] = batch[ATTENTION_MASK].clone()
    (got,) = run_distributed(_checkpointed_update, 1, str(tmp_path), batch, routes, preload=PRELOAD)
    (loss, chosen, grads), (ckpt_loss, ckpt_chosen, ckpt_grads) = got[False], got[True]
    assert ckpt_loss == pytest.approx(loss, rel=1e-6)
    assert torch.equal(ckpt_chosen, chosen)
    assert sorted(ckpt_grads) == sorted(grads)
    for name, g in grads.items():
        torch.testing.assert_close(ckpt_grads[name], g, atol=1e-6, rtol=1e-5, msg=name)
    assert any(n.endswith(".gate.weight") and float(g.abs().sum()) > 0 for n, g in grads.items())


def test_route_checks_name_what_is_wrong() -> None:
    from engine_core.errors import BatchError
    from engine_core.moe import check_routes

    good = torch.tensor([[[0, 3], [1, 2]], [[2, 1], [3, 0]]])  # [tokens, layers, top_k]
    check_routes(good, num_experts=4)
    with pytest.raises(
        BatchError, match=r"routed_experts name experts outside 0\.\.3: min 0, max 4"
    ):
        check_routes(good + (good == 3).long(), num_experts=4, what="routed_experts")
    twice = torch.tensor([[[1, 1]]])
    with pytest.raises(BatchError, match="an expert twice.*top_k=2 distinct"):
        check_routes(twice, num_experts=4)
    check_routes(twice, num_experts=4, distinct=False)  # padding rows may repeat an id
    with pytest.raises(BatchError, match="integer expert ids; got torch.bool"):
        check_routes(good.bool(), num_experts=4)
