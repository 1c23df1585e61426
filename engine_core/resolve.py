"""Config resolution: raw mapping -> (backend spec, validated config), before anything starts.

Owns :func:`resolve_engine_config` and :func:`resolve_rollout_config`. Resolution picks the
backend named by ``backend``, validates the mapping with that backend's own config class (errors
carry the full field path, e.g. ``engine.micro_batch_size``) and refuses a config that asks for a
capability the backend does not declare. It imports the config class only, never the backend
class, so a bad config fails in seconds, before any process or model is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from pydantic import BaseModel, ValidationError

from engine_core.capabilities import Capability, check_capabilities
from engine_core.config import EngineConfig
from engine_core.configio import prefix_validation_error
from engine_core.errors import CapabilityError, ConfigError
from engine_core.plugins import BackendKind, BackendSpec, PluginManager

__all__ = ["resolve_engine_config", "resolve_rollout_config"]


def resolve_engine_config(
    raw: Mapping[str, Any], manager: PluginManager, *, path: tuple[str, ...] = ("engine",)
) -> tuple[BackendSpec, EngineConfig]:
    """Validate ``raw`` (with its ``backend`` key) against the chosen engine.

    Raises ``ConfigError`` (no/invalid ``backend``), ``UnknownBackendError``,
    ``PluginLoadError``, pydantic ``ValidationError`` (paths prefixed with ``path``) or
    ``CapabilityError``.
    """
    spec, cfg = _resolve(BackendKind.ENGINE, raw, manager, path)
    return spec, cast(EngineConfig, cfg)


def resolve_rollout_config(
    raw: Mapping[str, Any], manager: PluginManager, *, path: tuple[str, ...] = ("rollout",)
) -> tuple[BackendSpec, BaseModel]:
    """Like :func:`resolve_engine_config`, for rollouts.

    A rollout config is a pydantic model with a ``backend`` field; it may define
    ``required_capabilities() -> set[Capability]`` to be checked against the rollout.
    """
    return _resolve(BackendKind.ROLLOUT, raw, manager, path)


def _resolve(
    kind: BackendKind, raw: Mapping[str, Any], manager: PluginManager, path: tuple[str, ...]
) -> tuple[BackendSpec, BaseModel]:
    where = ".".join(path) or "config"
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{where} must be a mapping with a 'backend' key, got {type(raw).__name__} "
            f"({raw!r}); e.g. {{backend: {_example(kind, manager)}, ...}}."
        )
    available = ", ".join(manager.registry.names(kind)) or "(none installed)"
    name = raw.get("backend")
    if name is None:
        raise ConfigError(
            f"{where}.backend is missing; set it to one of the available {kind}s: {available} "
            f"(e.g. {where}.backend={_example(kind, manager)})."
        )
    if not isinstance(name, str):
        raise ConfigError(
            f"{where}.backend must be the name of a registered {kind} (a string), got "
            f"{type(name).__name__} {name!r}; available {kind}s: {available}."
        )
    spec = manager.get_backend(kind, name)
    config_cls = spec.load_config_class()
    try:
        cfg = config_cls.model_validate(dict(raw))
    except ValidationError as e:
        raise prefix_validation_error(e, path, f"{config_cls.__name__} ({where})") from None
    required = _required_capabilities(cfg)
    try:
        check_capabilities(spec.name, spec.capabilities, required)
    except CapabilityError as e:
        raise CapabilityError(f"{where}: {e}") from None
    return spec, cfg


def _required_capabilities(cfg: BaseModel) -> set[Capability]:
    method = getattr(cfg, "required_capabilities", None)
    if method is None:
        return set()
    return {Capability(c) for c in method()}


def _example(kind: BackendKind, manager: PluginManager) -> str:
    names = manager.registry.names(kind)
    return names[0] if names else "<name>"
