"""Gradient and loss invariance across DP sizes, on real gloo processes."""

from __future__ import annotations

import pytest
import torch

from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from tests._dist import run_distributed
from tests._models import engine_config, flat_grad, nll_loss, random_batch

NUM_SAMPLES = 10


def _engine(batching: dict) -> ReferenceEngine:
    engine = ReferenceEngine(ReferenceEngineConfig(**engine_config(**batching)))
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    return engine


def _dp_worker(rank: int, world_size: int, batching: dict, data_order: str) -> dict:
    engine = _engine(batching)
    batch = random_batch(NUM_SAMPLES, seed=7)
    if data_order == "skewed":
        # rank 0 gets the shortest sequences, rank 1 the longest: token budgets then differ
        batch = batch[torch.argsort(batch["attention_mask"].sum(-1))]
    local = engine.shard_data(batch)
    with engine.train_mode():
        result = engine.forward_backward_step(local)
    from engine_core.microbatch import prepare_micro_batches

    _, plan = prepare_micro_batches(
        local,
        micro_batch_size=batching.get("micro_batch_size"),
        max_tokens_per_micro_batch=batching.get("max_tokens_per_micro_batch"),
        group=None,
    )
    gathered = engine.unshard_data(result.outputs)
    return {
        "grad": flat_grad(engine.module),
        "loss": result.loss,
        "nll": result.metrics["nll"],
        "num_micro_batches": plan.num_micro_batches,
        "log_probs": gathered["log_probs"],
    }


def _single(batching: dict) -> dict:
    engine = _engine(batching)
    batch = random_batch(NUM_SAMPLES, seed=7)
    with engine.train_mode():
        result = engine.forward_backward_step(batch)
    return {
        "grad": flat_grad(engine.module),
        "loss": result.loss,
        "log_probs": result.outputs["log_probs"],
    }


@pytest.mark.parametrize(
    "batching",
    [{"micro_batch_size": 1}, {"micro_batch_size": 3}, {"max_tokens_per_micro_batch": 40}],
    ids=["mbs1", "mbs3", "budget40"],
)
def test_dp2_matches_single_process(batching: dict) -> None:
    want = _single({})  # one micro-batch, one process
    ranks = run_distributed(_dp_worker, 2, batching, "random")
    for r in ranks:
        assert torch.allclose(r["grad"], want["grad"], rtol=1e-5, atol=1e-7), (
            (r["grad"] - want["grad"]).abs().max()
        )
        assert r["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert r["nll"] == pytest.approx(want["loss"], rel=1e-6)
        assert torch.allclose(r["log_probs"], want["log_probs"], atol=1e-5)


def test_token_budget_agrees_on_micro_batch_count_across_ranks() -> None:
    ranks = run_distributed(_dp_worker, 2, {"max_tokens_per_micro_batch": 30}, "skewed")
    assert ranks[0]["num_micro_batches"] == ranks[1]["num_micro_batches"]
    want = _single({})
    for r in ranks:
        assert torch.allclose(r["grad"], want["grad"], rtol=1e-5, atol=1e-7)


def _rank_and_world(rank: int, world: int) -> tuple[int, int]:
    return rank, world


def test_a_taken_rendezvous_port_is_retried_on_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import engine_core.testing.distributed as launcher

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    ports = iter([taken])
    real = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda: next(ports, None) or real())
    try:
        assert launcher.run_distributed(_rank_and_world, 2) == [(0, 2), (1, 2)]
    finally:
        held.close()
