"""Stopping a run on request: a scheduler's signal (SIGTERM, or an earlier warning such as
SIGUSR1) or the run's own wall-time limit.

:class:`StopRequests` only notes the request: the step in flight finishes, the job writes a
checkpoint of it and raises :class:`engine_core.errors.RunStopped` (``engine-core`` exits 3). A
second signal while the checkpoint is written changes nothing (the save is committed by one
rename whatever happens), so a scheduler that signals twice leaves a loadable checkpoint.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

from engine_core.cli import raise_if_interrupted

__all__ = ["StopRequests", "check_stop_signals"]

# signals a process cannot catch, or that a job needs for itself
_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}


def check_stop_signals(names: Sequence[str]) -> list[str]:
    """The signal names, each one a signal this platform has and a handler can catch."""
    known = {s.name for s in signal.Signals}
    for name in names:
        if name not in known or name in _UNCATCHABLE:
            raise ValueError(
                f"stop_signals: {name!r} is not a signal a run can catch here; use names such "
                f"as SIGTERM, SIGUSR1, SIGUSR2 or SIGINT (SIGKILL and SIGSTOP cannot be caught)."
            )
    return list(names)


class StopRequests:
    """Whether the run has been asked to stop, and why (``requested()``)."""

    def __init__(self, signals: Sequence[str], max_wall_time: float | None) -> None:
        self.signals = [signal.Signals[name] for name in signals]
        self.max_wall_time = max_wall_time
        self._start = time.monotonic()
        self._reason: str | None = None

    @contextmanager
    def installed(self) -> Iterator[StopRequests]:
        """Catch the stop signals inside the block (the previous handlers come back after).
        Signals reach Python's main thread only: elsewhere the signals are left alone and the
        wall-time limit still applies."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous: dict[signal.Signals, Any] = {}
        try:
            for sig in self.signals:
                previous[sig] = signal.signal(sig, self._noted)
            # a SIGINT before this (while the command started) whose KeyboardInterrupt Python
            # dropped (it landed in a finalizer) still ends the run here, before any step
            raise_if_interrupted()
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _noted(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self._reason is None:  # the first request is the one reported
            self._reason = signal.Signals(signum).name

    def requested(self) -> str | None:
        """Why the run should stop now (a signal's name, or its wall-time limit), or None."""
        if self._reason is None and self.max_wall_time is not None:
            elapsed = time.monotonic() - self._start
            if elapsed >= self.max_wall_time:
                self._reason = f"max_wall_time={self.max_wall_time:g}s ({elapsed:.0f} s elapsed)"
        return self._reason
