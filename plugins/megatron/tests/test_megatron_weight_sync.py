"""Weights from a tensor- and pipeline-parallel megatron trainer into a vLLM rollout process.

Two trainer ranks (TP=2, or PP=2) take a step, then stream ``named_full_params`` through a
weight-sync group (rank 0 sends; every rank takes part in the gathers) to vLLM running in a
process of its own; every bucket is verified on arrival. The rollout's log-probs of what it
then samples must equal a plain transformers forward of the trainer's exported weights.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from engine_core import SamplingParams
from engine_core.executors.local import LocalWorkerGroup
from engine_core.remote_rollout import RolloutWorker
from engine_core.testing.distributed import free_port, run_distributed
from engine_core.testing.models import random_batch, registered_engine
from engine_core.weight_sync import WeightSyncGroup, send_weights

pytest.importorskip("vllm")

# head size 32 (vLLM's CPU attention needs >= 32), 2 KV heads (TP=2 splits them)
MODEL = {
    "model_type": "qwen2",
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
# the trainers' processes start from a fork server that imported the engine once
PRELOAD = (
    "engine_core_megatron.engine",
    "megatron.core",  # imported by the engine only as it builds: seconds of each process
    "transformers.models.qwen2.modeling_qwen2",
    "vllm",  # imported by this module (importorskip above), which each process unpickles from
)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3)


def _trainer(rank: int, world: int, port: int, folder: str, layout: str) -> None:
    engine = registered_engine(
        "megatron",
        model={"config": MODEL},
        optim={"lr": 5e-2, "clip_grad": None},
        **{layout: 2},
    )
    with engine.train_mode():
        engine.forward_backward_step(random_batch(8, seed=1))
        engine.optimizer_step()
    group = (
        WeightSyncGroup(host="127.0.0.1", port=port, rank=0, world_size=2) if rank == 0 else None
    )
    send_weights(group, engine.named_full_params(), bucket_bytes=16 << 10)
    engine.export_hf(folder)


def _sync(workers: LocalWorkerGroup, folder: Path, layout: str) -> list[Any]:
    port = free_port()
    errors: list[BaseException] = []

    def train() -> None:
        try:
            run_distributed(_trainer, 2, port, str(folder), layout, timeout=600, preload=PRELOAD)
        except BaseException as e:  # re-raised below
            errors.append(e)

    trainer = threading.Thread(target=train)
    trainer.start()
    workers.call_all("join_weight_sync", "127.0.0.1", port, 1, 2, "gloo", 600.0)
    buckets: list[Any] = workers.call_all("receive_weights")[0]
    trainer.join()
    assert not errors, errors
    return buckets


def _max_gap(out: TensorDict, folder: Path) -> float:
    """Rollout log-probs of its own samples against a plain forward of the exported weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    seq = torch.cat([out["prompt_ids"], out["response_ids"]], 1)
    with torch.no_grad():
        logits = model(seq).logits[:, out["prompt_ids"].shape[1] - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, out["response_ids"].unsqueeze(-1))[..., 0]
    mask = out["response_mask"].bool()
    return float((lp - out["rollout_log_probs"]).abs()[mask].max())


def test_sharded_megatron_trainers_sync_a_vllm_process(tmp_path: Path) -> None:
    rollout = {"backend": "vllm", "model": {"config": MODEL}, "seed": 7}
    ids = torch.randint(1, 64, (3, 5), generator=torch.Generator().manual_seed(1))
    prompts = TensorDict({"prompt_ids": ids, "prompt_mask": torch.ones_like(ids)}, batch_size=[3])
    workers = LocalWorkerGroup(RolloutWorker, 1, init_args=(rollout,), env={"OMP_NUM_THREADS": "1"})
    try:
        for layout in ("tensor_parallel_size", "pipeline_parallel_size"):
            folder = tmp_path / layout
            buckets = _sync(workers, folder, layout)
            assert len(buckets) > 1, layout  # several verified buckets, not one blob
            out = workers.call_all("generate", prompts, PARAMS)[0]
            gap = _max_gap(out, folder)
            assert gap < 1e-4, f"{layout}=2: rollout log-probs differ from the trainer by {gap}"
    finally:
        workers.shutdown()
