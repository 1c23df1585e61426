"""The HF rollout against plain transformers and a trainer forward, on a tiny model."""

from __future__ import annotations

import pytest
import torch
from engine_core_hf.rollout import HFRollout, HFRolloutConfig
from tensordict import TensorDict

from engine_core.batch import BatchMeta, make_batch
from engine_core.config import ModelConfig
from engine_core.plugins import load_plugins
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from engine_core.resolve import resolve_rollout_config
from engine_core.rollout import SamplingParams, sent_buckets
from tests._models import TINY_QWEN2, engine_config

STOP = 7


def rollout(**kw: object) -> HFRollout:
    return HFRollout(
        HFRolloutConfig(backend="hf", model=ModelConfig(config=dict(TINY_QWEN2)), **kw)
    )


def prompts(n: int = 3, p: int = 6, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, p + 1, (n,), generator=g)
    ids = torch.randint(8, TINY_QWEN2["vocab_size"], (n, p), generator=g)
    mask = (torch.arange(p) >= (p - lengths).unsqueeze(1)).long()  # left padding
    return TensorDict({"prompt_ids": ids * mask, "prompt_mask": mask}, batch_size=[n])


def trainer_log_probs(engine: ReferenceEngine, out: TensorDict, temperature: float) -> torch.Tensor:
    ids = torch.cat([out["prompt_ids"], out["response_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["response_mask"]], 1)
    batch = make_batch(ids, mask, meta=BatchMeta(temperature=temperature))
    with engine.eval_mode():
        lp = engine.forward_backward_step(batch, forward_only=True).outputs["log_probs"]
    return lp[:, out["prompt_ids"].shape[1] :]


def test_registered_and_resolvable() -> None:
    spec, cfg = resolve_rollout_config(
        {"backend": "hf", "model": {"config": dict(TINY_QWEN2)}}, load_plugins()
    )
    assert spec.load_class() is HFRollout and isinstance(cfg, HFRolloutConfig)


def test_greedy_equals_transformers_generate() -> None:
    r = rollout()
    p = prompts()
    out = r.generate(p, SamplingParams(temperature=0, max_new_tokens=8))
    want = r.model.generate(
        input_ids=p["prompt_ids"],
        attention_mask=p["prompt_mask"],
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
    )[:, p["prompt_ids"].shape[1] :]
    assert torch.equal(out["response_ids"], want)
    assert out["finish_reason"] == ["length"] * 3


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_sampled_log_probs_equal_a_trainer_forward(temperature: float) -> None:
    r = rollout(seed=0)
    engine = ReferenceEngine(ReferenceEngineConfig(**engine_config()))
    engine.init_model()
    r.load_weights(sent_buckets(engine.named_full_params()))
    out = r.generate(
        prompts(4), SamplingParams(temperature=temperature, max_new_tokens=6, n=2, seed=1)
    )
    want = trainer_log_probs(engine, out, temperature or 1.0)
    m = out["response_mask"].bool()
    assert torch.allclose(out["rollout_log_probs"][m], want[m], atol=1e-5)
    assert (out["rollout_log_probs"][~m] == 0).all()


def test_n_samples_are_adjacent_and_seeded() -> None:
    r = rollout()
    p = prompts(2)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, n=3, seed=11)
    a, b = r.generate(p, params), r.generate(p, params)
    assert a.batch_size[0] == 6
    assert torch.equal(a["prompt_ids"][:3], p["prompt_ids"][0].expand(3, -1))
    assert torch.equal(a["response_ids"], b["response_ids"])  # same seed, same samples


def test_stop_tokens_end_the_response() -> None:
    r = rollout()
    p = prompts(8, seed=3)
    out = r.generate(
        p, SamplingParams(temperature=1.5, max_new_tokens=12, stop_token_ids=[STOP, 9], seed=0)
    )
    for i in range(8):
        resp, m = out["response_ids"][i], out["response_mask"][i].bool()
        kept = resp[m].tolist()
        stops = [j for j, t in enumerate(kept) if t in (STOP, 9)]
        if out["finish_reason"][i] == "stop":
            assert stops == [len(kept) - 1]  # one stop token, the last kept one
            assert (resp[~m] == 0).all()
        else:
            assert stops == [] and len(kept) == 12
    assert "stop" in out["finish_reason"]  # the test must exercise the stop path


def test_generate_refuses_missing_prompt_fields() -> None:
    with pytest.raises(Exception, match="prompt_mask"):
        rollout().generate(
            TensorDict({"prompt_ids": torch.ones(1, 2, dtype=torch.long)}, batch_size=[1]),
            SamplingParams(),
        )


def test_sync_changes_what_is_generated() -> None:
    engine = ReferenceEngine(ReferenceEngineConfig(**engine_config()))
    engine.init_model()
    r = rollout(seed=99)  # different init from the trainer
    p, params = prompts(), SamplingParams(temperature=0, max_new_tokens=6)
    before = r.generate(p, params)["response_ids"]
    r.load_weights(sent_buckets(engine.named_full_params()))
    after = r.generate(p, params)
    want = engine.module.generate(
        input_ids=p["prompt_ids"],
        attention_mask=p["prompt_mask"],
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
    )[:, p["prompt_ids"].shape[1] :]
    assert torch.equal(after["response_ids"], want)
    assert not torch.equal(before, want)


def test_seeds_leave_the_global_rng_untouched() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    r = rollout(seed=5)  # the config's seed builds the model
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=7)
    a = r.generate(prompts(), params)
    assert torch.equal(torch.get_rng_state(), before)  # seeded: the caller's stream is kept
    b = r.generate(prompts(), params)
    c = r.generate(prompts(), params.model_copy(update={"seed": 8}))
    assert torch.equal(a["response_ids"], b["response_ids"])
    assert not torch.equal(a["response_ids"], c["response_ids"])
    assert torch.equal(rollout(seed=5).model.lm_head.weight, r.model.lm_head.weight)
    assert torch.equal(torch.get_rng_state(), before)
