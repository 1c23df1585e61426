"""A job killed (SIGKILL) at any point of a save stays resumable, and resumes exactly.

``engine-core run`` runs in child processes with an audit hook (``sys.addaudithook``) that
watches the file-system calls Python makes under the run's output folder (files opened for
writing, renames, deletions, new folders). One test kills at random calls of whole runs, each
restarted with ``--resume auto``. Another: a first run records the calls of the save at step 2;
then, for a spread of those calls, a fresh run is killed with ``SIGKILL`` by its own hook right
before the call. Each killed run is resumed (``--resume``) to step 3 in this process, and its
metrics must equal those of the uninterrupted run, step by step.

The runs are forked from one server process (``tests/_forkserver.py``) that has imported the
job's modules (and run no torch operation, so no thread pool is forked): each kill then costs a
run, not an interpreter start.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from engine_core_roles.jobs.cli import RECIPES
from tests._forkserver import JOB_MODULES, ForkServer

RECIPE = RECIPES / "grpo_tiny.yaml"

SETUP = (
    JOB_MODULES
    + r"""
import json, os, signal, sys
from engine_core_roles.jobs.cli import main  # imported once, before any fork
import engine_core_roles.jobs.rl.run  # noqa: F401

WATCH = {"open", "os.rename", "os.replace", "os.remove", "os.unlink", "os.rmdir", "os.mkdir",
         "shutil.rmtree", "shutil.move"}

def run(request):
    out, kill_at, record = request["out"], request["kill_at"], request["record"]
    watch_from = request.get("watch_from", "global_step_2")
    seen, calls = [False], []

    def hook(event, hargs):
        if event not in WATCH or not hargs:
            return
        if not isinstance(hargs[0], (str, os.PathLike)):
            return
        path = os.fspath(hargs[0])
        if not path.startswith(out):
            return
        if event == "open" and not (
            len(hargs) > 1 and isinstance(hargs[1], str) and set(hargs[1]) & set("wax+")
        ):
            return
        if watch_from in path:
            seen[0] = True
        if not seen[0]:
            return
        calls.append(f"{event} {os.path.relpath(path, out)}")
        if kill_at and len(calls) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    with open(os.devnull, "w") as sink:
        os.dup2(sink.fileno(), 1)
    code = main(["run", *request["args"]])
    if record:
        with open(record, "w") as f:
            json.dump(calls, f)
    return code
"""
)


class _Runs:
    """The fork server: ``run(...)`` forks one ``engine-core run`` and returns its exit status."""

    def __init__(self) -> None:
        self.server = ForkServer(SETUP, env={**os.environ, "RAY_AUTH_MODE": "disabled"})

    def run(
        self,
        out: Path,
        args: list[str],
        kill_at: int = 0,
        record: str = "",
        watch_from: str = "global_step_2",
    ) -> int:
        return self.server.run(
            out=str(out), args=args, kill_at=kill_at, record=record, watch_from=watch_from
        )

    def close(self) -> None:
        self.server.close()


@pytest.fixture(scope="module")
def runs() -> Any:
    server = _Runs()
    yield server
    server.close()


def _overrides(out: Path, algorithm: str, keep: int) -> list[str]:
    return [
        str(RECIPE),
        f"output_dir={out}",
        "steps=3",
        f"trainer.algorithm={algorithm}",
        f"max_ckpt_to_keep={keep}",
        "engine.backend=reference",
        "prompts_per_step=2",
        f"trainer.samples_per_prompt={1 if algorithm == 'ppo' else 2}",
        "save_every=1",
        "log_every=1",
    ]


def _quiet(main: Any, argv: list[str]) -> int:
    with open(os.devnull, "w") as sink:
        saved, sys.stdout = sys.stdout, sink
        try:
            return int(main(argv))
        finally:
            sys.stdout = saved


def _rows(out: Path) -> list[dict[str, Any]]:
    from engine_core_roles.trainer.metrics import TIMING_KEYS

    drop = TIMING_KEYS
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in drop} for line in lines]


# each algorithm's state (ppo: the critic) and each rotation (keep 1: the last step is the only
# one) once; the random kills below reach every write of whole runs
@pytest.mark.parametrize(("algorithm", "keep"), [("grpo", 1), ("ppo", 2)])
def test_a_kill_anywhere_in_a_save_leaves_a_run_that_resumes_exactly(
    runs: _Runs, tmp_path: Path, algorithm: str, keep: int
) -> None:
    from engine_core_roles.jobs.cli import main

    straight, record = tmp_path / "straight", tmp_path / "calls.json"
    assert runs.run(straight, _overrides(straight, algorithm, keep), record=str(record)) == 0
    calls = json.loads(record.read_text())
    # step 2's save: every call before step 3's first (its rotation of step 1 included)
    end = next(i for i, c in enumerate(calls) if "global_step_3" in c)
    save = list(range(1, end + 1))
    assert len(save) >= 6, calls
    assert any(c.startswith("os.rename") for c in calls), calls  # the commit is watched
    # a spread over the whole save: its first call, evenly spaced ones, its last
    points = sorted({save[0], save[-1], *(save[len(save) * k // 3] for k in range(1, 3))})
    want = _rows(straight)
    for point in points:
        out = tmp_path / f"killed-at-{point}"
        where = (point, calls[point - 1])
        assert runs.run(out, _overrides(out, algorithm, keep), kill_at=point) == -9, where
        # --resume (strict) and --resume auto continue alike from a checkpoint
        resume = ["--resume"] if keep == 1 else ["--resume", "auto"]
        code = _quiet(main, ["run", *_overrides(out, algorithm, keep), *resume])
        assert code == 0, where
        assert _rows(out) == want, where
        kept = sorted(p.name for p in (out / "checkpoints").iterdir())
        assert kept == [f"global_step_{s}" for s in range(4 - keep, 4)], (where, kept)


def test_a_run_killed_before_its_first_checkpoint_restarts_with_resume_auto(
    runs: _Runs, tmp_path: Path
) -> None:
    """Killed at the first file its first save writes (step 1's row is logged, no checkpoint
    exists): the same command with --resume auto starts fresh in the same folder and ends with
    the uninterrupted run's metrics; strict --resume refuses the folder, naming --resume auto."""
    from engine_core.errors import CheckpointError
    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.cli import load_recipe, main
    from engine_core_roles.jobs.rl.run import run_rl_job

    straight = tmp_path / "straight"
    assert runs.run(straight, _overrides(straight, "grpo", 2)) == 0
    out = tmp_path / "killed"
    assert runs.run(out, _overrides(out, "grpo", 2), kill_at=1, watch_from="global_step_1") == -9
    assert not any((out / "checkpoints").glob("global_step_?"))
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1  # step 1 was logged
    # a staging folder no later save of this run would reuse: removed when the run restarts
    (out / "checkpoints" / "global_step_7.tmp").mkdir(parents=True)
    raw = load_recipe(_overrides(out, "grpo", 2)[0], _overrides(out, "grpo", 2)[1:])
    with pytest.raises(CheckpointError, match="--resume auto to start fresh"):
        run_rl_job(raw, load_plugins(), resume=True)
    assert _quiet(main, ["run", *_overrides(out, "grpo", 2), "--resume", "auto"]) == 0
    assert _rows(out) == _rows(straight)
    assert not list((out / "checkpoints").glob("*.tmp"))
    # the recipe's setting does the same; with checkpoints it continues from the newest (here:
    # nothing more to train)
    assert _quiet(main, ["run", *_overrides(out, "grpo", 2), "resume=auto"]) == 0
    assert _rows(out) == _rows(straight)


def test_random_kills_anywhere_in_a_run_and_restarts_with_resume_auto_end_exactly(
    runs: _Runs, tmp_path: Path
) -> None:
    """SIGKILL at random moments of a whole run (any write under its folder: before the first
    checkpoint, inside a save, during the export), each time restarted by the same command
    with --resume auto, until a restart runs to the end: its metrics are the uninterrupted
    run's. The moments differ from one test run to the next; a failure names its seed."""
    import random

    straight, record = tmp_path / "straight", tmp_path / "calls.json"
    code = runs.run(straight, _overrides(straight, "grpo", 2), record=str(record), watch_from="")
    assert code == 0
    total = len(json.loads(record.read_text()))
    assert total > 20, total  # a run writes its rows, three checkpoints and the export
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    out, kills = tmp_path / "killed", []
    args = [*_overrides(out, "grpo", 2), "--resume", "auto"]
    while len(kills) < 4:
        # the first kill falls anywhere in the run; a restart's, anywhere in what a run writes
        at = rng.randint(1, total)
        code = runs.run(out, args, kill_at=at, watch_from="")
        if code == 0:
            break  # the restart finished before its kill
        assert code == -9, (seed, kills, at, code)
        kills.append(at)
    assert kills, seed  # the first run makes as many writes as the straight one
    assert runs.run(out, args) == 0, (seed, kills)
    assert _rows(out) == _rows(straight), (seed, kills)


def test_a_run_stops_on_its_wall_time_with_a_checkpoint_and_resumes_exactly(
    runs: _Runs, tmp_path: Path
) -> None:
    from engine_core.errors import RunStopped
    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.cli import load_recipe
    from engine_core_roles.jobs.rl.run import run_rl_job

    straight = tmp_path / "straight"
    assert runs.run(straight, _overrides(straight, "grpo", 2)) == 0
    out = tmp_path / "stopped"
    args = [*_overrides(out, "grpo", 2), "save_every=0", "max_wall_time=1e-3"]
    with open(os.devnull, "w") as sink:
        from rich.console import Console

        with pytest.raises(
            RunStopped, match=r"stopped on max_wall_time=0.001s .* after step 1 of 3"
        ):
            run_rl_job(load_recipe(args[0], args[1:]), load_plugins(), console=Console(file=sink))
    # the step in flight was finished and saved, though save_every=0 saves only at the end
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["global_step_1"]
    assert _quiet(_main, ["run", *args[:-1], "--resume", "auto"]) == 0
    assert _rows(out) == _rows(straight)


def _main(argv: list[str]) -> int:
    from engine_core_roles.jobs.cli import main

    return int(main(argv))
