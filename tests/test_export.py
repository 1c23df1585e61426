"""HF-folder export: reloads with from_pretrained and gives identical logits."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from tests._models import TINY_QWEN2, engine_config, nll_loss, random_batch


def _trained(**overrides: object) -> ReferenceEngine:
    engine = ReferenceEngine(ReferenceEngineConfig(**engine_config(**overrides)))
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    with engine.train_mode():
        engine.forward_backward_step(random_batch(4))
        engine.optimizer_step()
    return engine


def test_export_reloads_with_identical_logits(tmp_path: Path) -> None:
    engine = _trained()
    folder = engine.export_hf(str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = random_batch(3)["input_ids"]
    engine.module.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, engine.module(input_ids=ids).logits)


def test_export_replaces_an_older_export(tmp_path: Path) -> None:
    target = tmp_path / "hf"
    _trained().export_hf(str(target))
    first = (target / "model.safetensors").read_bytes()
    engine = _trained(seed=1)
    engine.export_hf(str(target))
    assert (target / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no .tmp/.old left behind


def test_value_head_export(tmp_path: Path) -> None:
    critic = ReferenceEngine(
        ReferenceEngineConfig(
            **engine_config(model={"config": dict(TINY_QWEN2), "value_head": True})
        )
    )
    critic.init_model()
    folder = critic.export_hf(str(tmp_path / "critic"))
    loaded = AutoModelForTokenClassification.from_pretrained(folder).eval()
    ids = random_batch(2)["input_ids"]
    critic.module.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, critic.module(input_ids=ids).logits)


def test_export_to_an_fsspec_url_reloads(tmp_path: Path) -> None:
    import fsspec

    engine = _trained()
    url = "memory://export-test/hf"
    assert engine.export_hf(url) == url
    engine.export_hf(url)  # replacing an export at a URL works the same way
    fs = fsspec.filesystem("memory")
    assert [p.rsplit("/", 1)[-1] for p in fs.ls("/export-test", detail=False)] == ["hf"]
    fs.get("/export-test/hf", str(tmp_path / "hf"), recursive=True)
    fs.rm("/export-test", recursive=True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = random_batch(3)["input_ids"]
    engine.module.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, engine.module(input_ids=ids).logits)
