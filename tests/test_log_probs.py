"""Chunked log-probs and entropy: the values and gradients of the full-logits path, without
keeping ``[tokens, vocab]`` logits for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from engine_core.log_probs import chunked_head, chunked_token_log_probs, head_of, token_log_probs

N, H, V = 37, 16, 101


def _inputs(dtype: torch.dtype = torch.float32, bias: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, b, targets


def _grads(*tensors: torch.Tensor | None) -> list[torch.Tensor]:
    """The tensors' gradients (cleared)."""
    out = []
    for t in tensors:
        if t is not None:
            assert t.grad is not None
            out.append(t.grad.clone())
            t.grad = None
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [5, N, 1000])  # several chunks; exactly one; one, kept
@pytest.mark.parametrize("terms", ["both", "log_probs", "entropy"])
def test_values_and_gradients_equal_the_full_logits_path(
    temperature: float, bias: bool, chunk: int, terms: str
) -> None:
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    entropy = terms != "log_probs"

    def run(path: str, dtype: torch.dtype) -> list[torch.Tensor]:
        hidden, weight, b, targets = _inputs(dtype, bias)
        if path == "full" and dtype == torch.float64:  # the truth, all in float64
            logp = torch.log_softmax(F.linear(hidden, weight, b) / temperature, dim=-1)
            lp = logp.gather(-1, targets[:, None]).squeeze(-1)
            ent = -(logp.exp() * logp).sum(-1) if entropy else None
        elif path == "full":
            logits = F.linear(hidden, weight, b) / temperature
            lp, ent = token_log_probs(logits, targets, entropy=entropy)
        else:
            lp, ent = chunked_token_log_probs(
                hidden,
                weight,
                targets,
                bias=b,
                temperature=temperature,
                entropy=entropy,
                chunk_tokens=chunk,
            )
            assert lp.dtype == torch.float32 and (ent is None) == (not entropy)
        total = torch.zeros((), dtype=torch.float64)
        if terms != "entropy":
            total = total + (lp.double() * g_lp.double()).sum()
        if entropy:
            assert ent is not None
            total = total + (ent.double() * g_ent.double()).sum()
        total.backward()
        values = [lp.double()] + ([ent.double()] if ent is not None else [])
        return [v.detach() for v in values] + [g.double() for g in _grads(hidden, weight, b)]

    truth = run("full", torch.float64)
    full, chunked = run("full", torch.float32), run("chunked", torch.float32)
    # as close to the float64 result as the full-logits path is in float32 (float rounding of
    # another order of operations), or within 4e-6 of each quantity's scale: float32 sums of a
    # few hundred terms, whose rounding follows the thread count of the matrix products
    for i, (want, old, new) in enumerate(zip(truth, full, chunked, strict=True)):
        scale = want.abs().max().item()
        err, old_err = (new - want).abs().max().item(), (old - want).abs().max().item()
        assert err <= max(2 * old_err, 4e-6 * scale), (i, err, old_err, scale)


def test_bfloat16_layer_gives_float32_results_close_to_the_full_path() -> None:
    hidden, weight, _, targets = _inputs(torch.bfloat16)
    lp, ent = token_log_probs(F.linear(hidden, weight), targets, entropy=True)
    (lp.sum() + ent.sum()).backward()
    want = _grads(hidden, weight)
    lp2, ent2 = chunked_token_log_probs(hidden, weight, targets, entropy=True, chunk_tokens=7)
    assert ent2 is not None
    (lp2.sum() + ent2.sum()).backward()
    got = _grads(hidden, weight)
    assert lp2.dtype == ent2.dtype == torch.float32
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    torch.testing.assert_close(lp2, lp, rtol=0, atol=1e-4)
    for a, c in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), c.float(), rtol=2e-2, atol=2e-2)


def test_float32_layer_under_autocast_computes_its_backward_like_the_plain_layer() -> None:
    # an engine's compute_dtype: float32 weights, the forward under autocast, the backward
    # outside it; the chunks' backward must still run the layer's matmuls in bfloat16
    hidden, weight, _, targets = _inputs()

    def grads(chunked: bool, autocast: bool = True) -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if chunked:
                lp, ent = chunked_token_log_probs(
                    hidden, weight, targets, entropy=True, chunk_tokens=7
                )
            else:
                lp, ent = token_log_probs(F.linear(hidden, weight), targets, entropy=True)
        assert ent is not None and lp.dtype == torch.float32
        (lp.sum() + 0.5 * ent.sum()).backward()
        return _grads(hidden, weight)

    plain, chunked, float32 = grads(False), grads(True), grads(True, autocast=False)
    assert chunked[0].dtype == chunked[1].dtype == torch.float32  # the weights' dtype
    # the hidden states' gradient is one bfloat16 matmul per row, whole or in chunks
    torch.testing.assert_close(chunked[0], plain[0], rtol=0, atol=1e-6)
    assert float((chunked[0] - float32[0]).abs().max()) > 1e-4  # not a float32 backward
    # the weight's sums over chunks in float32: within bfloat16 rounding of the whole matmul's
    torch.testing.assert_close(chunked[1], plain[1], rtol=2e-2, atol=2e-2)


def test_the_backward_keeps_no_tensor_of_the_logits_size() -> None:
    hidden, weight, _, targets = _inputs()
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = chunked_token_log_probs(hidden, weight, targets, entropy=True, chunk_tokens=5)
    assert max(saved) < N * V, saved  # hidden states and weight only
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_log_probs(F.linear(hidden, weight), targets, entropy=True)
    assert max(saved) >= N * V  # the full path keeps [N, V] tensors: the check can fail


def test_a_second_backward_through_a_kept_chunk_is_refused() -> None:
    # a single chunk's log-softmax is kept for the backward, which overwrites it: autograd's
    # version check refuses a second backward instead of reading the overwritten values
    hidden, weight, _, targets = _inputs()
    lp, _ = chunked_token_log_probs(hidden, weight, targets, chunk_tokens=1000)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()


def test_shapes_that_disagree_are_refused() -> None:
    hidden, weight, _, targets = _inputs()
    with pytest.raises(ValueError, match=r"hidden \(37, 16\) and targets \(36,\)"):
        chunked_token_log_probs(hidden, weight, targets[1:])
    with pytest.raises(ValueError, match=r"weight \(101, 8\) must be \[vocab, 16\]"):
        chunked_token_log_probs(hidden, weight[:, :8], targets)


def test_models_that_change_logits_after_the_output_layer_keep_full_logits() -> None:
    base = {
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
    }
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **base))
    head, why = head_of(plain)
    assert head is plain.lm_head and why == ""
    capped = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gemma2", final_logit_softcapping=30.0, **base)
    )
    head, why = head_of(capped)
    assert head is None and "soft-caps its logits" in why


def test_the_head_gives_logits_again_after_the_call() -> None:
    head = torch.nn.Linear(H, V)
    hidden, _, _, targets = _inputs()
    with chunked_head(head, targets, entropy=True):
        assert head(hidden).shape == (N, 2)
    assert head(hidden).shape == (N, V)
    marker = head.forward = lambda x: x  # a forward someone else set on the instance
    with chunked_head(head, targets):
        assert head(hidden).shape == (N, 2)
    assert head.forward is marker
