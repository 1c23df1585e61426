"""The local Ray cluster a job starts does not outlive it: a job killed with SIGKILL leaves its
head node's processes running (Ray's agents ignore SIGTERM), and the next run in the same folder
ends them, with one line saying so; a run that ends normally leaves no record behind."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from engine_core_roles.distributed.ray_cluster import RECORD, _processes
from engine_core_roles.jobs.cli import RECIPES
from tests._forkserver import ForkServer, Running

pytestmark = pytest.mark.ray


def _command(out: Path, *extra: str) -> list[str]:
    return [
        "run",
        str(RECIPES / "grpo_tiny.yaml"),
        f"output_dir={out}",
        "placement.executor=ray",
        "ray.num_cpus=2",
        "engine.backend=reference",
        "prompts_per_step=2",
        "trainer.samples_per_prompt=2",
        "save_every=0",
        *extra,
    ]


def _alive(session: str) -> list[int]:
    return [pid for pid, command in _processes() if session in command]


@pytest.fixture
def recorded_cluster() -> Any:
    """A cluster on this machine that a job without ``ray.address`` must leave alone: its head
    is recorded where ``ray start`` records one (Ray's own ``ray.init()`` would join it)."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        yield cluster
    finally:
        cluster.shutdown()


def test_a_killed_jobs_ray_cluster_is_ended_by_the_next_run(
    tmp_path: Path, recorded_cluster: Any, job_server: ForkServer
) -> None:
    """Also with another cluster recorded on the machine (a ``ray start``): the job starts one
    of its own, and neither run touches the other."""
    other = recorded_cluster.head_node.get_session_dir_path()
    out = tmp_path / "run"
    # both runs forked from the server that imported the job's modules (tests/_forkserver.py)
    job = Running(job_server, tmp_path, "first", _command(out, "steps=500"))
    record, metrics = out / RECORD, out / "metrics.jsonl"
    pid = job.wait_until(
        lambda: record.exists() and metrics.exists() and metrics.read_text().strip(),
        "the job started no Ray cluster and step",
        300,
    )
    session = json.loads(record.read_text())["session_dir"]
    assert session != other, "the job joined the recorded cluster instead of starting its own"
    os.kill(pid, signal.SIGKILL)
    code, _ = job.finish(60)
    assert code == -signal.SIGKILL, code
    time.sleep(2)
    left = _alive(session)
    assert left, "a killed driver's Ray cluster was expected to outlive it"

    # the next run in the same folder (fresh: no checkpoint was saved) ends them first
    code, stderr = Running(
        job_server, tmp_path, "again", [*_command(out, "steps=1"), "--resume", "auto"]
    ).finish(300)
    assert code == 0, stderr[-3000:]
    said = " ".join(stderr.split())
    # some of the orphans may exit on their own between the count above and the next start
    ended = re.search(r"ended (\d+) processes of the local Ray cluster an earlier run in", said)
    assert ended, said
    assert 1 <= int(ended.group(1)) <= len(left), said
    assert not _alive(session)
    assert not Path(session).parent.exists(), "the killed run's Ray folder was left behind"
    assert not record.exists()  # that run ended its own cluster, and its record with it
    assert _alive(other), "a run ended the recorded cluster it did not start"
