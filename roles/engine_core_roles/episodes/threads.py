"""Daemon threads that run environment steps and tool calls. A call that runs past its timeout is
abandoned (a thread cannot be stopped), and a thread takes its place.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class _Daemons:
    """Daemon threads that run environment steps and tool calls. A call that runs past its
    timeout is abandoned (a thread cannot be stopped): :meth:`abandoned` adds a thread in
    place of the one it holds, and being daemons they never hold up the process's exit."""

    def __init__(self, threads: int) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._target = threads

    def _spawn(self) -> None:
        threading.Thread(target=self._run, name="engine-core-env", daemon=True).start()
        self._threads += 1

    def _run(self) -> None:
        while True:
            fut, fn, args = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on it
                fut.set_exception(e)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        with self._lock:
            while self._threads < self._target:
                self._spawn()
        fut: Future[Any] = Future()
        self._queue.put((fut, fn, args))
        return fut

    def abandoned(self) -> None:
        with self._lock:
            self._spawn()

    def resize(self, threads: int) -> None:
        with self._lock:
            self._target = max(self._target, threads)


# two pools: an environment's step (on a step thread) may wait on its tool calls
_STEP_THREADS = _Daemons(32)


_TOOL_THREADS = _Daemons(32)
