"""Step time and memory of a mixture of experts on megatron: EP1 against EP2, same global batch.

A Qwen3-MoE built from a config (``--experts`` experts, top-2, hidden ``--hidden``, each expert
``--expert-ffn`` wide, ``--layers`` layers; the experts hold most of the weights) trains under
the megatron engine on two processes (gloo on a CPU host, NCCL on a GPU host), two ways side by
side in the same run, at the same global batch (``--batch`` sequences of up to ``--seq-len``
tokens, split over the two data-parallel ranks):

- ``ep1``: every expert on both ranks (expert_parallel_size 1), gradients all-reduced;
- ``ep2``: half the experts on each rank (expert_parallel_size 2), tokens sent to their
  experts' rank and back by megatron-core's all-to-all dispatcher.

Each way runs in its own pair of processes: build the engine, run one warm-up step (which
creates the optimizer state), then ``--repeats`` steps (``forward_backward_step`` with a token
NLL, ``optimizer_step``). Per rank: ``step_s``, the median step time; ``step_gib``, the largest
rise of the resident-set high-water mark above the resident memory just before a step (malloc's
free memory handed back and the mark reset first; on a GPU, ``torch.cuda.max_memory_allocated``
above the memory allocated before the step); ``weights_gib`` and ``expert_weights_gib``, the
parameters this rank holds, all and the experts'; ``optimizer_gib``, its Adam state. A figure
is the larger of the two ranks'. ``ratio`` is ep2 over ep1. Each process gets half the CPU
threads. Prints one JSON object.

The GPU path (NCCL, CUDA memory) has never been executed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _process_stats import (  # noqa: E402  (benchmarks/ is on sys.path as a script)
    reset_high_water_mark,
    rss_and_hwm,
)

from engine_core.launch import set_for_process  # noqa: E402


def _model(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model_type": "qwen3_moe",
        "vocab_size": 512,
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 2,
        "moe_intermediate_size": args.expert_ffn,
        "num_experts": args.experts,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": args.hidden // 4,
        "max_position_embeddings": args.seq_len,
        "tie_word_embeddings": False,
    }


def _gib(n: float) -> float:
    return round(n / 2**30, 4)


def _worker(rank: int, world: int, ep: int, args: argparse.Namespace, port: int, out: Any) -> None:
    from tensordict import TensorDict

    from engine_core.plugins import load_plugins
    from engine_core.testing.models import nll_loss

    set_for_process({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    spec = load_plugins().get_engine("megatron")
    config = spec.load_config_class()(
        backend="megatron",
        model={"config": _model(args)},
        optim={"lr": 1e-4},
        expert_parallel_size=ep,
        micro_batch_size=args.micro_batch_size,
    )
    engine = spec.load_class()(config)
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.seq_len // 2, args.seq_len + 1, (args.batch,), generator=g)
    ids = torch.randint(1, 512, (args.batch, args.seq_len), generator=g)
    mask = torch.arange(args.seq_len)[None] < lengths[:, None]
    batch = TensorDict(
        {
            "input_ids": ids.masked_fill(~mask, 0),
            "attention_mask": mask.long(),
            "position_ids": torch.arange(args.seq_len).expand(args.batch, -1).contiguous(),
        },
        batch_size=[args.batch],
    )
    mine = engine.shard_data(batch)

    def step() -> None:
        with engine.train_mode():
            engine.forward_backward_step(mine)
            engine.optimizer_step()
            engine.optimizer_zero_grad()

    step()  # warm-up: the optimizer state exists from here on
    times, rises = [], []
    for _ in range(args.repeats):
        dist.barrier()
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            before = reset_high_water_mark()
        t0 = time.perf_counter()
        step()
        if on_gpu:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            _, peak = rss_and_hwm()
        times.append(time.perf_counter() - t0)
        rises.append(peak - before)
    params = list(engine.module.named_parameters())
    weights = sum(p.numel() * p.element_size() for _, p in params)
    experts = sum(p.numel() * p.element_size() for n, p in params if ".local_experts." in n)
    optimizer = sum(
        t.numel() * t.element_size()
        for sub in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
        for state in sub.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    out.put(
        (
            rank,
            {
                "step_s": round(statistics.median(times), 4),
                "step_gib": _gib(max(rises)),
                "weights_gib": _gib(weights),
                "expert_weights_gib": _gib(experts),
                "optimizer_gib": _gib(optimizer),
            },
        )
    )
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(ep: int, args: argparse.Namespace) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, ep, args, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"ep{ep}: a rank failed (exit codes {[p.exitcode for p in procs]})")
    ranks = [queue.get() for _ in procs]
    return {k: max(r[k] for _, r in ranks) for k in ranks[0][1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--expert-ffn", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    runs = {f"ep{ep}": _run(ep, args) for ep in (1, 2)}
    ratio = {k: round(runs["ep2"][k] / runs["ep1"][k], 3) for k in runs["ep1"] if runs["ep1"][k]}
    print(json.dumps({"model": _model(args), **runs, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
