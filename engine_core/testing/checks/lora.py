"""LoRA (``lora``): training moves the adapters only, the base model stays the HF weights,
and the weight streams send the peft model's tensors unmerged, or its adapters alone.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

from engine_core.batch import LOG_PROBS
from engine_core.capabilities import Capability
from engine_core.engine import BaseEngine
from engine_core.testing.checks.registry import Check, Context, Layout
from engine_core.testing.checks.verdict import assert_outputs, result
from engine_core.testing.drive import LORA, build, forward, train
from engine_core.testing.oracle import Baseline, eval_batch

__all__ = [
    "CHECKS",
    "test_lora_trains_adapters_only",
    "test_named_weights_sends_a_lora_models_parts",
]


def _lora(c: Context) -> dict[str, Any]:
    engine = build(c.backend, model={"path": c.policy_dir, "lora": LORA})
    module = engine.module
    assert module is not None
    before = _params_unmerged(engine)
    train(engine, range(2))
    after = _params_unmerged(engine)
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    with module.disable_adapter():  # type: ignore[operator]
        base = forward(engine, eval_batch())[LOG_PROBS]
    return {
        "changed": changed,
        "base_log_probs": base,
        "stream": _lora_stream(engine, after),
        "parts": _weight_parts(engine),
    }


def _lora_stream(engine: BaseEngine, held: dict[str, torch.Tensor]) -> list[str]:
    """What is wrong with ``named_lora_params`` against the peft model's own tensors ``held``:
    every tensor, then the adapters alone (what a rollout serving the adapters is sent)."""
    from engine_core.models import is_adapter_name

    problems: list[str] = []
    for adapters_only in (False, True):
        want = {n for n in held if is_adapter_name(n) or not adapters_only}
        try:
            got = {
                n: t.detach().clone()
                for n, t in engine.named_lora_params(1 << 16, adapters_only=adapters_only)
            }
        except NotImplementedError as e:
            return [f"named_lora_params() is not implemented: {e}"]
        call = f"named_lora_params(adapters_only={adapters_only})"
        if set(got) != want:
            missing, extra = sorted(want - set(got)), sorted(set(got) - want)
            problems.append(f"{call} misses {missing[:3]} and adds {extra[:3]}")
        wrong = sorted(n for n in want & set(got) if not torch.equal(got[n], held[n]))
        if wrong:
            problems.append(f"{call} gives other values than the model holds for {wrong[:3]}")
    return problems


def _weight_parts(engine: BaseEngine) -> list[str]:
    """Where ``named_weights`` of a LoRA model's parts differs from ``named_lora_params``."""
    problems = []
    for part, adapters_only in (("peft", False), ("adapters", True)):
        want = {n: t.clone() for n, t in engine.named_lora_params(adapters_only=adapters_only)}
        got = {n: t.clone() for n, t in engine.named_weights(part)}  # type: ignore[arg-type]
        wrong = sorted(got.keys() ^ want.keys()) or sorted(
            n for n in want if not torch.equal(got[n], want[n])
        )
        if wrong:
            problems.append(f"named_weights({part!r}) differs in {wrong[:3]}")
    return problems


def _params_unmerged(engine: BaseEngine) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    assert engine.module is not None
    state: dict[str, Any] = get_model_state_dict(engine.module)
    return {
        k: cast(torch.Tensor, v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in state.items()
    }


LORA_CHECK = Check("lora", Layout.SINGLE, _lora, needs=frozenset({Capability.LORA}))

CHECKS = (LORA_CHECK,)


def test_lora_trains_adapters_only(single: dict, caps: frozenset, kit_baseline: Baseline) -> None:
    if not LORA_CHECK.applies(caps):
        pytest.skip("lora not declared")
    lora = result(single, LORA_CHECK, "lora")
    assert lora["changed"], "[lora] training changed no weight"
    frozen = [n for n in lora["changed"] if "lora_" not in n]
    assert not frozen, f"[lora] base weights changed: {frozen[:5]}"
    assert_outputs(
        lora["base_log_probs"], kit_baseline.log_probs, "disable_adapter log_probs", "lora"
    )
    assert not lora["stream"], (
        "[lora] a rollout that serves the adapters (hf, vllm, sglang) is sent the peft model's "
        "tensors unmerged, then its adapters alone: " + "; ".join(lora["stream"])
    )


def test_named_weights_sends_a_lora_models_parts(single: dict, caps: frozenset) -> None:
    if not LORA_CHECK.applies(caps):
        pytest.skip("lora not declared")
    parts = result(single, LORA_CHECK, "lora")["parts"]
    assert not parts, (
        "[lora] named_weights('peft') and named_weights('adapters') must give "
        "named_lora_params() and named_lora_params(adapters_only=True): " + "; ".join(parts)
    )
