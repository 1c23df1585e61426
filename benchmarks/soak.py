"""Soak: a few hundred GRPO steps with the actor at dp=2 in local worker processes, watching
every process for growth (memory, open file descriptors, threads, child processes, live
Python objects).

The experiment is the shipped tiny GRPO recipe (``roles/engine_core_roles/recipes/grpo_tiny.yaml``:
"reverse three digits", Qwen2 hidden 64, ``fsdp2``, ``hf`` rollout) run by
:class:`engine_core_roles.RLTrainer`, with one change of placement: the actor is an
:class:`engine_core_roles.distributed.placement.ActorGroup` of two ``torch.multiprocessing`` processes
(``LocalWorkerGroup``, gloo, dp=2) running :class:`SoakActorWorker` (the job's
:class:`engine_core_roles.distributed.workers.ActorWorker` plus what the soak reads from its process), and the rollout
runs in this process. The weights take the job's one path, :class:`engine_core_roles.WeightLink`: after
every update the group's writing rank streams them here bucket by bucket, and the rollout loads
and verifies each.

Every ``--sample-every`` steps (default: steps // 30; and once before the first), for this
process and each worker (:mod:`_process_stats`): RSS, open file descriptors, threads and child
processes as the process runs; then malloc's bytes in use and the RSS again after a
``malloc_trim`` (the free memory glibc keeps after a step's transient tensors makes the plain
RSS of a worker swing by +-20 MiB between samples, far more than the growth worth finding); and
the live gc-tracked Python objects after a collection. A census of those objects by type, after
the warm-up and at the end, names the types that grew; ``--trace`` adds the allocation sites
of this process still holding the most memory allocated after the warm-up (tracemalloc). The
first ``--warmup`` of the steps (default 10%) are left out: allocator pools, thread pools and
caches fill then. This process runs one torch thread (``--threads``), like each worker: two
spinning OpenMP threads on cores other jobs share make every small matmul wait for a time
slice, and the soak is about growth, not speed.

Verdicts, per process and metric ("flat" or "growing"; a trend needs at least 5 samples over
100 steps after the warm-up, else "too short to tell"):

- RSS (after the trim) and malloc in use: flat when the least-squares slope is below 2 MiB per
  100 steps (at most ~20 KiB kept per step), or when the slope over the second half of the
  samples is: growth that stops (a late warm-up, a cache filling up) is bounded. Anything a
  step could plausibly retain is larger: its training batch (256 samples x 9 tokens, six
  fields) is ~100 KiB in this process and half of that on each worker, one copy of the weights
  is 0.3 MiB, so a batch or a weight copy kept per step grows by 5 to 30 MiB per 100 steps.
  The plain RSS is reported beside it.
- Python objects: flat when their floor (minimum of the last third of the samples against the
  first third) rises by less than 100 objects per 100 steps; a step that kept its batch (a
  TensorDict and its tensors) would add tens per step. The floor, not the slope: torch keeps
  up to ~128 weak references to storages received from other processes and purges the dead
  ones when full, a sawtooth whose slope depends on where the run stops.
- Open fds, threads, child processes: flat when the last sample is not above the first.

Prints one JSON object (stdout); the progress bar goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tracemalloc
from collections import Counter, defaultdict
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _process_stats import (  # benchmarks/ is on sys.path when run as a script
    MIN_SAMPLES,
    MIN_SPAN,
    OBJECTS_FLOOR,
    RSS_SLOPE_MIB,
    growth,
    live_objects,
    read_process,
    summarize,
    traced_growth,
    trim_heap,
    type_counts,
)
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_core import (  # noqa: E402  (the repository root is on sys.path)
    apply_overrides,
    load_plugins,
    load_yaml,
    resolve_rollout_config,
)
from engine_core.executors import LocalWorkerGroup  # noqa: E402
from engine_core_roles import RLTrainer, WeightLink  # noqa: E402
from engine_core_roles.data.tasks.digits import PAD, DigitTask
from engine_core_roles.distributed.placement import ActorGroup
from engine_core_roles.distributed.workers import ActorWorker
from engine_core_roles.jobs.rl.config import RLJobConfig

HOST = "127.0.0.1"
PHASES = ("generate", "compute_log_prob", "update_actor", "weight_sync")


class SoakActorWorker(ActorWorker):
    """The recipe's actor worker, plus what the soak reads from its process and the sending
    end of the weight stream."""

    def pid(self) -> int:
        return os.getpid()

    def live_objects(self) -> int:
        return live_objects()

    def trim_heap(self) -> float:
        return trim_heap()

    def type_counts(self) -> Counter[str]:
        return type_counts()


def _timed(
    fn: Callable[..., Any], seconds: defaultdict[str, float], key: str
) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[key] += time.perf_counter() - start

    return call


def _phases(seconds: defaultdict[str, float], steps: int) -> dict[str, float]:
    """Mean seconds per step in each phase, the rest of the step (reward, advantages, batches)
    and the sampling between steps."""
    out = {k: seconds[k] / steps for k in PHASES}
    out["rest"] = (seconds["step"] - sum(seconds[k] for k in PHASES)) / steps
    out["sampling"] = seconds["sampling"] / steps
    return {k: round(v, 4) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--sample-every", type=int, default=None, help="default: steps // 30 (at least 1)"
    )
    parser.add_argument(
        "--warmup", type=float, default=0.1, help="fraction of the steps left out of the verdicts"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads in this process (workers: 1)"
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="trace this process's allocations after the warm-up (tracemalloc; slower, and its "
        "own memory shows in this process's figures) and list the sites still holding the most",
    )
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides of the recipe, e.g. engine.seed=1"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    raw = load_yaml(str(files("engine_core_roles") / "recipes" / "grpo_tiny.yaml"))
    job = RLJobConfig.model_validate(apply_overrides(raw, [*args.overrides, f"steps={args.steps}"]))
    task = DigitTask(job.task)
    rspec, rollout_cfg = resolve_rollout_config(
        {"model": job.engine["model"], **job.rollout}, load_plugins()
    )
    rollout = rspec.load_class()(rollout_cfg)
    seconds: defaultdict[str, float] = defaultdict(float)  # per phase, summed over the run
    rollout.generate = _timed(rollout.generate, seconds, "generate")

    every = args.sample_every or max(1, job.steps // 30)
    warmup = max(1, round(args.warmup * job.steps))
    samples: dict[str, dict[str, list[float]]] = {}
    sampled_at: list[int] = []
    censuses: list[dict[str, Counter[str]]] = []  # after the warm-up, and at the end
    rewards: list[float] = []
    start = time.perf_counter()
    with LocalWorkerGroup(
        SoakActorWorker,
        2,
        init_args=(job.engine, job.actor_config().model_dump(), job.trainer.algorithm.model_dump()),
    ) as group:
        actor = ActorGroup(group, job.actor_config(), job.trainer.algorithm)
        actor.compute_log_prob = _timed(actor.compute_log_prob, seconds, "compute_log_prob")  # type: ignore[method-assign]
        actor.update_actor = _timed(actor.update_actor, seconds, "update_actor")  # type: ignore[method-assign]
        link = WeightLink(actor, rollout)
        link.sync = _timed(link.sync, seconds, "weight_sync")  # type: ignore[method-assign]
        names = ["driver", *(f"actor_rank{i}" for i in range(group.num_workers))]
        pids = dict(zip(names, [os.getpid(), *group.call_all("pid")], strict=True))
        trainer = RLTrainer(
            job.trainer_config(task),
            actor=actor,
            rollout=rollout,
            reward_fn=lambda prompt, response, mask: task.score(
                prompt, response.masked_fill(mask == 0, PAD)
            ),
            prompts=lambda step: task.prompt_ids(task.sample_digits(job.prompts_per_step)),
            weights=link,
        )
        weight_bytes: list[float] = []

        def everywhere(method: str, local: Callable[[], Any]) -> dict[str, Any]:
            """``local()`` here and ``method`` on every worker, by process name."""
            return dict(zip(names, [local(), *group.call_all(method)], strict=True))

        def sample(step: int) -> None:
            if step >= warmup and not censuses:
                censuses.append(everywhere("type_counts", type_counts))
                if args.trace:
                    tracemalloc.start(8)
            t0 = time.perf_counter()
            sampled_at.append(step)
            reads = {name: read_process(pid) for name, pid in pids.items()}  # as they run
            in_use = everywhere("trim_heap", trim_heap)
            objects = everywhere("live_objects", live_objects)
            for name, pid in pids.items():
                reads[name]["rss_trimmed_mib"] = read_process(pid)["rss_mib"]
                reads[name]["malloc_in_use_mib"] = in_use[name]
                reads[name]["live_objects"] = objects[name]
                for key, value in reads[name].items():
                    samples.setdefault(name, {}).setdefault(key, []).append(value)
            seconds["sampling"] += time.perf_counter() - t0

        progress = Progress(
            TextColumn("[bold blue]soak"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]:.3f}  driver {task.fields[rss]:.0f} MiB"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )

        def on_step(trainer: RLTrainer, row: dict[str, Any]) -> None:
            rewards.append(row["reward"])
            weight_bytes.append(row["weight_sync/bytes"])
            seconds["step"] += row["time_s"]
            if row["step"] % every == 0 or row["step"] == job.steps:
                sample(row["step"])
            rss = samples["driver"]["rss_mib"][-1]
            progress.update(bar, advance=1, reward=row["reward"], rss=rss)

        sample(0)
        with progress:
            bar = progress.add_task("soak", total=job.steps, reward=0.0, rss=0.0)
            trainer.fit(job.steps, callbacks=[on_step])
        traced = traced_growth() if args.trace else None
        censuses.append(everywhere("type_counts", type_counts))
        link.close()
    wall = time.perf_counter() - start

    kept = [i for i, s in enumerate(sampled_at) if s >= warmup]
    processes = {
        name: {
            "pid": pids[name],
            **summarize(
                [sampled_at[i] for i in kept], {k: [v[i] for i in kept] for k, v in series.items()}
            ),
            "object_growth": growth(censuses[0][name], censuses[-1][name]),
        }
        for name, series in samples.items()
    }
    verdicts = [
        (f"{name} {metric}", v)
        for name, p in processes.items()
        for metric, v in p["verdict"].items()
    ]
    growing = [what for what, v in verdicts if v == "growing"]
    if growing:
        verdict = "growing: " + ", ".join(growing)
    elif all(v == "flat" for _, v in verdicts):
        verdict = "flat"
    else:
        verdict = "no count grew; trends too short to tell (see MIN_SAMPLES, MIN_SPAN)"
    head = min(10, len(rewards))
    result = {
        "benchmark": "soak",
        "recipe": "roles/engine_core_roles/recipes/grpo_tiny.yaml",
        "overrides": args.overrides,
        "placement": "actor: SoakActorWorker x2 (LocalWorkerGroup, gloo, dp=2, "
        f"{job.engine['backend']}); rollout: {job.rollout['backend']} in the driver; "
        "weights: WeightLink, the actor group's writing rank -> driver after every update",
        "steps": job.steps,
        "wall_s": round(wall, 1),
        "s_per_step": round(wall / job.steps, 3),
        "seconds_per_step": _phases(seconds, job.steps),
        "weights_bytes_per_sync": weight_bytes[-1],
        "reward_first10": round(float(np.mean(rewards[:head])), 3),
        "reward_last10": round(float(np.mean(rewards[-head:])), 3),
        "sample_every": every,
        "warmup_steps": warmup,
        "thresholds": {
            "rss_and_malloc_in_use_slope_mib_per_100_steps": RSS_SLOPE_MIB,
            "live_objects_floor_growth_per_100_steps": OBJECTS_FLOOR,
            "fds_threads_children": "last <= first",
            "trends_need": f">= {MIN_SAMPLES} samples over >= {MIN_SPAN} steps after warm-up",
        },
        "processes": processes,
        "verdict": verdict,
        "host": f"CPU, {os.cpu_count()} cores, torch {torch.__version__}",
        "driver_threads": args.threads,
    }
    if traced is not None:
        result["driver_traced_growth"] = traced
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
