"""Does the default recipe learn on every seed? ``engine-core run`` against the hand-written
minimal loop (``benchmarks/_minimal.py``) on the same seeds.

For each seed ``s`` both loops run the recipe (``--recipe``, default the shipped default) with
``seed=s``, the run's seed and so each section's (``engine.seed``: initial weights,
``trainer.seed``: the job's sampling, the minimal loop sampling from ``engine.seed``'s stream;
``data.seed`` or ``task.seed``: the prompts), plus any overrides given, for the recipe's steps
(or ``--steps``). Reports per seed and loop the mean reward of the last 10 steps, the first
step whose 10-step mean reaches ``--target`` (null: never), the spread between the best and the
worst seed, and each loop's wall time.

``--vs trl`` adds TRL's ``GRPOTrainer`` on the identical experiment (``benchmarks/_trl.py`` says
what is the same and what differs; TRL is the optional ``bench`` extra, pinned in
``engine_core/constraints.txt``: ``pip install -c engine_core/constraints.txt trl``; without it
the TRL loop is skipped with one line). Each loop's figures then also give the first step whose
10-step mean reaches 0.5, 0.8 and 0.9, the median step time, and per loop the median of each
over the seeds.

``--algorithm grpo,dr_grpo,rloo,gspo,cispo`` compares algorithms instead (presets of
``trainer.algorithm``, or any registered advantage estimator and policy loss as
``ADVANTAGE+LOSS``): the job alone runs each on every seed, with nothing else changed.
Prints one JSON object.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _minimal import minimal_grpo  # noqa: E402  (benchmarks/ is on sys.path as a script)

from engine_core_roles.jobs.cli import DEFAULT_RL_RECIPE, RECIPES, load_recipe

THRESHOLDS = (0.5, 0.8, 0.9)


def _job(raw: dict[str, Any]) -> tuple[list[float], float | None, list[float]]:
    from rich.console import Console

    from engine_core.configio import apply_overrides
    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.rl.run import run_rl_job

    with tempfile.TemporaryDirectory() as tmp:
        raw = apply_overrides(raw, [f"output_dir={tmp}/run", f"save_every={raw['steps']}"])
        with open(os.devnull, "w") as sink:
            run_rl_job(raw, load_plugins(), console=Console(file=sink))
        rows = [json.loads(x) for x in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
    val = [r["val/reward"] for r in rows if "val/reward" in r]
    return [r["reward"] for r in rows], (val[-1] if val else None), [r["time_s"] for r in rows]


def _first_step_at(rewards: list[float], target: float) -> int | None:
    """The first step whose mean over the last 10 steps reaches ``target`` (None: never)."""
    window = [statistics.fmean(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
    return next((i + 1 for i, v in enumerate(window) if i >= 9 and v >= target), None)


def _figures(
    rewards: list[float], target: float, seconds: float, step_s: list[float] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "final_reward": round(statistics.fmean(rewards[-10:]), 4),
        "first_step_at_target": _first_step_at(rewards, target),
        "first_step_at": {str(t): _first_step_at(rewards, t) for t in THRESHOLDS},
        "seconds": round(seconds, 1),
    }
    if step_s:
        out["median_step_s"] = round(statistics.median(step_s), 4)
        # a step of dynamic sampling draws again when its groups all scored alike, so late steps
        # of a learned policy cost several generations: the mean and the time to the target
        # say what the median does not
        out["mean_step_s"] = round(statistics.fmean(step_s), 4)
        reached = out["first_step_at_target"]
        out["step_seconds_to_target"] = (
            round(sum(step_s[:reached]), 1) if reached is not None else None
        )
    return out


def _median(values: list[Any]) -> Any:
    """The median of the seeds' figures, a seed that never reached counting as the worst (None
    once half or more never reached)."""
    if not values:
        return None
    never = [v for v in values if v is None]
    if len(never) * 2 >= len(values):
        return None
    return statistics.median(
        sorted(v for v in values if v is not None) + [float("inf")] * len(never)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=RECIPES / DEFAULT_RL_RECIPE)
    parser.add_argument(
        "--seeds",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[0, 1, 2, 3, 4],
        help="comma-separated, e.g. 0,1,2",
    )
    parser.add_argument("--steps", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument(
        "--loops",
        type=lambda v: v.split(","),
        default=["engine_core", "minimal"],
        help="comma-separated: engine_core,minimal,trl (trl: as --vs trl)",
    )
    parser.add_argument(
        "--vs",
        choices=["trl"],
        default=None,
        help="also run the identical experiment in this peer (trl: TRL's GRPOTrainer)",
    )
    parser.add_argument(
        "--algorithm",
        type=lambda v: v.split(","),
        default=None,
        help="comma-separated presets (grpo,dr_grpo,rloo,gspo,cispo) or ADVANTAGE+LOSS: the "
        "job alone, once per algorithm and seed",
    )
    parser.add_argument("overrides", nargs="*", help="recipe overrides, applied to both loops")
    args = parser.parse_args()
    extra = [*args.overrides, *([f"steps={args.steps}"] if args.steps else [])]
    if args.algorithm:
        _compare_algorithms(args, extra)
        return
    loops = [loop for loop in args.loops if loop != "trl"]
    peer: dict[str, Any] = {}
    if args.vs == "trl" or "trl" in args.loops:
        from _trl import have_trl

        version = have_trl()
        if version is None:
            print(
                "learning: TRL is not installed, so the TRL loop is skipped (pip install -c "
                "engine_core/constraints.txt trl)",
                file=sys.stderr,
            )
        else:
            loops.append("trl")
            peer = {"trl_version": version}
    results: dict[str, dict[int, dict[str, Any]]] = {loop: {} for loop in loops}
    for seed in args.seeds:
        # the run's seed: each section's own (engine, rollout, trainer, data or task) follows it
        raw = load_recipe(args.recipe, [*extra, f"seed={seed}"])
        for loop in loops:
            t0 = time.perf_counter()
            val, step_s = None, None
            if loop == "engine_core":
                rewards, val, step_s = _job(raw)
            elif loop == "trl":
                rewards, step_s = _trl_loop(raw)
            else:
                timed = minimal_grpo(raw, int(raw["steps"]))
                rewards, step_s = [r for _, r in timed], [s for s, _ in timed]
            results[loop][seed] = _figures(rewards, args.target, time.perf_counter() - t0, step_s)
            if val is not None:  # the job's last evaluation (the other loops have none)
                results[loop][seed]["final_val_reward"] = round(val, 4)
            print(f"learning: {loop} seed {seed}: {results[loop][seed]}", file=sys.stderr)
    summary = {}
    for loop, per_seed in results.items():
        finals = [f["final_reward"] for f in per_seed.values()]
        summary[loop] = {
            "per_seed": per_seed,
            "mean_final_reward": round(statistics.fmean(finals), 4),
            "worst_below_best": round(max(finals) - min(finals), 4),
            "median_first_step_at": {
                str(t): _median([f["first_step_at"][str(t)] for f in per_seed.values()])
                for t in THRESHOLDS
            },
            "seeds_at": {
                str(t): sum(f["first_step_at"][str(t)] is not None for f in per_seed.values())
                for t in THRESHOLDS
            },
            "median_step_s": _median([f.get("median_step_s") for f in per_seed.values()]),
            "median_mean_step_s": _median([f.get("mean_step_s") for f in per_seed.values()]),
            "median_step_seconds_to_target": _median(
                [f.get("step_seconds_to_target") for f in per_seed.values()]
            ),
        }
    print(
        json.dumps(
            {
                "benchmark": "learning",
                "recipe": args.recipe.name,
                "overrides": args.overrides,
                "steps": int(load_recipe(args.recipe, extra)["steps"]),
                "target": args.target,
                **peer,
                **summary,
            },
            indent=1,
        )
    )


def _trl_loop(raw: dict[str, Any]) -> tuple[list[float], list[float]]:
    import warnings

    from _trl import trl_grpo

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's notices about the installed vLLM's version
        return trl_grpo(raw, int(raw["steps"]), tmp)


def _algorithm_overrides(name: str) -> list[str]:
    if "+" in name:
        advantage, loss = name.split("+", 1)
        return [
            f"trainer.algorithm.advantage={advantage}",
            f"trainer.algorithm.policy_loss={loss}",
        ]
    return [f"trainer.algorithm={name}"]


def _compare_algorithms(args: argparse.Namespace, extra: list[str]) -> None:
    table: dict[str, Any] = {}
    for name in args.algorithm:
        per_seed = {}
        for seed in args.seeds:
            raw = load_recipe(args.recipe, [*extra, *_algorithm_overrides(name), f"seed={seed}"])
            t0 = time.perf_counter()
            rewards, val, _ = _job(raw)
            per_seed[seed] = _figures(rewards, args.target, time.perf_counter() - t0)
            if val is not None:
                per_seed[seed]["final_val_reward"] = round(val, 4)
        finals = [f["final_reward"] for f in per_seed.values()]
        reached = [f["first_step_at_target"] for f in per_seed.values()]
        table[name] = {
            "per_seed": per_seed,
            "mean_final_reward": round(statistics.fmean(finals), 4),
            "worst_below_best": round(max(finals) - min(finals), 4),
            "seeds_at_target": sum(r is not None for r in reached),
            "median_first_step_at_target": (
                statistics.median([r for r in reached if r is not None])
                if any(r is not None for r in reached)
                else None
            ),
        }
    steps = int(load_recipe(args.recipe, extra)["steps"])
    report = {"benchmark": "learning", "recipe": args.recipe.name, "overrides": args.overrides}
    print(
        json.dumps({**report, "steps": steps, "target": args.target, "algorithms": table}, indent=1)
    )


if __name__ == "__main__":
    main()
