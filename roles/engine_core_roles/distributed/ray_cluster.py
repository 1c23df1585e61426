"""The local Ray cluster a job starts: in a session of its own, recorded in the job's output
folder, ended with the job, and ended at the next start when the job was killed before it could
end it.

:func:`local_cluster` starts the head with ``ray start --head --block`` in a new session (its
own temporary folder, a free port, the dashboard left out) and connects ``ray.init`` to it, so
a signal to the job's whole process group reaches the job and not its cluster. The job ends the
head at its end (SIGTERM to ``ray start``, which ends the node's processes; anything left is
killed). A head node outlives a driver killed with SIGKILL, and its agents ignore SIGTERM:
while the job runs, the head's folder is written to ``<output_dir>/ray_cluster.json``, and a
later run in the same folder that finds the file ends every process whose command line or open
files name that folder (the head node's processes all do), with one line saying so. A cluster
the job joined (``ray.address``) is never recorded and never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["RECORD", "end_stale_cluster", "local_cluster"]

RECORD = "ray_cluster.json"
TEMP_PREFIX = "engine-core-ray-"  # the head's temporary folder, in the system's temporary one
START_TIMEOUT_S = 120.0  # for `ray start` to serve its address
END_TIMEOUT_S = 30.0  # for it to end the node's processes when told to


def _processes() -> Iterator[tuple[int, str]]:
    """``(pid, what names it)`` of every process this user can see (Linux ``/proc``): its
    command line and the files it holds open. Ray's agents rename themselves
    (``ray::DashboardAgent``), so their session shows only in the log files they hold."""
    proc = Path("/proc")
    if not proc.is_dir():
        return
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            raw = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            opened = []
            with contextlib.suppress(OSError):
                for fd in (entry / "fd").iterdir():
                    with contextlib.suppress(OSError):
                        opened.append(os.readlink(fd))
            yield int(entry.name), " ".join([raw, *opened])


def end_stale_cluster(out_dir: Path, say: Callable[[str], None]) -> int:
    """End the processes of the local cluster an earlier run in ``out_dir`` started and did not
    end (its record is there); returns how many were ended."""
    record = out_dir / RECORD
    if not record.exists():
        return 0
    try:
        recorded = json.loads(record.read_text())
        # the folder its head was started with (the session's folder is inside it)
        session = str(recorded.get("temp_dir") or recorded["session_dir"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        session = ""
    ended = 0
    if session:
        ended = _kill_naming(session)
        folder = Path(session)
        # the head's own temporary folder only (a record is a file anyone could have edited)
        if folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith(TEMP_PREFIX):
            shutil.rmtree(folder, ignore_errors=True)
    record.unlink(missing_ok=True)
    if ended:
        say(
            f"ended {ended} processes of the local Ray cluster an earlier run in {out_dir} "
            f"started and could not stop (session {session})."
        )
    return ended


def _head_command(temp_dir: Path, num_cpus: int | None) -> list[str]:
    """``ray start`` for a head node of the job's own, blocking until it is told to end."""
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block"]
    command += ["--port=0", "--node-ip-address=127.0.0.1", "--include-dashboard=false"]
    command += ["--disable-usage-stats", f"--temp-dir={temp_dir}"]
    return command + ([] if num_cpus is None else [f"--num-cpus={num_cpus}"])


def _started_head(temp_dir: Path, num_cpus: int | None, log: Path) -> tuple[Any, str]:
    """The head's ``ray start`` process, in a session of its own, and the address it serves;
    waits until it has written that address (``START_TIMEOUT_S`` at most)."""
    with log.open("ab") as out:
        head = subprocess.Popen(
            _head_command(temp_dir, num_cpus),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a signal to the job's process group does not reach it
        )
    written = temp_dir / "ray_current_cluster"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (written.exists() and written.read_text().strip()):
        exited = head.poll()
        if exited is not None or time.monotonic() > deadline:
            _end_head(head, temp_dir)
            why = (
                f"exited with status {exited}"
                if exited is not None
                else f"was not ready in {START_TIMEOUT_S:g} s"
            )
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(
                f"the job's Ray cluster did not start (`ray start --head` {why}); its output, "
                f"in {log}, ends:\n{tail}"
            )
        time.sleep(0.1)
    return head, written.read_text().strip()


def _end_head(head: Any, temp_dir: Path) -> None:
    """End the head: its ``ray start`` ends the node's processes on SIGTERM; what is still
    running after ``END_TIMEOUT_S`` (or was started outside it) is killed."""
    if head.poll() is None:
        head.terminate()
        try:
            head.wait(timeout=END_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(timeout=END_TIMEOUT_S)
    _kill_naming(str(temp_dir))


def _kill_naming(name: str) -> int:
    """SIGKILL every other process whose command line or open files name ``name``."""
    ended = 0
    for pid, command in _processes():
        if name in command and pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                ended += 1
    return ended


@contextlib.contextmanager
def local_cluster(
    out_dir: Path, num_cpus: int | None, say: Callable[[str], None]
) -> Iterator[None]:
    """A local cluster of the job's own for the block (``ray.init`` connected to it), recorded
    in ``out_dir`` while it runs, and ended after.

    Its head is started by ``ray start --head --block`` in a session of its own, not by
    ``ray.init``: a signal sent to the job's whole process group (a terminal's Ctrl-C, a
    scheduler's preemption) would otherwise end the cluster's GCS and raylet with the job's
    own process, and the job, which stops on that signal after a checkpoint, would lose its
    workers and wait a minute for a GCS that is gone."""
    import ray

    end_stale_cluster(out_dir, say)
    temp_dir = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
    out_dir.mkdir(parents=True, exist_ok=True)
    record = out_dir / RECORD
    record.write_text(json.dumps({"temp_dir": str(temp_dir), "pid": os.getpid()}))
    head = None
    try:
        head, address = _started_head(temp_dir, num_cpus, temp_dir / "ray_start.log")
        context = ray.init(address=address, log_to_driver=False)
        session = getattr(context, "address_info", {}).get("session_dir")
        record.write_text(
            json.dumps({"temp_dir": str(temp_dir), "session_dir": session, "pid": os.getpid()})
        )
        yield
    finally:
        with contextlib.suppress(Exception):  # a cluster already gone: nothing to disconnect
            ray.shutdown()
        if head is not None:
            _end_head(head, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        record.unlink(missing_ok=True)
