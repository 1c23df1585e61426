"""Meta-device init of a model large enough to measure: no rank ever holds the full model.

A Qwen2 of about 83 M parameters (≈ 330 MB in fp32) is saved with ``save_pretrained``; two gloo
ranks then load it with ``init='meta'`` (each reads only its shards from the safetensors file)
and, for comparison, with ``init='all_ranks'`` (each loads everything, then shards). Each rank's
peak resident memory growth during ``init_model`` is measured from ``/proc/self/status``
(VmHWM after, VmRSS before, with the peak reset first); the figures are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_core_fsdp.fsdp2 import FSDP2Engine, FSDP2EngineConfig

from engine_core.batch import make_batch
from tests._dist import run_distributed

LARGE = {
    "model_type": "qwen2",
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise AssertionError(f"{field} not in /proc/self/status")


def _reset_peak() -> float:
    """Reset this process's peak RSS (VmHWM) to its current RSS; return that RSS in MB.

    (``getrusage``'s peak survives exec, so a spawned child would inherit its parent's.)
    """
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def _load_worker(rank: int, world: int, path: str, init: str) -> dict:
    cfg = FSDP2EngineConfig(backend="fsdp2", model={"path": path}, init=init)
    engine = FSDP2Engine(cfg)
    import accelerate  # noqa: F401  - library code is not model memory: import before the baseline
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    before = _reset_peak()
    engine.init_model()
    grown = _status_mb("VmHWM") - before
    g = torch.Generator().manual_seed(0)
    batch = make_batch(torch.randint(1, LARGE["vocab_size"], (2, 16), generator=g))
    with engine.eval_mode():
        lp = engine.forward_backward_step(batch, forward_only=True).outputs["log_probs"]
    return {"grown_mb": grown, "lp": lp}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("large") / "hf"
    kwargs = dict(LARGE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    )
    size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    model.save_pretrained(folder)
    del model
    return str(folder), size_mb


def test_meta_init_peak_memory_is_well_below_the_model(saved_model: tuple[str, float]) -> None:
    path, size_mb = saved_model
    meta = run_distributed(_load_worker, 2, path, "meta")
    plain = run_distributed(_load_worker, 2, path, "all_ranks")
    meta_mb = [round(r["grown_mb"]) for r in meta]
    plain_mb = [round(r["grown_mb"]) for r in plain]
    print(
        f"\nmodel {size_mb:.0f} MB fp32; peak RSS growth per rank during init_model: "
        f"meta {meta_mb} MB, all_ranks {plain_mb} MB"
    )
    assert all(m < 0.75 * size_mb for m in meta_mb), (meta_mb, size_mb)
    assert all(p > size_mb for p in plain_mb), (plain_mb, size_mb)  # the measurement can see it
    for m, p in zip(meta, plain, strict=True):
        assert torch.allclose(m["lp"], p["lp"], atol=1e-5)
