"""Building a job: every config resolved first (:func:`resolve`), then the roles (engines in this
process, or worker groups), the rollout where the recipe puts it, and the weight link between
them (:func:`build`), each registered for closing as soon as it exists; and the job's thread plan.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from engine_core import (
    BackendSpec,
    BaseEngine,
    EngineConfig,
    PluginManager,
    RolloutConfig,
    resolve_engine_config,
    resolve_rollout_config,
)
from engine_core.capabilities import Capability, check_capabilities
from engine_core.errors import CapabilityError, ConfigError
from engine_core.executors.base import WorkerGroup, threads_per_process
from engine_core.hookspecs import AlgorithmNeed
from engine_core.models import build_hf_config
from engine_core.remote_rollout import ProcessRollout
from engine_core.rollout import BaseRollout
from engine_core.stop_strings import tokenizer_folder
from engine_core_roles.algorithms.select import resolve_algorithm
from engine_core_roles.distributed.placement import (
    ActorGroup,
    CriticGroup,
    ReferenceGroup,
    RewardModelGroup,
    RoleGroup,
    num_workers,
    start_group,
)
from engine_core_roles.distributed.ray_cluster import local_cluster
from engine_core_roles.distributed.weights import WeightLink
from engine_core_roles.distributed.workers import (
    ActorWorker,
    CriticWorker,
    ReferenceWorker,
    RewardModelWorker,
)
from engine_core_roles.episodes.rollout import EpisodeRollout, EpisodeWorker
from engine_core_roles.jobs.rl.config import RLJobConfig
from engine_core_roles.jobs.rl.text import TextParts, episode_settings
from engine_core_roles.models.actor import Actor
from engine_core_roles.models.critic import Critic
from engine_core_roles.models.reference import Reference
from engine_core_roles.models.reward_model import RewardModel
from engine_core_roles.serving.agents import AgentRollout


@dataclass
class Resolved:
    """Every engine and rollout config of a job, resolved (and refused, naming the field)
    before anything is built."""

    engine: tuple[BackendSpec, EngineConfig]
    rollout: tuple[BackendSpec, RolloutConfig]
    critic: tuple[BackendSpec, EngineConfig] | None
    reward_model: tuple[BackendSpec, EngineConfig] | None


def resolve(job: RLJobConfig, manager: PluginManager) -> Resolved:
    engine = resolve_engine_config(job.actor_engine_config(), manager, path=("engine",))
    rollout_raw = {"model": job.engine["model"], **job.rollout}
    if job.trainer.routing_replay in ("rollout", "measure"):  # the rollout returns its routes
        rollout_raw["return_routes"] = True
    rollout_spec, rollout_cfg = resolve_rollout_config(rollout_raw, manager, path=("rollout",))
    if not isinstance(rollout_cfg, RolloutConfig):
        raise ConfigError(
            f"rollout.backend={rollout_spec.name!r} declares the config class "
            f"{type(rollout_cfg).__name__}, which does not subclass engine_core.RolloutConfig; "
            f"a rollout's config must, so that the job can hand it to the rollout's processes. "
            f"Fix the plugin's config class."
        )
    _check_routing_capabilities(job, engine[0])
    _check_stop_strings(job, rollout_spec, rollout_cfg)
    critic = None
    algorithm = resolve_algorithm(job.trainer.algorithm, manager)
    if AlgorithmNeed.CRITIC in algorithm.needs:
        critic = resolve_engine_config(job.critic_engine_config(), manager, path=("critic_engine",))
    reward_model = None
    if job.reward_model is not None:
        reward_model = resolve_engine_config(
            job.reward_model.engine_config(), manager, path=("reward_model", "engine")
        )
        _check_vocabulary(engine[1], reward_model[1])
    return Resolved(engine, (rollout_spec, rollout_cfg), critic, reward_model)


def _check_stop_strings(job: RLJobConfig, spec: BackendSpec, cfg: RolloutConfig) -> None:
    """trainer.stop_strings need a rollout that stops on strings and a tokenizer to decode with."""
    strings = job.trainer.stop_strings
    if not strings:
        return
    _require(spec, Capability.STOP_STRINGS, f"trainer.stop_strings={strings!r}: rollout")
    if tokenizer_folder(cfg.model) is None:
        raise ConfigError(
            f"trainer.stop_strings={strings!r} are found in the decoded text, and the model has "
            f"no tokenizer (engine.model.path={cfg.model.path!r}, engine.model.tokenizer="
            f"{cfg.model.tokenizer!r}); set engine.model.tokenizer to a folder holding one, or "
            f"stop on token ids (trainer.stop_token_ids)."
        )


def _check_routing_capabilities(job: RLJobConfig, engine: BackendSpec) -> None:
    """trainer.routing_replay and actor.moe_aux_loss_coef need the engine to declare
    routing_replay (the rollout, asked for its routes by rollout.return_routes, is checked as
    its config is resolved)."""
    mode = job.trainer.routing_replay
    asks = [f"trainer.routing_replay={mode}"] if mode != "off" else []
    if job.actor.moe_aux_loss_coef > 0:
        asks.append(f"actor.moe_aux_loss_coef={job.actor.moe_aux_loss_coef:g}")
    if asks:
        _require(engine, Capability.ROUTING_REPLAY, f"{' and '.join(asks)}: engine")


def _require(spec: BackendSpec, capability: Capability, asked: str) -> None:
    """Refuse a setting (``asked``: what asks for it and of which role) that needs a
    capability ``spec`` does not declare."""
    try:
        check_capabilities(spec.name, spec.capabilities, [capability])
    except CapabilityError as e:
        raise CapabilityError(f"{asked}: {e}") from None


@dataclass
class Roles:
    """The job's roles as the trainer calls them: in this process, or worker groups.
    ``parts`` are what a checkpoint saves (the engines, or the groups), by name."""

    actor: Actor | ActorGroup
    parts: dict[str, BaseEngine | RoleGroup]
    reference: Reference | ReferenceGroup | None = None
    critic: Critic | CriticGroup | None = None
    reward_model: RewardModel | RewardModelGroup | None = None

    @property
    def actor_part(self) -> BaseEngine | RoleGroup:
        return self.parts["actor"]


@dataclass
class Built:
    """A job's roles, its rollout and the one weight path between them (and, where the rollout
    runs agents, it as the :class:`AgentRollout` it is)."""

    roles: Roles
    rollout: BaseRollout
    weights: WeightLink
    agents: AgentRollout | None = None  # the rollout, where it runs agents


def build(
    job: RLJobConfig,
    resolved: Resolved,
    stack: contextlib.ExitStack,
    threads: Threads,
    text: TextParts | None = None,
) -> Built:
    """The job's roles, rollout and weight link; ``stack`` closes each (in reverse order)."""
    if job.placement.grouped:
        roles = _grouped_roles(job, resolved, stack)
    else:
        roles = _local_roles(job, resolved)
    rollout = _rollout(job, resolved, threads, text, stack)
    agents = None
    if text is not None and text.agent is not None:  # agents, through an endpoint over it
        agents = _agent_rollout(job, rollout, text)
        stack.callback(agents.shutdown)  # before the rollout's (callbacks run in reverse)
        rollout = agents
    weights = WeightLink(roles.actor, rollout)
    stack.callback(weights.close)
    return Built(roles, rollout, weights, agents)


def _local_roles(job: RLJobConfig, resolved: Resolved) -> Roles:
    """The roles on engines in this process (the reference: a second copy of the initial
    policy, built with the same seed)."""

    def engine(spec: BackendSpec, cfg: EngineConfig) -> BaseEngine:
        built: BaseEngine = spec.load_class()(cfg)
        built.init_model()
        return built

    actor_engine = engine(*resolved.engine)
    actor = Actor(job.actor_config(), actor_engine, job.trainer.algorithm)
    roles = Roles(actor, {"actor": actor_engine})
    if job.needs_reference:
        roles.reference = Reference(engine(*resolved.engine))
    if resolved.critic is not None:
        critic_engine = engine(*resolved.critic)
        roles.critic, roles.parts["critic"] = Critic(job.critic, critic_engine), critic_engine
    if resolved.reward_model is not None:
        roles.reward_model = RewardModel(engine(*resolved.reward_model))
    return roles


def _grouped_roles(job: RLJobConfig, resolved: Resolved, stack: contextlib.ExitStack) -> Roles:
    """The roles as worker groups on ``job.placement.executor`` (local processes or Ray)."""
    placement = job.placement
    if placement.executor == "ray":
        import ray

        if not ray.is_initialized():
            # no address: a cluster of its own, its head in a session of its own
            # (local_cluster); Ray's own default would join the cluster a `ray start` on this
            # machine recorded, or RAY_ADDRESS's, and the job would then take that cluster for
            # its own (and end it if killed, at the next start)
            if job.ray.address is None:  # a cluster of its own: ended with the job, or after
                say = Console(stderr=True).print
                out = Path(job.output_dir)
                stack.enter_context(local_cluster(out, job.ray.num_cpus, say))
            else:  # a cluster it joined: left as it was
                ray.init(address=job.ray.address, num_cpus=job.ray.num_cpus, log_to_driver=False)
                stack.callback(ray.shutdown)

    def started(role: str, worker: type[Any], cfg: EngineConfig, *args: Any) -> WorkerGroup:
        where = getattr(placement, role)
        group = start_group(
            placement, worker, num_workers(where.dp, cfg), (cfg.model_dump(), *args), where
        )
        stack.callback(group.shutdown)
        _say_where(role, group)
        return group

    engine_cfg, actor_cfg, algorithm = resolved.engine[1], job.actor_config(), job.trainer.algorithm
    actor = ActorGroup(
        started("actor", ActorWorker, engine_cfg, actor_cfg.model_dump(), algorithm.model_dump()),
        actor_cfg,
        algorithm,
    )
    roles = Roles(actor, {"actor": actor})
    groups: dict[str, RoleGroup] = {"actor": actor}
    if job.needs_reference:
        roles.reference = groups["reference"] = ReferenceGroup(
            started("reference", ReferenceWorker, engine_cfg)
        )
    if resolved.critic is not None:
        critic = CriticGroup(
            started("critic", CriticWorker, resolved.critic[1], job.critic.model_dump())
        )
        roles.critic = roles.parts["critic"] = groups["critic"] = critic
    if resolved.reward_model is not None:
        roles.reward_model = groups["reward_model"] = RewardModelGroup(
            started("reward_model", RewardModelWorker, resolved.reward_model[1])
        )
    for role, group in groups.items():
        want = getattr(placement, role).dp
        if group.dp_size != want:
            raise ConfigError(
                f"placement.{role}.dp={want}, but its engine formed dp={group.dp_size} from "
                f"{group.group.num_workers} workers; the engine's tensor_parallel_size × "
                f"pipeline_parallel_size must divide them. Check the role's engine config."
            )
    return roles


def _rollout(
    job: RLJobConfig,
    resolved: Resolved,
    threads: Threads,
    text: TextParts | None,
    stack: contextlib.ExitStack,
) -> BaseRollout:
    """The rollout in this process, or as replicas in processes of their own (Ray actors
    with the roles on Ray); with an environment, whole episodes run where it generates."""
    spec, rollout_cfg = resolved.rollout
    episodes = episode_settings(job, text)
    if job.rollout_placement == "process":
        hosting: dict[str, Any] = {}  # the replicas' worker: the plain one unless episodes
        if episodes:
            hosting = {"worker_cls": EpisodeWorker, "worker_args": (episodes,)}
        if job.placement.executor == "ray":
            where = job.placement.rollout
            hosting.update(resources=where.bundle(), strategy=where.strategy)
        remote = ProcessRollout(
            rollout_cfg,
            replicas=job.rollout_replicas,
            executor="ray" if job.placement.executor == "ray" else "local",
            threads_per_replica=threads.per_replica,
            python=job.rollout_python,
            **hosting,
        )
        stack.callback(remote.shutdown)
        _say_where("rollout", remote.worker_group)
        return remote
    backend: BaseRollout = spec.load_class()(rollout_cfg)
    stack.callback(backend.shutdown)
    if episodes and text is not None and text.environment is not None:
        assert job.env is not None
        return EpisodeRollout(
            backend,
            text.environment,
            text.tokenizer,
            max_turns=job.env.max_turns,
            max_episode_tokens=episodes["max_episode_tokens"],
            step_timeout_s=job.env.step_timeout_s,
            images=text.images,
        )
    return backend


def _agent_rollout(job: RLJobConfig, backend: BaseRollout, text: TextParts) -> AgentRollout:
    """The job's agents over ``backend``, through an endpoint that samples as the trainer
    computes its log-probs: its temperature, its stop tokens, its per-call token budget."""
    assert text.agent is not None
    trainer = job.text_trainer_config(text.stops)
    return AgentRollout(
        backend,
        text.agent,
        text.tokenizer,
        temperature=trainer.temperature,
        max_tokens=trainer.max_new_tokens,
        stop_token_ids=list(trainer.stop_token_ids),
        max_concurrency=job.agent_concurrency,
        timeout_s=job.agent_timeout_s,
        scored_by_fn=job.reward is not None,
    )


def _say_where(role: str, group: WorkerGroup) -> None:
    """One line naming the nodes a Ray group's workers run on."""
    where = getattr(group, "where", None)
    if where is not None:
        Console(stderr=True).print(f"placement: {role} workers: {where()}", soft_wrap=True)


@dataclass(frozen=True)
class Threads:
    """The job's CPU threads, decided here and nowhere else: this process's count while the
    job runs (None: left as it is) and each rollout replica's."""

    driver: int | None
    per_replica: int


def thread_plan(job: RLJobConfig) -> Threads:
    if job.rollout_placement != "process":
        return Threads(None, 1)
    driver = None
    if job.trainer.max_staleness:
        # generation and training run at once: the cores are split between this process and
        # the rollout's, not every process on every core
        driver = threads_per_process(2)
    cores = driver or torch.get_num_threads()
    return Threads(driver, threads_per_process(job.rollout_replicas, cores))


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
