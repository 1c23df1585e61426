"""Choosing a run's algorithm: presets, the typed config, and resolution through the plugins.

``trainer.algorithm`` is one preset name (``grpo``, ``gspo``, ...) or a mapping naming an
advantage estimator and a policy loss with their parameters::

    trainer:
      algorithm:
        advantage: rloo
        policy_loss: gspo
        policy_loss_params: {clip_ratio_high: 5.0e-4}

:func:`resolve_algorithm` finds both names among the registered algorithms (the shipped ones and
any installed plugin's), validates their parameters with each one's own model and returns what
the run needs (:attr:`ResolvedAlgorithm.needs`): all of it before anything is built.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field, PositiveInt, ValidationError, model_validator

import engine_core_roles.algorithms.plugin as plugin
from engine_core import FrozenModel, LossAggregation
from engine_core.configio import prefix_validation_error
from engine_core.errors import ConfigError, PluginError
from engine_core.hookspecs import AlgorithmKind, AlgorithmNeed, AlgorithmSpec
from engine_core.plugins import PluginManager, load_plugins
from engine_core_roles.algorithms.base import AdvantageEstimator, NoParams, PolicyLoss
from engine_core_roles.algorithms.losses import KLEstimator

__all__ = [
    "PRESETS",
    "Preset",
    "OverlongShaping",
    "KLInReward",
    "AlgorithmConfig",
    "ResolvedAlgorithm",
    "algorithm_manager",
    "resolve_algorithm",
    "build_policy_loss",
    "check_needs",
]


@dataclass(frozen=True)
class Preset:
    """One name for an advantage estimator and a policy loss (and the loss aggregation the
    method's paper uses, applied when the algorithm's mapping sets none)."""

    advantage: str
    policy_loss: str = "ppo_clip"
    advantage_params: Mapping[str, Any] | None = None
    policy_loss_params: Mapping[str, Any] | None = None
    loss_agg_mode: LossAggregation | None = None
    description: str = ""


PRESETS: dict[str, Preset] = {
    "grpo": Preset("grpo", description="group-normalized scores, PPO clip"),
    "ppo": Preset("gae", description="GAE over a critic's values, PPO clip"),
    "dr_grpo": Preset(
        "grpo",
        advantage_params={"normalize_std": False},
        loss_agg_mode=LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM,
        description="group-centered scores (no std), each sequence's token sum over the "
        "generation budget",
    ),
    "rloo": Preset("rloo", description="leave-one-out baseline, PPO clip"),
    "reinforce_pp": Preset("reinforce_pp", description="REINFORCE++, PPO clip"),
    "reinforce_pp_baseline": Preset(
        "reinforce_pp_baseline", description="REINFORCE++ with the group mean as baseline"
    ),
    "gspo": Preset(
        "grpo",
        "gspo",
        loss_agg_mode=LossAggregation.SEQ_MEAN_TOKEN_MEAN,
        description="group-normalized scores, sequence-level ratio clipped per sequence",
    ),
    "cispo": Preset("grpo", "cispo", description="group-normalized scores, CISPO's loss"),
}


class OverlongShaping(FrozenModel):
    """DAPO's overlong reward shaping: a response within ``buffer`` tokens of the generation
    budget (``max_new_tokens``) loses up to ``penalty`` from its reward, linearly: nothing at
    ``max_new_tokens - buffer`` tokens, all of it at ``max_new_tokens``. Logged as
    ``reward/overlong_penalty``."""

    buffer: PositiveInt = Field(..., description="Tokens before the budget where it starts.")
    penalty: float = Field(1.0, ge=0, description="What a response of the full budget loses.")


class KLInReward(FrozenModel):
    """KL to the reference in the reward: each loss token's reward gets
    ``-coef * KL(policy || reference)`` (estimated from the sampled token's log-probs), which the
    estimator sees as token rewards. Logged as ``reward/kl_penalty`` (the mean sample's total).
    Needs a reference (the job builds one). The alternative is the KL term in the actor's loss
    (``actor.use_kl_loss``)."""

    coef: float = Field(0.001, ge=0, description="The KL penalty's weight.")
    estimator: KLEstimator = Field(
        KLEstimator.K1, description="Per-token KL estimator: k1, k2, k3, low_var_kl or abs."
    )


class AlgorithmConfig(FrozenModel):
    """The run's advantage estimator and policy loss (``trainer.algorithm``).

    Given as a preset name (``grpo``), it is that preset; given as a mapping, ``preset`` (if
    any) fills what the mapping leaves out. The names must be registered algorithms (``engine-core
    plugins`` lists them); each one's parameters are checked by its own model.

    The algorithm owns the policy loss, its parameters and the loss aggregation, and the actor
    reads them from it (``Actor(config, engine, algorithm=...)``): a user picks a method by
    name (``gspo``) and the method's paper fixes its loss and aggregation together, so they
    are read where the method is named, not in the actor's update settings (epochs,
    mini-batches, entropy, KL), which stay the same when the method changes.
    """

    preset: str | None = Field(
        None, description=f"A preset: {', '.join(PRESETS)}; fills what is left unset."
    )
    advantage: str = Field("grpo", description="A registered advantage estimator.")
    advantage_params: dict[str, Any] = Field(
        default_factory=dict, description="The estimator's parameters (its own model checks them)."
    )
    policy_loss: str = Field("ppo_clip", description="A registered policy loss.")
    policy_loss_params: dict[str, Any] = Field(
        default_factory=dict, description="The loss's parameters (its own model checks them)."
    )
    loss_agg_mode: LossAggregation = Field(
        LossAggregation.TOKEN_MEAN,
        description="How the actor's per-token terms (the policy loss, the entropy bonus, the "
        "KL loss, the routers' balance loss) become one number; unset: the preset's (dr_grpo: "
        "seq-mean-token-sum-norm; gspo: seq-mean-token-mean), else token-mean.",
    )
    overlong: OverlongShaping | None = Field(
        None, description="DAPO's overlong reward shaping; None: off."
    )
    kl_in_reward: KLInReward | None = Field(
        None, description="KL to the reference as a per-token reward; None: off."
    )

    @model_validator(mode="before")
    @classmethod
    def _from_preset(cls, data: Any) -> Any:
        if isinstance(data, str):
            data = {"preset": data}
        if not isinstance(data, Mapping) or data.get("preset") is None:
            return data
        name = data["preset"]
        preset = PRESETS.get(name) if isinstance(name, str) else None
        if preset is None:
            close = difflib.get_close_matches(str(name), list(PRESETS), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise ValueError(
                f"unknown algorithm preset {name!r}; presets: {', '.join(PRESETS)}{hint} Or give "
                f"a mapping: {{advantage: <estimator>, policy_loss: <loss>}} (`engine-core "
                f"plugins` lists the registered ones)."
            )
        own_mode = {} if preset.loss_agg_mode is None else {"loss_agg_mode": preset.loss_agg_mode}
        filled: dict[str, Any] = {
            "advantage": preset.advantage,
            "policy_loss": preset.policy_loss,
            **own_mode,
            **data,
        }
        # a preset's parameters stay unless given again: a mapping adds to them
        for key, own in (
            ("advantage", preset.advantage_params),
            ("policy_loss", preset.policy_loss_params),
        ):
            given = data.get(f"{key}_params") or {}
            same = filled[key] == getattr(preset, key)
            base = dict(own or {}) if same else {}
            filled[f"{key}_params"] = {**base, **given} if isinstance(given, Mapping) else given
        return filled

    @property
    def name(self) -> str:
        """What the run's title and logs call it: the preset, while its estimator and loss are
        the preset's; else ``advantage+policy_loss``."""
        preset = PRESETS.get(self.preset or "")
        if preset is not None and (preset.advantage, preset.policy_loss) == (
            self.advantage,
            self.policy_loss,
        ):
            return str(self.preset)
        return f"{self.advantage}+{self.policy_loss}"


@dataclass(frozen=True)
class ResolvedAlgorithm:
    """Both parts found and their parameters validated; nothing built yet."""

    advantage: AlgorithmSpec
    advantage_params: BaseModel
    policy_loss: AlgorithmSpec
    policy_loss_params: BaseModel

    @property
    def needs(self) -> frozenset[AlgorithmNeed]:
        return self.advantage.needs | self.policy_loss.needs

    def build_estimator(self) -> AdvantageEstimator:
        return _built(self.advantage, self.advantage_params, AdvantageEstimator)

    def build_policy_loss(self) -> PolicyLoss:
        return _built(self.policy_loss, self.policy_loss_params, PolicyLoss)


@functools.lru_cache(maxsize=1)
def algorithm_manager() -> PluginManager:
    """This process's plugins (from the environment), with the shipped algorithms registered
    even when plugin autoload is off or ``ENGINE_CORE_PLUGINS`` leaves them out."""
    manager = load_plugins()
    ensure_shipped(manager)
    return manager


def ensure_shipped(manager: PluginManager) -> PluginManager:
    """Register the shipped algorithms on ``manager`` unless its plugins already did."""
    if "grpo" not in manager.registry.algorithm_names(AlgorithmKind.ADVANTAGE):
        manager.register(plugin, plugin.PLUGIN_NAME, distribution="engine-core-roles")
    return manager


def resolve_algorithm(
    config: AlgorithmConfig,
    manager: PluginManager | None = None,
    *,
    path: str = "trainer.algorithm",
) -> ResolvedAlgorithm:
    """Find ``config``'s estimator and loss and validate their parameters (imports their
    modules, builds nothing). Unknown names are refused with the registered ones."""
    manager = _manager(manager)
    advantage = _spec(manager, AlgorithmKind.ADVANTAGE, config.advantage, f"{path}.advantage")
    loss = _spec(manager, AlgorithmKind.POLICY_LOSS, config.policy_loss, f"{path}.policy_loss")
    return ResolvedAlgorithm(
        advantage,
        _params(advantage, config.advantage_params, f"{path}.advantage_params"),
        loss,
        _params(loss, config.policy_loss_params, f"{path}.policy_loss_params"),
    )


def build_policy_loss(
    name: str,
    params: Mapping[str, Any],
    manager: PluginManager | None = None,
    *,
    path: str = "trainer.algorithm",
) -> PolicyLoss:
    """The policy loss ``name`` with ``params`` (an algorithm's ``policy_loss`` and
    ``policy_loss_params``)."""
    spec = _spec(_manager(manager), AlgorithmKind.POLICY_LOSS, name, f"{path}.policy_loss")
    return _built(spec, _params(spec, params, f"{path}.policy_loss_params"), PolicyLoss)


def check_needs(
    resolved: ResolvedAlgorithm,
    *,
    has_critic: bool | None,
    samples_per_prompt: int,
    has_reference: bool | None = None,
) -> None:
    """Refuse a run that lacks what its algorithm declared it needs, naming the part.
    ``has_critic`` / ``has_reference`` ``None``: not known yet (not checked)."""
    for spec in (resolved.advantage, resolved.policy_loss):
        what = f"{spec.kind.replace('_', ' ')} {spec.name!r}"
        if AlgorithmNeed.REFERENCE in spec.needs and has_reference is False:
            raise ConfigError(
                f"the {what} reads the reference policy's log-probs, and the run has no "
                f"reference; pass reference=Reference(engine) (a frozen copy of the initial "
                f"policy). engine-core run builds one for it."
            )
        if AlgorithmNeed.CRITIC in spec.needs and has_critic is False:
            raise ConfigError(
                f"the {what} estimates advantages from a critic's values, and the run has no "
                f"critic; pass critic= (engine-core run: the job builds one from critic_engine, "
                f"or the actor's engine with a value head), or pick an estimator without one "
                f"(grpo, rloo, reinforce_pp)."
            )
        if AlgorithmNeed.GROUPS in spec.needs and samples_per_prompt < 2:
            raise ConfigError(
                f"the {what} compares each sample with the other samples of its prompt, so "
                f"trainer.samples_per_prompt must be >= 2 (got {samples_per_prompt}); raise it, "
                f"or pick one that needs no groups (reinforce_pp, or gae with a critic)."
            )
    if AlgorithmNeed.CRITIC not in resolved.needs and has_critic is True:
        raise ConfigError(
            f"a critic is configured but the advantage estimator {resolved.advantage.name!r} "
            f"uses none; drop the critic (critic= / critic_engine), or use advantage gae "
            f"(algorithm=ppo)."
        )


def _spec(manager: PluginManager, kind: AlgorithmKind, name: str, where: str) -> AlgorithmSpec:
    try:
        return manager.get_algorithm(kind, name)
    except PluginError as e:
        raise ConfigError(f"{where}: {e}") from None


def _params(spec: AlgorithmSpec, raw: Mapping[str, Any], where: str) -> BaseModel:
    _, model = spec.load()
    model = NoParams if model is None else model
    try:
        return model.model_validate(dict(raw))
    except ValidationError as e:
        raise prefix_validation_error(
            e, tuple(where.split(".")), f"{model.__name__} ({spec.kind} {spec.name!r})"
        ) from None


def _manager(manager: PluginManager | None) -> PluginManager:
    return algorithm_manager() if manager is None else ensure_shipped(manager)


def _built(spec: AlgorithmSpec, params: BaseModel, base: type) -> Any:
    """``spec``'s class, checked to be a ``base``, built with its validated ``params``."""
    cls, _ = spec.load()
    if not issubclass(cls, base):
        raise PluginError(
            f"{spec.kind} {spec.name!r} from plugin {spec.plugin!r}: {spec.target} is not a "
            f"subclass of {base.__module__}.{base.__name__}; fix the plugin's registration."
        )
    return cls(params)
