"""Where a stalled run of the digit task is wrong: train one seed of a recipe (``--recipe``,
default ``grpo_tiny.yaml``; overrides after the seed), then read the final policy (the job's
Hugging Face export) on every prompt of the task (all 1,000 three-digit inputs), teacher-forced
on the right answer.

Reported per answer position (0: the last input digit reversed first, ..., the end token last):
how many prompts greedy gets wrong there, the mean entropy there, and for the wrong ones the
input digit the position copies and the token greedy picks instead; the median probability the
policy gives the right token where greedy is wrong; the run's last 10 steps' mean reward. A
stall shows as positions wrong on many prompts with near-zero entropy and a right-token
probability far below one in the samples a step draws: no sample of those prompts differs, so
their groups give GRPO nothing. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def _train(recipe: Path, seed: int, out: Path, overrides: list[str]) -> list[dict[str, Any]]:
    from rich.console import Console

    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.cli import load_recipe
    from engine_core_roles.jobs.rl.run import run_rl_job

    raw = load_recipe(recipe, [f"seed={seed}", f"output_dir={out}", *overrides])
    raw["save_every"] = raw["steps"]
    with open(os.devnull, "w") as sink:
        run_rl_job(raw, load_plugins(), console=Console(file=sink))
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def where_wrong(model: Any, num_digits: int = 3) -> dict[str, Any]:
    """The per-position figures of the docstring for ``model`` on every input."""
    from engine_core_roles.data.tasks.digits import DigitTask, TaskConfig

    task = DigitTask(TaskConfig(name="reverse", num_digits=num_digits))
    digits = torch.tensor(list(itertools.product(range(10), repeat=num_digits)))
    prompt, target = task.prompt_ids(digits), task.target_ids(digits)
    ids = torch.cat([prompt, target], 1)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)[:, prompt.shape[1] - 1 : -1]
    pred = logp.argmax(-1)
    wrong = pred != target
    entropy = -(logp.exp() * logp).sum(-1)
    right = logp.gather(-1, target[..., None])[..., 0].exp()
    positions = []
    for k in range(target.shape[1]):
        bad = wrong[:, k]
        row: dict[str, Any] = {
            "wrong_prompts": int(bad.sum()),
            "mean_entropy": round(float(entropy[:, k].mean()), 4),
        }
        if k < num_digits and bad.any():
            source = digits[:, num_digits - 1 - k]
            row["wrong_by_input_digit"] = torch.bincount(source[bad], minlength=10).tolist()
            row["greedy_token_where_wrong"] = torch.bincount(pred[bad, k]).tolist()
        positions.append(row)
    return {
        "prompts_wrong": int(wrong.any(-1).sum()),
        "positions": positions,
        "right_token_prob_where_wrong_median": (
            float(right[wrong].median()) if bool(wrong.any()) else None
        ),
    }


def main() -> None:
    from transformers import AutoModelForCausalLM

    from engine_core_roles.jobs.cli import RECIPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=RECIPES / "grpo_tiny.yaml")
    parser.add_argument("seed", type=int)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "run")
        rows = _train(args.recipe, args.seed, out, args.overrides)
        model = AutoModelForCausalLM.from_pretrained(str(out / "hf_export")).eval()
        report = where_wrong(model)
    last = rows[-10:]
    print(
        json.dumps(
            {
                "seed": args.seed,
                "overrides": args.overrides,
                "final_reward": round(sum(r["reward"] for r in last) / len(last), 4),
                **report,
            }
        )
    )


if __name__ == "__main__":
    main()
