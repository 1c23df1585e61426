"""Tool calls in worker processes (``env.tool_processes``): for tools that compute, which would
hold the GIL on the threads, or that may hang, which a thread cannot be stopped from doing.

Each worker process imports the tools by their import paths and answers one call at a time. A
request and its answer cross the pipe as JSON text (the tool's import path and its arguments;
the text it returned, or what went wrong): nothing is pickled, either way. A call that runs past
its deadline kills its process, and a fresh one is started when next needed; a process that
dies is replaced the same way. The processes are daemons of this process: they end with it.
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine_core.launch import own_session
from engine_core_roles.data.rewards.functions import load_function

__all__ = ["ToolProcesses", "TOOL_PROCESSES", "serve"]


def serve(conn: Any) -> None:
    """A worker's loop: a JSON request in, a JSON answer out, until the pipe closes."""
    own_session()  # a signal to the job's process group is the job's to handle
    tools: dict[str, Any] = {}
    for path in json.loads(conn.recv_bytes())["preload"]:  # imported before any call is timed
        try:
            tools[path] = load_function(path, what="env.tools")
        except Exception:
            pass  # the call names the failure
    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        path, name = request["tool"], request["name"]
        try:
            fn = tools.get(path) or tools.setdefault(path, load_function(path, what="env.tools"))
            result = fn(**request["arguments"])
        except Exception as e:
            answer = f"error: tool {name!r} raised {type(e).__name__}: {e}"
        else:
            answer = (
                result
                if isinstance(result, str)
                else f"error: tool {name!r} returned {type(result).__name__}, not text"
            )
        conn.send_bytes(json.dumps({"text": answer}).encode())


@dataclass
class _Worker:
    process: Any
    conn: Any

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class ToolProcesses:
    """Up to ``size`` worker processes. :meth:`warm` starts the missing ones (together) and
    waits until each has imported what it needs, so a call's timeout never pays for a start;
    :meth:`call` takes an idle one, sends it the call and waits until the deadline. A process
    killed on a timeout is replaced in the background."""

    START_TIMEOUT_S = 300.0  # spawning imports torch; a loaded machine can take a while

    def __init__(self, size: int = 0) -> None:
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running = 0
        self._preload: list[str] = []
        self.size = size

    def resize(self, size: int, tools: Sequence[str] = ()) -> None:
        """At least ``size`` processes, each importing ``tools`` (import paths) as it starts."""
        with self._lock:
            self.size = max(self.size, size)
            self._preload += [t for t in tools if t not in self._preload]

    def warm(self) -> None:
        """Start processes until ``size`` run; return once every new one is ready."""
        with self._lock:
            missing = max(0, self.size - self._running)
            self._running += missing
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds threads
        started = []
        for _ in range(missing):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=serve, args=(child,), name="engine-core-tool", daemon=True)
            process.start()
            child.close()
            parent.send_bytes(json.dumps({"preload": self._preload}).encode())
            started.append(_Worker(process, parent))
        failed = 0
        for worker in started:
            try:
                ready = worker.conn.poll(self.START_TIMEOUT_S) and worker.conn.recv_bytes()
            except (EOFError, OSError):
                ready = False
            if ready:
                self._idle.put(worker)
            else:
                failed += 1
                self._retire(worker, replace=False)
        if failed:
            raise RuntimeError(
                f"{failed} of {len(started)} tool processes did not start within "
                f"{self.START_TIMEOUT_S:g} s (or died starting); run the tools on threads "
                f"(env.tool_processes=0) or check that the tool modules import."
            )

    def _take(self, deadline: float) -> _Worker | None:
        """An idle process, waiting for one until ``deadline`` (None: none came). A killed
        process's replacement starts in the background, so a call never waits on a start."""
        try:
            return self._idle.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None

    def _retire(self, worker: _Worker, *, replace: bool = True) -> None:
        worker.kill()
        with self._lock:
            self._running -= 1
        if replace:
            threading.Thread(
                target=self._replace, name="engine-core-tool-start", daemon=True
            ).start()

    def _replace(self) -> None:
        try:
            self.warm()
        except RuntimeError:
            pass  # the next call that finds too few processes tries again

    def call(self, path: str, name: str, arguments: dict[str, Any], timeout_s: float) -> str:
        """The text tool ``path`` (called ``name`` in the model's messages) returned for
        ``arguments``, or an ``error:`` text saying why there is none. ``timeout_s`` bounds the
        wait for an idle process, and then the tool's own run."""
        late = f"error: tool {name!r} did not answer within {timeout_s:g} s"
        worker = self._take(time.monotonic() + timeout_s)
        if worker is None:  # every process busy the whole time
            return late
        request = {"tool": path, "name": name, "arguments": arguments}
        try:
            worker.conn.send_bytes(json.dumps(request).encode())
            if not worker.conn.poll(timeout_s):
                self._retire(worker)  # killed: a thread cannot be stopped, a process can
                return late
            answer = json.loads(worker.conn.recv_bytes())
        except (EOFError, OSError):
            worker.process.join(timeout=5)  # the pipe closes before the exit is reaped
            code = worker.process.exitcode
            self._retire(worker)
            return f"error: tool {name!r} ended its process (exit code {code})"
        self._idle.put(worker)
        return str(answer["text"])


TOOL_PROCESSES = ToolProcesses()
