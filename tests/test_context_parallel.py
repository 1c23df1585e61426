"""Ulysses' all-to-alls (engine_core.context_parallel) and sdpa_varlen's rows of one length.

The end-to-end check (a row split over ranks gives the single-process engine's log-probs and
training curve) is in plugins/fsdp/tests/test_fsdp_parallel.py; here the exchanges themselves:
the tokens and heads each rank gets, the layouts they come in, and their gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine_core.attention import _varlen_attention
from engine_core.context_parallel import head_to_seq, seq_to_head
from tests._dist import run_distributed

HEADS, DIM, LOCAL = 4, 8, 6


def _row(heads: int, length: int, seed: int) -> torch.Tensor:
    """A ``[1, heads, length, DIM]`` row, token-major as transformers' projections give it."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, length, heads, DIM, generator=g).transpose(1, 2)


def _exchange_worker(rank: int, world: int) -> dict[str, Any]:
    group = torch.distributed.group.WORLD
    whole = _row(HEADS, LOCAL * world, seed=0)  # every rank builds the whole row
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    heads = slice(rank * HEADS // world, (rank + 1) * HEADS // world)
    x = whole[:, :, mine].clone().requires_grad_(True)
    to_heads = seq_to_head(x, group)
    back = head_to_seq(to_heads, group)
    weight = _row(HEADS // world, LOCAL * world, seed=1 + rank)  # this rank's heads' gradient
    (to_heads * weight).sum().backward()
    # the gradient of this rank's tokens: every rank's weight for them, each on its own heads
    want_grad = torch.cat([_row(HEADS // world, LOCAL * world, 1 + r) for r in range(world)], 1)
    return {
        "heads": torch.equal(to_heads, whole[:, heads]),
        "token_major": to_heads.transpose(1, 2).is_contiguous(),
        "round_trip": torch.equal(back, x),
        "back_token_major": back.transpose(1, 2).is_contiguous(),
        "grad": torch.equal(x.grad, want_grad[:, :, mine]),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_alls_move_tokens_and_heads_and_their_gradients(world: int) -> None:
    for rank, got in enumerate(run_distributed(_exchange_worker, world)):
        assert got == dict.fromkeys(got, True), (rank, got)


@pytest.mark.parametrize("lengths", [[24], [8, 8, 8], [8, 0, 8, 8]], ids=str)
def test_rows_of_one_length_attend_as_views_of_the_row(lengths: list[int]) -> None:
    # no gather and no scatter: the kernel reads the row itself; each sequence's causal
    # attention, result and gradients, as when it runs alone
    row = sum(lengths)
    q, k, v = (_row(h, row, seed).requires_grad_(True) for h, seed in ((4, 0), (2, 1), (2, 2)))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append([a.untyped_storage().data_ptr() for a in args])
        return sdpa(*args, **kwargs)

    module = torch.nn.Module()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("engine_core.attention.F.scaled_dot_product_attention", spy)
        out, _ = _varlen_attention(module, q, k, v, None, 0.0, None, cu)
    assert seen == [[x.untyped_storage().data_ptr() for x in (q, k, v)]]  # one call, no copy
    assert out.shape == (1, row, 4, DIM) and out.is_contiguous()
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(out, (q, k, v), grad)
    for start, n in zip(cu[:-1].tolist(), lengths, strict=True):
        if n == 0:
            continue
        part = [x[:, :, start : start + n].detach().requires_grad_(True) for x in (q, k, v)]
        alone = F.scaled_dot_product_attention(*part, is_causal=True, enable_gqa=True)
        want = torch.autograd.grad(alone, part, grad[:, start : start + n].transpose(1, 2))
        torch.testing.assert_close(out[:, start : start + n].transpose(1, 2), alone)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g[:, :, start : start + n], w)
