"""Daemon threads that run environment steps and tool calls. A call that runs past its timeout is
abandoned (a thread cannot be stopped), and a thread takes its place, up to a bound: a pool never
holds more than twice its size in threads. Past that, a hung call's thread is not replaced (the
pool runs on fewer threads, so later calls wait and time out), and a warning says once how to
stop hung tools for good (``env.tool_processes``: a tool call past its timeout kills its process).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_log = logging.getLogger(__name__)


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
        self._abandoned = 0  # threads held by calls past their timeout
        self._warned = False

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
        """A call past its timeout holds a thread: replace it while the pool holds at most
        twice its size in threads."""
        with self._lock:
            self._abandoned += 1
            if self._threads < 2 * self._target:
                self._spawn()
            elif not self._warned:
                self._warned = True
                _log.warning(
                    "%d environment calls ran past their timeout and still hold their threads "
                    "(a thread cannot be stopped); no more are replaced, so later calls may time "
                    "out waiting. Tools that hang are killed when they run in processes of their "
                    "own: set env.tool_processes.",
                    self._abandoned,
                )

    @property
    def threads(self) -> int:
        """Threads started so far (live or held by abandoned calls)."""
        return self._threads

    def resize(self, threads: int) -> None:
        with self._lock:
            self._target = max(self._target, threads)


# two pools: an environment's step (on a step thread) may wait on its tool calls
_STEP_THREADS = _Daemons(32)


_TOOL_THREADS = _Daemons(32)
