"""The megatron engine on CUDA with NCCL: outputs against transformers, bf16 training and a
checkpoint round trip, for megatron-core's local layers and, where it imports, TransformerEngine.

Marked ``gpu``: skipped cleanly where no CUDA device is visible. Each case runs on one GPU
(world 1) and, with more than one GPU, on all of them (TP=2 when the GPU count is even, the rest
data parallel). One process run per case gathers every figure, so each case starts megatron-core
once. Executed on one H100 (world 1, local layers); TransformerEngine and more than one GPU
have not run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.batch import LOG_PROBS
from engine_core.testing.distributed import run_distributed
from engine_core.testing.kit import Baseline, build, eval_batch, forward, make_baseline, train_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

IMPLS = ["local", "transformer_engine"]
OPTIM = {"lr": 1e-2, "clip_grad": 1.0}
STEPS, MORE = 6, 2
FP32_ATOL = 1e-5  # fp32 on the GPU against fp32 transformers on the CPU
BF16_ATOL = 5e-2  # bf16 weights and compute against the same fp32 reference
SAMPLES = 8  # kit batches


def _worlds() -> list[int]:
    n = torch.cuda.device_count()
    return [1] + ([n] if n > 1 else [])


def _tp(world: int) -> int:
    return 2 if world % 2 == 0 else 1  # the kit's model has 2 KV heads: TP <= 2


def _steps(engine: Any, n: int) -> list[tuple[float, float]]:
    """(loss, grad norm) of ``n`` optimizer steps on one fixed batch: the loss must fall."""
    out = []
    for _ in range(n):
        with engine.train_mode():
            result = engine.forward_backward_step(engine.shard_data(train_batch(0)))
            norm = engine.optimizer_step()
            engine.lr_scheduler_step()
            engine.optimizer_zero_grad()
        out.append((float(result.loss), float(norm)))
    return out


def _log_probs(engine: Any) -> torch.Tensor:
    return forward(engine, eval_batch())[LOG_PROBS].float().cpu()


def _case(rank: int, world: int, policy: str, root: str, impl: str) -> dict[str, Any]:
    layout = {"tensor_parallel_size": _tp(world), "transformer_impl": impl}
    out: dict[str, Any] = {}
    if impl == "local":  # TransformerEngine's packed (THD) attention has no fp32 kernel
        fp32 = build("megatron", model={"path": policy}, **layout)
        out["fp32_log_probs"] = _log_probs(fp32)
        del fp32
    bf16 = {"model": {"path": policy, "dtype": "bfloat16"}, "optim": OPTIM, **layout}
    engine = build("megatron", **bf16)
    assert engine.module is not None
    out["device"] = engine.device.type
    out["param_devices"] = sorted({p.device.type for p in engine.module.parameters()})
    out["param_dtypes"] = sorted({str(p.dtype) for p in engine.module.parameters()})
    out["bf16_log_probs"] = _log_probs(engine)
    out["steps"] = _steps(engine, STEPS)
    folder = engine.save_checkpoint(str(Path(root) / "ckpt"), step=STEPS)
    out["saved_log_probs"] = _log_probs(engine)
    out["continued"] = _steps(engine, MORE)
    resumed = build("megatron", **bf16)
    out["resumed_step"] = resumed.load_checkpoint(folder)
    out["resumed_log_probs"] = _log_probs(resumed)
    out["resumed_continued"] = _steps(resumed, MORE)
    return out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    return make_baseline(str(tmp_path_factory.mktemp("megatron-gpu-baseline")))


@pytest.fixture(
    scope="module",
    params=[(w, impl) for w in _worlds() for impl in IMPLS],
    ids=lambda p: f"world{p[0]}-{p[1]}",
)
def case(
    request: pytest.FixtureRequest, baseline: Baseline, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    world, impl = request.param
    if impl == "transformer_engine":
        pytest.importorskip("transformer_engine")
    dp = world // _tp(world)
    if SAMPLES % dp:
        pytest.skip(f"{world} GPUs give {dp} DP ranks, which do not split {SAMPLES} samples")
    root = str(tmp_path_factory.mktemp(f"megatron-gpu-{world}-{impl}"))
    runs = run_distributed(
        _case, world, baseline.policy_dir, root, impl, timeout=600, pg_backend="nccl"
    )
    return {"world": world, "impl": impl, "runs": runs}


def test_runs_on_cuda_in_bf16(case: dict[str, Any]) -> None:
    for r in case["runs"]:
        assert r["device"] == "cuda" and r["param_devices"] == ["cuda"]
        assert r["param_dtypes"] == ["torch.bfloat16"]


def test_log_probs_match_transformers(case: dict[str, Any], baseline: Baseline) -> None:
    for rank, r in enumerate(case["runs"]):
        if "fp32_log_probs" in r:
            diff = float((r["fp32_log_probs"] - baseline.log_probs).abs().max())
            assert diff <= FP32_ATOL, f"rank {rank}: fp32 log-probs differ by {diff:.3g}"
        diff = float((r["bf16_log_probs"] - baseline.log_probs).abs().max())
        assert diff <= BF16_ATOL, f"rank {rank}: bf16 log-probs differ by {diff:.3g}"


def test_bf16_losses_decrease(case: dict[str, Any]) -> None:
    for rank, r in enumerate(case["runs"]):
        losses = [loss for loss, _ in r["steps"]]
        assert all(math.isfinite(x) for x in losses), f"rank {rank}: {losses}"
        assert all(math.isfinite(norm) for _, norm in r["steps"]), f"rank {rank}: {r['steps']}"
        assert losses[-1] < losses[0], f"rank {rank}: losses did not fall: {losses}"


def test_checkpoint_round_trip(case: dict[str, Any]) -> None:
    for rank, r in enumerate(case["runs"]):
        assert r["resumed_step"] == STEPS
        diff = float((r["resumed_log_probs"] - r["saved_log_probs"]).abs().max())
        assert diff <= 1e-6, f"rank {rank}: reloaded log-probs differ by {diff:.3g}"
        for (loss, norm), (want_loss, want_norm) in zip(
            r["resumed_continued"], r["continued"], strict=True
        ):
            # bf16 backward kernels may accumulate in a different order from run to run
            assert loss == pytest.approx(want_loss, rel=1e-3)
            assert norm == pytest.approx(want_norm, rel=1e-2)
