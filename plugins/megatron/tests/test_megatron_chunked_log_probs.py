"""Chunked log-probs (``logits_chunk_tokens``) in the megatron engine, on two gloo ranks.

One run gathers every figure: the vocabulary-parallel chunked function against a full-vocabulary
log-softmax (values and gradients, a padded vocabulary, a temperature), and the engine at TP=2,
with and without sequence parallelism, with chunks of 3 tokens (crossing sequence boundaries)
against full logits (``logits_chunk_tokens: null``): outputs, training steps and the weights
they leave, and the rows of hidden states the head keeps for the backward (this rank's only,
with sequence parallelism); a value head is unaffected.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_core.batch import ENTROPY, LOG_PROBS, VALUES, BatchMeta, set_meta
from engine_core.loss import GlobalBatchContext, Metric, aggregate_loss
from engine_core.testing.distributed import run_distributed
from engine_core.testing.kit import Baseline, build, eval_batch, forward, make_baseline
from engine_core.testing.models import random_batch, train_steps

PRELOAD = (
    "engine_core_megatron.engine",
    "megatron.core",  # imported by the engine only as it builds: seconds of each process
    "transformers.models.qwen2.modeling_qwen2",
)
OPTIM = {"lr": 1e-2, "clip_grad": 1.0, "warmup_steps": 1}
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tensor_parallel_size": 2},
    "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
}
CHUNKS = {"chunks_of_3": 3, "full_logits": None}
ATOL = 1e-5


def _function(rank: int) -> dict[str, float]:
    """Largest differences from a full-vocabulary log-softmax: 11 real rows padded to 12."""
    from engine_core_megatron.vocab_parallel import vocab_parallel_chunked_log_probs

    vocab, padded, tokens, width, temperature = 11, 12, 10, 8, 0.7
    gen = torch.Generator().manual_seed(3)  # the same tensors on both ranks
    hidden = torch.randn(tokens, width, generator=gen)
    weight = torch.randn(padded, width, generator=gen)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    g_lp, g_ent = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)

    h_full, w_full = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp = torch.log_softmax(h_full @ w_full[:vocab].t() / temperature, dim=-1)
    lp_full = logp.gather(-1, targets[:, None]).squeeze(-1)
    ent_full = -(logp.exp() * logp).sum(-1)
    ((g_lp * lp_full).sum() + (g_ent * ent_full).sum()).backward()

    rows = slice(rank * padded // 2, (rank + 1) * padded // 2)
    h, w = hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_()
    lp, ent = vocab_parallel_chunked_log_probs(
        h,
        w,
        targets,
        vocab_size=vocab,
        group=dist.group.WORLD,
        temperature=temperature,
        entropy=True,
        chunk_tokens=3,
    )
    assert ent is not None
    ((g_lp * lp).sum() + (g_ent * ent).sum()).backward()
    assert h.grad is not None and w.grad is not None and w_full.grad is not None
    grad_h = h.grad.clone()
    dist.all_reduce(grad_h)  # each rank's part is a sum over its slice of the vocabulary
    return {
        "log_probs": float((lp - lp_full).abs().max()),
        "entropy": float((ent - ent_full).abs().max()),
        "grad_hidden": float((grad_h - h_full.grad).abs().max()),  # type: ignore[operator]
        "grad_weight": float((w.grad - w_full.grad[rows]).abs().max()),
    }


def _entropy_loss(
    mb: TensorDict, out: TensorDict, ctx: GlobalBatchContext
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """NLL with an entropy bonus: both outputs carry a gradient."""
    from engine_core.engine import loss_mask_of

    per_token = -out[LOG_PROBS] - 0.1 * out[ENTROPY]
    return aggregate_loss(per_token, loss_mask_of(mb), "token-mean", ctx), {}


def _entropy_step(engine: Any) -> tuple[float, float]:
    """One optimizer step on the entropy-regularised loss at temperature 0.9."""
    batch = random_batch(8, seed=7)
    set_meta(batch, BatchMeta(compute_entropy=True, temperature=0.9))
    engine.set_loss_fn(_entropy_loss)
    with engine.train_mode():
        result = engine.forward_backward_step(engine.shard_data(batch))
        norm = engine.optimizer_step()
        engine.optimizer_zero_grad()
    return float(result.loss), float(norm)


def _forward_with_widths(engine: Any) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Outputs of the eval batch, and the last dimension of what the output layer returned:
    2 (log-prob, entropy) from the chunked head, or this rank's vocabulary slice."""
    widths: set[int] = set()
    layer = engine.chunks[-1].module.output_layer
    hook = layer.register_forward_hook(lambda m, a, o: widths.add(int(o[0].shape[-1])))
    try:
        return forward(engine, eval_batch()), sorted(widths)
    finally:
        hook.remove()


def _rows_kept(engine: Any) -> list[tuple[int, int]]:
    """For each training micro-batch: the rows (tokens) the output layer computed, and the rows
    of hidden states its chunked function keeps for the backward."""
    seen: list[tuple[int, int]] = []

    def hook(module: Any, args: Any, out: Any) -> None:
        nodes, visited = [out[0].grad_fn], set()
        while nodes:
            node = nodes.pop()
            if node is None or id(node) in visited:
                continue
            visited.add(id(node))
            if type(node).__name__.startswith("ChunkedHead"):
                seen.append((out[0].shape[0] * out[0].shape[1], node.saved_tensors[0].shape[0]))
                return
            nodes += [n for n, _ in node.next_functions]

    layer = engine.chunks[-1].module.output_layer
    handle = layer.register_forward_hook(hook)
    try:
        with engine.train_mode():
            engine.forward_backward_step(engine.shard_data(random_batch(8, seed=5)))
            engine.optimizer_zero_grad()
    finally:
        handle.remove()
    return seen


def _runs(rank: int, world: int, policy: str, critic: str) -> dict[str, Any]:
    out: dict[str, Any] = {"function": _function(rank)}
    for layout, sizes in LAYOUTS.items():
        for name, chunk in CHUNKS.items():
            engine = build(
                "megatron", model={"path": policy}, optim=OPTIM, logits_chunk_tokens=chunk, **sizes
            )
            outputs, widths = _forward_with_widths(engine)
            run: dict[str, Any] = {"outputs": outputs, "widths": widths}
            if chunk is not None:
                run["rows_kept"] = _rows_kept(engine)
            # log-probs alone: megatron-core's fused cross-entropy on full logits
            run["steps"] = train_steps(engine, range(2))
            run["entropy_step"] = _entropy_step(engine)
            run["after"] = forward(engine, eval_batch())
            out[f"{layout}/{name}"] = run
    engine = build(
        "megatron",
        model={"path": critic, "value_head": True},
        tensor_parallel_size=2,
        logits_chunk_tokens=3,
    )
    out["values"] = forward(engine, eval_batch())[VALUES]
    return out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    return make_baseline(str(tmp_path_factory.mktemp("megatron-chunked")))


@pytest.fixture(scope="module")
def runs(baseline: Baseline) -> list[dict[str, Any]]:
    return run_distributed(
        _runs, 2, baseline.policy_dir, baseline.critic_dir, timeout=600, preload=PRELOAD
    )


def test_vocab_parallel_chunked_function_equals_full_log_softmax(
    runs: list[dict[str, Any]],
) -> None:
    for rank, r in enumerate(runs):
        for key, diff in r["function"].items():
            assert diff <= ATOL, f"rank {rank}: {key} differs from full logits by {diff:.3g}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_outputs_equal_full_logits(
    runs: list[dict[str, Any]], baseline: Baseline, layout: str
) -> None:
    for rank, r in enumerate(runs):
        # the chunked engine's output layer gave (log-prob, entropy), the other its logits
        assert r[f"{layout}/chunks_of_3"]["widths"] == [2]
        assert r[f"{layout}/full_logits"]["widths"] == [
            baseline.state_dict["lm_head.weight"].shape[0] // 2
        ]
        got, want = r[f"{layout}/chunks_of_3"]["outputs"], r[f"{layout}/full_logits"]["outputs"]
        for key in (LOG_PROBS, ENTROPY):
            diff = float((got[key] - want[key]).abs().max())
            assert diff <= ATOL, f"{layout}, rank {rank}: chunked {key} differ by {diff:.3g}"
        diff = float((got[LOG_PROBS] - baseline.log_probs).abs().max())
        assert diff <= ATOL, f"{layout}, rank {rank}: log-probs differ from transformers by {diff}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_training_equals_full_logits(runs: list[dict[str, Any]], layout: str) -> None:
    for rank, r in enumerate(runs):
        got, want = r[f"{layout}/chunks_of_3"], r[f"{layout}/full_logits"]
        pairs = [*zip(got["steps"], want["steps"], strict=True)]
        pairs.append((got["entropy_step"], want["entropy_step"]))
        for step, ((loss, norm), (w_loss, w_norm)) in enumerate(pairs):
            assert abs(loss - w_loss) <= ATOL * abs(w_loss), f"{layout}, step {step}: loss"
            assert abs(norm - w_norm) <= ATOL * abs(w_norm), f"{layout}, step {step}: grad norm"
        # the weights the three steps leave give the same outputs
        for key in (LOG_PROBS, ENTROPY):
            diff = float((got["after"][key] - want["after"][key]).abs().max())
            assert diff <= ATOL, f"{layout}, rank {rank}: {key} after training differ by {diff}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_head_keeps_only_this_ranks_rows(runs: list[dict[str, Any]], layout: str) -> None:
    """With sequence parallelism the head keeps its input's local rows for the backward (and
    gathers them again there), as megatron-core's own layer does; without, every row."""
    share = 2 if LAYOUTS[layout].get("sequence_parallel") else 1
    for rank, r in enumerate(runs):
        kept = r[f"{layout}/chunks_of_3"]["rows_kept"]
        assert kept, f"{layout}, rank {rank}: the chunked head did not run in training"
        for rows, saved in kept:
            assert saved * share == rows, (
                f"{layout}, rank {rank}: the head keeps {saved} of {rows} rows for the backward"
            )


def test_value_head_is_unaffected(runs: list[dict[str, Any]], baseline: Baseline) -> None:
    for rank, r in enumerate(runs):
        diff = float((r["values"] - baseline.values).abs().max())
        assert diff <= ATOL, f"rank {rank}: values differ from transformers by {diff:.3g}"
