"""One PPO step through Actor + Critic + Reference, under the ``fsdp`` and ``fsdp2`` engines,
in-process, through local worker groups (dp=2) and through Ray (one actor per role): the same metrics, outputs
and updated weights as the single-process reference engine. Only config changes between runs."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from engine_core.executors import LocalWorkerGroup
from engine_core_roles.algorithms.advantages import gae_advantages, sequence_to_token_rewards
from engine_core_roles.batch.keys import OLD_LOG_PROBS, OLD_VALUES, REF_LOG_PROBS, RETURNS
from engine_core_roles.distributed.workers import ActorWorker, CriticWorker, ReferenceWorker
from tests._dist import run_distributed
from tests._models import engine_config
from tests.test_roles import ppo_batch

# one mini-batch per epoch: with DP, mini-batch k is the union of every rank's k-th local
# mini-batch, so smaller mini-batches legitimately differ in composition from one process
ACTOR = {"ppo_epochs": 2, "entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.1}
CRITIC = {"ppo_epochs": 2}
BACKENDS = ["fsdp", "fsdp2"]


def _configs(backend: str) -> dict[str, dict[str, Any]]:
    policy = engine_config(backend=backend, micro_batch_size=2)
    critic_model = {"config": policy["model"]["config"], "value_head": True}
    return {
        "actor": policy,
        "critic": engine_config(backend=backend, micro_batch_size=2, model=critic_model),
        "ref": policy,
    }


class _Direct:
    """A role worker called in the calling process."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def run(self, method: str, batch: Any) -> Any:
        return getattr(self.worker, method)(batch)

    def abs_weight_sums(self) -> list[float]:
        return [self.worker.abs_weight_sum()]


class _Group:
    """A role worker group: the same calls, dispatched over its DP ranks."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def run(self, method: str, batch: Any) -> Any:
        out = self.group.execute(method, batch)
        if isinstance(out, list):  # update metrics: one per DP rank, reduced before returning
            assert all(o == out[0] for o in out)
            return out[0]
        return out

    def abs_weight_sums(self) -> list[float]:
        return list(self.group.call_all("abs_weight_sum"))


def ppo_step(actor: Any, critic: Any, ref: Any) -> dict[str, Any]:
    batch = ppo_batch()
    old = actor.run("compute_log_prob", batch)[OLD_LOG_PROBS]
    batch[OLD_LOG_PROBS] = old + 0.05  # as if the rollout policy were slightly off
    batch[REF_LOG_PROBS] = ref.run("compute_ref_log_prob", batch)[REF_LOG_PROBS]
    values = critic.run("compute_values", batch)[OLD_VALUES]
    batch[OLD_VALUES] = values
    scores = torch.linspace(-1.0, 1.0, batch.batch_size[0])
    rewards = sequence_to_token_rewards(scores, batch["loss_mask"])
    _, batch[RETURNS] = gae_advantages(rewards, values, batch["loss_mask"], gamma=1.0, lam=0.95)
    return {
        "old": old,
        "ref": batch[REF_LOG_PROBS],
        "values": values,
        "actor": actor.run("update_actor", batch).metrics,
        "critic": critic.run("update_critic", batch),
        "weights": actor.abs_weight_sums() + critic.abs_weight_sums(),
    }


def _in_process(rank: int, world: int, backend: str) -> dict[str, Any]:
    cfg = _configs(backend)
    return ppo_step(
        _Direct(ActorWorker(cfg["actor"], ACTOR)),
        _Direct(CriticWorker(cfg["critic"], CRITIC)),
        _Direct(ReferenceWorker(cfg["ref"])),
    )


def _grouped(make_group: Any, backend: str) -> dict[str, Any]:
    cfg = _configs(backend)
    with contextlib.ExitStack() as stack:
        actor = stack.enter_context(make_group(ActorWorker, (cfg["actor"], ACTOR)))
        critic = stack.enter_context(make_group(CriticWorker, (cfg["critic"], CRITIC)))
        ref = stack.enter_context(make_group(ReferenceWorker, (cfg["ref"],)))
        return ppo_step(_Group(actor), _Group(critic), _Group(ref))


def _local(cls: type, args: tuple) -> LocalWorkerGroup:
    return LocalWorkerGroup(cls, 2, init_args=args)


@pytest.fixture(scope="module")
def want() -> dict[str, Any]:
    # a spawned process so engines' process groups never leak into the test process
    (result,) = run_distributed(_in_process, 1, "reference")
    return result


def check(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in ("old", "ref", "values"):
        assert torch.allclose(got[key], want[key], atol=1e-5), key
    for role in ("actor", "critic"):
        assert got[role].keys() == want[role].keys()
        for k, v in want[role].items():
            assert got[role][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (role, k)
    actor_want, critic_want = want["weights"]
    half = len(got["weights"]) // 2
    for c in got["weights"][:half]:
        assert c == pytest.approx(actor_want, rel=1e-6)
    for c in got["weights"][half:]:
        assert c == pytest.approx(critic_want, rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_process(backend: str, want: dict) -> None:
    (got,) = run_distributed(_in_process, 1, backend)
    check(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_local_worker_groups_dp2(backend: str, want: dict) -> None:
    check(_grouped(_local, backend), want)


@pytest.mark.ray
@pytest.mark.parametrize("backend", ["fsdp2"])  # the same workers as on local processes
def test_ray_worker_groups(backend: str, want: dict, ray_session: Any) -> None:
    """One Ray actor per role (dp=2 on Ray is the placement tests' job: a dp=2 actor's run
    equals the in-process one), so that each role's worker is shown to work through Ray."""
    from engine_core.executors import RayWorkerGroup

    def ray_group(cls: type, args: tuple) -> RayWorkerGroup:
        return RayWorkerGroup(cls, 1, init_args=args)

    check(_grouped(ray_group, backend), want)
