"""Training throughput and model FLOPs utilisation (MFU) of the ``fsdp2`` and ``megatron`` engines.

On a CUDA host: one process per GPU (``torch.cuda.device_count()`` of them, NCCL, the
rendezvous environment set here by :func:`engine_core.testing.distributed.run_distributed`),
a Llama-shaped model built from a config (:data:`LLAMA_1B`: hidden 2048, 16 layers, 16 heads,
8 KV heads, MLP 8192, vocabulary 32000, untied head: 1,137,772,544 parameters), bf16, packed
sequences under a token budget per micro-batch, AdamW. ``fsdp2`` keeps fp32 master weights and
computes in bf16 (``mixed_precision.param_dtype: bfloat16``); ``megatron`` runs a bf16 model with
megatron-core's fp32 main weights. Each engine runs in fresh processes, one after the other.

Model FLOPs of one optimizer step, counted from the config (no recomputation counted)::

    flops = 6 * N * T + 12 * L * H * sum_i(s_i ** 2)

``N``: parameters that multiply (all but the input embedding table, a lookup), ``T``: tokens
in the step (sum of the sequence lengths ``s_i``), ``L``: layers, ``H``: hidden size. The second
term is the usual per-token attention estimate ``12 * L * H * s`` summed over the tokens of each
packed sequence; it counts the full score matrix, as published MFU figures do, although causal
kernels skip about half of it. MFU = flops / (median step time * GPUs * peak dense bf16 FLOP/s
of the device, from :data:`PEAK_BF16` by device name; null for an unknown device). Target stated
in the output: MFU >= 0.45 on H100 for both engines.

Without CUDA it runs a smoke configuration (a tiny Llama, one gloo process, fp32, a few steps) so
the script keeps working; it prints the same JSON shape with ``"smoke": true`` and MFU null.

``fsdp2_compile`` is ``fsdp2`` with ``compile: true`` (``torch.compile`` per decoder block).

Status: executed on one H200 (torch 2.11.0+cu130, one process, no TransformerEngine or
flash-attention), token budget 8192: fsdp2 42.4k tokens/s (MFU 0.300), megatron 47.5k (0.337),
fsdp2_compile 47.8k (0.339); with ``--max-tokens 24576``: fsdp2 48.7k (0.345), fsdp2_compile
60.0k (0.425). Figures and profiles in docs/status.md. More than one GPU has not run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _recipes import build_engine, train_step  # noqa: E402  (benchmarks/ is on sys.path)

# "fsdp2_compile": fsdp2 with ``compile: true`` (torch.compile per decoder block)
ENGINES = ("fsdp2", "fsdp2_compile", "megatron")
TARGET_MFU = 0.45
LLAMA_1B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
# dense (no sparsity) bf16 tensor-core peaks; the first name contained in the device's wins
PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
)
OPTIM = {"lr": 1e-4, "weight_decay": 0.01, "clip_grad": 1.0}


@dataclass(frozen=True)
class Plan:
    """What one run trains: model, data shape, batching and how many steps are timed."""

    model: dict[str, Any]
    samples_per_rank: int
    min_len: int
    max_len: int
    max_tokens_per_micro_batch: int
    warmup_steps: int
    timed_steps: int
    bf16: bool


GPU_PLAN = Plan(LLAMA_1B, 16, 1024, 2048, 8192, warmup_steps=3, timed_steps=10, bf16=True)
SMOKE_PLAN = Plan(TINY_LLAMA, 8, 16, 64, 128, warmup_steps=1, timed_steps=3, bf16=False)


# ---------------------------------------------------------------------------- model arithmetic
def param_counts(model: dict[str, Any]) -> dict[str, int]:
    """Total parameters of the HF model built from ``model`` (on the meta device: no memory), and
    those that multiply (all but the input embedding table)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(model)
    hf = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(hf)
    total = sum(p.numel() for p in net.parameters())
    embedding = net.get_input_embeddings().weight.numel()
    tied = bool(model.get("tie_word_embeddings", False))
    return {"total": total, "matmul": total if tied else total - embedding}


def lengths(plan: Plan, world: int) -> list[int]:
    """Sequence lengths of the global batch: the same every step, so every step's FLOPs are too."""
    g = torch.Generator().manual_seed(0)
    n = plan.samples_per_rank * world
    return torch.randint(plan.min_len, plan.max_len + 1, (n,), generator=g).tolist()


def step_flops(plan: Plan, seq_lens: list[int], matmul_params: int) -> float:
    layers, hidden = plan.model["num_hidden_layers"], plan.model["hidden_size"]
    tokens = sum(seq_lens)
    return 6.0 * matmul_params * tokens + 12.0 * layers * hidden * sum(s * s for s in seq_lens)


def peak_bf16(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16 if key in device_name), None)


# ---------------------------------------------------------------------------- engines
def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def engine_config(backend: str, plan: Plan, *, on_gpu: bool, world: int) -> dict[str, Any]:
    """The raw engine config each backend is resolved from (one place, so the JSON shows it)."""
    compiled = backend == "fsdp2_compile"
    backend = "fsdp2" if compiled else backend
    raw: dict[str, Any] = {
        "backend": backend,
        "model": {"config": dict(plan.model), "dtype": "float32"},
        "optim": dict(OPTIM),
        "use_packing": True,
        "max_tokens_per_micro_batch": plan.max_tokens_per_micro_batch,
        "seed": 0,
    }
    if backend == "fsdp2":
        # packed rows need a varlen kernel: flash-attention's where installed, else SDPA per
        # sequence; transformers' default would build a dense [T, T] mask
        flash = on_gpu and plan.bf16 and _has("flash_attn")
        raw["model"]["attn_implementation"] = "flash_attention_2" if flash else "sdpa_varlen"
        if plan.bf16:
            raw["mixed_precision"] = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
        if compiled:
            raw["compile"] = True
    elif backend == "megatron":
        if plan.bf16:
            raw["model"]["dtype"] = "bfloat16"
        te = on_gpu and _has("transformer_engine")
        raw["transformer_impl"] = "transformer_engine" if te else "local"
        raw["use_distributed_optimizer"] = world > 1
    return raw


def _batch(step: int, plan: Plan, seq_lens: list[int]) -> Any:
    from engine_core.batch import make_batch

    g = torch.Generator().manual_seed(1000 + step)
    n, width = len(seq_lens), max(seq_lens)
    ids = torch.randint(1, plan.model["vocab_size"], (n, width), generator=g)
    mask = torch.arange(width).expand(n, width) < torch.tensor(seq_lens).unsqueeze(1)
    return make_batch(ids.masked_fill(~mask, 0), mask.long())


def _sync() -> None:
    import torch.distributed as dist

    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        torch.cuda.synchronize()
    dist.barrier()


def _profile(engine: Any, batch: Any, rows: int) -> str:
    """One more step under the torch profiler: the kernels and ops that took the device's time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if engine.device.type == "cuda" else []
    )
    with profile(activities=activities) as prof:
        train_step(engine, batch)
        _sync()
    key = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    return str(prof.key_averages().table(sort_by=key, row_limit=rows))


def _worker(
    rank: int, world: int, backend: str, plan: Plan, raw: dict[str, Any], profile_rows: int
) -> dict:
    """One rank: build the engine generically, then time warm-up + timed optimizer steps."""
    t0 = time.perf_counter()
    engine = build_engine(raw)
    setup_s = time.perf_counter() - t0
    seq_lens = lengths(plan, world)
    times, losses = [], []
    for step in range(plan.warmup_steps + plan.timed_steps):
        batch = engine.shard_data(_batch(step, plan, seq_lens))
        _sync()
        start = time.perf_counter()
        result = train_step(engine, batch)
        _sync()
        if step >= plan.warmup_steps:
            times.append(time.perf_counter() - start)
        losses.append(float(result.loss))
    on_cuda = engine.device.type == "cuda"
    table = None
    if profile_rows:
        table = _profile(engine, engine.shard_data(_batch(0, plan, seq_lens)), profile_rows)
    return {
        "profile": table if rank == 0 else None,
        "times": times,
        "losses": losses,
        "setup_s": setup_s,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None,
        "device": str(engine.device),
    }


def run_engine(
    backend: str,
    plan: Plan,
    *,
    world: int,
    on_gpu: bool,
    peak: float | None,
    flops: float,
    tokens: int,
    profile_rows: int = 0,
) -> dict[str, Any]:
    from engine_core.testing.distributed import run_distributed

    raw = engine_config(backend, plan, on_gpu=on_gpu, world=world)
    pg = "nccl" if on_gpu else "gloo"
    results = run_distributed(
        _worker, world, backend, plan, raw, profile_rows, timeout=1800, pg_backend=pg
    )
    r = results[0]  # barriers around every step: rank 0's times are the step's
    if r["profile"]:
        print(f"--- {backend}: one profiled step (rank 0)\n{r['profile']}", file=sys.stderr)
    median = statistics.median(r["times"])
    mfu = flops / (median * world * peak) if peak else None
    return {
        "tokens_per_s": round(tokens / median, 1),
        "tokens_per_s_per_gpu": round(tokens / median / world, 1) if on_gpu else None,
        "step_time_median_s": round(median, 4),
        "step_time_min_max_s": [round(min(r["times"]), 4), round(max(r["times"]), 4)],
        "mfu": round(mfu, 4) if mfu is not None else None,
        "target_met": (mfu >= TARGET_MFU) if mfu is not None else None,
        "loss_first_last": [round(r["losses"][0], 4), round(r["losses"][-1], 4)],
        "setup": {
            # the model's config is printed once, under "model"
            "engine_config": {
                **raw,
                "model": {k: v for k, v in raw["model"].items() if k != "config"},
            },
            "processes": world,
            "process_group": pg,
            "device": r["device"],
            "init_s": round(r["setup_s"], 2),
            "peak_memory_gib": max(
                (x["peak_memory_gib"] for x in results if x["peak_memory_gib"] is not None),
                default=None,
            ),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny CPU configuration anywhere")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="after timing, profile one more step and print its top ROWS ops to stderr",
    )
    parser.add_argument(
        "--max-tokens", type=int, help="token budget per micro-batch (default: the plan's)"
    )
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available() and not args.smoke
    plan = GPU_PLAN if on_gpu else SMOKE_PLAN
    if args.max_tokens:
        plan = replace(plan, max_tokens_per_micro_batch=args.max_tokens)
    world = torch.cuda.device_count() if on_gpu else 1
    device_name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    peak = peak_bf16(device_name) if on_gpu else None
    counts = param_counts(plan.model)
    seq_lens = lengths(plan, world)
    tokens = sum(seq_lens)
    flops = step_flops(plan, seq_lens, counts["matmul"])
    engines = {
        b: run_engine(
            b,
            plan,
            world=world,
            on_gpu=on_gpu,
            peak=peak,
            flops=flops,
            tokens=tokens,
            profile_rows=args.profile,
        )
        for b in args.engines
    }
    print(
        json.dumps(
            {
                "benchmark": "training tokens/s and MFU: fsdp2 and megatron",
                "smoke": not on_gpu,
                "status": "GPU path executed on one H100 and one H200; more than one GPU never executed",
                "device": {"name": device_name, "count": world, "peak_bf16_flops": peak},
                "model": {
                    **plan.model,
                    "params": counts["total"],
                    "matmul_params": counts["matmul"],
                },
                "flops": {
                    "formula": "6 * N * T + 12 * L * H * sum_i(s_i^2)",
                    "terms": "N: parameters that multiply (all but the input embedding); T: "
                    "tokens per step; L: layers; H: hidden size; s_i: packed sequence lengths",
                    "per_step": flops,
                    "mfu": "flops / (median step time * GPUs * peak dense bf16 FLOP/s)",
                },
                "setup": {
                    **{k: v for k, v in asdict(plan).items() if k != "model"},
                    "global_samples_per_step": len(seq_lens),
                    "tokens_per_step": tokens,
                    "optimizer": {"name": "AdamW", **OPTIM},
                },
                "engines": engines,
                "target": {"mfu": TARGET_MFU, "device": "H100", "engines": list(engines)},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
