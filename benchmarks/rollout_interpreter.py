"""What running the rollout replica in another interpreter costs, against the same-environment
replica, on the same experiment.

Both run ``engine-core run`` on one recipe (``--recipe``, default ``grpo_tiny.yaml``; the model
grown with ``--hidden``/``--layers`` so a sync moves enough bytes to time) with
``rollout_placement=process`` and one replica, for ``--steps`` steps, alternating over
``--rounds`` runs each, with the rollout backend ``--rollout`` (``hf`` by default, or ``vllm``):

- ``same_env``: the replica is a spawned process of this interpreter; weights go over a gloo
  weight-sync group, prompts and samples through torch's pickling pipes;
- ``interpreter``: the replica runs in ``--python`` (default: this interpreter, started by path;
  give another environment's to include a different torch) and everything crosses its pipes as
  engine-core frames (JSON headers, safetensors bytes); weights are relayed by the trainer,
  bucket by bucket, and verified by the replica.

Reports per path the median step time and median seconds per weight sync after ``--warmup``
steps, the bytes of weights per sync, the mean reward of the last 10 steps of its first run, and
the ratios interpreter / same_env. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from engine_core_roles.jobs.cli import RECIPES, load_recipe


def _run(recipe: Path, overrides: list[str]) -> list[dict[str, Any]]:
    from rich.console import Console

    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.rl.run import run_rl_job

    with tempfile.TemporaryDirectory() as tmp:
        raw = load_recipe(recipe, [f"output_dir={tmp}/run", *overrides])
        with open(os.devnull, "w") as sink:
            run_rl_job(raw, load_plugins(), console=Console(file=sink))
        lines = Path(tmp, "run", "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=RECIPES / "grpo_tiny.yaml")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rollout", default="hf", help="the rollout backend: hf or vllm")
    args = parser.parse_args()
    common = [
        f"rollout.backend={args.rollout}",
        f"steps={args.steps}",
        f"save_every={args.steps}",
        "rollout_placement=process",
        f"engine.model.config.hidden_size={args.hidden}",
        f"engine.model.config.intermediate_size={args.hidden * 2}",
        f"engine.model.config.num_hidden_layers={args.layers}",
    ]
    paths = {"same_env": [], "interpreter": [f"rollout_python={args.python}"]}
    runs: dict[str, list[list[dict[str, Any]]]] = {k: [] for k in paths}
    for r in range(args.rounds):
        order = list(paths) if r % 2 == 0 else list(reversed(paths))
        for name in order:
            runs[name].append(_run(args.recipe, common + paths[name]))

    def figures(name: str) -> dict[str, float]:
        rows = [row for run in runs[name] for row in run[args.warmup :]]
        return {
            "median_step_s": round(statistics.median(r["time_s"] for r in rows), 4),
            "median_sync_s": round(statistics.median(r["weight_sync/time_s"] for r in rows), 4),
            "sync_bytes": int(rows[-1]["weight_sync/bytes"]),
            "reward_last10": round(statistics.fmean(r["reward"] for r in runs[name][0][-10:]), 4),
        }

    out = {name: figures(name) for name in paths}
    print(
        json.dumps(
            {
                "benchmark": "rollout_interpreter",
                "recipe": args.recipe.name,
                "rollout": args.rollout,
                "python": args.python,
                "steps": args.steps,
                "rounds": args.rounds,
                "hidden": args.hidden,
                "layers": args.layers,
                **out,
                "step_ratio_interpreter_to_same_env": round(
                    out["interpreter"]["median_step_s"] / out["same_env"]["median_step_s"], 3
                ),
                "sync_ratio_interpreter_to_same_env": round(
                    out["interpreter"]["median_sync_s"] / out["same_env"]["median_sync_s"], 3
                ),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
