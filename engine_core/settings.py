"""Process-wide settings read from the environment: the only module that reads a variable of
``os.environ`` (:mod:`engine_core.launch` is the only one that writes them, and the one that
hands a worker the caller's whole environment).

``engine-core``'s own variables (all optional), read by :meth:`Settings.from_env`:

``ENGINE_CORE_DISABLE_PLUGIN_AUTOLOAD``
    ``1``/``true``/``yes``/``on`` skips discovery (entry points and ``ENGINE_CORE_EXTRA_PLUGINS``);
    only the core's built-in plugin and plugins registered explicitly with
    ``PluginManager.register`` are loaded.
``ENGINE_CORE_PLUGINS``
    Comma-separated allow-list of plugin names, e.g. ``fsdp,vllm``. The built-in plugin is always
    loaded. Unset or empty: every discovered plugin is loaded.
``ENGINE_CORE_EXTRA_PLUGINS``
    Comma-separated ``name=package.module`` pairs: plugin modules that are not installed as a
    distribution, discovered beside the entry points as if each were one (the allow-list applies
    to them too), e.g. ``mine=my_engine.plugin``. The module must be importable in every process
    that loads plugins (on ``sys.path``, e.g. through ``PYTHONPATH``).
``ENGINE_CORE_LOG_LEVEL``
    ``DEBUG``, ``INFO``, ``WARNING`` (default), ``ERROR`` or ``CRITICAL``.
``ENGINE_CORE_COLLECTIVE_TIMEOUT_S``
    Seconds a collective of a worker's process group may wait for the other ranks before it
    fails (a positive number); unset: torch's default. The executors set it for their workers
    from their ``collective_timeout_s`` argument.
``ENGINE_CORE_WORKER_START``
    How the local executor starts worker processes: ``spawn`` (default: a fresh interpreter
    each, which imports torch and the engine again) or ``forkserver`` (each forked from a server
    that imported them once: seconds less per worker; :mod:`engine_core.executors.forkserver`).
``ENGINE_CORE_CPUS``
    How many CPU cores this process and the processes it starts share (a positive whole
    number), read by :func:`cpu_cores`: each worker, replica and the job's own process get their
    share of them as intra-op threads. Unset: the cores this process may run on (its CPU
    affinity, which SLURM and container cpusets narrow), not every core of the machine. Set it
    to run two jobs side by side on one machine without oversubscribing its cores.

Every worker process calls :meth:`Settings.from_env` for itself, so set these before launching.

Set by ``engine-core`` itself (through :mod:`engine_core.launch`), not by users:

``ENGINE_CORE_SGLANG_CPU_SEEDS``
    Internal: the SGLang rollout sets it to ``1`` for ``device: cpu`` with
    ``deterministic_inference``, before SGLang is imported; the ``sgl_kernel`` stand-in of
    SGLang's CPU environment (``plugins/sglang/cpu``) reads it on import and then skips
    SGLang's swap to batch-invariant Triton kernels (which refuses a host without CUDA/XPU), so
    that per-sample seeds apply on a CPU.
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``
    torch.distributed's rendezvous, set by the executors for each worker
    (:func:`engine_core.executors.worker_env`); a worker reads the first three through
    :func:`launch_from_env`. A rollout replica reads its rank and count, then unsets all five,
    since the backend it hosts is no rank of a process group.
``OMP_NUM_THREADS``, ``TORCHELASTIC_USE_AGENT_STORE``
    Set for each worker: its share of :func:`cpu_cores` as intra-op threads unless the executor
    is told otherwise, and (when
    the executor hosts the rendezvous store) every rank joins that store as a client.
``PYTHONPATH``
    Set to this process's ``sys.path`` while a fork server starts, so that it imports what this
    process can; restored right after.
``VLLM_ENABLE_V1_MULTIPROCESSING``, ``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_LOGGING_LEVEL``
    Set by the vLLM rollout before vLLM is imported: ``0`` (the model lives in the rollout's
    process); ``cpu_kv_cache_gib`` and ``WARNING`` unless already set.
``SGLANG_USE_CPU_ENGINE``
    Set to ``1`` by the SGLang rollout for ``device: cpu``, before SGLang is imported.
``MLFLOW_TRACKING_URI``, ``MLFLOW_ALLOW_FILE_STORE``
    The MLflow tracker reads the first when ``mlflow.tracking_uri`` is unset
    (:func:`mlflow_tracking_uri`); storing in ``output_dir/mlruns`` instead, it sets the second
    to ``true`` unless already set.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, field_validator

from engine_core.errors import ConfigError

__all__ = [
    "ENV_DISABLE_AUTOLOAD",
    "ENV_PLUGINS",
    "ENV_EXTRA_PLUGINS",
    "ENV_LOG_LEVEL",
    "ENV_SGLANG_CPU_SEEDS",
    "ENV_COLLECTIVE_TIMEOUT",
    "ENV_WORKER_START",
    "ENV_MLFLOW_TRACKING_URI",
    "ENV_CPUS",
    "BUILTIN_PLUGIN",
    "Launch",
    "LogLevel",
    "Settings",
    "cpu_cores",
    "launch_from_env",
    "environment_copy",
    "variable",
    "mlflow_tracking_uri",
    "sglang_cpu_seeds",
]

ENV_DISABLE_AUTOLOAD = "ENGINE_CORE_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "ENGINE_CORE_PLUGINS"
ENV_EXTRA_PLUGINS = "ENGINE_CORE_EXTRA_PLUGINS"
ENV_LOG_LEVEL = "ENGINE_CORE_LOG_LEVEL"
ENV_COLLECTIVE_TIMEOUT = "ENGINE_CORE_COLLECTIVE_TIMEOUT_S"
ENV_WORKER_START = "ENGINE_CORE_WORKER_START"
ENV_MLFLOW_TRACKING_URI = "MLFLOW_TRACKING_URI"
ENV_SGLANG_CPU_SEEDS = "ENGINE_CORE_SGLANG_CPU_SEEDS"
ENV_CPUS = "ENGINE_CORE_CPUS"
# Entry-point name of the core's own plugin; never filtered out.
BUILTIN_PLUGIN = "builtin"

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
WorkerStart = Literal["spawn", "forkserver"]
_WORKER_STARTS: tuple[str, ...] = ("spawn", "forkserver")
_LOG_LEVELS: tuple[str, ...] = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_PLUGIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$", re.ASCII)


class Settings(BaseModel):
    """Immutable settings; build from the environment with :meth:`from_env`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    disable_plugin_autoload: bool = False
    plugins: tuple[str, ...] | None = None
    extra_plugins: tuple[tuple[str, str], ...] = ()  # (name, module)
    log_level: LogLevel = "WARNING"
    collective_timeout_s: float | None = None  # None: torch's default
    worker_start: WorkerStart = "spawn"

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

    @field_validator("collective_timeout_s")
    @classmethod
    def _valid_timeout(cls, v: float | None) -> float | None:
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(
                f"collective_timeout_s={v!r}: use a positive, finite number of seconds"
            )
        return v

    @field_validator("extra_plugins")
    @classmethod
    def _valid_extra(cls, v: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        problems = _extra_plugin_problems(v)
        if problems:
            raise ValueError("; ".join(problems))
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
            extra_plugins=_parse_extra_plugins(env.get(ENV_EXTRA_PLUGINS)),
            log_level=_parse_log_level(env.get(ENV_LOG_LEVEL)),
            collective_timeout_s=_parse_seconds(
                ENV_COLLECTIVE_TIMEOUT, env.get(ENV_COLLECTIVE_TIMEOUT)
            ),
            worker_start=_parse_worker_start(env.get(ENV_WORKER_START)),
        )

    @property
    def collective_timeout(self) -> datetime.timedelta | None:
        """:attr:`collective_timeout_s` as ``init_process_group`` takes it (None: its default)."""
        if self.collective_timeout_s is None:
            return None
        return datetime.timedelta(seconds=self.collective_timeout_s)

    def allows(self, plugin: str) -> bool:
        """Whether entry-point plugin ``plugin`` may be loaded under the allow-list."""
        return plugin == BUILTIN_PLUGIN or self.plugins is None or plugin in self.plugins

    def configure_logging(self) -> None:
        """Apply :attr:`log_level` to the ``engine_core`` loggers (used by the CLI)."""
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("engine_core").setLevel(self.log_level)


class Launch(BaseModel):
    """Where this process stands in the group its executor started (torch.distributed's
    ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``); a process started by none is rank 0 of 1."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def launch_from_env(environ: Mapping[str, str] | None = None) -> Launch:
    """This process's :class:`Launch` from ``environ`` (default: ``os.environ``); an unset
    variable takes its default (rank 0 of 1)."""
    env = os.environ if environ is None else environ
    return Launch(
        rank=_parse_int("RANK", env.get("RANK"), 0),
        world_size=_parse_int("WORLD_SIZE", env.get("WORLD_SIZE"), 1),
        local_rank=_parse_int("LOCAL_RANK", env.get("LOCAL_RANK"), 0),
    )


def cpu_cores(environ: Mapping[str, str] | None = None) -> int:
    """The CPU cores this process and the processes it starts share: ``ENGINE_CORE_CPUS`` when
    set, else the cores this process may run on (its affinity mask; every core where the
    platform has none)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_CPUS)
    if raw is not None and raw.strip():
        if not raw.strip().isdigit() or int(raw) < 1:
            raise ConfigError(
                f"{ENV_CPUS}={raw!r} is not a positive whole number: it is how many CPU cores "
                f"a job's processes share. Set e.g. {ENV_CPUS}=4, or unset it to use the cores "
                f"this process may run on."
            )
        return int(raw)
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def sglang_cpu_seeds(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the SGLang rollout asked its CPU environment's ``sgl_kernel`` stand-in to keep
    per-sample seeds (``ENGINE_CORE_SGLANG_CPU_SEEDS=1``, set by the rollout, not by users)."""
    return (os.environ if environ is None else environ).get(ENV_SGLANG_CPU_SEEDS) == "1"


def environment_copy(exclude: Sequence[str] | frozenset[str] = ()) -> dict[str, str]:
    """A copy of this process's whole environment, ``exclude`` left out (for
    :func:`engine_core.launch.caller_environment`: what a forked worker takes on)."""
    skipped = frozenset(exclude)
    return {k: v for k, v in os.environ.items() if k not in skipped}


def variable(name: str) -> str | None:
    """The value of ``name`` in this process's environment (None: unset), for
    :mod:`engine_core.launch` to restore what it set temporarily."""
    return os.environ.get(name)


def mlflow_tracking_uri(environ: Mapping[str, str] | None = None) -> str | None:
    """``MLFLOW_TRACKING_URI`` as set (None: unset), for an MLflow run whose config names none."""
    env = os.environ if environ is None else environ
    return env.get(ENV_MLFLOW_TRACKING_URI)


def _parse_int(var: str, raw: str | None, default: int) -> int:
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"{var}={raw!r} is not a whole number; the executors set it for each worker (an "
            f"integer such as {default}). Fix or unset the variable."
        ) from None


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


def _parse_worker_start(raw: str | None) -> WorkerStart:
    value = (raw or "").strip().lower() or "spawn"
    if value not in _WORKER_STARTS:
        raise ConfigError(
            f"{ENV_WORKER_START}={raw!r} is not a start method; allowed: "
            f"{', '.join(_WORKER_STARTS)}. Fix or unset the variable (unset: spawn)."
        )
    return cast(WorkerStart, value)


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


def _parse_extra_plugins(raw: str | None) -> tuple[tuple[str, str], ...]:
    if raw is None or not raw.strip():
        return ()
    pairs = []
    for item in (i.strip() for i in raw.split(",")):
        if not item:
            continue
        name, eq, module = (part.strip() for part in item.partition("="))
        if not eq:
            raise ConfigError(
                f"{ENV_EXTRA_PLUGINS}={raw!r}: {item!r} has no '='; expected comma-separated "
                "'name=package.module' pairs, e.g. 'mine=my_engine.plugin'."
            )
        pairs.append((name, module))
    problems = _extra_plugin_problems(pairs)
    if problems:
        raise ConfigError(
            f"{ENV_EXTRA_PLUGINS}={raw!r}: {'; '.join(problems)}. Expected comma-separated "
            "'name=package.module' pairs, e.g. 'mine=my_engine.plugin'."
        )
    return tuple(pairs)


def _extra_plugin_problems(pairs: Sequence[tuple[str, str]]) -> list[str]:
    problems = []
    seen: set[str] = set()
    for name, module in pairs:
        if not _PLUGIN_NAME.match(name):
            problems.append(f"invalid plugin name {name!r} (letters, digits, '_', '.', '-')")
        elif name == BUILTIN_PLUGIN:
            problems.append(f"the name {name!r} is the core's own plugin; pick another name")
        elif name in seen:
            problems.append(f"the name {name!r} is given twice; give each plugin one name")
        if not _MODULE.match(module):
            problems.append(
                f"{module!r} (for {name!r}) is not a dotted module path such as 'package.module'"
            )
        seen.add(name)
    return problems


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


def _parse_seconds(var: str, raw: str | None) -> float | None:
    if raw is None or not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(
            f"{var}={raw!r} is not a timeout; allowed: a positive, finite number of seconds, "
            "e.g. 600. Fix or unset the variable."
        )
    return value
