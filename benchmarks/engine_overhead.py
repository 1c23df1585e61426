"""Engine overhead: our FSDP2 engine's step against a hand-written FSDP2 loop, same everything.

Two gloo processes on CPU, a Qwen2 model built from a config (hidden 256, 4 layers), 16 samples
of 128 tokens per step (8 per rank), padded execution and one micro-batch in both, AdamW.
(a) ``forward_backward_step`` + ``optimizer_step`` of the ``fsdp2`` engine; (b) the same model
sharded the same way (``fully_shard`` per decoder block, then the root) with a plain
forward / token-mean NLL / backward / clip / step loop. Steps alternate a, b, a, b, ... so drift
hits both; the median step-time ratio a/b is reported (target ≤ 1.03). Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
BATCH, SEQ, WARMUP, STEPS = 16, 128, 2, 12


def _batch(step: int, rank: int, world: int):  # type: ignore[no-untyped-def]
    from engine_core.batch import make_batch

    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, MODEL["vocab_size"], (BATCH, SEQ), generator=g)
    per = BATCH // world
    return make_batch(ids[rank * per : (rank + 1) * per])


def _worker(rank: int, world: int, port: int, queue) -> None:  # type: ignore[no-untyped-def]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from engine_core_fsdp.fsdp2 import FSDP2Engine, FSDP2EngineConfig
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine_core.engine import loss_mask_of
    from engine_core.loss import aggregate_loss

    def nll(mb, out, ctx):  # type: ignore[no-untyped-def]
        return aggregate_loss(-out["log_probs"], loss_mask_of(mb), "token-mean", ctx), {}

    engine = FSDP2Engine(
        FSDP2EngineConfig(
            backend="fsdp2",
            model={"config": dict(MODEL)},
            optim={"lr": 1e-4, "clip_grad": 1.0},
            use_packing=False,
        )
    )
    engine.init_model()
    engine.set_loss_fn(nll)

    cfg = dict(MODEL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def engine_step(b) -> None:  # type: ignore[no-untyped-def]
        with engine.train_mode():
            engine.forward_backward_step(b)
            engine.optimizer_step()
            engine.lr_scheduler_step()
            engine.optimizer_zero_grad()

    def plain_step(b) -> None:  # type: ignore[no-untyped-def]
        ids, mask = b["input_ids"], b["attention_mask"]
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -lp.mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"engine": [], "plain": []}
    for step in range(WARMUP + STEPS):
        b = _batch(step, rank, world)
        for name, fn in (("engine", engine_step), ("plain", plain_step)):
            dist.barrier()
            t0 = time.perf_counter()
            fn(b)
            dist.barrier()
            if step >= WARMUP:
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def main() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    times = queue.get(timeout=600)
    for p in procs:
        p.join()
    a, b = statistics.median(times["engine"]), statistics.median(times["plain"])
    print(
        json.dumps(
            {
                "benchmark": "fsdp2 engine step vs hand-written fsdp2 loop",
                "setup": {
                    "processes": 2,
                    "backend": "gloo",
                    "device": "cpu",
                    "model": MODEL,
                    "global_batch": BATCH,
                    "seq_len": SEQ,
                    "timed_steps": STEPS,
                },
                "engine_median_s": round(a, 4),
                "plain_median_s": round(b, 4),
                "ratio": round(a / b, 4),
                "target_ratio": 1.03,
                "target_met": a / b <= 1.03,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
