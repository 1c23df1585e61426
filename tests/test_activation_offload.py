"""Activation offload: saved tensors copied to host memory and back, on a real transformers model.

On this CPU-only host the offloaded device type is named ``cpu`` explicitly, so the copies really
happen (host to host); the engine's default (every device type but ``cpu``) moves nothing here.
"""

from __future__ import annotations

import pytest
import torch

from engine_core.activation_offload import OffloadActivations
from engine_core.capabilities import Capability
from engine_core.testing.kit import CAPABILITY_TRIGGERS
from tests._models import TINY_QWEN2, random_batch, registered_engine, train_steps


def _model() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_QWEN2)).train()


def _loss(model: torch.nn.Module) -> torch.Tensor:
    ids = random_batch(2, seq_len=16, seed=1)["input_ids"]
    return model(input_ids=ids).logits.float().log_softmax(-1).mean()


def test_backward_reads_host_copies_and_gives_the_same_gradients() -> None:
    model = _model()
    _loss(model).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    offload = OffloadActivations(devices=("cpu",), min_bytes=1024)
    with offload:
        loss = _loss(model)
    loss.backward()
    for p, g in zip(model.parameters(), want, strict=True):
        assert torch.equal(p.grad, g)
    stats = offload.stats
    assert stats.moved > 0 and stats.moved_bytes >= 1024 * stats.moved
    assert stats.kept > 0  # parameters and tensors under min_bytes stay
    assert stats.devices == {"cpu"}


def test_the_backward_uses_the_copies_not_the_originals() -> None:
    """A saved activation changed in place after the forward: autograd refuses the original,
    while the copy offload took at the forward gives the untouched gradient."""

    x = torch.randn(64, 64)

    def run(offload: bool) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        h = leaf * 2.0
        ctx = OffloadActivations(devices=("cpu",), min_bytes=0) if offload else None
        if ctx is not None:
            with ctx:
                y = h.sin()  # saves h
        else:
            y = h.sin()
        with torch.no_grad():
            h.add_(1.0)  # in place, after it was saved
        y.sum().backward()
        assert leaf.grad is not None
        return leaf.grad

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(offload=False)
    assert torch.allclose(run(offload=True), 2.0 * torch.cos(2.0 * x))


def test_parameters_and_small_tensors_stay() -> None:
    weight = torch.nn.Parameter(torch.randn(256, 256))
    x = torch.randn(4, 256, requires_grad=True)
    offload = OffloadActivations(devices=("cpu",), min_bytes=256 * 4 * 4 + 1)
    with offload:
        out = x @ weight  # saves x (4 KiB: under min_bytes) and the weight (a parameter)
    out.sum().backward()
    assert offload.stats.moved == 0 and offload.stats.kept == 2
    # views of a parameter stay as well (FSDP1's forward runs on views of its flat parameter)
    offload = OffloadActivations(devices=("cpu",), min_bytes=0)
    with offload:
        out = x @ weight.view(256, 256)[:, :128]
    assert offload.stats.kept == 1 and offload.stats.moved == 1  # the view stays; x moves


def _saved_outside(engine) -> int:  # type: ignore[no-untyped-def]
    """Saved tensors a hook around the whole step sees (innermost hooks take them first)."""
    seen = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal seen
        seen += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), engine.train_mode():
        engine.forward_backward_step(engine.shard_data(random_batch(4, seed=3)))
        engine.optimizer_zero_grad()
    return seen


@pytest.mark.parametrize("backend", ["reference", "fsdp2"])
def test_the_engine_runs_the_model_inside_the_offload_hooks(backend: str) -> None:
    plain = registered_engine(backend)
    offloaded = registered_engine(backend, **CAPABILITY_TRIGGERS[Capability.ACTIVATION_OFFLOAD])
    # the model's activations go to the engine's hooks, not to one around the step
    assert _saved_outside(plain) > 50
    assert _saved_outside(offloaded) < _saved_outside(plain) // 10
    # and training is unchanged (on CPU nothing moves)
    again = registered_engine(backend)
    assert train_steps(offloaded, range(2)) == train_steps(again, range(2))


def test_compiled_blocks_save_through_the_hooks_without_recompiling() -> None:
    """fsdp2 with ``compile``: the compiled blocks' saved tensors reach the engine's hooks too,
    training is unchanged, and once shapes have gone dynamic, steps compile nothing new."""
    from torch._dynamo.utils import counters

    plain = registered_engine("fsdp2", compile=True)
    offloaded = registered_engine("fsdp2", compile=True, activation_offload=True)
    assert _saved_outside(offloaded) < _saved_outside(plain) // 10
    again = registered_engine("fsdp2", compile=True)
    # the first steps compile, then recompile with dynamic shapes (new lengths)
    assert train_steps(offloaded, range(2)) == train_steps(again, range(2))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    assert train_steps(offloaded, range(2, 5)) == train_steps(again, range(2, 5))
    assert counters["stats"]["unique_graphs"] == graphs
