"""BaseEngine's shared forward/backward path, exercised through the reference engine."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine_core.batch import ATTENTION_MASK, INPUT_IDS, LOG_PROBS, BatchMeta, set_meta
from engine_core.engine import predicted_mask
from engine_core.errors import EngineCoreError, TokenBudgetError
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from tests._models import TINY_QWEN2, engine_config, flat_grad, nll_loss, random_batch


def make_engine(**overrides: object) -> ReferenceEngine:
    engine = ReferenceEngine(ReferenceEngineConfig(**engine_config(**overrides)))
    engine.init_model()
    return engine


def hf_model() -> torch.nn.Module:
    cfg = dict(TINY_QWEN2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))


def per_sequence_log_probs(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Each sequence alone through a plain transformers forward (no padding at all)."""
    out = torch.zeros(ids.shape, dtype=torch.float32)
    for i in range(ids.shape[0]):
        real = mask[i].bool()
        seq = ids[i][real].unsqueeze(0)
        logits = model(input_ids=seq).logits.float()
        lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, seq[0, 1:, None]).squeeze(-1)
        idx = real.nonzero().squeeze(-1)
        out[i, idx[1:]] = lp
    return out


@pytest.mark.parametrize("attn", [None, "eager", "sdpa_varlen"])
@pytest.mark.parametrize("left_pad", [False, True])
@pytest.mark.parametrize("use_packing", [True, False])
def test_log_probs_match_plain_transformers(
    use_packing: bool, left_pad: bool, attn: str | None
) -> None:
    model_cfg = {"config": dict(TINY_QWEN2), "attn_implementation": attn}
    engine = make_engine(use_packing=use_packing, micro_batch_size=3, model=model_cfg)
    batch = random_batch(7, left_pad=left_pad)
    with engine.eval_mode():
        got = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
    model = hf_model().eval()
    with torch.no_grad():
        want = per_sequence_log_probs(model, batch[INPUT_IDS], batch[ATTENTION_MASK])
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # padding and each sequence's first token carry no prediction
    assert (got[~predicted_mask(batch[ATTENTION_MASK])] == 0).all()


def test_packed_needs_no_cache_or_attention_leaks() -> None:
    """Packing relies on position ids and use_cache=False; the engine's output must not depend
    on which other sequences share the packed row."""
    engine = make_engine(micro_batch_size=8)
    batch = random_batch(8, seed=3)
    with engine.eval_mode():
        together = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
    alone = make_engine(micro_batch_size=1)
    with alone.eval_mode():
        single = alone.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
    assert torch.allclose(together, single, atol=1e-5)


def test_entropy_and_temperature() -> None:
    engine = make_engine()
    batch = random_batch(4)
    set_meta(batch, BatchMeta(temperature=2.0, compute_entropy=True))
    with engine.eval_mode():
        out = engine.forward_backward_step(batch, forward_only=True).outputs
    model = hf_model().eval()
    with torch.no_grad():
        logits = model(input_ids=batch[INPUT_IDS], attention_mask=batch[ATTENTION_MASK]).logits
    logp = torch.log_softmax(logits[:, :-1] / 2.0, -1)
    want = logp.gather(-1, batch[INPUT_IDS][:, 1:, None]).squeeze(-1)
    want_ent = -(logp.exp() * logp).sum(-1)
    valid = predicted_mask(batch[ATTENTION_MASK])[:, 1:]
    assert torch.allclose(out[LOG_PROBS][:, 1:][valid], want[valid], atol=1e-5)
    assert torch.allclose(out["entropy"][:, 1:][valid], want_ent[valid], atol=1e-5)


def full_batch_reference_grad(batch) -> tuple[torch.Tensor, float]:
    """Plain single-process PyTorch: one padded forward of the whole batch, mean NLL."""
    model = hf_model()
    ids, mask = batch[INPUT_IDS], batch[ATTENTION_MASK]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=batch["position_ids"]).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    valid = predicted_mask(mask)[:, 1:]
    loss = -(lp * valid).sum() / valid.sum()
    loss.backward()
    return flat_grad(model), float(loss.detach())


BATCHING = [
    {"micro_batch_size": 1},
    {"micro_batch_size": 3},
    {"micro_batch_size": 9},
    {},
    {"max_tokens_per_micro_batch": 24},
    {"max_tokens_per_micro_batch": 50},
    {"max_tokens_per_micro_batch": 1000},
    {"micro_batch_size": 3, "use_packing": False},
    {
        "max_tokens_per_micro_batch": 50,
        "model": {"config": TINY_QWEN2, "attn_implementation": "sdpa_varlen"},
    },
]


@pytest.mark.parametrize(
    "batching",
    BATCHING,
    ids=lambda b: ",".join(f"{k}={v}" for k, v in b.items() if k != "model") or "one",
)
def test_gradient_invariance_single_process(batching: dict) -> None:
    batch = random_batch(9, seed=1)
    want_grad, want_loss = full_batch_reference_grad(batch)
    engine = make_engine(**batching)
    engine.set_loss_fn(nll_loss)
    with engine.train_mode():
        result = engine.forward_backward_step(batch)
    got = flat_grad(engine.module)
    assert torch.allclose(got, want_grad, rtol=1e-5, atol=1e-7), (got - want_grad).abs().max()
    assert result.loss == pytest.approx(want_loss, rel=1e-6)
    assert result.metrics["nll"] == pytest.approx(want_loss, rel=1e-6)


def test_sample_over_budget_is_a_clear_error() -> None:
    engine = make_engine(max_tokens_per_micro_batch=8)
    engine.set_loss_fn(nll_loss)
    with pytest.raises(TokenBudgetError, match="max_tokens_per_micro_batch|budget"):
        with engine.train_mode():
            engine.forward_backward_step(random_batch(4, min_len=12))


def test_training_needs_a_loss_fn() -> None:
    engine = make_engine()
    with pytest.raises(EngineCoreError, match="set_loss_fn"):
        engine.forward_backward_step(random_batch(2))


def test_non_finite_grad_norm_skips_the_update() -> None:
    engine = make_engine()
    engine.set_loss_fn(nll_loss)
    with engine.train_mode():
        engine.forward_backward_step(random_batch(4))
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    next(engine.module.parameters()).grad.view(-1)[0] = float("nan")
    norm = engine.optimizer_step()
    assert norm != norm  # nan
    assert engine.skipped_steps == 1
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("seed", [2, 5])
def test_sdpa_varlen_attends_per_bucket_without_a_mask(seed: int) -> None:
    """The packed row reaches the kernel as one causal call per bucket of lengths, each of
    ``n`` sequences padded to the bucket's longest (the varlen path really runs)."""
    from unittest import mock

    import engine_core.attention as attention

    model_cfg = {"config": dict(TINY_QWEN2), "attn_implementation": "sdpa_varlen"}
    engine = make_engine(micro_batch_size=8, model=model_cfg)
    batch = random_batch(8, seed=seed)
    lengths = batch["attention_mask"].sum(-1).tolist()
    buckets = attention.length_buckets(lengths)
    sdpa = attention.F.scaled_dot_product_attention
    with mock.patch.object(attention.F, "scaled_dot_product_attention", wraps=sdpa) as spy:
        with engine.eval_mode():
            engine.forward_backward_step(batch, forward_only=True)
    layers = TINY_QWEN2["num_hidden_layers"]
    assert 1 < len(buckets) < len(set(lengths))  # some lengths share a call, not all
    assert spy.call_count == layers * len(buckets)
    shapes = sorted({(c.args[0].shape[0], c.args[0].shape[2]) for c in spy.call_args_list})
    want = sorted((sum(n in b for n in lengths), max(b)) for b in buckets)
    assert shapes == want  # [n, h, longest, d] per bucket
    assert all(c.kwargs["is_causal"] and len(c.args) == 3 for c in spy.call_args_list)


def test_length_buckets_share_calls_within_the_padding_bound() -> None:
    from engine_core.attention import MAX_PADDED_COST, length_buckets

    assert length_buckets([7, 8, 9, 8, 7]) == [[7, 8, 9]]  # near-equal lengths: one call
    assert length_buckets([10, 1000]) == [[10], [1000]]  # padding 10 to 1000 doubles the cost
    assert length_buckets([5, 5, 5]) == [[5]]
    assert length_buckets([]) == []
    lengths = torch.randint(1, 300, (500,), generator=torch.Generator().manual_seed(0)).tolist()
    buckets = length_buckets(lengths)
    assert sorted(n for b in buckets for n in b) == sorted(set(lengths))  # each length once
    for b in buckets:
        members = [n for n in lengths if n in b]
        assert max(b) ** 2 * len(members) <= MAX_PADDED_COST * sum(n * n for n in members)


def test_auto_chunks_the_output_layer_only_where_a_chunk_holds_less_than_the_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # logits_chunk_tokens='auto': full logits while a micro-batch's [tokens, vocab] fit in one
    # chunk (chunks would hold as much), chunks once they do not; an explicit size always chunks
    import engine_core.engine as engine_module

    used: list[int] = []
    real = engine_module.chunked_head

    def counted(*args: object, **kwargs: object) -> object:
        used.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module, "chunked_head", counted)
    batch = random_batch(6)
    tokens = 3 * int(batch[INPUT_IDS].shape[1])  # a micro-batch of 3, padded
    vocab = int(TINY_QWEN2["vocab_size"])

    def log_probs(budget: int, setting: object = "auto") -> torch.Tensor:
        monkeypatch.setattr(engine_module, "DEFAULT_CHUNK_ELEMENTS", budget)
        used.clear()
        engine = make_engine(micro_batch_size=3, use_packing=False, logits_chunk_tokens=setting)
        with engine.eval_mode():
            out = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
        return out

    full = log_probs(tokens * vocab)
    assert not used
    chunked = log_probs(tokens * vocab - 1)
    assert len(used) == 2  # one per micro-batch
    log_probs(tokens * vocab, setting=5)
    assert len(used) == 2
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-6)
