"""Building a job's roles: engines in this process, or worker groups, the rollout where the
recipe puts it, the weight link between them, and the job's thread plan.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_core import (
    BaseEngine,
    PluginManager,
    resolve_engine_config,
    resolve_rollout_config,
)
from engine_core.errors import ConfigError
from engine_core.executors.base import threads_per_process
from engine_core.models import build_hf_config
from engine_core.remote_rollout import ProcessRollout
from engine_core.rollout import BaseRollout
from engine_core_roles.distributed.placement import (
    ActorGroup,
    CriticGroup,
    ReferenceGroup,
    RewardModelGroup,
    RoleGroup,
    num_workers,
    start_group,
)
from engine_core_roles.distributed.weights import WeightLink
from engine_core_roles.distributed.workers import (
    ActorWorker,
    CriticWorker,
    ReferenceWorker,
    RewardModelWorker,
)
from engine_core_roles.episodes.rollout import EpisodeRollout, EpisodeWorker
from engine_core_roles.jobs.rl.config import RLJobConfig
from engine_core_roles.jobs.rl.text import _episode_settings, _Text
from engine_core_roles.roles.actor import Actor
from engine_core_roles.roles.critic import Critic
from engine_core_roles.roles.reference import Reference
from engine_core_roles.roles.reward_model import RewardModel
from engine_core_roles.trainer.protocols import (
    PolicyRole,
    ReferenceRole,
    RewardRole,
    ValueRole,
)


@dataclass
class _Roles:
    """The job's roles as the trainer calls them, and what holds their engines."""

    actor: PolicyRole
    rollout: BaseRollout | ProcessRollout
    reference: ReferenceRole | None
    critic: ValueRole | None
    parts: dict[str, Any]  # checkpoint parts: engines, or role groups
    reward_model: RewardRole | None = None
    groups: dict[str, RoleGroup] = field(default_factory=dict)  # by placement role name
    owns_ray: bool = False
    weights: WeightLink | None = None  # the one path from the actor to the rollout

    @property
    def actor_part(self) -> Any:
        return self.parts["actor"]

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()
        if isinstance(self.rollout, ProcessRollout):
            self.rollout.shutdown()
        for group in self.groups.values():
            group.shutdown()
        if self.owns_ray:
            import ray

            ray.shutdown()


@dataclass(frozen=True)
class _Threads:
    """The job's CPU threads, decided here and nowhere else: this process's count while the
    job runs (None: left as it is) and each rollout replica's."""

    driver: int | None
    per_replica: int


def _threads(job: RLJobConfig) -> _Threads:
    if job.rollout_placement != "process":
        return _Threads(None, 1)
    driver = None
    if job.trainer.max_staleness:
        # generation and training run at once: the cores are split between this process and
        # the rollout's, not every process on every core
        driver = threads_per_process(2)
    cores = driver or torch.get_num_threads()
    return _Threads(driver, threads_per_process(job.rollout_replicas, cores))


def _build(
    job: RLJobConfig,
    manager: PluginManager,
    stack: contextlib.ExitStack,
    threads: _Threads,
    text: _Text | None = None,
) -> _Roles:
    # every config is resolved (and refused, naming the field) before anything is built
    spec, engine_cfg = resolve_engine_config(job.engine, manager, path=("engine",))
    rollout_raw = {"model": job.engine["model"], **job.rollout}
    rspec, rollout_cfg = resolve_rollout_config(rollout_raw, manager, path=("rollout",))
    critic_spec = critic_cfg = None
    if job.trainer.algorithm == "ppo":
        path = ("critic_engine",)
        critic_spec, critic_cfg = resolve_engine_config(
            job.critic_engine_config(), manager, path=path
        )
    rm_spec = rm_cfg = None
    if job.reward_model is not None:
        rm_spec, rm_cfg = resolve_engine_config(
            job.reward_model.engine_config(), manager, path=("reward_model", "engine")
        )
        _check_vocabulary(engine_cfg, rm_cfg)
    roles = _Roles(actor=None, rollout=None, reference=None, critic=None, parts={})  # type: ignore[arg-type]
    stack.callback(roles.close)
    if job.placement.grouped:
        _build_groups(job, roles, engine_cfg, critic_cfg, rm_cfg)
    else:
        engine: BaseEngine = spec.load_class()(engine_cfg)
        engine.init_model()
        roles.actor, roles.parts["actor"] = Actor(job.actor_config(), engine), engine
        if job.actor.use_kl_loss:
            ref_engine = spec.load_class()(engine_cfg)
            ref_engine.init_model()  # same seed: the initial policy
            roles.reference = Reference(ref_engine)
        if critic_spec is not None:
            critic_engine = critic_spec.load_class()(critic_cfg)
            critic_engine.init_model()
            roles.critic, roles.parts["critic"] = Critic(job.critic, critic_engine), critic_engine
        if rm_spec is not None:
            rm_engine = rm_spec.load_class()(rm_cfg)
            rm_engine.init_model()
            roles.reward_model = RewardModel(rm_engine)
    episodes = _episode_settings(job, text)
    if job.rollout_placement == "process":
        # with the roles on Ray, the replicas are Ray actors too (placed by Ray, like the roles);
        # with an environment, each replica runs its episodes whole
        hosting: dict[str, Any] = {}  # the replicas' worker: the plain one unless episodes
        if episodes:
            hosting = {"worker_cls": EpisodeWorker, "worker_args": (episodes,)}
        roles.rollout = ProcessRollout(
            rollout_cfg,  # type: ignore[arg-type]
            replicas=job.rollout_replicas,
            executor="ray" if job.placement.executor == "ray" else "local",
            threads_per_replica=threads.per_replica,
            **hosting,
        )
    else:
        backend: BaseRollout = rspec.load_class()(rollout_cfg)
        roles.rollout = backend
        if episodes and text is not None and text.environment is not None:
            assert job.env is not None
            roles.rollout = EpisodeRollout(
                backend,
                text.environment,
                text.tokenizer,
                max_turns=job.env.max_turns,
                max_episode_tokens=episodes["max_episode_tokens"],
                step_timeout_s=job.env.step_timeout_s,
            )
    roles.weights = WeightLink(roles.actor, roles.rollout)  # type: ignore[arg-type]
    return roles


def _check_vocabulary(policy_cfg: Any, rm_cfg: Any) -> None:
    """A reward model reads the actor's token ids: the two must share one vocabulary."""
    policy = build_hf_config(policy_cfg.model).vocab_size
    rm = build_hf_config(rm_cfg.model).vocab_size
    if policy != rm:
        raise ConfigError(
            f"reward_model.engine.model has vocab_size {rm}, the actor's model {policy}; the "
            f"reward model scores the actor's token ids, so it must use the same tokenizer. "
            f"Train or pick a reward model on the actor's vocabulary."
        )


def _build_groups(
    job: RLJobConfig, roles: _Roles, engine_cfg: Any, critic_cfg: Any, rm_cfg: Any
) -> None:
    """The roles as worker groups on ``job.placement.executor`` (local processes or Ray)."""

    placement = job.placement
    if placement.executor == "ray":
        import ray

        if not ray.is_initialized():
            ray.init(address=job.ray.address, num_cpus=job.ray.num_cpus, log_to_driver=False)
            roles.owns_ray = True
    policy_raw, actor_cfg = engine_cfg.model_dump(), job.actor_config()
    actor = start_group(
        placement,
        ActorWorker,
        num_workers(placement.actor.dp, engine_cfg),
        (policy_raw, actor_cfg.model_dump()),
    )
    roles.groups["actor"] = ActorGroup(actor, actor_cfg)
    roles.actor = roles.parts["actor"] = roles.groups["actor"]  # type: ignore[assignment]
    if job.actor.use_kl_loss:
        workers = num_workers(placement.reference.dp, engine_cfg)
        ref = start_group(placement, ReferenceWorker, workers, (policy_raw,))
        roles.groups["reference"] = ReferenceGroup(ref)
        roles.reference = roles.groups["reference"]  # type: ignore[assignment]
    if critic_cfg is not None:
        workers = num_workers(placement.critic.dp, critic_cfg)
        critic_args = (critic_cfg.model_dump(), job.critic.model_dump())
        critic = start_group(placement, CriticWorker, workers, critic_args)
        roles.groups["critic"] = CriticGroup(critic)
        roles.critic = roles.parts["critic"] = roles.groups["critic"]  # type: ignore[assignment]
    if rm_cfg is not None:
        workers = num_workers(placement.reward_model.dp, rm_cfg)
        rm = start_group(placement, RewardModelWorker, workers, (rm_cfg.model_dump(),))
        roles.groups["reward_model"] = RewardModelGroup(rm)
        roles.reward_model = roles.groups["reward_model"]  # type: ignore[assignment]
    for role, group in roles.groups.items():
        want = getattr(placement, role).dp
        if group.dp_size != want:
            raise ConfigError(
                f"placement.{role}.dp={want}, but its engine formed dp={group.dp_size} from "
                f"{group.group.num_workers} workers; the engine's tensor_parallel_size × "
                f"pipeline_parallel_size must divide them. Check the role's engine config."
            )
