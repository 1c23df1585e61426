"""A fork server for tests that run a program many times: one interpreter imports its modules
once, and each run is a child forked from it, so a run costs the run, not an interpreter start
and its imports.

The server runs ``setup`` (Python source that defines ``run(request: dict) -> int``; it should
import modules and run no torch operation, so no thread pool is forked), then reads one JSON
request per line from its stdin, forks a child that calls ``run(request)`` and exits with its
result, and answers with the child's exit status (negative: killed by that signal). A child
exits as an interpreter does: ``SystemExit`` gives the status, an exception prints its traceback
and exits 1, and the ``atexit`` functions run. With ``log`` in the request, the child's stdout
and stderr go to that file; without it, both go to the server's stderr. The child's stdin is
empty. A run past ``timeout`` seconds kills the server and its runs (one process group) and
fails.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["JOB_MODULES", "JOB_RUNNER", "ForkServer", "Running"]

# what an engine-core job imports as it runs besides the job's own modules (transformers'
# tokenizer and model classes, the default engine and rollout, the data files' reader, the
# plot): a ``setup`` that forks jobs imports these once, so that no run imports them again
# (about 10 s of a two-core machine per run)
JOB_MODULES = """
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot, matplotlib.ticker
import datasets
from transformers import AutoModelForCausalLM, AutoTokenizer
import engine_core.reference_engine, engine_core_fsdp.fsdp2, engine_core_hf.rollout
"""

# a ``setup`` whose runs are ``engine-core ARGS...`` (``request["args"]``), or a documentation
# page's Python blocks (``request["blocks"]``: (name, source) pairs run in order in one fresh
# namespace), in ``request["cwd"]`` (default: the server's folder) with ``request["env"]`` added
# to the environment; with ``request["pid_file"]``, in a process group of its own (as a shell's
# job or a scheduler's job step is), its pid written there once it runs
JOB_RUNNER = (
    JOB_MODULES
    + r"""
import os, signal
from engine_core.cli import main  # imported once, before any fork
import engine_core.parity, engine_core_roles.jobs.rl.run, engine_core_roles.jobs.sft  # noqa: F401

START = os.getcwd()

def run(request):
    os.chdir(request.get("cwd") or START)
    os.environ.update(request.get("env") or {})
    if "blocks" in request:
        namespace = {"__name__": "__main__"}
        for name, source in request["blocks"]:
            exec(compile(source, name, "exec"), namespace)
        return 0
    if "pid_file" in request:
        # SIGINT as a shell gives a foreground job, whatever the test process had when it
        # started this server
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        os.setsid()
        with open(request["pid_file"] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(request["pid_file"] + ".tmp", request["pid_file"])
    return main(request["args"])
"""
)

SERVER = r"""
import atexit, json, os, sys, traceback

reply = os.fdopen(os.dup(1), "w")  # the answers; nothing else writes there
os.dup2(2, 1)
exec(compile(sys.argv.pop(1), "<fork server setup>", "exec"))

for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            reply.close()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            log = request.pop("log", None)
            if log:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
            try:
                code = run(request)
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    reply.write(json.dumps({"code": code}) + "\n")
    reply.flush()
"""


class ForkServer:
    """``run(**request)`` forks one run from the server and returns its exit status."""

    def __init__(
        self, setup: str, *, cwd: str | Path | None = None, env: dict[str, str] | None = None
    ) -> None:
        self._start = (setup, cwd, env)
        self.proc = self._started()
        self._lock = threading.Lock()  # one request at a time: its answer is the next line

    def _started(self) -> subprocess.Popen[str]:
        setup, cwd, env = self._start
        return subprocess.Popen(
            [sys.executable, "-c", SERVER, setup],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=env,
            start_new_session=True,  # its runs and their processes: one group to kill
        )

    def run(self, timeout: float | None = None, **request: Any) -> int:
        with self._lock:
            if self.proc.poll() is not None:  # killed by an earlier run past its timeout
                self.proc = self._started()
            return self._run(timeout, request)

    def _run(self, timeout: float | None, request: dict[str, Any]) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        # one answer per request: nothing is buffered ahead of it, so the pipe tells when it came
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"{request} ran past {timeout} s; killed")
        answer = self.proc.stdout.readline()
        assert answer, f"the fork server died (exit {self.proc.poll()})"
        return int(json.loads(answer)["code"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Running:
    """One ``engine-core`` run forked from a :data:`JOB_RUNNER` server in the background (its
    exit status, or what the server raised, in :attr:`answer`), its pid written to
    ``<name>.pid`` and its output to ``<name>.log`` under ``tmp``."""

    def __init__(self, server: ForkServer, tmp: Path, name: str, args: list[str]) -> None:
        self.pid_file, self.log = tmp / f"{name}.pid", tmp / f"{name}.log"
        self.answer: dict[str, Any] = {}
        request = {"args": args, "pid_file": str(self.pid_file), "log": str(self.log)}

        def run() -> None:
            try:
                self.answer["code"] = server.run(timeout=600, **request)
            except BaseException as e:  # named by the test, not lost in the thread
                self.answer["error"] = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def wait_until(self, ready: Any, what: str, timeout: float) -> int:
        """Wait until the pid is written and ``ready()``; returns the pid."""
        deadline = time.monotonic() + timeout
        while not (self.pid_file.exists() and ready()):
            assert self.thread.is_alive(), (self.answer, self.output()[-3000:])
            assert time.monotonic() < deadline, f"{what} in {timeout:g} s"
            time.sleep(0.01)
        return int(self.pid_file.read_text())

    def finish(self, timeout: float = 300) -> tuple[Any, str]:
        """The exit status and the output, once the run has ended."""
        self.thread.join(timeout=timeout)
        err = self.output()
        assert not self.thread.is_alive() and "error" not in self.answer, (
            self.answer,
            err[-3000:],
        )
        return self.answer["code"], err
