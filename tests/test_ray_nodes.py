"""Worker groups on a Ray cluster of several nodes: two raylets on this machine (Ray's test
cluster, each node with its own CPUs and a resource naming it). Groups are placed where they
fit (spread over both nodes, or on the node a resource names); a group the cluster has no room
for is refused with what the nodes have; a worker whose node leaves the cluster is named with
that node (the actor's ranks and the rollout replicas one a node, the weights synced across
them), and the job stops with one line, its checkpoints intact, and resumes with
``--resume auto`` once the cluster has room again. Nothing here has run on separate machines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_core.executors.base import FAILURE_GRACE_S
from engine_core_roles.jobs.cli import RECIPES
from tests._forkserver import ForkServer, Running

pytestmark = pytest.mark.ray

ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    nodes = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"first": 1},
            "include_dashboard": False,
            # a node that stops answering is declared dead after ~2 s (Ray's default: ~15 s)
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4},
        },
    )
    try:
        yield nodes
    finally:
        nodes.shutdown()


# One script and one second node serve both tests below: first the placements (a group spread
# over both nodes, one on the node a resource names, one that fits nowhere), then one group of
# two workers for each way the other worker behaves, all three spanning both nodes and called at
# once, so that one node's leaving serves the three (each test of its own would start its own
# node and interpreter and connect again: ~20 s of a loaded two-core host)
OTHERS = ("silent", "answered", "raised_there")
SCRIPT = r"""
import json, sys, threading, ray
from engine_core.errors import DispatchError
from engine_core.executors.ray import RayWorkerGroup
from tests._workers import MeshWorker

ray.init(address=sys.argv[1], log_to_driver=False)
placed = {}
spread = RayWorkerGroup(MeshWorker, 2, resources={"CPU": 1}, strategy="SPREAD")
placed["spread"] = [ip_id[0] for ip_id in spread.nodes]
placed["echo"] = spread.call_all("echo", 1)
spread.shutdown()
named = RayWorkerGroup(MeshWorker, 1, resources={"second": 1})
placed["named"] = named.nodes[0][0]
named.shutdown()
try:
    RayWorkerGroup(MeshWorker, 3, strategy="STRICT_SPREAD", call_timeout_s=1)  # never placed
except DispatchError as e:
    placed["refused"] = str(e)

raisers, calls, said = {}, {}, {}
for other in sys.argv[3].split(","):
    group = RayWorkerGroup(
        MeshWorker, 2, strategy="STRICT_SPREAD", resources={"CPU": 0.25}, call_timeout_s=120
    )
    leaving = [node for node, _ in group.nodes].index(sys.argv[2])
    raiser = leaving if other == "raised_there" else 1 - leaving
    answered = other != "silent"  # the other answers at once; the raiser lost a peer
    raisers[other] = raiser
    calls[other] = group.call_all_async("raise_or_nap", raiser, 0 if answered else 600, answered)
print(json.dumps({"placed": placed, "raisers": raisers}), flush=True)

def result(other):
    try:
        calls[other].result()
    except DispatchError as e:
        said[other] = str(e)

threads = [threading.Thread(target=result, args=(other,)) for other in calls]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"said": said}), flush=True)
"""


@pytest.fixture(scope="module")
def second_node_left(cluster: Any) -> dict[str, Any]:
    """The script above on the cluster with a second node (one CPU and a resource naming it),
    which leaves the cluster once the raised errors have waited out their grace period: what
    the script printed, with the nodes' ids and its stderr."""
    second = cluster.add_node(num_cpus=1, resources={"second": 1})
    cluster.wait_for_nodes()
    script = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, cluster.address, second.node_id, ",".join(OTHERS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=Path(__file__).parents[1],
    )
    assert script.stdout is not None
    first = next((line for line in script.stdout if line.startswith('{"placed"')), "{}")
    started = json.loads(first)
    if "raisers" not in started:
        cluster.remove_node(second)
        pytest.fail(script.communicate(timeout=60)[1][-3000:])
    time.sleep(FAILURE_GRACE_S + 2)  # the raised errors have waited out their grace period
    cluster.remove_node(second, allow_graceful=False)
    out, err = script.communicate(timeout=180)
    said = next((json.loads(s)["said"] for s in out.splitlines() if s.startswith('{"said"')), {})
    return {
        **started,
        "said": said,
        "err": err,
        "head": cluster.head_node.node_id,
        "second": second.node_id,
    }


def test_groups_are_placed_where_they_fit_and_refused_where_nothing_fits(
    second_node_left: dict[str, Any],
) -> None:
    out, second = second_node_left["placed"], second_node_left["second"]
    assert sorted(out["spread"]) == sorted([second_node_left["head"], second])  # one each
    assert sorted(out["echo"]) == [10, 11]  # both answer, each with its rank
    assert out["named"] == second  # the node with the resource asked for
    assert "no room for 3 workers" in out["refused"] and "STRICT_SPREAD" in out["refused"]
    assert out["refused"].count("CPU") >= 2  # each node's resources are named


def test_a_worker_cut_off_with_its_node_is_named_though_it_said_nothing(
    second_node_left: dict[str, Any],
) -> None:
    """In each group one worker raises at once; the other is on a node that leaves the cluster
    only after the grace period for the others' answers. ``silent``: it never answers;
    ``answered``: it answered at once, and the raiser's error is a collective's lost peer (the
    peer may be another group's, on that node); ``raised_there``: the raiser is the one on the
    leaving node. The worker on the node that left is named first, with its node."""
    said, raisers = second_node_left["said"], second_node_left["raisers"]
    assert set(said) == set(OTHERS), (said, second_node_left["err"][-3000:])
    for other in OTHERS:
        raiser, lines = raisers[other], said[other].splitlines()
        lost = raiser if other == "raised_there" else 1 - raiser
        named = "died during 'raise_or_nap' on node" if other == "silent" else "was on node"
        assert lines[0].startswith(f"worker {lost} {named}"), (other, said[other])
        assert "which left the cluster" in lines[0], (other, said[other])
        assert f"worker {raiser} raised in 'raise_or_nap'" in said[other], (other, said[other])


def _job(out: Path, *extra: str) -> list[str]:
    return [
        "run",
        str(RECIPES / "grpo_tiny.yaml"),
        f"output_dir={out}",
        "engine.backend=reference",
        "prompts_per_step=2",
        "trainer.samples_per_prompt=2",
        "save_every=1",
        "placement.executor=ray",
        "placement.actor.dp=2",
        "placement.actor.num_cpus=0.5",
        "placement.actor.strategy=STRICT_SPREAD",
        "rollout_placement=process",
        "rollout_replicas=2",
        "placement.rollout.num_cpus=0.25",
        "placement.rollout.strategy=STRICT_SPREAD",
        "placement.call_timeout_s=60",
        *extra,
    ]


def test_a_job_spans_two_nodes_stops_when_one_leaves_and_resumes_on_a_new_one(
    cluster: Any, tmp_path: Path, job_server: ForkServer
) -> None:
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    out = tmp_path / "run"
    # both runs forked from the server that imported the job's modules (tests/_forkserver.py)
    job = Running(
        job_server, tmp_path, "first", _job(out, "steps=200", f"ray.address={cluster.address}")
    )
    metrics = out / "metrics.jsonl"
    job.wait_until(
        lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2,
        "the job logged no two steps",
        300,
    )
    cluster.remove_node(second, allow_graceful=False)  # the node goes, mid-run
    code, err = job.finish(300)
    assert code == 1, err
    for role in ("actor", "rollout"):  # one worker of each group on each node
        placed = next(line for line in err.splitlines() if line.startswith(f"placement: {role}"))
        assert placed.count("1 on node") == 2, placed
    said = [line for line in err.splitlines() if "engine-core run failed" in line]
    assert len(said) == 1, err
    # the lost node named first: the failed call's worker on it died during the call, or it
    # answered (or raised) and went with the node, with the call's peers of other groups there
    lost = "died during" in said[0] or " was on node " in said[0]
    assert lost and "which left the cluster" in said[0], said[0]
    assert "checkpoints already saved" in said[0]
    assert "Traceback" not in err
    # the committed steps (a save the loss broke off leaves its staging folder, *.tmp)
    saved = sorted(
        (p.name for p in (out / "checkpoints").iterdir() if p.name.split("_")[-1].isdigit()),
        key=lambda name: int(name.split("_")[-1]),
    )
    assert saved, list((out / "checkpoints").iterdir())

    # a new node: the same command with --resume auto continues from the newest checkpoint
    third = cluster.add_node(num_cpus=1)
    try:
        cluster.wait_for_nodes()
        last = int(saved[-1].rsplit("_", 1)[1])
        again = [
            *_job(out, f"steps={last + 1}", f"ray.address={cluster.address}"),
            "--resume",
            "auto",
        ]
        code, err = Running(job_server, tmp_path, "resumed", again).finish(300)
        assert code == 0, err[-3000:]
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, last + 2))
        assert not list((out / "checkpoints").glob("*.tmp"))  # removed at the start
    finally:
        cluster.remove_node(third)
