"""Process-wide settings read from the environment: the only module that reads ``os.environ``.

Variables (all optional):

``ENGINE_CORE_DISABLE_PLUGIN_AUTOLOAD``
    ``1``/``true``/``yes``/``on`` skips entry-point discovery; only the core's built-in plugin
    and plugins registered explicitly with ``PluginManager.register`` are loaded.
``ENGINE_CORE_PLUGINS``
    Comma-separated allow-list of plugin (entry-point) names, e.g. ``fsdp,vllm``. The built-in
    plugin is always loaded. Unset or empty: every installed plugin is loaded.
``ENGINE_CORE_LOG_LEVEL``
    ``DEBUG``, ``INFO``, ``WARNING`` (default), ``ERROR`` or ``CRITICAL``.

Every worker process calls :meth:`Settings.from_env` for itself, so set these before launching.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, field_validator

from engine_core.errors import ConfigError

__all__ = [
    "ENV_DISABLE_AUTOLOAD",
    "ENV_PLUGINS",
    "ENV_LOG_LEVEL",
    "BUILTIN_PLUGIN",
    "LogLevel",
    "Settings",
]

ENV_DISABLE_AUTOLOAD = "ENGINE_CORE_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "ENGINE_CORE_PLUGINS"
ENV_LOG_LEVEL = "ENGINE_CORE_LOG_LEVEL"
# Entry-point name of the core's own plugin; never filtered out.
BUILTIN_PLUGIN = "builtin"

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
_LOG_LEVELS: tuple[str, ...] = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_PLUGIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


class Settings(BaseModel):
    """Immutable settings; build from the environment with :meth:`from_env`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    disable_plugin_autoload: bool = False
    plugins: tuple[str, ...] | None = None
    log_level: LogLevel = "WARNING"

    @field_validator("plugins")
    @classmethod
    def _valid_names(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for name in v or ():
            if not _PLUGIN_NAME.match(name):
                raise ValueError(
                    f"invalid plugin name {name!r}: use entry-point names such as 'fsdp' "
                    "(letters, digits, '_', '.', '-')"
                )
        return v

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read the ``ENGINE_CORE_*`` variables from ``environ`` (default: ``os.environ``)."""
        env = os.environ if environ is None else environ
        return cls(
            disable_plugin_autoload=_parse_bool(
                ENV_DISABLE_AUTOLOAD, env.get(ENV_DISABLE_AUTOLOAD)
            ),
            plugins=_parse_plugins(env.get(ENV_PLUGINS)),
            log_level=_parse_log_level(env.get(ENV_LOG_LEVEL)),
        )

    def allows(self, plugin: str) -> bool:
        """Whether entry-point plugin ``plugin`` may be loaded under the allow-list."""
        return plugin == BUILTIN_PLUGIN or self.plugins is None or plugin in self.plugins

    def configure_logging(self) -> None:
        """Apply :attr:`log_level` to the ``engine_core`` loggers (used by the CLI)."""
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("engine_core").setLevel(self.log_level)


def _parse_bool(var: str, raw: str | None) -> bool:
    value = (raw or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(
        f"{var}={raw!r} is not a boolean; allowed: {', '.join(_TRUE)} (on) or "
        f"{', '.join(v for v in _FALSE if v)} or empty (off). Fix or unset the variable."
    )


def _parse_plugins(raw: str | None) -> tuple[str, ...] | None:
    if raw is None or not raw.strip():
        return None
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    bad = [n for n in names if not _PLUGIN_NAME.match(n)]
    if bad:
        raise ConfigError(
            f"{ENV_PLUGINS}={raw!r} contains invalid plugin names {bad}; allowed: a "
            "comma-separated list of entry-point names, e.g. 'fsdp,vllm' "
            "(`engine-core plugins` lists them)."
        )
    return names


def _parse_log_level(raw: str | None) -> LogLevel:
    if raw is None or not raw.strip():
        return "WARNING"
    value = raw.strip().upper()
    if value in _LOG_LEVELS:
        return cast(LogLevel, value)
    raise ConfigError(
        f"{ENV_LOG_LEVEL}={raw!r} is not a log level; allowed: {', '.join(_LOG_LEVELS)} "
        "(case-insensitive). Fix or unset the variable."
    )
