"""Routing replay (``routing_replay``): given a batch's ``routed_experts``, a tiny Qwen3-MoE's
log-probs equal transformers' with those routes replayed, and asked for them, the routers' own
choices come back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.batch import ATTENTION_MASK, LOG_PROBS, with_meta
from engine_core.capabilities import Capability
from engine_core.engine import predicted_mask
from engine_core.testing.checks.registry import Check, Context, Layout
from engine_core.testing.checks.verdict import ATOL, result
from engine_core.testing.drive import build, forward
from engine_core.testing.oracle import plain_log_probs

__all__ = ["CHECKS", "test_routing_replay_follows_the_given_routes"]


def _routing(c: Context) -> dict[str, float]:
    """An engine that declares routing_replay, given a batch with ``routed_experts`` on a tiny
    Qwen3-MoE: how far its log-probs are from transformers' with those routes replayed, and
    from transformers' own routing (which the given routes differ from)."""
    from engine_core.batch import ROUTED_EXPERTS
    from engine_core.config import ModelConfig
    from engine_core.models import build_model
    from engine_core.moe import route_mismatch
    from engine_core.testing.moe import TINY_QWEN3_MOE, own_routes, routed_batch

    folder = str(Path(c.root) / "moe_policy")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: Any = build_model(ModelConfig(config=dict(TINY_QWEN3_MOE))).eval()
    model.save_pretrained(folder)
    batch, routes = routed_batch(model)
    want, _ = plain_log_probs(model, batch, routes)
    own, _ = plain_log_probs(model, batch)
    chosen = own_routes(model, batch, routes)  # the routers' own choice under the replay
    engine = build(c.backend, model={"path": folder})
    batch[ROUTED_EXPERTS] = routes
    out = forward(engine, with_meta(batch, return_routes=True))
    got = out[LOG_PROBS]
    mask = predicted_mask(batch[ATTENTION_MASK])
    real = batch[ATTENTION_MASK].bool()
    returned = out.get(ROUTED_EXPERTS)
    return {
        "gap": float((got - want).abs()[mask].max()),
        "own_gap": float((got - own).abs()[mask].max()),
        # BatchMeta.return_routes: the share of decisions that are not the routers' own
        "returned_mismatch": (
            1.0
            if returned is None or returned.shape != chosen.shape
            else route_mismatch(returned[real], chosen[real])
        ),
    }


ROUTING = Check("routing", Layout.SINGLE, _routing, needs=frozenset({Capability.ROUTING_REPLAY}))

CHECKS = (ROUTING,)


def test_routing_replay_follows_the_given_routes(single: dict, caps: frozenset) -> None:
    if not ROUTING.applies(caps):
        pytest.skip("routing_replay not declared")
    got = result(single, ROUTING, "routing replay")
    if got["gap"] > ATOL:
        how = (
            "it routed on its own (its log-probs are the model's own routing's)"
            if got["own_gap"] <= ATOL
            else "the routes went to the wrong tokens or layers"
        )
        pytest.fail(
            f"[routing replay] a tiny Qwen3-MoE given routed_experts: log-probs {got['gap']:.3g} "
            f"from transformers' with those routes replayed; {how}. Route each token of the "
            f"model's row to the batch's experts (BaseEngine.prepare_model_inputs and "
            f"forward_model do it for transformers models, through engine_core.moe)."
        )
    if got["returned_mismatch"] > 0:
        pytest.fail(
            f"[routing replay] asked for routes (BatchMeta.return_routes), the engine returned "
            f"routed_experts that differ from the routers' own choice in "
            f"{got['returned_mismatch']:.1%} of (token, layer) decisions (or none, or of "
            f"another shape). Return [B, L, layers, top_k] of what each router chose before the "
            f"replay replaced it (BaseEngine.forward_model records it through engine_core.moe)."
        )
