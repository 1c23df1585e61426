"""Step time of ``engine-core run`` against a hand-written minimal GRPO loop, same experiment.

Both train the default recipe's experiment (``grpo_tiny.yaml``: the tiny Qwen2 built from its
config, "reverse three digits", 16 prompts x 16 samples, 4 new tokens, temperature 1, AdamW
1e-3 with gradient clipping 1.0, no KL) for ``--steps`` steps in this process, one after the
other:

- ``minimal``: one transformers model generates (``generate``, sampling) and trains; rewards,
  group-normalized advantages, one forward/backward of the token-level policy gradient
  (on-policy: the PPO ratio is 1), one AdamW step. No engine, no checks, no weight copy.
- ``engine_core``: ``engine-core run`` with the recipe unchanged (fsdp2 engine, colocated HF
  rollout): old log-probs by the engine, the PPO-clip update with its metrics, the verified
  weight sync (names, shapes, checksums) into the rollout and the rollout/trainer log-prob
  comparison of every step, JSONL and TensorBoard logging.

The two alternate over ``--rounds`` runs each (A B B A ...), so a machine that speeds up or
slows down during the benchmark weighs on both alike. Reports the median wall time per step
after ``--warmup`` steps of every run for each, their ratio, each run's median, the mean reward
of the last 10 steps of each loop's first run, and where ``engine_core``'s step goes (median seconds
of generation, old log-probs, update, weight sync and the rest) by timing the roles' calls.
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

from engine_core_roles.cli import RECIPES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RECIPE = RECIPES / "grpo_tiny.yaml"


def _minimal(steps: int) -> list[tuple[float, float]]:
    """(seconds, mean reward) of each step of the hand-written loop."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from engine_core.configio import load_yaml
    from engine_core_roles.tasks import EOS, PAD, DigitTask, TaskConfig

    recipe = load_yaml(RECIPE)
    torch.manual_seed(recipe["engine"]["seed"])
    config = {k: v for k, v in recipe["engine"]["model"]["config"].items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(Qwen2Config(**config))
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["engine"]["optim"]["lr"])
    task = DigitTask(TaskConfig(**recipe["task"]))
    n, prompts_per_step = recipe["trainer"]["samples_per_prompt"], recipe["prompts_per_step"]
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        prompt = task.prompt_ids(task.sample_digits(prompts_per_step))  # equal lengths
        model.eval()
        with torch.no_grad():
            seqs = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=task.response_len,
                num_return_sequences=n,
                eos_token_id=EOS,
                pad_token_id=PAD,
            )
        p = prompt.shape[1]
        response = seqs[:, p:]
        # tokens after the first EOS are padding
        done = torch.cumsum((response == EOS).long(), 1) - (response == EOS).long()
        mask = (done == 0).float()
        scores = task.score(seqs[:, :p], response.masked_fill(mask == 0, PAD))
        grouped = scores.view(-1, n)
        adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
        model.train()
        attn = torch.cat([torch.ones_like(seqs[:, :p]), mask.long()], 1)
        logits = model(seqs, attention_mask=attn).logits[:, p - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())  # on-policy: 1, with the policy's gradient
        loss = -(ratio * adv.view(-1, 1) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        out.append((time.perf_counter() - t0, float(scores.mean())))
    return out


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


def _engine_core(
    steps: int, extra: list[str]
) -> tuple[list[tuple[float, float]], dict[str, list[float]]]:
    from rich.console import Console

    from engine_core.configio import apply_overrides, load_yaml
    from engine_core.plugins import load_plugins
    from engine_core_roles.actor import Actor
    from engine_core_roles.rl_job import run_rl_job
    from engine_core_roles.trainer import RLTrainer

    times: dict[str, list[float]] = collections.defaultdict(list)
    restore = [
        _timed(times, RLTrainer, "_generate", "generation"),
        _timed(times, Actor, "compute_log_prob", "old_log_probs"),
        _timed(times, Actor, "update_actor", "update"),
        _timed(times, RLTrainer, "sync_weights", "weight_sync"),
    ]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            overrides = [f"output_dir={tmp}/run", f"steps={steps}", f"save_every={steps}", *extra]
            raw = apply_overrides(load_yaml(RECIPE), overrides)
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
    parser.add_argument(
        "overrides",
        nargs="*",
        help="recipe overrides for engine-core run, e.g. engine.backend=reference",
    )
    args = parser.parse_args()
    minimal_runs: list[list[tuple[float, float]]] = []
    ours_runs: list[list[tuple[float, float]]] = []
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(args.rounds):
        for which in ("minimal", "ours") if r % 2 == 0 else ("ours", "minimal"):
            if which == "minimal":
                minimal_runs.append(_minimal(args.steps))
            else:
                rows, times = _engine_core(args.steps, args.overrides)
                ours_runs.append(rows)
                # the first sync happens before step 1 (outside its time_s): dropped with warm-up
                for k, v in times.items():
                    parts[k] += v[args.warmup :]

    def median(runs: list[list[tuple[float, float]]]) -> float:
        return statistics.median(t for rows in runs for t, _ in rows[args.warmup :])

    def last10(runs: list[list[tuple[float, float]]]) -> float:
        return round(statistics.fmean(r for _, r in runs[0][-10:]), 4)

    minimal, ours = minimal_runs, ours_runs
    step = median(ours)
    breakdown = {k: statistics.median(v) for k, v in parts.items()}
    breakdown["rest"] = step - sum(breakdown.values())
    print(
        json.dumps(
            {
                "benchmark": "grpo_step",
                "recipe": RECIPE.name,
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
                "minimal_reward_last10": last10(minimal),
                "engine_core_reward_last10": last10(ours),
                "engine_core_step_breakdown_s": {k: round(v, 4) for k, v in breakdown.items()},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
