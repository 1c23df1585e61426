"""Roles as workers of a worker group: each worker builds its engine in its own process.

The role methods are dispatched on their mesh ("actor", "critic", "ref", "rm"): a batch is split into
DP chunks, each rank runs the role on its chunk, and one output per DP rank is collected. With
the local executor (``torch.multiprocessing``) or Ray, the same calls that run in-process run
data-parallel, and the user script does not change.
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDict

from engine_core import BaseEngine, load_plugins, resolve_engine_config
from engine_core.dispatch import DispatchMode, Worker, register
from engine_core.engine import WeightPart
from engine_core.executors import join_process_group
from engine_core.executors.base import free_port, meeting_host
from engine_core.rollout import run_through
from engine_core.weight_sync import WeightSyncGroup, send_weights
from engine_core_roles.algorithms.select import AlgorithmConfig
from engine_core_roles.algorithms.supervised import supervised_step
from engine_core_roles.models.actor import Actor, ActorConfig, ActorUpdate
from engine_core_roles.models.critic import Critic, CriticConfig
from engine_core_roles.models.reference import Reference
from engine_core_roles.models.reward_model import RewardModel

__all__ = ["ActorWorker", "CriticWorker", "ReferenceWorker", "RewardModelWorker", "build_engine"]


def build_engine(engine_config: dict[str, Any]) -> BaseEngine:
    """Resolve, build and initialise the engine named by ``engine_config['backend']``."""
    spec, cfg = resolve_engine_config(engine_config, load_plugins())
    engine: BaseEngine = spec.load_class()(cfg)
    engine.init_model()
    return engine


class _RoleWorker(Worker):
    mesh = ""

    def __init__(self, engine_config: dict[str, Any]) -> None:
        join_process_group()  # with the collective timeout the executor set
        self.engine = build_engine(engine_config)
        e = self.engine
        self.register_mesh(
            self.mesh, dp_rank=e.dp_rank, dp_size=e.dp_size, is_collect=e.is_collect_rank
        )

    # what a driver needs of a role it does not hold: checkpoints, the export, a fingerprint
    # (each collective: call it on every worker of the group)

    def checkpoint_preflight(self, root: str, saving: bool) -> None:
        self.engine.checkpoint_preflight(root, saving=saving)

    def write_checkpoint_files(self, folder: str, step: int) -> None:
        self.engine.write_checkpoint_files(folder, step=step)

    def read_checkpoint_files(self, folder: str) -> int:
        return self.engine.read_checkpoint_files(folder)

    def export_hf(self, path: str) -> str:
        return self.engine.export_hf(path)

    def abs_weight_sum(self) -> float:
        """The sum of |w| over the full weights: a cheap fingerprint (not a checksum) to compare
        runs across engines and layouts. Collective for sharded engines: call it on every
        worker."""
        return float(sum(float(t.double().abs().sum()) for _, t in self.engine.named_full_params()))


class ActorWorker(_RoleWorker):
    mesh = "actor"

    def __init__(
        self,
        engine_config: dict[str, Any],
        actor_config: dict[str, Any],
        algorithm: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(engine_config)
        algo = None if algorithm is None else AlgorithmConfig.model_validate(algorithm)
        self.actor = Actor(ActorConfig(**actor_config), self.engine, algo)
        self._weight_sync: WeightSyncGroup | None = None

    def max_position_embeddings(self) -> int | None:
        return self.actor.max_position_embeddings

    # the sending end of the job's weight link (engine_core_roles.distributed.weights.WeightLink): every rank takes
    # part in the gathers, the writing rank streams (each collective: call it on every worker)

    def weight_sync_address(self, any_node: bool) -> tuple[str, int] | None:
        """Where the link's weight-sync group meets: a free port of the writing rank's machine
        (``None`` from every other rank, which takes no part in that group)."""
        if not self.engine.writes_full_params:
            return None
        return meeting_host(any_node), free_port()

    def join_weight_sync(
        self, host: str, port: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        """The writing rank joins the link's weight-sync group as its sender (rank 0)."""
        self.leave_weight_sync()
        if self.engine.writes_full_params:
            self._weight_sync = WeightSyncGroup(
                host=host,
                port=port,
                rank=0,
                world_size=world_size,
                backend=backend,
                timeout_s=timeout_s,
            )

    def leave_weight_sync(self) -> None:
        if self._weight_sync is not None:
            self._weight_sync.close()
            self._weight_sync = None

    def send_weights(
        self, bucket_bytes: int, receiver_names: list[str], part: WeightPart = "model"
    ) -> int:
        """Every rank gathers ``part`` of the weights (see :data:`WeightPart`) a bucket of
        ``bucket_bytes`` at a time; the writing rank streams them to the receivers (verified by
        each) and returns the bytes it sent, the others 0."""
        buckets = self.engine.weight_buckets(part, bucket_bytes)
        try:
            if not self.engine.writes_full_params:
                return 0
            if self._weight_sync is None:
                raise RuntimeError("join_weight_sync() first: no rollout is connected.")
            send_weights(
                self._weight_sync,
                buckets,
                bucket_bytes=bucket_bytes,
                receiver_names=receiver_names,
            )
            return buckets.bytes
        finally:
            run_through(buckets)  # whatever happened, this rank finishes its part of the gathers

    @register(DispatchMode.ND_COMPUTE, mesh="actor")
    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        return self.actor.compute_log_prob(batch)

    @register(DispatchMode.ND_COMPUTE, mesh="actor")
    def update_actor(self, batch: TensorDict) -> ActorUpdate:
        return self.actor.update_actor(batch)

    @register(DispatchMode.ND_COMPUTE, mesh="actor")
    def supervised_step(self, batch: TensorDict) -> dict[str, float]:
        """One supervised step on this rank's share of ``batch`` (the job's warm-up)."""

        return supervised_step(self.engine, batch)


class CriticWorker(_RoleWorker):
    mesh = "critic"

    def __init__(self, engine_config: dict[str, Any], critic_config: dict[str, Any]) -> None:
        super().__init__(engine_config)
        self.critic = Critic(CriticConfig(**critic_config), self.engine)

    @register(DispatchMode.ND_COMPUTE, mesh="critic")
    def compute_values(self, batch: TensorDict) -> TensorDict:
        return self.critic.compute_values(batch)

    @register(DispatchMode.ND_COMPUTE, mesh="critic")
    def update_critic(self, batch: TensorDict) -> dict[str, float]:
        return self.critic.update_critic(batch)


class ReferenceWorker(_RoleWorker):
    mesh = "ref"

    def __init__(self, engine_config: dict[str, Any]) -> None:
        super().__init__(engine_config)
        self.reference = Reference(self.engine)

    @register(DispatchMode.ND_COMPUTE, mesh="ref")
    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        return self.reference.compute_ref_log_prob(batch)


class RewardModelWorker(_RoleWorker):
    mesh = "rm"

    def __init__(self, engine_config: dict[str, Any]) -> None:
        super().__init__(engine_config)
        self.reward_model = RewardModel(self.engine)

    @register(DispatchMode.ND_COMPUTE, mesh="rm")
    def compute_rm_score(self, batch: TensorDict) -> TensorDict:
        return self.reward_model.compute_rm_score(batch)
