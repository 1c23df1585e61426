"""Step time of ``engine-core run`` against a hand-written minimal GRPO loop, same experiment.

Both train one recipe's experiment (``--recipe``, default the shipped default recipe
``text_tiny.yaml``: the tiny Qwen2 built from its config reading chat prompts of three digits
through the shipped tokenizer, 16 prompts x 16 samples, 4 new tokens, temperature 1, AdamW 1e-3
with gradient clipping 1.0, no KL; ``grpo_tiny.yaml`` is the same task on token ids) with the
same overrides, for ``--steps`` steps in this process, one after the other:

- ``minimal``: ``benchmarks/_minimal.py``: one transformers model generates (``generate``,
  sampling) and trains; rewards, group-normalized advantages, one forward/backward of the
  token-level policy gradient (on-policy: the PPO ratio is 1), one AdamW step. No engine, no
  checks, no weight copy.
- ``engine_core``: ``engine-core run`` with the recipe (fsdp2 engine, colocated HF rollout):
  old log-probs by the engine, the PPO-clip update with its metrics, the verified weight sync
  (names, shapes, checksums) into the rollout and the rollout/trainer log-prob comparison of
  every step, JSONL and TensorBoard logging.

The two alternate over ``--rounds`` runs each (A B B A ...), so a machine that speeds up or
slows down during the benchmark weighs on both alike. Reports the median wall time per step
after ``--warmup`` steps of every run for each, their ratio, each run's median, the ratio of
each round's two runs (which ran next to each other) and the median of those ratios, the mean reward
of the last 10 steps of each loop's first run, where the minimal loop's step goes (median
seconds of generation, scoring and the update) and where ``engine_core``'s goes (generation,
old log-probs, update, weight sync and the rest) by timing the roles' calls; on a text recipe
also the text path's own work (drawing the prompts' token ids, inside generation; decoding and
the reward function) and its share of the step.
Then one more run of each, interleaved step by step in this process (after each of the job's
steps, outside its time, one step of the minimal loop): their medians, the ratio of those and
the median ratio of each step to the minimal step right after it. A machine whose speed drifts
within seconds weighs on both alike there.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine_core_roles.jobs.cli import DEFAULT_RL_RECIPE, RECIPES, load_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _minimal import MinimalGRPO, minimal_grpo  # noqa: E402  (benchmarks/ is on sys.path as a script)

DEFAULT_RECIPE = RECIPES / DEFAULT_RL_RECIPE


def _timed(times: dict[str, list[float]], owner: Any, name: str, label: str) -> Callable[[], None]:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times[label].append(time.perf_counter() - t0)

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, original)


def timed_calls() -> list[tuple[Any, str, str]]:
    """(class, method, label) of each call ``engine_core``'s breakdown times."""
    from engine_core_roles.data.datasets.prompts import PromptData
    from engine_core_roles.data.rewards.text import TextReward
    from engine_core_roles.models.actor import Actor
    from engine_core_roles.trainer.generation import Synchronous
    from engine_core_roles.trainer.loop import RLTrainer

    return [
        (Synchronous, "draw", "generation"),  # the step's prompts and their samples
        (Actor, "compute_log_prob", "old_log_probs"),
        (Actor, "update_actor", "update"),
        (RLTrainer, "sync_weights", "weight_sync"),
        # the text path's own work: drawing and padding token ids, decoding and the reward fn
        (PromptData, "next_batch", "text_prompts"),
        (TextReward, "__call__", "text_decode_and_reward"),
    ]


def _engine_core(
    steps: int, recipe: Path, extra: list[str], after_step: Callable[[], None] | None = None
) -> tuple[list[tuple[float, float]], dict[str, list[float]]]:
    """(seconds, mean reward) of each step of one ``engine-core run`` and the timed calls'
    seconds. ``after_step`` runs after each step's own time was taken (outside ``time_s``)."""
    from rich.console import Console

    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.rl.run import run_rl_job
    from engine_core_roles.trainer.loop import RLTrainer

    times: dict[str, list[float]] = collections.defaultdict(list)
    restore = [_timed(times, owner, name, label) for owner, name, label in timed_calls()]
    if after_step is not None:
        step = RLTrainer.step

        def stepped(self: RLTrainer) -> dict[str, Any]:
            row = step(self)
            after_step()
            return row

        RLTrainer.step = stepped  # type: ignore[method-assign]
        restore.append(lambda: setattr(RLTrainer, "step", step))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            overrides = [f"output_dir={tmp}/run", f"steps={steps}", f"save_every={steps}", *extra]
            raw = load_recipe(recipe, overrides)
            with open(os.devnull, "w") as sink:
                run_rl_job(raw, load_plugins(), console=Console(file=sink))
            rows = [
                json.loads(x) for x in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()
            ]
    finally:
        for undo in restore:
            undo()
    return [(r["time_s"], r["reward"]) for r in rows], times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="alternating runs of each loop (A B B A ...): machine drift hits both alike",
    )
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    parser.add_argument(
        "overrides",
        nargs="*",
        help="recipe overrides, applied to both loops (e.g. engine.seed=3 trainer.seed=3); the "
        "minimal loop reads the model, optimizer, sampling, task or data and reward settings",
    )
    args = parser.parse_args()
    minimal_runs: list[list[tuple[float, float]]] = []
    ours_runs: list[list[tuple[float, float]]] = []
    parts: dict[str, list[float]] = collections.defaultdict(list)
    minimal_parts: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(args.rounds):
        for which in ("minimal", "ours") if r % 2 == 0 else ("ours", "minimal"):
            if which == "minimal":
                run_parts: dict[str, list[float]] = collections.defaultdict(list)
                minimal_runs.append(
                    minimal_grpo(load_recipe(args.recipe, args.overrides), args.steps, run_parts)
                )
                for k, v in run_parts.items():
                    minimal_parts[k] += v[args.warmup :]
            else:
                rows, times = _engine_core(args.steps, args.recipe, args.overrides)
                ours_runs.append(rows)
                # the first sync happens before step 1 (outside its time_s): dropped with warm-up
                for k, v in times.items():
                    parts[k] += v[args.warmup :]

    def median(runs: list[list[tuple[float, float]]]) -> float:
        return statistics.median(t for rows in runs for t, _ in rows[args.warmup :])

    def last10(runs: list[list[tuple[float, float]]]) -> float:
        return round(statistics.fmean(r for _, r in runs[0][-10:]), 4)

    # step by step: after each of the job's steps one of the minimal loop's, in one process, so
    # the two alternate every ~0.1 s and share the machine's state of that moment
    loop = MinimalGRPO(load_recipe(args.recipe, args.overrides))
    minimal_steps: list[tuple[float, float]] = []
    ours_steps, _ = _engine_core(
        args.steps, args.recipe, args.overrides, lambda: minimal_steps.append(loop.step())
    )
    pairs = [o / m for (o, _), (m, _) in zip(ours_steps, minimal_steps, strict=True)]
    interleaved = {
        "minimal_median_step_s": round(median([minimal_steps]), 4),
        "engine_core_median_step_s": round(median([ours_steps]), 4),
        "ratio_of_medians": round(median([ours_steps]) / median([minimal_steps]), 3),
        "median_ratio_of_step_pairs": round(statistics.median(pairs[args.warmup :]), 3),
    }

    minimal, ours = minimal_runs, ours_runs
    step = median(ours)
    # each round's two runs ran next to each other: their ratio is free of the drift between
    # rounds, and the median of those ratios of one round's outlier
    paired = [median([o]) / median([m]) for o, m in zip(ours, minimal, strict=True)]
    breakdown = {k: statistics.median(v) for k, v in parts.items()}
    nested = {"text_prompts"}  # timed inside generation
    breakdown["rest"] = step - sum(v for k, v in breakdown.items() if k not in nested)
    text = breakdown.get("text_prompts", 0.0) + breakdown.get("text_decode_and_reward", 0.0)
    print(
        json.dumps(
            {
                "benchmark": "grpo_step",
                "recipe": args.recipe.name,
                "steps": args.steps,
                "rounds": args.rounds,
                "per_round_median_step_s": {
                    "minimal": [round(median([rows]), 4) for rows in minimal],
                    "engine_core": [round(median([rows]), 4) for rows in ours],
                },
                "overrides": args.overrides,
                "torch_threads": torch.get_num_threads(),
                "minimal_median_step_s": round(median(minimal), 4),
                "engine_core_median_step_s": round(step, 4),
                "ratio_engine_core_to_minimal": round(step / median(minimal), 3),
                "per_round_ratio": [round(x, 3) for x in paired],
                "median_per_round_ratio": round(statistics.median(paired), 3),
                "interleaved_steps": interleaved,
                "minimal_reward_last10": last10(minimal),
                "engine_core_reward_last10": last10(ours),
                "minimal_step_breakdown_s": {
                    k: round(statistics.median(v), 4) for k, v in minimal_parts.items()
                },
                "engine_core_step_breakdown_s": {k: round(v, 4) for k, v in breakdown.items()},
                "text_path_share_of_step": round(text / step, 4),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
