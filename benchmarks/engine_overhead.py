"""Engine overhead: an engine's training step against a hand-written loop on the same library.

Two gloo processes on CPU, a Qwen2 model built from a config (hidden 256, 4 layers), 16 samples
of 128 tokens per step, padded execution and one micro-batch in both, AdamW, clipping at 1.0.

- ``fsdp2`` row: the engine's ``forward_backward_step`` + ``optimizer_step`` against the same
  model sharded the same way (``fully_shard`` per decoder block, then the root; 8 samples per
  rank) with a plain forward / token-mean NLL / backward / clip / step loop.
- ``megatron`` row (tensor parallel 2): the engine's step against a hand-written megatron-core
  loop, Megatron-LM style: the same ``GPTModel`` (megatron-core's local layers with the engine's
  SDPA core attention, the config mapped from the same HF config), megatron's DDP and
  optimizer (clipping inside it), the per-token loss from ``GPTModel(labels=...)`` and one
  call of megatron's forward-backward schedule.

Steps alternate engine, plain, engine, plain, ... so drift hits both; each pair gives a ratio
engine / plain and the row reports the median ratio with its quartiles (target: median
≤ 1.03). ``--profile`` adds, per row, the functions of ``engine_core`` that took the most
cumulative time in one extra engine step (cProfile, rank 0). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _recipes import build_engine, train_step  # noqa: E402  (benchmarks/ is on sys.path)

MODEL = {
    "model_type": "qwen2",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
BATCH, SEQ, WARMUP = 16, 128, 3
OPTIM = {"lr": 1e-4, "clip_grad": 1.0}
ROWS = ("fsdp2", "megatron")
TARGET = 1.03


def _batch(step: int) -> Any:
    from engine_core.batch import make_batch

    g = torch.Generator().manual_seed(step)
    return make_batch(torch.randint(1, MODEL["vocab_size"], (BATCH, SEQ), generator=g))


def _engine(backend: str, **extra: Any) -> Any:
    raw = {
        "backend": backend,
        "model": {"config": dict(MODEL)},
        "optim": dict(OPTIM),
        "use_packing": False,
        **extra,
    }
    return build_engine(raw)


def _engine_step(engine: Any) -> Callable[[Any], None]:
    def step(batch: Any) -> None:
        train_step(engine, engine.shard_data(batch))

    return step


# ---------------------------------------------------------------------------- plain loops
def _plain_fsdp2(rank: int, world: int) -> Callable[[Any], None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(MODEL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM["lr"])
    per = BATCH // world

    def step(batch: Any) -> None:
        ids = batch["input_ids"][rank * per : (rank + 1) * per]
        mask = batch["attention_mask"][rank * per : (rank + 1) * per]
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -lp.mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["clip_grad"])
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _plain_megatron(rank: int, world: int) -> Callable[[Any], None]:
    """Megatron-LM's training step, written against megatron-core directly. Runs after the
    engine has initialised megatron's parallel state (TP=2) in this process."""
    from engine_core_megatron._cpu_compat import cpu_compat
    from engine_core_megatron.attention import SDPACoreAttention
    from engine_core_megatron.convert import UNFUSED, layout_of, transformer_config_kwargs
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import AutoConfig

    cfg = dict(MODEL)
    hf = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    layout = layout_of(hf, value_head=False, tp=2)
    config_kwargs, model_kwargs = transformer_config_kwargs(hf, layout)
    with cpu_compat():
        tc = TransformerConfig(
            **config_kwargs,
            tensor_model_parallel_size=2,
            use_cpu_initialization=True,
            **UNFUSED,
            calculate_per_token_loss=True,
        )
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        model = DistributedDataParallel(
            tc,
            DistributedDataParallelConfig(grad_reduce_in_fp32=False),
            module=GPTModel(tc, spec, pre_process=True, post_process=True, **model_kwargs),
        )
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=OPTIM["lr"], clip_grad=OPTIM["clip_grad"]),
            [model],
        )
    schedule = get_forward_backward_func()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)

    def forward_step(data: Any, net: torch.nn.Module) -> Any:
        ids = next(data)
        labels = torch.roll(ids, -1, dims=1)
        mask = torch.ones_like(ids, dtype=torch.float32)
        mask[:, -1] = 0.0  # the last position has no next token
        per_token = net(input_ids=ids, position_ids=positions, attention_mask=None, labels=labels)

        def loss_func(output: torch.Tensor) -> Any:
            # summed loss and its token count: megatron divides by the count (per-token loss)
            return (output.float() * mask).sum(), mask.sum().to(torch.int), {}

        return per_token, loss_func

    def step(batch: Any) -> None:
        with cpu_compat():
            schedule(
                forward_step_func=forward_step,
                data_iterator=iter([batch["input_ids"]]),
                model=model,
                num_microbatches=1,
                seq_length=SEQ,
                micro_batch_size=BATCH,
                forward_only=False,
            )
            optimizer.step()
            model.zero_grad_buffer()
            optimizer.zero_grad()

    return step


def _profile_engine_step(step: Callable[[Any], None], batch: Any, rows: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    step(batch)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats("cumulative")
    stats.print_stats(r"engine_core", rows)
    return out.getvalue()


def _worker(rank: int, world: int, row: str, steps: int, profile_rows: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    if row == "fsdp2":
        engine = _engine("fsdp2")
        plain = _plain_fsdp2(rank, world)
    else:
        engine = _engine("megatron", tensor_parallel_size=2)
        plain = _plain_megatron(rank, world)
    fns = {"engine": _engine_step(engine), "plain": plain}
    times: dict[str, list[float]] = {"engine": [], "plain": []}
    for i in range(WARMUP + steps):
        batch = _batch(i)
        # alternate which one goes first so neither always follows the other
        order = ("engine", "plain") if i % 2 == 0 else ("plain", "engine")
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            fns[name](batch)
            dist.barrier()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t0)
    profile = None
    if profile_rows:
        with contextlib.redirect_stdout(io.StringIO()):
            profile = _profile_engine_step(fns["engine"], _batch(0), profile_rows)
    return {"times": times, "profile": profile if rank == 0 else None}


def _quartiles(xs: list[float]) -> list[float]:
    q = statistics.quantiles(xs, n=4)
    return [round(q[0], 4), round(q[2], 4)]


def run_row(row: str, steps: int, profile_rows: int) -> dict[str, Any]:
    from engine_core.testing.distributed import run_distributed

    results = run_distributed(_worker, 2, row, steps, profile_rows, timeout=1800)
    times = results[0]["times"]  # barriers around every step: rank 0's times are the step's
    ratios = [a / b for a, b in zip(times["engine"], times["plain"], strict=True)]
    median = statistics.median(ratios)
    if results[0]["profile"]:
        print(
            f"--- {row}: one engine step, engine_core functions\n{results[0]['profile']}",
            file=sys.stderr,
        )
    return {
        "engine_median_s": round(statistics.median(times["engine"]), 4),
        "plain_median_s": round(statistics.median(times["plain"]), 4),
        "ratio_median": round(median, 4),
        "ratio_quartiles": _quartiles(ratios),
        "timed_pairs": len(ratios),
        "target_met": median <= TARGET,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--steps", type=int, default=150, help="timed engine/plain pairs per row")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="print the top ROWS engine_core functions of one engine step",
    )
    args = parser.parse_args()
    rows = {row: run_row(row, args.steps, args.profile) for row in args.rows}
    print(
        json.dumps(
            {
                "benchmark": "engine step vs hand-written loop (fsdp2, megatron)",
                "setup": {
                    "processes": 2,
                    "backend": "gloo",
                    "device": "cpu",
                    "model": MODEL,
                    "global_batch": BATCH,
                    "seq_len": SEQ,
                    "warmup_pairs": WARMUP,
                    "layouts": {"fsdp2": "dp=2 (fully_shard)", "megatron": "tp=2"},
                },
                "rows": rows,
                "target_ratio": TARGET,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
