"""Plugin discovery: loading entry points, recording failures, looking backends up.

Owns :class:`PluginManager` (one pluggy manager and one :class:`BackendRegistry` per instance),
:class:`PluginInfo` and :func:`load_plugins`. The types plugins touch (``BackendKind``,
``BackendSpec``, ``BackendRegistry``) live in :mod:`engine_core.hookspecs` and are re-exported.

Plugins come from the ``engine_core.plugins`` entry points and from ``ENGINE_CORE_EXTRA_PLUGINS``
(modules named in the environment, for plugins that are not installed, such as test fixtures);
both are discovered alike, under the same settings. Loading a plugin imports only its hook module; a backend's class and config are imported when
that backend is selected. A plugin that fails to import is recorded, listed by
``engine-core plugins``, and named (with the install command) when one of its backends is asked
for, instead of surfacing later as an "unknown backend".
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast

import pluggy

from engine_core.errors import PluginError, PluginLoadError, UnknownBackendError
from engine_core.hookspecs import (
    PROJECT_NAME,
    AlgorithmKind,
    AlgorithmSpec,
    BackendKind,
    BackendRegistry,
    BackendSpec,
    DoctorCheck,
    EngineCoreHookSpecs,
    Origin,
    install_hint,
)
from engine_core.settings import (
    BUILTIN_PLUGIN,
    ENV_DISABLE_AUTOLOAD,
    ENV_EXTRA_PLUGINS,
    ENV_PLUGINS,
    Settings,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendKind",
    "BackendSpec",
    "BackendRegistry",
    "PluginInfo",
    "PluginManager",
    "load_plugins",
]

ENTRY_POINT_GROUP = "engine_core.plugins"
_CORE_DISTRIBUTION = "engine-core"
_BUILTIN_MODULE = "engine_core.builtin_plugin"
logger = logging.getLogger(__name__)
_WARNED: set[tuple[str, str]] = set()  # the entry points whose failure this process has logged


# Where a plugin came from (PluginInfo.source); one from ENGINE_CORE_EXTRA_PLUGINS names it.
SOURCE_ENTRY_POINT = "entry point"
SOURCE_EXPLICIT = "registered"


@dataclass(frozen=True)
class PluginInfo:
    """What ``engine-core plugins`` shows for one plugin; ``error`` is set when it failed.

    ``source``: ``"entry point"``, ``"registered"`` (``PluginManager.register``) or, for a plugin
    named by ``ENGINE_CORE_EXTRA_PLUGINS``, ``"ENGINE_CORE_EXTRA_PLUGINS: <module>"`` (such a
    plugin belongs to no distribution: ``distribution`` and ``version`` are empty).
    """

    name: str
    distribution: str
    version: str
    status: Literal["ok", "failed"]
    error: str | None = None
    traceback: str | None = None
    install_hint: str | None = None
    backends: tuple[BackendSpec, ...] = ()
    source: str = SOURCE_ENTRY_POINT
    algorithms: tuple[AlgorithmSpec, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "error": self.error,
            "traceback": self.traceback,
            "install_hint": self.install_hint,
            "backends": [b.to_dict() for b in self.backends],
            "algorithms": [a.to_dict() for a in self.algorithms],
            "source": self.source,
        }


class PluginManager:
    """Loads plugins, records their failures, and looks backends up by name.

    Each instance owns its pluggy manager and :attr:`registry`; nothing is shared between
    instances, so tests and worker processes can build as many as they need.
    """

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = Settings.from_env() if settings is None else settings
        self.registry = BackendRegistry()
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(EngineCoreHookSpecs)
        self._infos: dict[str, PluginInfo] = {}
        self._skipped: list[str] = []  # entry points left out by the settings

    # -- loading -------------------------------------------------------------------------------

    def load_entry_points(self) -> None:
        """Load every allowed plugin of group ``engine_core.plugins``, each in isolation, then
        those named by ``ENGINE_CORE_EXTRA_PLUGINS``.

        The built-in plugin is always loaded (directly when autoload is off or the core is
        not installed as a distribution). Failures are recorded, logged and never raised.
        """
        if self.settings.disable_plugin_autoload:
            logger.info("plugin autoload disabled by %s", ENV_DISABLE_AUTOLOAD)
        else:
            # Builtin first, then by name: a plugin overriding a core backend loads after it.
            eps = md.entry_points(group=ENTRY_POINT_GROUP)
            for ep in sorted(eps, key=lambda e: (e.name != BUILTIN_PLUGIN, e.name)):
                self._load_entry_point(ep)
            for name, module in self.settings.extra_plugins:
                self._load_extra_plugin(name, module)
            missing = set(self.settings.plugins or ()) - set(self._infos) - {BUILTIN_PLUGIN}
            if missing:
                logger.warning(
                    "%s names plugins that are not installed: %s", ENV_PLUGINS, sorted(missing)
                )
        if BUILTIN_PLUGIN not in self._infos:
            self._register(
                importlib.import_module(_BUILTIN_MODULE),
                BUILTIN_PLUGIN,
                _CORE_DISTRIBUTION,
                _dist_version(_CORE_DISTRIBUTION),
            )

    def _load_entry_point(self, ep: md.EntryPoint) -> None:
        if not self.settings.allows(ep.name):
            self._skipped.append(ep.name)
            return
        dist = ep.dist.metadata["Name"] if ep.dist is not None else ep.value.split(".")[0]
        version = ep.dist.version if ep.dist is not None else "unknown"
        if ep.name in self._infos:
            if self._infos[ep.name].distribution == dist:
                return  # loaded by an earlier call
            logger.warning(
                "plugin name %r from %s is already taken by %s; ignoring the second one",
                ep.name,
                dist,
                self._infos[ep.name].distribution,
            )
            return
        try:
            plugin = ep.load()
            if self._pm.is_registered(plugin):
                return  # registered explicitly under another name before discovery
            self._register(plugin, ep.name, dist, version)
        except Exception as e:  # any failure of one plugin must not hide the others
            self._infos[ep.name] = PluginInfo(
                name=ep.name,
                distribution=dist,
                version=version,
                status="failed",
                error=f"{type(e).__name__}: {e}",
                traceback="".join(traceback.format_exception(type(e), e, e.__traceback__)),
                install_hint=install_hint(dist),
            )
            if (ep.name, dist) not in _WARNED:  # once per process, however many managers load it
                _WARNED.add((ep.name, dist))
                logger.warning(
                    "plugin %r (%s) failed to load: %s: %s", ep.name, dist, type(e).__name__, e
                )

    def _load_extra_plugin(self, name: str, module: str) -> None:
        if not self.settings.allows(name):
            self._skipped.append(name)
            return
        source = f"{ENV_EXTRA_PLUGINS}: {module}"
        try:
            plugin = importlib.import_module(module)
            if self._pm.is_registered(plugin):
                return  # also installed (found through its entry point) or registered explicitly
            if name in self._infos:
                logger.warning(
                    "%s names plugin %r (%s), but that name is taken by %s; ignoring it",
                    ENV_EXTRA_PLUGINS,
                    name,
                    module,
                    self._infos[name].distribution or self._infos[name].source,
                )
                return
            self._register(plugin, name, "", "", source=source)
        except Exception as e:  # as for an entry point: recorded, never hiding the others
            if name in self._infos:  # taken by a plugin that loaded: keep that one's record
                logger.warning(
                    "%s: plugin %r (%s) failed to load: %s", ENV_EXTRA_PLUGINS, name, module, e
                )
                return
            self._infos[name] = PluginInfo(
                name=name,
                distribution="",
                version="",
                status="failed",
                error=f"{type(e).__name__}: {e}",
                traceback="".join(traceback.format_exception(type(e), e, e.__traceback__)),
                install_hint=(
                    f"make module {module!r} importable in every process that loads plugins "
                    f"(e.g. add its folder to PYTHONPATH), or fix {ENV_EXTRA_PLUGINS}"
                ),
                source=source,
            )
            logger.warning(
                "plugin %r (module %s, from %s) failed to load: %s: %s",
                name,
                module,
                ENV_EXTRA_PLUGINS,
                type(e).__name__,
                e,
            )

    def register(
        self, plugin: object, name: str, *, distribution: str = "", version: str = ""
    ) -> None:
        """Register a plugin module or object explicitly; errors are raised, not recorded."""
        self._register(plugin, name, distribution, version, source=SOURCE_EXPLICIT)

    def _register(
        self,
        plugin: object,
        name: str,
        distribution: str,
        version: str,
        *,
        source: str = SOURCE_ENTRY_POINT,
    ) -> None:
        if name in self._infos or self._pm.has_plugin(name):
            raise PluginError(
                f"a plugin named {name!r} is already registered; register this one under "
                "another name."
            )
        if self._pm.is_registered(plugin):
            raise PluginError(
                f"plugin {plugin!r} is already registered as "
                f"{self._pm.get_name(plugin)!r}; register each plugin once."
            )
        snapshot = self.registry._snapshot()
        try:
            self._pm.register(plugin, name=name)  # validates hook signatures, changes nothing
            try:
                # Earlier plugins passed this check, so anything pending belongs to this one.
                self._pm.check_pending()
                others = [p for p in self._pm.get_plugins() if p is not plugin]
                register_hook = self._pm.subset_hook_caller("engine_core_register", others)
                with self.registry._registering(Origin(name, distribution, version)):
                    register_hook(registry=self.registry)
            except Exception:
                self.registry._restore(snapshot)
                self._pm.unregister(plugin)
                raise
        except pluggy.PluginValidationError as e:
            raise PluginError(
                f"plugin {name!r} does not match engine_core.hookspecs: {e}. Hook names and "
                "arguments must match the specs (e.g. engine_core_register(registry))."
            ) from e
        self._infos[name] = PluginInfo(name, distribution, version, "ok", source=source)

    def check_pending(self) -> None:
        """Raise :class:`PluginError` if a registered plugin implements an unknown hook."""
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as e:
            raise PluginError(f"{e}; hook names must match engine_core.hookspecs.") from e

    # -- queries -------------------------------------------------------------------------------

    def plugins(self) -> list[PluginInfo]:
        """Every plugin tried, in load order, with the backends and algorithms each one
        registered."""
        specs, algorithms = self.registry.specs(), self.registry.algorithm_specs()
        return [
            PluginInfo(
                **{
                    **vars(info),
                    "backends": tuple(s for s in specs if s.plugin == name),
                    "algorithms": tuple(a for a in algorithms if a.plugin == name),
                }
            )
            for name, info in self._infos.items()
        ]

    def failed_plugins(self) -> list[PluginInfo]:
        return [p for p in self._infos.values() if p.status == "failed"]

    def get_engine(self, name: str) -> BackendSpec:
        return self.get_backend(BackendKind.ENGINE, name)

    def get_rollout(self, name: str) -> BackendSpec:
        return self.get_backend(BackendKind.ROLLOUT, name)

    def get_backend(self, kind: BackendKind, name: str) -> BackendSpec:
        """The spec of ``kind`` backend ``name``; names the failed plugin that should provide it."""
        kind = BackendKind(kind)
        if name in self.registry.names(kind):
            return self.registry.get(kind, name)
        culprit = self._failed_provider(str(name))
        if culprit is not None:
            where = f"{culprit.distribution} {culprit.version}".strip() or culprit.source
            fix = (
                f"`{culprit.install_hint}` (reinstalling pulls in its missing dependencies)"
                if culprit.distribution
                else str(culprit.install_hint)
            )
            raise PluginLoadError(
                f"{kind} {name!r} is provided by plugin {culprit.name!r} ({where}), which failed "
                f"to load: {culprit.error}. Fix: {fix}; `engine-core plugins` shows the traceback."
            )
        raise UnknownBackendError(self._unknown_message(kind, name))

    def get_algorithm(self, kind: AlgorithmKind | str, name: str) -> AlgorithmSpec:
        """The spec of ``kind`` algorithm ``name``; an unknown one is refused with the
        registered names, a did-you-mean, and the plugins that failed to load."""
        kind = AlgorithmKind(kind)
        if name in self.registry.algorithm_names(kind):
            return self.registry.algorithm(kind, name)
        parts = [self.registry.unknown_algorithm(kind, name)]
        failed = self.failed_plugins()
        if failed:
            listed = "; ".join(
                f"{p.name} ({p.distribution or p.source}): {p.error}" for p in failed
            )
            parts.append(f"Plugins that failed to load (one may provide it): {listed}.")
        if self._skipped:
            parts.append(f"Skipped by {ENV_PLUGINS}: {', '.join(self._skipped)}.")
        parts.append("`engine-core plugins` lists every registered algorithm.")
        raise UnknownBackendError(" ".join(parts))

    def _failed_provider(self, name: str) -> PluginInfo | None:
        # A plugin's entry-point name is the best guess at what it provides ("fsdp" -> "fsdp2").
        matches = [p for p in self.failed_plugins() if name.startswith(p.name)]
        return max(matches, key=lambda p: len(p.name), default=None)

    def _unknown_message(self, kind: BackendKind, name: object) -> str:
        available = ", ".join(self.registry.names(kind)) or "(none)"
        parts = [f"unknown {kind} {name!r}. Available {kind}s: {available}."]
        failed = self.failed_plugins()
        if failed:
            listed = "; ".join(f"{p.name} ({p.distribution}): {p.error}" for p in failed)
            parts.append(f"Plugins that failed to load: {listed}.")
        if self.settings.disable_plugin_autoload:
            parts.append(f"Plugin autoload is disabled by {ENV_DISABLE_AUTOLOAD}.")
        if self._skipped:
            parts.append(
                f"Skipped by {ENV_PLUGINS}: {', '.join(self._skipped)} (add a plugin's name "
                "there, or unset it, to load it)."
            )
        parts.append(
            "Check the spelling, or install the plugin that provides it "
            "(`engine-core plugins` lists what is installed)."
        )
        return " ".join(parts)

    def doctor_checks(self) -> list[DoctorCheck]:
        """One check per plugin load, then each plugin's own environment checks."""
        checks = [
            DoctorCheck(
                name=f"plugin {p.name}",
                ok=p.status == "ok",
                detail=p.error or f"{p.distribution} {p.version}".strip() or p.source,
                hint=p.install_hint or "",
            )
            for p in self._infos.values()
        ]
        for impl in self._pm.hook.engine_core_doctor_checks.get_hookimpls():
            try:
                result: list[Any] = list(cast(Iterable[Any], impl.function()))
                wrong = [r for r in result if not isinstance(r, DoctorCheck)]
                if wrong:
                    raise TypeError(f"expected a list of DoctorCheck, got an item {wrong[0]!r}")
            except Exception as e:  # a broken check is itself a failed check
                detail = f"{type(e).__name__}: {e}"
                result = [DoctorCheck(f"plugin {impl.plugin_name} checks", False, detail)]
            checks.extend(result)
        return checks


def load_plugins(settings: Settings | None = None) -> PluginManager:
    """A fresh manager with every allowed entry-point plugin loaded (settings: from the env)."""
    manager = PluginManager(settings)
    manager.load_entry_points()
    manager.check_pending()
    return manager


def _dist_version(distribution: str) -> str:
    try:
        return md.version(distribution)
    except md.PackageNotFoundError:
        return "unknown"
