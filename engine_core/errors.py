"""The engine-core error hierarchy.

Every error the SDK raises on bad input derives from :class:`EngineCoreError` and its message
says what was received, what is allowed, and how to fix it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "EngineCoreError",
    "ConfigError",
    "PluginError",
    "PluginLoadError",
    "UnknownBackendError",
    "DuplicateBackendError",
    "CapabilityError",
    "BatchError",
    "TokenBudgetError",
    "DispatchError",
    "MeshRegistrationError",
    "CheckpointError",
    "WeightSyncError",
    "TrackerError",
    "OutputError",
    "RunFailed",
    "RunStopped",
    "EXIT_INTERRUPTED",
    "EXIT_STOPPED",
]

EXIT_STOPPED = 3
"""The exit status of an ``engine-core`` run that stopped on request (:class:`RunStopped`)."""

EXIT_INTERRUPTED = 130
"""The exit status of an ``engine-core`` command interrupted by SIGINT outside a job's steps
(128 + SIGINT, as shells report it); a job's steps stop on SIGINT with :data:`EXIT_STOPPED`."""


class EngineCoreError(Exception):
    """Base class of every error raised by engine-core on bad input or misuse."""


class ConfigError(EngineCoreError, ValueError):
    """A configuration value is invalid or inconsistent with the chosen backend."""


class PluginError(EngineCoreError):
    """A plugin or backend could not be registered or selected."""


class PluginLoadError(PluginError, ImportError):
    """A plugin exists but failed to import; the message names the plugin, the error and the install hint."""


class UnknownBackendError(PluginError, KeyError):
    """A backend name is not registered; the message lists the available names."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateBackendError(PluginError):
    """Two plugins registered the same backend name without ``override=True``."""


class CapabilityError(ConfigError):
    """The config asks for a capability the selected engine does not declare."""


class BatchError(EngineCoreError, ValueError):
    """A batch is missing a field, has the wrong shape, or has inconsistent entries."""


class TokenBudgetError(BatchError):
    """A token-budget micro-batch plan cannot be made (e.g. one sample exceeds the budget)."""


class DispatchError(EngineCoreError, RuntimeError):
    """Dispatching to, or collecting from, a worker group failed a consistency check."""


class MeshRegistrationError(DispatchError):
    """A worker registered a mesh twice, or a mesh's collect ranks do not cover its dp ranks."""


class CheckpointError(EngineCoreError, RuntimeError):
    """A checkpoint could not be saved or loaded; nothing already on disk was changed."""


class WeightSyncError(EngineCoreError, RuntimeError):
    """Weights sent to a rollout did not match what it expected (names, shapes or checksums)."""


class TrackerError(EngineCoreError, RuntimeError):
    """A metrics tracker (Weights & Biases, MLflow) could not start; nothing was trained."""


class OutputError(EngineCoreError, OSError):
    """A run's own output (its metrics or samples rows) could not be written: a full disk, a
    folder turned read-only; the checkpoints already committed are untouched."""


class RunFailed(EngineCoreError):
    """A run that had started stopped on a failure (a refused weight sync, a dead worker, the
    skipped-updates stop, a full disk, ...). The message is one line; the failure itself is
    the ``__cause__``, and its traceback is in :attr:`log_path`."""

    def __init__(self, message: str, log_path: Path) -> None:
        super().__init__(message)
        self.log_path = log_path


class RunStopped(EngineCoreError):
    """A run stopped on request before its last step (a stop signal such as SIGTERM from a
    scheduler, or its wall-time limit), after finishing the step in flight and writing a
    checkpoint of it. The message is one line; ``engine-core`` exits with
    :data:`EXIT_STOPPED` (3), which a requeue script tests before rerunning the same command
    with ``--resume auto``."""

    def __init__(self, message: str, checkpoint: str | None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
