"""Where a job's roles run: in this process, or as worker groups on local processes or on Ray.

A :class:`PlacementConfig` names an executor and, per role, its data-parallel size. With
``executor: in_process`` (the default) every role's one engine is built in the calling process,
as :class:`engine_core_roles.Actor` & co. With ``local`` or ``ray``, each role is a worker group of
``dp × tensor_parallel_size × pipeline_parallel_size`` workers (the model-parallel sizes are the
role's engine config's), and the driver holds an :class:`ActorGroup`, :class:`CriticGroup` or
:class:`ReferenceGroup`: the same calls as the in-process roles, dispatched over the group's DP
ranks (:mod:`engine_core.dispatch`). :class:`engine_core_roles.RLTrainer` takes either.

A role group is also a checkpoint part (:class:`engine_core.checkpoint.JobCheckpoints`): its
workers write and read their own shards into the folder the driver stages and commits, so a
step is still one folder, whole or absent. The actor group's full weights reach the rollout
through the job's :class:`engine_core_roles.distributed.weights.WeightLink`: every rank takes part in the gathers and
the writing rank streams them, bucket by bucket, to the rollout's processes (or this one's).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, PositiveInt, model_validator
from tensordict import TensorDict

from engine_core import FrozenModel
from engine_core.executors import start_worker_group
from engine_core.executors.base import DEFAULT_CALL_TIMEOUT_S, WorkerGroup
from engine_core_roles.algorithms.select import AlgorithmConfig
from engine_core_roles.models.actor import ActorConfig, ActorUpdate

__all__ = [
    "ActorGroup",
    "CriticGroup",
    "PlacementConfig",
    "RayConfig",
    "RayPlacement",
    "ReferenceGroup",
    "RewardModelGroup",
    "RoleGroup",
    "RolePlacement",
    "start_group",
]

Executor = Literal["in_process", "local", "ray"]


class RayPlacement(FrozenModel):
    """On Ray (``executor: ray``): what each worker of a group asks the cluster for, and how the
    group's workers are spread over its nodes (one Ray placement group per worker group)."""

    num_cpus: float = Field(
        0.01,
        ge=0,
        description="ray: CPUs each worker holds (a share by default, so small "
        "hosts can place several).",
    )
    num_gpus: float = Field(0, ge=0, description="ray: GPUs each worker holds.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="ray: custom resources each worker holds, as the nodes declare them (e.g. "
        "{trainer: 1} places the workers on nodes started with --resources '{\"trainer\": N}').",
    )
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="ray: PACK fills as few nodes as fit; SPREAD spreads the workers over the "
        "nodes; STRICT_PACK one node or nothing; STRICT_SPREAD one worker per node.",
    )

    def bundle(self) -> dict[str, float]:
        """One worker's resources, as Ray names them."""
        return {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}

    @property
    def placed(self) -> bool:
        """Whether anything here differs from the defaults (which only Ray reads)."""
        return bool(self.model_fields_set & {"num_cpus", "num_gpus", "resources", "strategy"})


class RolePlacement(RayPlacement):
    """How many data-parallel replicas of one role's engine run, and where on Ray."""

    dp: PositiveInt = Field(
        1,
        description="Data-parallel size. The role runs dp × tensor_parallel_size × "
        "pipeline_parallel_size workers (the model-parallel sizes are its engine config's).",
    )


class RayConfig(FrozenModel):
    """The Ray cluster a ``placement.executor: ray`` job runs on."""

    address: str | None = Field(
        None,
        description="None: start a Ray instance on this machine for the job (stopped at its "
        "end), also where a `ray start` cluster runs or RAY_ADDRESS is set; 'auto': join the "
        "cluster this machine belongs to; 'host:port' or 'ray://host:port': join that cluster.",
    )
    num_cpus: PositiveInt | None = Field(
        None, description="CPUs of the Ray instance the job starts (None: every core)."
    )


class PlacementConfig(FrozenModel):
    """Which executor runs the roles, and each role's data-parallel size."""

    executor: Executor = Field(
        "in_process",
        description="in_process: every role's one engine in this process; local: each role a "
        "worker group of spawned processes (gloo, NCCL on GPUs); ray: each role a group of Ray "
        "actors.",
    )
    actor: RolePlacement = RolePlacement()
    critic: RolePlacement = Field(
        default_factory=RolePlacement,
        description="Only with a critic (advantage gae: algorithm=ppo).",
    )
    reference: RolePlacement = Field(
        default_factory=RolePlacement,
        description="Only with a reference: actor.use_kl_loss or trainer.algorithm.kl_in_reward.",
    )
    reward_model: RolePlacement = Field(
        default_factory=RolePlacement, description="Only with a reward_model."
    )
    rollout: RayPlacement = Field(
        default_factory=RayPlacement,
        description="ray, rollout_placement=process: each rollout replica's resources and how "
        "the replicas are spread (their number is rollout_replicas).",
    )
    call_timeout_s: float = Field(
        DEFAULT_CALL_TIMEOUT_S,
        gt=0,
        description="local/ray: seconds every worker of a group has to answer a call.",
    )
    collective_timeout_s: float | None = Field(
        None,
        gt=0,
        description="local/ray: seconds a collective waits for the other ranks before failing "
        "(None: torch's default).",
    )

    @model_validator(mode="after")
    def _check(self) -> PlacementConfig:
        roles = ("actor", "critic", "reference", "reward_model", "rollout")
        placed = [r for r in roles if getattr(self, r).placed]
        if placed and self.executor != "ray":
            raise ValueError(
                f"num_cpus, num_gpus, resources and strategy place Ray actors; "
                f"{', '.join(f'placement.{r}' for r in placed)} set them with "
                f"executor={self.executor}. Set executor=ray, or remove them."
            )
        if self.executor == "in_process":
            wide = [
                f"{role}.dp={p.dp}"
                for role, p in (
                    ("actor", self.actor),
                    ("critic", self.critic),
                    ("reference", self.reference),
                    ("reward_model", self.reward_model),
                )
                if p.dp != 1
            ]
            if wide:
                raise ValueError(
                    f"executor=in_process runs one engine per role in this process, so every "
                    f"dp must be 1; got {', '.join(wide)}. Set executor=local or executor=ray "
                    f"for data-parallel roles."
                )
        return self

    @property
    def grouped(self) -> bool:
        """Whether the roles run as worker groups (``local`` or ``ray``)."""
        return self.executor != "in_process"


def num_workers(dp: int, engine_config: Any) -> int:
    """Workers of a role: its DP size times its engine's tensor × pipeline parallel sizes."""
    tp = int(getattr(engine_config, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(engine_config, "pipeline_parallel_size", 1) or 1)
    return dp * tp * pp


def start_group(
    placement: PlacementConfig,
    worker_cls: type,
    workers: int,
    init_args: tuple[Any, ...],
    role: RayPlacement | None = None,
) -> WorkerGroup:
    """``workers`` instances of a role worker class on ``placement.executor``, each with its
    share of this machine's cores; on Ray placed as ``role`` says (default: the defaults)."""
    role = role if role is not None else RayPlacement()
    if placement.executor == "in_process":  # grouped placements only
        raise ValueError("start_group runs roles on 'local' processes or 'ray', not in_process.")
    where: dict[str, Any] = {}
    if placement.executor == "ray":
        where = {"resources": role.bundle(), "strategy": role.strategy}
    return start_worker_group(
        placement.executor,
        worker_cls,
        workers,
        init_args=init_args,
        call_timeout_s=placement.call_timeout_s,
        collective_timeout_s=placement.collective_timeout_s,
        **where,
    )


class RoleGroup:
    """A role's worker group seen from the driver; also a checkpoint part of the job."""

    mesh = ""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    @property
    def dp_size(self) -> int:
        return self.group.mesh_ranks(self.mesh)[0].dp_size

    def checkpoint_preflight(self, path: str, *, saving: bool) -> None:
        self.group.call_all("checkpoint_preflight", str(path), saving)

    def write_checkpoint_files(self, folder: str, *, step: int) -> None:
        self.group.call_all("write_checkpoint_files", folder, step)

    def read_checkpoint_files(self, folder: str) -> int:
        return int(self.group.call_all("read_checkpoint_files", folder)[0])

    def export_hf(self, path: str) -> str:
        return str(self.group.call_all("export_hf", path)[0])

    def shutdown(self) -> None:
        self.group.shutdown()


def _first(per_dp_rank: list[dict[str, float]]) -> dict[str, float]:
    # metrics are reduced over the DP ranks inside the update: every rank returns the same
    return per_dp_rank[0]


class ActorGroup(RoleGroup):
    """:class:`engine_core_roles.Actor`'s calls on an :class:`engine_core_roles.distributed.workers.ActorWorker` group."""

    mesh = "actor"

    def __init__(
        self, group: WorkerGroup, config: ActorConfig, algorithm: AlgorithmConfig | None = None
    ) -> None:
        """``config`` and ``algorithm`` are the ones the group's workers were started with
        (:class:`engine_core_roles.Actor`'s; None: the grpo preset)."""
        super().__init__(group)
        self.config = config
        self.algorithm = AlgorithmConfig(preset="grpo") if algorithm is None else algorithm
        self._max_positions: int | None = group.call_all("max_position_embeddings")[0]

    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        out: TensorDict = self.group.execute("compute_log_prob", batch)
        return out

    def update_actor(self, batch: TensorDict) -> ActorUpdate:
        per_dp_rank: list[ActorUpdate] = self.group.execute("update_actor", batch)
        metrics = _first([u.metrics for u in per_dp_rank])
        old = [u.old_log_probs for u in per_dp_rank if u.old_log_probs is not None]
        if not old:
            return ActorUpdate(metrics)
        # the DP chunks in order, without the rows that padded the batch to the DP size
        rows = int(batch.batch_size[0])
        routes = [u.routes for u in per_dp_rank if u.routes is not None]
        return ActorUpdate(
            metrics, torch.cat(old)[:rows], torch.cat(routes)[:rows] if routes else None
        )

    def supervised_step(self, batch: TensorDict) -> dict[str, float]:
        """One supervised step of the whole group on ``batch``, split over its DP ranks (its
        metrics are the global ones, the same on each)."""
        per_dp_rank: list[dict[str, float]] = self.group.execute("supervised_step", batch)
        return per_dp_rank[0]

    @property
    def max_position_embeddings(self) -> int | None:
        return self._max_positions


class CriticGroup(RoleGroup):
    """:class:`engine_core_roles.Critic`'s calls on a :class:`engine_core_roles.distributed.workers.CriticWorker` group."""

    mesh = "critic"

    def compute_values(self, batch: TensorDict) -> TensorDict:
        out: TensorDict = self.group.execute("compute_values", batch)
        return out

    def update_critic(self, batch: TensorDict) -> dict[str, float]:
        return _first(self.group.execute("update_critic", batch))


class RewardModelGroup(RoleGroup):
    """:class:`engine_core_roles.RewardModel`'s call on a :class:`engine_core_roles.distributed.workers.RewardModelWorker` group
    (frozen: no checkpoint of its own)."""

    mesh = "rm"

    def compute_rm_score(self, batch: TensorDict) -> TensorDict:
        out: TensorDict = self.group.execute("compute_rm_score", batch)
        return out


class ReferenceGroup(RoleGroup):
    """:class:`engine_core_roles.Reference`'s call on a :class:`engine_core_roles.distributed.workers.ReferenceWorker` group."""

    mesh = "ref"

    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        out: TensorDict = self.group.execute("compute_ref_log_prob", batch)
        return out
