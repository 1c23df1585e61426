"""Both FSDP engines on CUDA with NCCL: outputs and training against the CPU reference, bf16
mixed precision, offload between modes, flash-attention varlen for packed sequences, and
fsdp2 with compiled blocks.

Marked ``gpu``: skipped cleanly where no CUDA device is visible. One process per GPU, at most two.
"""

from __future__ import annotations

import pytest
import torch

from engine_core.batch import BatchMeta, set_meta
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from tests._dist import run_distributed
from tests._models import engine_config, nll_loss, random_batch, registered_engine, train_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = ["fsdp", "fsdp2"]
N = 8
STEPS = 3
OPTIM = {"lr": 1e-2, "clip_grad": 1.0, "warmup_steps": 1}
BF16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


def _world() -> int:
    return min(2, torch.cuda.device_count())


def _log_probs(engine) -> torch.Tensor:  # type: ignore[no-untyped-def]
    batch = random_batch(N, seed=11, left_pad=True)
    set_meta(batch, BatchMeta())
    engine.set_loss_fn(None)
    with engine.eval_mode():
        out = engine.forward_backward_step(engine.shard_data(batch), forward_only=True).outputs
    engine.set_loss_fn(nll_loss)
    return engine.unshard_data(out)["log_probs"].cpu()


@pytest.fixture(scope="module")
def reference() -> dict:
    e = ReferenceEngine(ReferenceEngineConfig(**engine_config(optim=OPTIM)))
    e.init_model()
    e.set_loss_fn(nll_loss)
    return {"lp": _log_probs(e), "curve": train_steps(e, range(STEPS), N)}


def _worker(rank: int, world: int, backend: str, overrides: dict) -> dict:
    engine = registered_engine(backend, optim=OPTIM, **overrides)
    out: dict = {"lp": _log_probs(engine), "curve": train_steps(engine, range(STEPS), N)}
    out["param_devices"] = sorted({p.device.type for p in engine.module.parameters()})
    out["master_dtypes"] = sorted({str(p.dtype) for p in engine.module.parameters()})
    out["allocated_after"] = torch.cuda.memory_allocated()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_nccl_fp32_matches_cpu_reference(backend: str, reference: dict) -> None:
    for r in run_distributed(_worker, _world(), backend, {}, pg_backend="nccl"):
        assert r["param_devices"] == ["cuda"]
        assert torch.allclose(r["lp"], reference["lp"], atol=1e-4)
        for (loss, norm), (want_loss, want_norm) in zip(
            r["curve"], reference["curve"], strict=True
        ):
            assert loss == pytest.approx(want_loss, rel=1e-4)
            assert norm == pytest.approx(want_norm, rel=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_mixed_precision_on_gpu(backend: str, reference: dict) -> None:
    overrides = {"mixed_precision": BF16}
    for r in run_distributed(_worker, _world(), backend, overrides, pg_backend="nccl"):
        assert r["master_dtypes"] == ["torch.float32"]
        assert torch.allclose(r["lp"], reference["lp"], atol=5e-2)
        for (loss, _), (want_loss, _) in zip(r["curve"], reference["curve"], strict=True):
            assert loss == pytest.approx(want_loss, rel=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_offload_leaves_gpu_between_modes_and_trains_the_same(
    backend: str, reference: dict
) -> None:
    for r in run_distributed(_worker, _world(), backend, {"offload": True}, pg_backend="nccl"):
        assert r["param_devices"] == ["cpu"]  # offloaded after the last train_mode exit
        assert torch.allclose(r["lp"], reference["lp"], atol=1e-4)
        for (loss, norm), (want_loss, want_norm) in zip(
            r["curve"], reference["curve"], strict=True
        ):
            assert loss == pytest.approx(want_loss, rel=1e-4)
            assert norm == pytest.approx(want_norm, rel=1e-4)
    resident = run_distributed(_worker, _world(), backend, {}, pg_backend="nccl")
    offloaded = run_distributed(_worker, _world(), backend, {"offload": True}, pg_backend="nccl")
    for kept, freed in zip(resident, offloaded, strict=True):
        assert freed["allocated_after"] < kept["allocated_after"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attention_varlen_packed_matches_sdpa(backend: str) -> None:
    pytest.importorskip("flash_attn")
    runs = {}
    for attn in ("sdpa", "flash_attention_2"):
        model = {"config": engine_config()["model"]["config"], "attn_implementation": attn}
        overrides = {"model": model, "mixed_precision": BF16, "use_packing": True}
        runs[attn] = run_distributed(_worker, _world(), backend, overrides, pg_backend="nccl")
    for sdpa, flash in zip(runs["sdpa"], runs["flash_attention_2"], strict=True):
        # packed sequences must not attend to each other under either kernel
        assert torch.allclose(flash["lp"], sdpa["lp"], atol=5e-2)
        for (a, _), (b, _) in zip(flash["curve"], sdpa["curve"], strict=True):
            assert a == pytest.approx(b, rel=2e-2)


def test_fsdp2_compiled_blocks_on_gpu(reference: dict) -> None:
    # inductor's CUDA kernels for each block, packed rows through sdpa_varlen, fp32 then bf16
    model = {"config": engine_config()["model"]["config"], "attn_implementation": "sdpa_varlen"}
    packed = {"model": model, "use_packing": True, "compile": True}
    for r in run_distributed(_worker, _world(), "fsdp2", packed, pg_backend="nccl"):
        assert torch.allclose(r["lp"], reference["lp"], atol=1e-4)
        for (loss, norm), (want_loss, want_norm) in zip(
            r["curve"], reference["curve"], strict=True
        ):
            assert loss == pytest.approx(want_loss, rel=1e-4)
            assert norm == pytest.approx(want_norm, rel=1e-4)
    bf16 = {**packed, "mixed_precision": BF16}
    for r in run_distributed(_worker, _world(), "fsdp2", bf16, pg_backend="nccl"):
        assert torch.allclose(r["lp"], reference["lp"], atol=5e-2)
        for (loss, _), (want_loss, _) in zip(r["curve"], reference["curve"], strict=True):
            assert loss == pytest.approx(want_loss, rel=2e-2)
