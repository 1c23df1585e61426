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
from pathlib import Path
from typing import Any

__all__ = ["JOB_MODULES", "ForkServer"]

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
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, setup],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=env,
            start_new_session=True,  # its runs and their processes: one group to kill
        )

    def run(self, timeout: float | None = None, **request: Any) -> int:
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
