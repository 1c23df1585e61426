"""Qwen3 (per-head q/k RMSNorm, head_dim apart from hidden/heads) on megatron-core.

An unseen tiny Qwen3 of odd shapes (vocabulary 67, head_dim 16 with hidden 48 and 4 heads),
every weight random (the norms too, so a swapped or dropped q/k norm shows), saved with
``save_pretrained``: the megatron engine at TP1, TP2 and PP2 (real gloo groups) against
transformers' own forward, an fsdp2 engine's steps, its own weights handed back under the HF
names, and an export that ``from_pretrained`` loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="the megatron plugin's tests need megatron-core")

from engine_core.batch import LOG_PROBS  # noqa: E402
from engine_core.testing.distributed import run_distributed  # noqa: E402
from engine_core.testing.kit import build, eval_batch, forward, plain_log_probs  # noqa: E402
from engine_core.testing.models import TINY_QWEN3, save_with_own_norms, train_steps  # noqa: E402

PRELOAD = (
    "engine_core_megatron.engine",
    "megatron.core",  # imported by the engine only as it builds: seconds of each process
    "engine_core_fsdp.fsdp2",
    "transformers.models.qwen3.modeling_qwen3",
)
QWEN3 = TINY_QWEN3
OPTIM = {"lr": 1e-2, "clip_grad": 1.0, "warmup_steps": 1}
LAYOUTS: dict[str, tuple[int, dict[str, int]]] = {
    "tp1": (1, {}),
    "tp2": (2, {"tensor_parallel_size": 2}),
    "pp2": (2, {"pipeline_parallel_size": 2}),
}
STEPS = range(3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("qwen3")
    save_with_own_norms(QWEN3, path)
    return str(path)


def _megatron(rank: int, world: int, folder: str, sizes: dict[str, int], root: str) -> Any:
    engine = build("megatron", model={"path": folder}, optim=OPTIM, **sizes)
    weights = {n: t.clone() for n, t in engine.named_full_params()}
    log_probs = forward(engine, eval_batch())[LOG_PROBS]
    steps = train_steps(engine, STEPS)
    engine.export_hf(root)
    return {"weights": weights, "log_probs": log_probs, "steps": steps}


def _fsdp2(rank: int, world: int, folder: str) -> Any:
    return train_steps(build("fsdp2", model={"path": folder}, optim=OPTIM), STEPS)


@pytest.fixture(scope="module")
def runs(folder: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: dict[str, Any] = {}
    (out["fsdp2"],) = run_distributed(_fsdp2, 1, folder, preload=PRELOAD)
    for name, (world, sizes) in LAYOUTS.items():
        root = str(tmp_path_factory.mktemp(f"export-{name}"))
        out[name] = run_distributed(_megatron, world, folder, sizes, root, preload=PRELOAD)[0]
        out[name]["export"] = root
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_qwen3_on_megatron_equals_transformers(
    runs: dict[str, Any], layout: str, folder: str
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    state = hf.state_dict()
    got = runs[layout]
    # the weights come back under the HF names, bit for bit (q/k norms included)
    assert sorted(got["weights"]) == sorted(state)
    for name, t in state.items():
        assert torch.equal(got["weights"][name], t), f"{layout}: {name} differs"
    want, _ = plain_log_probs(hf, eval_batch())
    gap = float((got["log_probs"] - want).abs().max())
    assert gap <= 1e-5, f"{layout}: log-probs {gap:.3g} from transformers'"
    # the same updates as fsdp2 (its transformers model: q/k norms trained the same way)
    for (loss, norm), (want_loss, want_norm) in zip(got["steps"], runs["fsdp2"], strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-4), layout
        assert norm == pytest.approx(want_norm, rel=1e-4), layout
    # the export after training loads with from_pretrained as a Qwen3
    exported = AutoModelForCausalLM.from_pretrained(Path(got["export"]), dtype=torch.float32)
    assert type(exported).__name__ == "Qwen3ForCausalLM"
    assert not torch.equal(exported.state_dict()["model.layers.0.self_attn.q_norm.weight"],
                           state["model.layers.0.self_attn.q_norm.weight"])  # fmt: skip
