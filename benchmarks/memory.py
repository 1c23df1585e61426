"""Peak memory and time of one actor update on one long sequence: full logits against chunked.

A 2-layer, hidden-64 Qwen2 (GQA: 4 heads, 2 key/value heads) built from a config, under the
``--backend`` engine (default fsdp2, one process), trains one ``Actor.update_actor`` (PPO-clip
loss with an entropy bonus, one optimizer step) on a single sequence of T tokens, for every T
in ``--lengths`` and vocabulary V in ``--vocabs``, two ways side by side in the same run:

- ``full``: ``logits_chunk_tokens: null``, the ``[T, V]`` logits materialised (the old path);
- ``chunked``: ``logits_chunk_tokens: auto`` (the default: chunks of about 2**22 logits),
  log-probs and entropy computed chunk by chunk and recomputed in the backward.

Each configuration runs in its own process: build the engine and run one warm-up update (which
creates the optimizer state); then, before each of ``--repeats`` updates, malloc's free memory
goes back to the system (``malloc_trim``) and the resident-set high-water mark is reset
(``/proc/self/clear_refs``). ``step_gib``: the largest rise of that mark above the resident
memory just before an update (what the update itself adds: activations, logits, gradients);
``peak_gib``: the mark itself then; ``step_s``: the median update time; ``log_prob_s``: the
median time of ``Actor.compute_log_prob`` after them (forward only, no entropy: on megatron
with full logits, megatron-core's fused cross-entropy). ``logits_gib`` is the size of one fp32
``[T, V]`` tensor. Ratios compare the two paths of one (T, V). Then context parallelism: the
chunked path on one process (``cp1``) against two processes splitting each row (``cp2``,
Ulysses attention; each process gets half the threads), for every T in ``--cp-lengths`` at V
``--cp-vocab``, on a wider model (``CP_MODEL``: hidden 256, 4 layers) so that activations
outweigh the rest, with glibc's mmap threshold fixed at 128 KiB (``CP_MALLOC_MMAP_THRESHOLD``);
a ``cp2`` figure is that of the rank whose update added the most memory. The per-rank
activation memory is the slope of ``step_gib`` over T between the first and last of
``--cp-lengths`` (GiB per 1k tokens), for each; the fixed part of a step (FSDP's gathered
weights and unsharded gradients at cp2, none of which grows with T) drops out of it. A
configuration whose full path would need more memory than the host has available is reported
as skipped. On a CPU, Linux only (``/proc``). Prints one JSON object.

On a CUDA host each configuration's process is one NCCL rank (a ``cp2`` run: two, one GPU
each), so the engine runs on the GPU, and memory is ``torch.cuda.max_memory_allocated``: its
peak is reset before each update, ``step_gib`` is its rise above the memory allocated just
before, times are taken after ``torch.cuda.synchronize``, and the free memory that decides a
skip is the first GPU's. This GPU path has never been executed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _process_stats import (  # noqa: E402  (benchmarks/ is on sys.path as a script)
    reset_high_water_mark,
    rss_and_hwm,
)

from engine_core.launch import caller_environment  # noqa: E402

MODEL = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}


# the context-parallel comparison: a wider, deeper model, so activations outweigh the rest
CP_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


# The context-parallel runs' processes allocate every block of 128 KiB or more with mmap
# (glibc's MALLOC_MMAP_THRESHOLD_, unless already set): by default glibc raises that threshold
# up to 32 MiB as blocks are freed, so [T, hidden] activations land on the heap, and the freed
# gaps they leave stay resident in an amount that depends on allocation order, differing between
# ranks and runs. With the threshold fixed, the resident step equals the tensors' own peak (the
# profiler's, within 0.3%); the comparison is of activation memory, not of heap leftovers.
CP_MALLOC_MMAP_THRESHOLD = 128 * 1024


def _one(
    backend: str,
    length: int,
    vocab: int,
    path: str,
    repeats: int,
    cp: int = 1,
    shape: dict[str, int] | None = None,
) -> dict[str, Any]:
    from tensordict import TensorDict

    from engine_core.plugins import load_plugins
    from engine_core_roles.models.actor import Actor, ActorConfig

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))
    model = {**MODEL, **(shape or {}), "vocab_size": vocab, "max_position_embeddings": length}
    spec = load_plugins().get_engine(backend)
    config = spec.load_config_class()(
        backend=backend,
        model={"config": model},
        optim={"lr": 1e-4},
        logits_chunk_tokens=None if path == "full" else "auto",
        context_parallel_size=cp,
    )
    engine = spec.load_class()(config)
    engine.init_model()
    actor = Actor(ActorConfig(entropy_coeff=0.001), engine)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (1, length), generator=g)
    mask = torch.ones_like(ids)
    loss_mask = mask.clone()
    loss_mask[:, : length // 4] = 0  # a prompt
    batch = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": torch.arange(length)[None],
            "loss_mask": loss_mask,
            "old_log_probs": torch.full(ids.shape, -float(torch.tensor(vocab).log())),
            "advantages": torch.randn(ids.shape, generator=g),
        },
        batch_size=[1],
    )
    actor.update_actor(batch)  # warm-up: the optimizer state exists from here on
    on_cuda = engine.device.type == "cuda"
    peak = before = 0
    times = []
    for _ in range(repeats):
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            now = torch.cuda.memory_allocated()
        else:
            now = reset_high_water_mark()  # what the last update freed is not counted
        t0 = time.perf_counter()
        actor.update_actor(batch)
        if on_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        hwm = torch.cuda.max_memory_allocated() if on_cuda else rss_and_hwm()[1]
        if hwm - now > peak - before:
            peak, before = hwm, now
    log_prob_times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        actor.compute_log_prob(batch)
        if on_cuda:
            torch.cuda.synchronize()
        log_prob_times.append(time.perf_counter() - t0)
    return {
        "peak_gib": round(peak / 2**30, 3),
        "step_gib": round((peak - before) / 2**30, 3),
        "step_s": round(statistics.median(times), 3),
        "log_prob_s": round(statistics.median(log_prob_times), 3),
    }


def _rank(rank: int, world: int, *args: Any) -> dict[str, Any]:
    return _one(*args, cp=world, shape=CP_MODEL)


def _gpu_rank(rank: int, world: int, *args: Any) -> dict[str, Any]:
    return _one(*args)


def _process_group() -> str:
    """nccl on a CUDA host (the engines then run on the GPU, one per process), else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _one_cp(backend: str, length: int, vocab: int, repeats: int, cp: int) -> dict[str, Any]:
    """The chunked path on ``cp`` processes splitting the row; the figures of the rank whose
    update added the most memory."""
    from engine_core.testing.distributed import run_distributed

    ranks = run_distributed(
        _rank,
        cp,
        backend,
        length,
        vocab,
        "chunked",
        repeats,
        timeout=3000,
        pg_backend=_process_group(),
    )
    return max(ranks, key=lambda r: r["step_gib"])


def _available_bytes() -> int:
    """Free memory where the update runs: the first GPU's on a CUDA host, else the host's."""
    if torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(0)[0])
    return int(psutil.virtual_memory().available)


def _spawn(
    args: argparse.Namespace, length: int, vocab: int, path: str, cp: int = 0
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", f"{length},{vocab},{path},{cp}"]
    cmd += ["--backend", args.backend, "--repeats", str(args.repeats)]
    env = caller_environment()
    if cp:  # see CP_MALLOC_MMAP_THRESHOLD
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(CP_MALLOC_MMAP_THRESHOLD))
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return {"error": f"exit code {done.returncode}: {tail[0]}"}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="fsdp2")
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--vocabs", default="32768,131072")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cp-lengths", default="2048,8192")
    parser.add_argument("--cp-vocab", type=int, default=32768)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        length, vocab, path, cp = args.one.split(",")
        if int(cp):
            out = _one_cp(args.backend, int(length), int(vocab), args.repeats, int(cp))
        elif torch.cuda.is_available():  # one NCCL process, so that the engine runs on the GPU
            from engine_core.testing.distributed import run_distributed

            out = run_distributed(
                _gpu_rank,
                1,
                args.backend,
                int(length),
                int(vocab),
                path,
                args.repeats,
                timeout=3000,
                pg_backend="nccl",
            )[0]
        else:
            out = _one(args.backend, int(length), int(vocab), path, args.repeats)
        print(json.dumps(out))
        return
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for vocab in [int(x) for x in args.vocabs.split(",")]:
            logits = length * vocab * 4
            row: dict[str, Any] = {"T": length, "V": vocab, "logits_gib": round(logits / 2**30, 3)}
            for path in ("full", "chunked"):
                # the full path's update adds about six [T, V] fp32 tensors at its peak
                # (12.05 GiB for 2 GiB of logits at 4096 x 131072 on fsdp2)
                need = 6 * logits if path == "full" else logits // 8
                if need > _available_bytes():
                    row[path] = {"skipped": f"needs about {need / 2**30:.1f} GiB"}
                    continue
                row[path] = _spawn(args, length, vocab, path)
            full, chunked = row["full"], row["chunked"]
            if "step_gib" in full and "step_gib" in chunked:
                row["step_memory_ratio"] = round(full["step_gib"] / chunked["step_gib"], 2)
                row["peak_ratio"] = round(full["peak_gib"] / chunked["peak_gib"], 2)
                row["time_ratio_chunked_over_full"] = round(chunked["step_s"] / full["step_s"], 3)
                row["log_prob_time_ratio_chunked_over_full"] = round(
                    chunked["log_prob_s"] / full["log_prob_s"], 3
                )
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    cp_rows = []
    for length in [int(x) for x in args.cp_lengths.split(",") if x]:
        row = {"T": length, "V": args.cp_vocab}
        for cp in (1, 2):
            row[f"cp{cp}"] = _spawn(args, length, args.cp_vocab, "chunked", cp)
        if "step_gib" in row["cp1"] and "step_gib" in row["cp2"]:
            row["per_rank_step_memory_ratio"] = round(
                row["cp1"]["step_gib"] / row["cp2"]["step_gib"], 2
            )
            row["time_ratio_cp2_over_cp1"] = round(row["cp2"]["step_s"] / row["cp1"]["step_s"], 3)
        cp_rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    # activation memory grows with the tokens a rank holds: its slope over T, per rank, is what
    # context parallelism divides (the fixed part, FSDP's gathered weights and gradients, is not)
    slopes: dict[str, Any] = {}
    ok = [r for r in cp_rows if "step_gib" in r["cp1"] and "step_gib" in r["cp2"]]
    if len(ok) >= 2:
        lo, hi = ok[0], ok[-1]
        for cp in ("cp1", "cp2"):
            per_k = (hi[cp]["step_gib"] - lo[cp]["step_gib"]) / ((hi["T"] - lo["T"]) / 1024)
            slopes[f"{cp}_activation_gib_per_1k_tokens"] = round(per_k, 4)
        if slopes["cp2_activation_gib_per_1k_tokens"] > 0:
            slopes["per_rank_activation_ratio"] = round(
                slopes["cp1_activation_gib_per_1k_tokens"]
                / slopes["cp2_activation_gib_per_1k_tokens"],
                2,
            )
    print(
        json.dumps(
            {
                "backend": args.backend,
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                "memory": (
                    "torch.cuda.max_memory_allocated"
                    if torch.cuda.is_available()
                    else "resident-set high-water mark"
                ),
                "model": MODEL,
                "cp_model": {**MODEL, **CP_MODEL},
                "threads": os.cpu_count(),
                "rows": rows,
                "context_parallel": cp_rows,
                "context_parallel_activations": slopes,
            }
        )
    )


if __name__ == "__main__":
    main()
