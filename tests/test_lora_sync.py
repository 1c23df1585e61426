"""LoRA weight syncs: a rollout that serves the adapters takes the base once, then the adapters.

A real fsdp2 engine holding a peft model (tiny Qwen2 from a config) and a real HF rollout built
with the same ``model.lora``; jobs run end to end with the rollout colocated, in a process of
its own (a gloo group) and in another interpreter (relayed over pipes).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_core_hf.rollout import HFRollout, HFRolloutConfig
from tensordict import TensorDict

from engine_core.batch import BatchMeta, make_batch
from engine_core.config import ModelConfig
from engine_core.configio import apply_overrides, load_yaml
from engine_core.errors import WeightSyncError
from engine_core.models import build_model, is_adapter_name
from engine_core.plugins import load_plugins
from engine_core.rollout import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    SamplingParams,
    model_weight_shapes,
    sent_buckets,
)
from engine_core_roles.distributed.weights import WeightLink
from engine_core_roles.distributed.workers import build_engine
from engine_core_roles.jobs.cli import RECIPES
from engine_core_roles.jobs.rl.run import run_rl_job
from engine_core_roles.models.actor import Actor, ActorConfig
from engine_core_roles.trainer.metrics import TIMING_KEYS
from tests._models import TINY_QWEN2, engine_config

LORA = {"rank": 4, "alpha": 8.0}
MODEL = {"config": dict(TINY_QWEN2), "lora": LORA}
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3)


def _nbytes(named: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def _peft_state(actor: Actor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in actor.engine.named_weights("peft")}


def _gap(actor: Actor, out: TensorDict) -> float:
    """Largest |rollout log-prob - the actor's own| over the sampled tokens."""
    ids = torch.cat([out[PROMPT_IDS], out[RESPONSE_IDS]], 1)
    mask = torch.cat([out[PROMPT_MASK], out[RESPONSE_MASK]], 1)
    engine = actor.engine
    with engine.eval_mode():
        lp = engine.forward_backward_step(
            make_batch(ids, mask, meta=BatchMeta(temperature=PARAMS.temperature)), forward_only=True
        ).outputs["log_probs"][:, out[PROMPT_IDS].shape[1] :]
    return float((lp - out[ROLLOUT_LOG_PROBS]).abs()[out[RESPONSE_MASK].bool()].max())


def _prompts() -> TensorDict:
    ids = torch.randint(
        1, TINY_QWEN2["vocab_size"], (3, 5), generator=torch.Generator().manual_seed(1)
    )
    return TensorDict({PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}, batch_size=[3])


def test_a_lora_policy_sends_its_base_once_then_the_adapters_alone() -> None:
    actor = Actor(ActorConfig(), build_engine(engine_config(backend="fsdp2", model=MODEL)))
    # another seed: the rollout's base starts different from the actor's, so the first sync
    # must carry the base for the two to agree
    rollout = HFRollout(HFRolloutConfig(backend="hf", model=ModelConfig(**MODEL), seed=99))
    link = WeightLink(actor, rollout)
    assert link.serves_adapters and link.next_part == "peft"
    everything = _peft_state(actor)
    adapters = {k: v for k, v in everything.items() if is_adapter_name(k)}
    assert adapters and len(adapters) < len(everything)

    first = link.sync()
    assert first["weight_sync/bytes"] == _nbytes(everything.items())
    held = rollout.model.state_dict()
    assert all(torch.equal(held[k], v) for k, v in everything.items())
    assert link.next_part == "adapters"

    # the adapters train (lora_B starts at zero: move it), the base does not
    with torch.no_grad():
        for name, p in actor.engine.require_module().named_parameters():
            if is_adapter_name(name):
                p.add_(torch.randn_like(p) * 0.05)
    second = link.sync()
    now = _peft_state(actor)
    assert second["weight_sync/bytes"] == _nbytes((k, now[k]) for k in adapters)
    assert second["weight_sync/bytes"] < first["weight_sync/bytes"] / 5
    held = rollout.model.state_dict()
    assert all(torch.equal(held[k], v) for k, v in now.items())
    assert not all(torch.equal(adapters[k], now[k]) for k in adapters)  # a real change went
    assert _gap(actor, rollout.generate(_prompts(), PARAMS)) < 1e-5

    # an adapter stream that leaves one adapter out is refused, naming it
    left_out = sorted(adapters)[0]
    partial = [(k, now[k]) for k in sorted(adapters) if k != left_out]
    with pytest.raises(WeightSyncError, match=rf"never sent.*{left_out}"):
        rollout.load_weights(sent_buckets(partial))
    link.close()


def test_a_rollout_names_the_base_or_the_peft_weights_it_takes() -> None:
    """model_weight_shapes: a rollout that takes merged weights expects the base model's names
    (a link to it sends part='model'); one that serves the adapters (hf, vllm, sglang) the
    peft model's (part='peft', then 'adapters')."""
    shapes = model_weight_shapes(ModelConfig(**MODEL))
    assert shapes == model_weight_shapes(ModelConfig(config=dict(TINY_QWEN2)))
    assert not any(is_adapter_name(n) for n in shapes)
    peft_names = build_model(ModelConfig(**MODEL)).state_dict()
    served = model_weight_shapes(ModelConfig(**MODEL), adapters=True)
    assert served == {n: tuple(t.shape) for n, t in peft_names.items()}
    assert any(is_adapter_name(n) for n in served)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_lora_job_syncs_adapters_only_wherever_the_rollout_runs(tmp_path: Path) -> None:
    variants = {
        "colocated": ["rollout_placement=colocated"],
        "process": ["rollout_placement=process"],
        "interpreter": ["rollout_placement=process", f"rollout_python={sys.executable}"],
        # vLLM serves the adapters itself (its own sampler: checked for bytes and log-probs)
        "vllm": ["rollout.backend=vllm"],
    }
    if importlib.util.find_spec("vllm") is None:
        del variants["vllm"]
    runs = {}
    for name, extra in variants.items():
        out = tmp_path / name
        overrides = [f"output_dir={out}", "steps=3", "log_every=1", *extra]
        raw = apply_overrides(load_yaml(RECIPES / "grpo_tiny.yaml"), overrides)
        raw["engine"]["model"]["lora"] = dict(LORA)
        peft_model = build_model(ModelConfig(**raw["engine"]["model"])).state_dict()
        adapter_bytes = _nbytes((n, t) for n, t in peft_model.items() if is_adapter_name(n))
        run_rl_job(raw, load_plugins())
        runs[name] = _rows(out)
        assert [r["weight_sync/bytes"] for r in runs[name]] == [adapter_bytes] * 3, name
        limit = 1e-4 if name == "vllm" else 1e-5  # vLLM: kernels of its own, in fp32
        assert max(r["rollout/logprob_diff_max"] for r in runs[name]) < limit, name
    for name in ("process", "interpreter"):
        for a, b in zip(runs["colocated"], runs[name], strict=True):
            for k in a:
                if k not in TIMING_KEYS:
                    assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (name, k)


def test_adapter_folders_write_what_peft_loads(tmp_path: Path) -> None:
    """Each version's folder is peft's own format: peft loads it onto the base model and computes
    what the trained peft model computes; only the newest folder is kept; nothing to serve is
    refused."""
    from peft import PeftModel

    from engine_core.adapters import AdapterFolders, split_peft_tensors
    from engine_core.config import LoraConfig

    torch.manual_seed(0)
    trained = build_model(ModelConfig(**MODEL))
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if is_adapter_name(name):
                p.add_(torch.randn_like(p) * 0.3)
    adapters: dict[str, torch.Tensor] = {}
    base = dict(split_peft_tensors(trained.state_dict().items(), adapters))
    assert adapters and all(is_adapter_name(n) for n in adapters)
    assert not any("base_layer" in n or n.startswith("base_model.") for n in base)

    folders = AdapterFolders(LoraConfig(**LORA))
    first = folders.write(adapters)
    second = folders.write(adapters)
    assert not first.exists() and second.exists() and folders.version == 2
    plain = build_model(ModelConfig(config=dict(TINY_QWEN2)), load_weights=False)
    plain.load_state_dict(base)
    served = PeftModel.from_pretrained(plain, str(second)).eval()
    ids = _prompts()[PROMPT_IDS]
    with torch.no_grad():
        assert torch.allclose(served(ids).logits, trained.eval()(ids).logits, atol=1e-6)
    with pytest.raises(WeightSyncError, match="no LoRA adapter tensors"):
        folders.write({})
    folders.cleanup()
