"""The episode loop's batching: episodes per second when every turn generates for all unfinished
episodes in one ``generate`` call, against the same episodes generated one at a time.

The shipped tool task's model (``recipes/agent_tiny.yaml``, random weights) on the hf rollout
(``--backend vllm`` for vLLM), ``--prompts`` rows × ``--samples`` episodes each. The environment
answers every assistant message after ``--tool-ms`` milliseconds (a tool's latency, slept on the
environment's ``--workers`` threads) with one user message, for ``--turns`` turns; turns end at a stop token
(half of the vocabulary stops, so a random model's turns are a few tokens, as a trained model's
short answers are) or at ``--new-tokens``. Both ways run the same episodes with the same seeds,
alternating, after one warm-up each; the medians are reported, with the share of the batched
loop's time spent waiting on the environment. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_core_roles.episodes.protocol import Environment, StepResult
from engine_core_roles.episodes.threads import _STEP_THREADS


class Slow(Environment):
    """Answers each message with one user message after ``delay`` seconds; never ends."""

    delay = 0.0

    def reset(self, row: Any) -> list[dict[str, Any]]:
        return [{"role": "user", "content": str(row["key"])}]

    def step(self, message: dict[str, Any]) -> StepResult:
        time.sleep(self.delay)
        return StepResult([{"role": "user", "content": "go on"}], counts={"tool_calls": 1})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--tool-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=32, help="env.workers: step threads")
    args = parser.parse_args()

    from tensordict import NonTensorStack

    from engine_core import SamplingParams, load_plugins
    from engine_core.config import ModelConfig
    from engine_core.resolve import resolve_rollout_config
    from engine_core_roles import prompt_batch
    from engine_core_roles.batch.keys import EPISODE, ROW
    from engine_core_roles.data.datasets.tokenizer import load_tokenizer
    from engine_core_roles.episodes.rollout import EpisodeRollout
    from engine_core_roles.jobs.cli import RECIPES, load_recipe

    Slow.delay = args.tool_ms / 1000
    model = load_recipe(RECIPES / "agent_tiny.yaml")["engine"]["model"]
    raw: dict[str, Any] = {"backend": args.backend, "model": model}
    if args.backend == "vllm":
        raw["max_model_len"] = 256
    spec, cfg = resolve_rollout_config(raw, load_plugins())
    inner = spec.load_class()(cfg)
    tokenizer = load_tokenizer(ModelConfig.model_validate(model), None)
    loop = EpisodeRollout(inner, Slow, tokenizer, max_turns=args.turns, max_episode_tokens=256)
    _STEP_THREADS.resize(args.workers)
    vocab = int(model["config"]["vocab_size"])

    def params(seed: int, n: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=args.new_tokens, n=n, seed=seed, stop_token_ids=list(range(0, vocab, 2))
        )

    def prompts(keys: list[str]) -> Any:
        batch = prompt_batch([[1]] * len(keys))
        batch[ROW] = NonTensorStack.from_list([{"key": k} for k in keys])
        return batch

    keys = [f"k{i}" for i in range(args.prompts)]

    def batched() -> tuple[float, int, int, float]:
        t0 = time.perf_counter()
        out = loop.generate(prompts(keys), params(1, args.samples))
        dt = time.perf_counter() - t0
        records = out[EPISODE].tolist()
        turns = sum(r["turns"] for r in records)
        wait = max(r["env_wait_s"] for r in records)
        return dt, len(records), turns, wait

    def one_at_a_time() -> tuple[float, int, int, float]:
        t0, episodes, turns, wait = time.perf_counter(), 0, 0, 0.0
        for i, key in enumerate(keys):
            for k in range(args.samples):
                out = loop.generate(prompts([key]), params(1000 * i + k, 1))
                records = out[EPISODE].tolist()
                episodes += len(records)
                turns += sum(r["turns"] for r in records)
                wait += max(r["env_wait_s"] for r in records)
        return time.perf_counter() - t0, episodes, turns, wait

    runs: dict[str, list[tuple[float, int, int, float]]] = {"batched": [], "one_at_a_time": []}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, fn in (("batched", batched), ("one_at_a_time", one_at_a_time)):
            runs[name].append(fn())
    figures = {}
    for name, results in runs.items():
        timed = results[1:]
        seconds = statistics.median(r[0] for r in timed)
        figures[name] = {
            "seconds": round(seconds, 3),
            "episodes": timed[0][1],
            "turns": statistics.median(r[2] for r in timed),
            "episodes_per_s": round(timed[0][1] / seconds, 2),
            "env_wait_share": round(statistics.median(r[3] / r[0] for r in timed), 3),
        }
    print(
        json.dumps(
            {
                "benchmark": "agent_step",
                "backend": args.backend,
                "prompts": args.prompts,
                "samples": args.samples,
                "max_turns": args.turns,
                "tool_ms": args.tool_ms,
                **figures,
                "speedup": round(
                    figures["batched"]["episodes_per_s"]
                    / figures["one_at_a_time"]["episodes_per_s"],
                    2,
                ),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
