"""The same PPO step in-process, through local worker processes (dp=2) and through Ray (dp=2)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine_core.executors import LocalWorkerGroup
from roles.actor import OLD_LOG_PROBS
from roles.workers import ActorWorker
from tests._models import engine_config
from tests.test_roles import ppo_batch

# one mini-batch per epoch: with DP, mini-batch k is the union of every rank's k-th local
# mini-batch, so smaller mini-batches legitimately differ in composition from one process
ACTOR = {"ppo_epochs": 2, "entropy_coeff": 0.01}
ENGINE = engine_config(micro_batch_size=2)


def in_process() -> tuple[dict[str, float], torch.Tensor, float]:
    worker = ActorWorker(ENGINE, ACTOR)
    batch = ppo_batch()
    old = worker.compute_log_prob(batch)[OLD_LOG_PROBS]
    batch[OLD_LOG_PROBS] = old + 0.05
    metrics = worker.update_actor(batch)
    return metrics, old, worker.params_checksum()


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, float], torch.Tensor, float]:
    return in_process()


def run_group(group: Any) -> tuple[dict[str, float], torch.Tensor, list[float]]:
    with group:
        batch = ppo_batch()
        old = group.execute("compute_log_prob", batch)[OLD_LOG_PROBS]
        batch[OLD_LOG_PROBS] = old + 0.05
        per_dp = group.execute("update_actor", batch)
        assert per_dp[0] == per_dp[1]  # metrics are reduced across DP before they are returned
        return per_dp[0], old, group.call_all("params_checksum")


def check(got: tuple[dict[str, float], torch.Tensor, list[float]], want: tuple) -> None:
    metrics, old, checksums = got
    assert torch.allclose(old, want[1], atol=1e-5)
    assert metrics.keys() == want[0].keys()
    for k, v in want[0].items():
        assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    for c in checksums:
        assert c == pytest.approx(want[2], rel=1e-9)


def test_local_worker_group_dp2(reference: tuple) -> None:
    check(run_group(LocalWorkerGroup(ActorWorker, 2, init_args=(ENGINE, ACTOR))), reference)


@pytest.mark.ray
def test_ray_worker_group_dp2(reference: tuple, ray_session: Any) -> None:
    from engine_core.executors import RayWorkerGroup

    check(run_group(RayWorkerGroup(ActorWorker, 2, init_args=(ENGINE, ACTOR))), reference)
