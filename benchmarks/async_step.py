"""Wall time per step of ``engine-core run``: synchronous against asynchronous training.

The default recipe's experiment (``grpo_tiny.yaml``: 16 prompts x 16 samples, the tiny Qwen2,
AdamW 1e-3) with the rollout in a process of its own (``rollout_placement=process``), run three
ways one after the other in this process:

- ``sync_2threads``: synchronous, each process may use 2 threads (they take turns, so each can
  have both cores while the other waits);
- ``sync_1thread``: synchronous, 1 thread per process;
- ``async``: ``trainer.max_staleness=1``, 1 thread per process (one core generates step t+1 while
  the other trains step t).

Reports, per mode, the median and mean wall time of a step after ``--warmup`` steps (the
``time_s`` of each metrics row: the whole step, waiting for the rollout included), the run's
wall time, and the mean reward of the first and last 10 steps (so a faster run that learns
less shows); then the speed-up of ``async`` over the faster synchronous mode. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_core_roles.jobs.cli import RECIPES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RECIPE = RECIPES / "grpo_tiny.yaml"
MODES = {
    "sync_2threads": (2, ["trainer.max_staleness=0"]),
    "sync_1thread": (1, ["trainer.max_staleness=0"]),
    "async": (1, ["trainer.max_staleness=1"]),
}


def _run(mode: str, steps: int, backend: str, out: Path) -> list[dict[str, Any]]:
    import torch
    from rich.console import Console

    from engine_core.configio import apply_overrides, load_yaml
    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.rl.run import run_rl_job

    threads, extra = MODES[mode]
    torch.set_num_threads(threads)  # the rollout's process takes the same number
    overrides = [
        f"output_dir={out}",
        f"steps={steps}",
        f"engine.backend={backend}",
        "rollout_placement=process",
        f"save_every={steps}",
        f"log_every={steps}",
        *extra,
    ]
    raw = apply_overrides(load_yaml(RECIPE), overrides)
    with open(os.devnull, "w") as sink:
        run_rl_job(raw, load_plugins(), console=Console(file=sink))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--backend", default="fsdp2", help="the actor's engine backend")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "benchmark": "async_step",
        "recipe": RECIPE.name,
        "engine": args.backend,
        "steps": args.steps,
        "cpu_count": os.cpu_count(),
        "modes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            t0 = time.perf_counter()
            rows = _run(mode, args.steps, args.backend, Path(tmp) / mode)
            wall = time.perf_counter() - t0
            times = [r["time_s"] for r in rows[args.warmup :]]
            rewards = [r["reward"] for r in rows]
            report["modes"][mode] = {
                "median_step_s": round(statistics.median(times), 4),
                "mean_step_s": round(statistics.fmean(times), 4),
                "run_wall_s": round(wall, 1),
                "reward_first10": round(statistics.fmean(rewards[:10]), 4),
                "reward_last10": round(statistics.fmean(rewards[-10:]), 4),
                "max_staleness_seen": max(r.get("rollout/staleness", 0.0) for r in rows),
            }
    modes = report["modes"]
    sync = [m for m in ("sync_2threads", "sync_1thread") if m in modes]
    if "async" in modes and sync:
        best = min(sync, key=lambda m: modes[m]["median_step_s"])
        report["async_speedup_vs_best_sync"] = round(
            modes[best]["median_step_s"] / modes["async"]["median_step_s"], 3
        )
        report["best_sync_mode"] = best
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
