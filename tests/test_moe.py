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

from engine_core.batch import LOG_PROBS
from engine_core.config import ModelConfig
from engine_core.models import build_model
from engine_core.moe import RouteRecorder, RouteReplay, replaying, route_mismatch, routers
from engine_core.testing.distributed import run_distributed
from engine_core.testing.kit import build, eval_batch, forward, plain_log_probs
from engine_core.testing.models import train_steps

QWEN3_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 67,
    "hidden_size": 48,
    "intermediate_size": 80,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
MIXTRAL: dict[str, Any] = {
    "model_type": "mixtral",
    "vocab_size": 71,
    "hidden_size": 40,
    "intermediate_size": 40,  # bf16 grouped_mm: rows of a multiple of 16 bytes
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 10,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
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
