"""A run stops on a signal as clusters and terminals deliver it, under every executor.

Each case runs ``engine-core run`` in a process group of its own (as a shell's job or a
scheduler's job step is), waits until a random step (its seed is in a failure's message) is
logged, and sends the signal twice (the second while the run finishes the step and saves):

- ``process``: SIGTERM to the job's process alone;
- ``group``: SIGTERM to its whole process group (``kill -- -PGID``: SLURM's preemption, many
  launchers);
- ``ctrl_c``: SIGINT to its whole process group, as a terminal's Ctrl-C sends it.

Each must end with the one-line stop message, one checkpoint of a finished step and exit status
3, and ``--resume auto`` must continue to the metrics of an uninterrupted run, step by step.
The resume and the uninterrupted run keep only the settings that change the numbers: they run
in process, where the executor or where one synchronous replica runs are all that differ (the
checkpoint is the same whatever the executor; resuming under each executor is
``test_placement``'s and ``test_ray_nodes``'s, and restarting workers, replicas or a Ray
cluster here would double each case's cost).
Besides the three executors, the processes a job starts besides its workers are signalled with
the group: rollout replicas in processes of their own (asynchronous training), and a replica in
an interpreter started by path.

The runs are forked from the suite's job server, which has imported the job's modules
(``tests/_forkserver.py``): each case costs its runs, not interpreter starts.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine_core.errors import EXIT_STOPPED
from engine_core_roles.jobs.cli import RECIPES
from tests._forkserver import ForkServer, Running

RECIPE = RECIPES / "grpo_tiny.yaml"
STEPS = 6

EXECUTORS = {
    "in_process": ["placement.executor=in_process"],
    "local": ["placement.executor=local"],
    "ray": ["placement.executor=ray", "ray.num_cpus=2"],
}
DELIVERIES = {
    "process": (signal.SIGTERM, False),
    "group": (signal.SIGTERM, True),
    "ctrl_c": (signal.SIGINT, True),
}
# the processes a job starts besides its role workers, each signalled with the whole group
STARTED = {
    "replicas_async": [
        "placement.executor=local",
        "rollout_placement=process",
        "rollout_replicas=2",
        "trainer.max_staleness=1",
        "trainer.filter_groups=false",  # the recipe's dynamic sampling is synchronous only
    ],
    "interpreter_replica": [
        "rollout_placement=process",
        f"rollout_python={sys.executable}",
    ],
}
# Each delivery under the in-process and local executors; under Ray the group alone (SLURM's
# preemption). The job's own Ray cluster, like its workers, runs in a session of its own, so
# whichever of the three deliveries reaches the job reaches its driver alone, as under the
# local executor, whose three cases show that; the group's case shows the cluster kept out of
# the signalled group (each Ray case costs a cluster's start and end: ~25 s of a 2-core host).
RAY_DELIVERIES = ("group",)
CASES = [
    *(
        pytest.param(EXECUTORS[e], d, id=f"{e}-{d}", marks=[pytest.mark.ray] if e == "ray" else [])
        for e in EXECUTORS
        for d in DELIVERIES
        if e != "ray" or d in RAY_DELIVERIES
    ),
    *(pytest.param(extra, "group", id=f"{name}-group") for name, extra in STARTED.items()),
]


def _args(out: Path, extra: list[str]) -> list[str]:
    return [
        "run",
        str(RECIPE),
        f"output_dir={out}",
        f"steps={STEPS}",
        "engine.backend=reference",
        "prompts_per_step=2",
        "trainer.samples_per_prompt=2",
        "save_every=0",
        "log_every=1",
        *extra,
    ]


def _rows(out: Path) -> list[dict[str, Any]]:
    from engine_core_roles.trainer.metrics import TIMING_KEYS

    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


# the uninterrupted runs, by what changes the numbers (the executor does not)
_STRAIGHT: dict[tuple[str, ...], list[dict[str, Any]]] = {}


def _computing(extra: list[str]) -> tuple[str, ...]:
    """The settings of ``extra`` that change the numbers: not the executor, nor where one
    synchronous rollout replica runs (colocated, in a process of its own or in another
    interpreter, the runs' metrics are equal, measured)."""
    kept = [
        a for a in extra if not a.startswith(("placement.executor=", "ray.", "rollout_python="))
    ]
    if not any(a.startswith(("rollout_replicas=", "trainer.max_staleness=")) for a in kept):
        kept = [a for a in kept if not a.startswith("rollout_placement=")]
    return tuple(kept)


def _straight(server: ForkServer, tmp: Path, extra: list[str]) -> list[dict[str, Any]]:
    key = _computing(extra)
    if key not in _STRAIGHT:
        out = tmp / "straight"
        code, err = Running(server, tmp, "straight", _args(out, list(key))).finish(600)
        assert code == 0, err[-3000:]
        _STRAIGHT[key] = _rows(out)
    return _STRAIGHT[key]


@pytest.mark.parametrize(("extra", "delivery"), CASES)
def test_a_signal_as_delivered_stops_the_run_at_a_step_that_resumes_exactly(
    job_server: ForkServer, tmp_path: Path, extra: list[str], delivery: str
) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    after = random.Random(seed).randint(1, STEPS - 3)
    sig, to_group = DELIVERIES[delivery]
    out, metrics = tmp_path / "run", tmp_path / "run" / "metrics.jsonl"
    running = Running(job_server, tmp_path, "run", _args(out, extra))
    pid = running.wait_until(
        lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= after,
        f"the run logged no step {after}",
        300,
    )
    for _ in range(2):  # the second while it finishes the step in flight and saves
        if to_group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    signalled = time.monotonic()
    code, err = running.finish()
    took = time.monotonic() - signalled
    assert code == EXIT_STOPPED, (seed, code, err[-3000:])
    said = " ".join(err.split())
    name = signal.Signals(sig).name
    assert f"stopped on {name} after step" in said and "--resume auto" in said, (seed, err)
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0].startswith("global_step_"), (seed, saved)
    step = int(saved[0].rsplit("_", 1)[1])
    assert after <= step < STEPS and f"after step {step} of {STEPS}" in said, (seed, said)
    assert "Traceback" not in err, (seed, err[-3000:])
    print(f"{delivery}: exit {code} {took:.1f} s after the signal, at step {step}")

    # the resume runs in process (the module docstring says why)
    again = list(_computing(extra))
    resumed = Running(job_server, tmp_path, "resumed", [*_args(out, again), "--resume", "auto"])
    code, err = resumed.finish(600)
    assert code == 0, err[-3000:]
    assert _rows(out) == _straight(job_server, tmp_path, extra), seed


def test_a_ctrl_c_before_the_first_step_is_one_line_and_exit_130(
    job_server: ForkServer, tmp_path: Path
) -> None:
    """SIGINT while the run starts (no step yet to finish) ends it at once: one line, no
    traceback, nothing saved, exit status 130."""
    from engine_core.errors import EXIT_INTERRUPTED

    out = tmp_path / "run"
    running = Running(job_server, tmp_path, "run", _args(out, []))
    pid = running.wait_until(lambda: True, "the run wrote no pid", 120)
    time.sleep(0.3)  # inside the command: loading its plugins and recipe, building models
    os.killpg(pid, signal.SIGINT)
    code, err = running.finish()
    assert code == EXIT_INTERRUPTED, (code, err[-3000:])
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("engine-core run: interrupted (SIGINT)"), err[-3000:]
    assert "Traceback" not in err and not (out / "metrics.jsonl").exists(), err[-3000:]
