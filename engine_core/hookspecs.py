"""The plugin contract: the hooks a plugin implements and the registry the central hook hands it.

Owns the pluggy markers, :class:`EngineCoreHookSpecs`, and the types plugins touch:
:class:`BackendRegistry` (where backends are registered), :class:`BackendSpec` (one registered
backend, imported lazily) and :class:`DoctorCheck`. Loading plugins is
:mod:`engine_core.plugins`' job.

Algorithms are registered the same way: :meth:`BackendRegistry.register_advantage` and
:meth:`BackendRegistry.register_policy_loss` name an advantage estimator or a policy loss
(:class:`AlgorithmSpec`); the roles package defines their base classes and runs them.

A plugin is a module (named by an entry point in the ``engine_core.plugins`` group) holding
functions decorated with :data:`hookimpl`. Every hook is optional. Plugins must be cheap to
import and re-entrant: every worker process loads them, so a hook registers names and
``"package.module:Class"`` strings, never imports a backend's heavy dependencies.

Example plugin module::

    from engine_core.hookspecs import hookimpl

    @hookimpl
    def engine_core_register(registry):
        registry.register_engine(
            "myengine",
            "my_pkg.engine:MyEngine",
            config="my_pkg.config:MyEngineConfig",
            capabilities={"cpu", "packing"},
        )
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import pluggy
from pydantic import BaseModel

from engine_core.capabilities import Capability, StrEnum
from engine_core.config import EngineConfig
from engine_core.errors import (
    DuplicateBackendError,
    PluginError,
    PluginLoadError,
    UnknownBackendError,
)

__all__ = [
    "PROJECT_NAME",
    "hookspec",
    "hookimpl",
    "BackendKind",
    "BackendSpec",
    "AlgorithmKind",
    "AlgorithmNeed",
    "AlgorithmSpec",
    "BackendRegistry",
    "Origin",
    "DoctorCheck",
    "EngineCoreHookSpecs",
    "install_hint",
]

PROJECT_NAME = "engine_core"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class BackendKind(StrEnum):
    """The two kinds of backend a plugin can provide."""

    ENGINE = "engine"
    ROLLOUT = "rollout"


class AlgorithmKind(StrEnum):
    """The two kinds of algorithm a plugin can provide."""

    ADVANTAGE = "advantage"
    POLICY_LOSS = "policy_loss"


class AlgorithmNeed(StrEnum):
    """What an algorithm needs from the run, checked before anything is built.

    ``critic``: a value model (its values reach the estimator, its update follows it);
    ``groups``: more than one sample per prompt; ``reference``: the reference policy's
    log-probs of the sampled tokens (the run computes them, and they reach the estimator).
    """

    CRITIC = "critic"
    GROUPS = "groups"
    REFERENCE = "reference"


_E = TypeVar("_E", bound=StrEnum)

_TARGET = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_BACKEND_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def install_hint(distribution: str) -> str:
    """The command that installs (or repairs) ``distribution``."""
    return f"pip install {distribution}" if distribution else "pip install <the plugin>"


@dataclass(frozen=True)
class Origin:
    """The plugin a registration comes from."""

    plugin: str
    distribution: str
    version: str


_DIRECT = Origin("(direct)", "", "")


@dataclass(frozen=True)
class BackendSpec:
    """One registered backend. Its class and config are imported only by the ``load_*`` methods."""

    name: str
    kind: BackendKind
    target: str
    config: str
    capabilities: frozenset[Capability]
    plugin: str
    distribution: str
    version: str
    description: str = ""
    # modules the class imports only as it builds (a heavy library, kept out of a plugin
    # listing): a process about to build it may import them ahead, as the conformance kit's
    # fork server does for the processes it forks
    imports: tuple[str, ...] = ()

    def load_class(self) -> type[Any]:
        """Import the backend class (a ``BaseEngine`` / ``BaseRollout`` subclass)."""
        cls = self._import(self.target)
        # Heavy (torch) imports, deferred to selection time.
        from engine_core.engine import BaseEngine
        from engine_core.rollout import BaseRollout

        base: type = BaseEngine if self.kind is BackendKind.ENGINE else BaseRollout
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise PluginError(
                f"{self.kind} {self.name!r} from plugin {self.plugin!r}: target {self.target!r} "
                f"is {cls!r}, not a subclass of {base.__name__}; fix the plugin's registration."
            )
        return cls

    def load_config_class(self) -> type[BaseModel]:
        """Import the config model (an ``EngineConfig`` subclass for engines)."""
        cls = self._import(self.config)
        base = EngineConfig if self.kind is BackendKind.ENGINE else BaseModel
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise PluginError(
                f"{self.kind} {self.name!r} from plugin {self.plugin!r}: config {self.config!r} "
                f"is {cls!r}, not a subclass of {base.__name__}; fix the plugin's registration."
            )
        return cls

    def _import(self, ref: str) -> Any:
        return _import_ref(self, ref)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "name": self.name,
            "target": self.target,
            "config": self.config,
            "capabilities": sorted(str(c) for c in self.capabilities),
            "plugin": self.plugin,
            "description": self.description,
        }


@dataclass(frozen=True)
class AlgorithmSpec:
    """One registered algorithm: an advantage estimator or a policy loss.

    ``target`` names its class, ``params`` its parameters' pydantic model (``""``: it takes
    none); both are imported only by :meth:`load`, when a run selects it.
    """

    name: str
    kind: AlgorithmKind
    target: str
    params: str
    needs: frozenset[AlgorithmNeed]
    plugin: str
    distribution: str
    version: str
    description: str = ""

    def load(self) -> tuple[Any, type[BaseModel] | None]:
        """Import the class and its parameters' model (``None`` when it takes none)."""
        cls = self._import(self.target)
        if not isinstance(cls, type):
            raise PluginError(
                f"{self.kind} {self.name!r} from plugin {self.plugin!r}: target {self.target!r} "
                f"is {cls!r}, not a class; fix the plugin's registration."
            )
        if not self.params:
            return cls, None
        params = self._import(self.params)
        if not (isinstance(params, type) and issubclass(params, BaseModel)):
            raise PluginError(
                f"{self.kind} {self.name!r} from plugin {self.plugin!r}: params {self.params!r} "
                f"is {params!r}, not a pydantic model; fix the plugin's registration."
            )
        return cls, params

    def _import(self, ref: str) -> Any:
        return _import_ref(self, ref)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "name": self.name,
            "target": self.target,
            "params": self.params,
            "needs": sorted(str(n) for n in self.needs),
            "plugin": self.plugin,
            "description": self.description,
        }


def _import_ref(spec: BackendSpec | AlgorithmSpec, ref: str) -> Any:
    """Import ``ref`` ("package.module:Name") for ``spec``; a failure names the plugin and the fix."""
    module_name, _, qualname = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in qualname.split("."):
            obj = getattr(obj, attr)
    except Exception as e:
        where = f"{spec.distribution} {spec.version}".strip() or "not from a distribution"
        raise PluginLoadError(
            f"{spec.kind} {spec.name!r} from plugin {spec.plugin!r} ({where}) could not "
            f"load {ref!r}: {type(e).__name__}: {e}. Fix: `{install_hint(spec.distribution)}` "
            "(reinstalling pulls in its missing dependencies)."
        ) from e
    return obj


_Snapshot = tuple[
    dict[BackendKind, dict[str, BackendSpec]], dict[AlgorithmKind, dict[str, AlgorithmSpec]]
]


class BackendRegistry:
    """Backends by kind and name; one per :class:`PluginManager`, filled by its plugins."""

    def __init__(self) -> None:
        self._specs: dict[BackendKind, dict[str, BackendSpec]] = {k: {} for k in BackendKind}
        self._algorithms: dict[AlgorithmKind, dict[str, AlgorithmSpec]] = {
            k: {} for k in AlgorithmKind
        }
        self._origin = _DIRECT

    def register_engine(
        self,
        name: str,
        target: str,
        *,
        config: str,
        capabilities: Iterable[Capability | str],
        description: str = "",
        override: bool = False,
        imports: Iterable[str] = (),
    ) -> BackendSpec:
        """Register engine ``name`` implemented by ``target`` ("package.module:Class");
        ``imports``: modules it imports only as it builds (:attr:`BackendSpec.imports`)."""
        return self._add(
            BackendKind.ENGINE, name, target, config, capabilities, description, override, imports
        )

    def register_rollout(
        self,
        name: str,
        target: str,
        *,
        config: str,
        capabilities: Iterable[Capability | str],
        description: str = "",
        override: bool = False,
    ) -> BackendSpec:
        """Register rollout ``name`` implemented by ``target`` ("package.module:Class")."""
        return self._add(
            BackendKind.ROLLOUT, name, target, config, capabilities, description, override
        )

    def register_advantage(
        self,
        name: str,
        target: str,
        *,
        params: str = "",
        needs: Iterable[AlgorithmNeed | str] = (),
        description: str = "",
        override: bool = False,
    ) -> AlgorithmSpec:
        """Register advantage estimator ``name``: ``target`` ("package.module:Class") is an
        ``engine_core_roles.AdvantageEstimator``, ``params`` its parameters' pydantic model."""
        return self._add_algorithm(
            AlgorithmKind.ADVANTAGE, name, target, params, needs, description, override
        )

    def register_policy_loss(
        self,
        name: str,
        target: str,
        *,
        params: str = "",
        needs: Iterable[AlgorithmNeed | str] = (),
        description: str = "",
        override: bool = False,
    ) -> AlgorithmSpec:
        """Register policy loss ``name``: ``target`` is an ``engine_core_roles.PolicyLoss``."""
        return self._add_algorithm(
            AlgorithmKind.POLICY_LOSS, name, target, params, needs, description, override
        )

    def algorithm(self, kind: AlgorithmKind | str, name: str) -> AlgorithmSpec:
        """The spec of ``kind`` algorithm ``name``; an unknown name is refused with the
        registered ones and the closest of them."""
        kind = AlgorithmKind(kind)
        found = self._algorithms[kind].get(name)
        if found is None:
            raise UnknownBackendError(self.unknown_algorithm(kind, name))
        return found

    def unknown_algorithm(self, kind: AlgorithmKind, name: object) -> str:
        names = self.algorithm_names(kind)
        message = f"unknown {kind} {name!r}; registered: {', '.join(names) or '(none)'}"
        close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.5)
        return message + (f"; did you mean {close[0]!r}?" if close else ".")

    def algorithm_names(self, kind: AlgorithmKind | str) -> list[str]:
        return sorted(self._algorithms[AlgorithmKind(kind)])

    def algorithm_specs(self, kind: AlgorithmKind | None = None) -> list[AlgorithmSpec]:
        kinds = list(AlgorithmKind) if kind is None else [AlgorithmKind(kind)]
        return [self._algorithms[k][n] for k in kinds for n in sorted(self._algorithms[k])]

    def get(self, kind: BackendKind, name: str) -> BackendSpec:
        try:
            return self._specs[BackendKind(kind)][name]
        except KeyError:
            raise UnknownBackendError(
                f"unknown {kind} {name!r}. Available {kind}s: "
                f"{', '.join(self.names(kind)) or '(none)'}."
            ) from None

    def names(self, kind: BackendKind) -> list[str]:
        return sorted(self._specs[BackendKind(kind)])

    def specs(self, kind: BackendKind | None = None) -> list[BackendSpec]:
        kinds = list(BackendKind) if kind is None else [BackendKind(kind)]
        return [self._specs[k][n] for k in kinds for n in sorted(self._specs[k])]

    def _add(
        self,
        kind: BackendKind,
        name: str,
        target: str,
        config: str,
        capabilities: Iterable[Capability | str],
        description: str,
        override: bool,
        imports: Iterable[str] = (),
    ) -> BackendSpec:
        self._check_registration(
            kind, name, {"target": target, "config": config}, "fsdp2", "my_plugin.engine:MyEngine"
        )
        caps = self._members(Capability, capabilities, kind, name, "capability")
        self._check_new(kind, name, target, self._specs[kind].get(name), override)
        spec = BackendSpec(
            name=name,
            kind=kind,
            target=target,
            config=config,
            capabilities=frozenset(caps),
            plugin=self._origin.plugin,
            distribution=self._origin.distribution,
            version=self._origin.version,
            description=description,
            imports=tuple(imports),
        )
        self._specs[kind][name] = spec
        return spec

    def _add_algorithm(
        self,
        kind: AlgorithmKind,
        name: str,
        target: str,
        params: str,
        needs: Iterable[AlgorithmNeed | str],
        description: str,
        override: bool,
    ) -> AlgorithmSpec:
        refs = {"target": target, **({"params": params} if params else {})}
        self._check_registration(kind, name, refs, "rloo", "my_algos.rloo:RLOO")
        declared = self._members(AlgorithmNeed, needs, kind, name, "need")
        self._check_new(kind, name, target, self._algorithms[kind].get(name), override)
        spec = AlgorithmSpec(
            name=name,
            kind=kind,
            target=target,
            params=params or "",
            needs=frozenset(declared),
            plugin=self._origin.plugin,
            distribution=self._origin.distribution,
            version=self._origin.version,
            description=description,
        )
        self._algorithms[kind][name] = spec
        return spec

    def _check_registration(
        self, kind: str, name: object, refs: Mapping[str, object], name_eg: str, ref_eg: str
    ) -> None:
        """Refuse a name or a ``"package.module:Class"`` reference that is malformed."""
        who = f"plugin {self._origin.plugin!r}"
        if not isinstance(name, str) or not _BACKEND_NAME.match(name):
            raise PluginError(
                f"{who} registered {kind} name {name!r}; names use letters, digits, '_', '.', "
                f"'-' and start with a letter or digit, e.g. '{name_eg}'."
            )
        for label, ref in refs.items():
            if not isinstance(ref, str) or not _TARGET.match(ref):
                raise PluginError(
                    f"{who} registered {kind} {name!r} with {label}={ref!r}; expected "
                    f"'package.module:Class', e.g. '{ref_eg}'."
                )

    def _members(
        self, enum: type[_E], values: Iterable[Any], kind: str, name: str, what: str
    ) -> set[_E]:
        """``values`` as members of ``enum``; an unknown one is refused with the allowed ones."""
        members: set[_E] = set()
        for value in values:
            try:
                members.add(enum(value))
            except ValueError:
                raise PluginError(
                    f"plugin {self._origin.plugin!r} registered {kind} {name!r} with unknown "
                    f"{what} {value!r}; allowed: {', '.join(str(x) for x in enum)}."
                ) from None
        return members

    def _check_new(
        self,
        kind: str,
        name: str,
        target: str,
        existing: BackendSpec | AlgorithmSpec | None,
        override: bool,
    ) -> None:
        """Refuse a name another registration holds, unless ``override``."""
        if existing is not None and not override:
            raise DuplicateBackendError(
                f"{kind} {name!r} is already registered by plugin {existing.plugin!r} "
                f"({existing.target}); plugin {self._origin.plugin!r} tried to register it "
                f"again ({target}). Choose another name, or pass override=True to replace it "
                "deliberately."
            )

    @contextmanager
    def _registering(self, origin: Origin) -> Iterator[None]:
        """Attribute registrations made inside the block to ``origin``."""
        previous, self._origin = self._origin, origin
        try:
            yield
        finally:
            self._origin = previous

    def _snapshot(self) -> _Snapshot:
        return (
            {kind: dict(specs) for kind, specs in self._specs.items()},
            {kind: dict(specs) for kind, specs in self._algorithms.items()},
        )

    def _restore(self, snapshot: _Snapshot) -> None:
        backends, algorithms = snapshot
        self._specs = {kind: dict(specs) for kind, specs in backends.items()}
        self._algorithms = {kind: dict(specs) for kind, specs in algorithms.items()}


@dataclass(frozen=True)
class DoctorCheck:
    """The outcome of one environment check, as shown by ``engine-core doctor``.

    ``hint`` says how to fix a failed check (e.g. the package to install). A failed
    ``optional`` check is shown as missing but does not fail ``engine-core doctor``: it names
    something only some features need.
    """

    name: str
    ok: bool
    detail: str = ""
    hint: str = ""
    optional: bool = False


class EngineCoreHookSpecs:
    """Hook specifications of engine-core. Implement them as module-level functions."""

    @hookspec
    def engine_core_register(self, registry: BackendRegistry) -> None:
        """Register this plugin's engines, rollouts and algorithms on ``registry``.

        Called once per plugin, right after the plugin is loaded. Use
        :meth:`BackendRegistry.register_engine` / :meth:`BackendRegistry.register_rollout` with
        ``"package.module:Class"`` strings: the classes are imported only when a backend is
        selected, so a missing heavy dependency does not break listing or other backends.
        Registering a name another plugin already took raises ``DuplicateBackendError`` unless
        ``override=True`` is passed.
        """

    @hookspec
    def engine_core_doctor_checks(self) -> list[DoctorCheck]:
        """Return cheap checks of the environment this plugin needs (``engine-core doctor``).

        Checks must not import heavy libraries just to report their absence; prefer
        ``importlib.util.find_spec`` and version lookups through ``importlib.metadata``.
        """
        return []
