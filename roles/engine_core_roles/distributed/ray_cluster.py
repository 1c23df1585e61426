"""The local Ray cluster a job starts: recorded in its output folder, ended with the job, and
ended at the next start when the job was killed before it could end it.

``ray.init()`` without an address starts a head node (GCS, raylet, dashboard and runtime-env
agents, log monitor) that outlives a driver killed with SIGKILL, and its agents ignore SIGTERM.
:func:`local_cluster` writes the cluster's session folder to ``<output_dir>/ray_cluster.json``
while the job runs; a later run in the same folder that finds the file ends every process whose
command line or open files name that session folder (the head node's processes all do), with
one line saying so. A cluster the job joined (``ray.address``) is never recorded and never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["RECORD", "end_stale_cluster", "local_cluster"]

RECORD = "ray_cluster.json"


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
        session = str(json.loads(record.read_text())["session_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        session = ""
    ended = 0
    if session:
        for pid, command in _processes():
            if session in command and pid != os.getpid():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    ended += 1
    record.unlink(missing_ok=True)
    if ended:
        say(
            f"ended {ended} processes of the local Ray cluster an earlier run in {out_dir} "
            f"started and could not stop (session {session})."
        )
    return ended


@contextlib.contextmanager
def local_cluster(
    out_dir: Path, init: Callable[[], Any], shutdown: Callable[[], None], say: Callable[[str], None]
) -> Iterator[None]:
    """Start a local cluster with ``init`` (``ray.init(...)``, returning its context) for the
    block, recorded in ``out_dir`` while it runs; ``shutdown`` it after."""
    end_stale_cluster(out_dir, say)
    context = init()
    session = getattr(context, "address_info", {}).get("session_dir")
    record = out_dir / RECORD
    if session:
        out_dir.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"session_dir": session, "pid": os.getpid()}))
    try:
        yield
    finally:
        shutdown()
        record.unlink(missing_ok=True)
