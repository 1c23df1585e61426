"""Process launch: the only module that writes ``os.environ`` (:mod:`engine_core.settings` is
the only one that reads it, this module included; the test tooling of :mod:`engine_core.testing`
aside).

What a process hands on through its environment goes through here: the variables set for this
process (and so for the processes it starts, which inherit them), the rendezvous variables a
worker is given and a hosted backend is spared, and the caller's environment that a worker
forked from a fork server takes on in place of the server's; and the session of its own that
every process a job starts runs in (:func:`own_session`). Every variable written here is
listed in :mod:`engine_core.settings`'s docstring and in ``docs/config.md``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping

from engine_core.settings import environment_copy, variable

__all__ = [
    "RENDEZVOUS",
    "adopt_environment",
    "caller_environment",
    "own_session",
    "set_for_process",
    "set_default_for_process",
    "unset_for_process",
    "with_variable",
]

# what torch.distributed's env:// rendezvous reads; an executor sets them for each worker
RENDEZVOUS: tuple[str, ...] = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def set_for_process(values: Mapping[str, str]) -> None:
    """Set ``values`` in this process's environment (the processes it starts later inherit
    them); a variable already set is replaced."""
    os.environ.update(values)


def set_default_for_process(name: str, value: str) -> str:
    """Set ``name`` to ``value`` unless it is set already (a user's setting wins); returns the
    value in effect."""
    return os.environ.setdefault(name, value)


def unset_for_process(names: Iterable[str]) -> None:
    """Remove ``names`` from this process's environment (those unset already are skipped)."""
    for name in names:
        os.environ.pop(name, None)


def caller_environment(exclude: Iterable[str] = ()) -> dict[str, str]:
    """A copy of this process's environment, ``exclude`` left out: what a worker that does not
    start from a fresh interpreter is handed, to take on with :func:`adopt_environment`."""
    return environment_copy(frozenset(exclude))


def adopt_environment(env: Mapping[str, str]) -> None:
    """Make this process's environment exactly ``env`` (a forked worker: the caller's, not the
    fork server's, as a spawned worker's would be)."""
    os.environ.clear()
    os.environ.update(env)


@contextlib.contextmanager
def with_variable(name: str, value: str) -> Iterator[None]:
    """``name`` set to ``value`` inside the block (for a process started there), then restored
    as it was (unset again if it was unset)."""
    saved = variable(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def own_session() -> None:
    """Put this process (one a job started: a worker, a replica, a tool process) in a session
    and process group of its own. A signal sent to the job's whole process group (a terminal's
    Ctrl-C, a scheduler's preemption, ``kill -- -PGID``) then reaches the job's own process,
    which finishes the step, writes its checkpoint and ends its workers itself, and not the
    workers it still needs for that. Such a process ends when its caller stops it or its pipe
    to the caller closes. Where sessions do not exist, or the process leads one already, it
    stays where it is."""
    if hasattr(os, "setsid"):
        with contextlib.suppress(OSError):  # already a group or session leader
            os.setsid()
