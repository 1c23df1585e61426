"""How the kit's contract tests judge a check's raw result: the tolerances, reading a result
(a check that did not run or raised fails the test that reads it), and the assertions several
concerns share (outputs against plain transformers, one step's loss and grad norm, what a call
raised).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine_core.testing.checks.registry import ERROR, Check
from engine_core.testing.oracle import Baseline

__all__ = [
    "ATOL",
    "RTOL",
    "assert_outputs",
    "check_step",
    "exception",
    "is_",
    "probe",
    "result",
    "described",
]

ATOL = 1e-5  # fp32 outputs against plain transformers
RTOL = 1e-5  # fp32 losses and grad norms


_HINTS = {
    "no process group": (
        " (a script and `engine-core run` build the engine in a plain process with no process "
        "group: create a one-rank group in init_model when none exists, or avoid collectives)"
    ),
    "checkpoint": (
        " (every rank must write and read only its own part of sharded state; save_shards and "
        "load_shards run on every rank)"
    ),
}


def result(results: dict[str, Any], check: Check, contract: str) -> Any:
    """``check``'s raw result in ``results`` (one process's); fails the test, under the
    ``[contract]`` it checks, when the check did not run or raised inside the engine."""
    key = check.name
    if key not in results:
        pytest.fail(f"[{contract}] check {key!r} did not run")
    value = results[key]
    if isinstance(value, dict) and ERROR in value and isinstance(value[ERROR], str):
        hint = _HINTS.get(contract.split(",")[0], "")
        pytest.fail(f"[{contract}] check {key!r} raised inside the engine{hint}:\n{value[ERROR]}")
    return value


def order_hint(got: torch.Tensor, want: torch.Tensor) -> str:
    """Name rows that match a different input row: outputs returned out of input order."""
    moved = []
    for i in range(got.shape[0]):
        if torch.allclose(got[i], want[i], atol=ATOL):
            continue
        for j in range(want.shape[0]):
            if j != i and torch.allclose(got[i], want[j], atol=ATOL):
                moved.append(f"output row {i} is input row {j}")
                break
    if moved:
        return (
            "outputs are not in input order (" + "; ".join(moved[:4]) + "): restore the order "
            "of the batch after micro-batching (MicroBatchPlan.restore)."
        )
    return ""


def assert_outputs(got: torch.Tensor, want: torch.Tensor, what: str, layout: str) -> None:
    if got.shape != want.shape:
        pytest.fail(
            f"[outputs] {what} ({layout}): shape {tuple(got.shape)}, want {tuple(want.shape)}"
        )
    if torch.allclose(got, want, atol=ATOL):
        return
    hint = order_hint(got, want) or (
        "check position ids, packing boundaries, padding and the shift that aligns position t "
        "with the prediction of token t."
    )
    diff = float((got - want).abs().max())
    pytest.fail(
        f"[outputs] {what} ({layout}) differ from plain transformers by {diff:.3g} "
        f"(atol {ATOL}): {hint}"
    )


def check_step(step: dict, baseline: Baseline, variant: str, dp_size: int = 1) -> None:
    loss, norm = step["loss"], step["norm"]
    calls = int(step.get("calls") or 1)
    if loss is None or abs(loss - baseline.loss) > RTOL * abs(baseline.loss):
        cause = ""
        ratio = loss / baseline.loss if loss is not None else float("nan")
        if calls > 1 and abs(ratio * calls - 1) < 1e-3:
            cause = (
                f" It is 1/{calls} of that, with {calls} micro-batches: the micro-batch losses "
                f"are averaged. Each is already normalized by the global token count; add them."
            )
        elif dp_size > 1 and abs(ratio * dp_size - 1) < 1e-3:
            cause = f" It is 1/{dp_size} of that: this rank's part only. Sum it over the DP ranks."
        elif dp_size > 1 and abs(ratio - dp_size) < 1e-3:
            cause = (
                f" It is {dp_size}x that: scaled by dp_size. Scale what backward() sees (for a "
                f"reduction that averages), never the loss reported."
            )
        pytest.fail(
            f"[loss contract] {variant}: loss {loss} != full-batch token-mean loss "
            f"{baseline.loss:.8g}: the reported loss must be the global loss, summed over "
            f"micro-batches and DP ranks.{cause}"
        )
    if abs(norm - baseline.grad_norm) > RTOL * baseline.grad_norm:
        ratio = norm / baseline.grad_norm
        if calls > 1 and abs(ratio * calls - 1) < 1e-3:
            fix = (
                f"the gradients are 1/{calls} of the sum, with {calls} micro-batches: something "
                f"averages over micro-batches (a division by their count, or a loss scaled by "
                f"1/num_micro_batches). Each micro-batch's loss is already globally normalized."
            )
        elif dp_size > 1 and abs(ratio * dp_size - 1) < 1e-3:
            fix = (
                f"the gradients are 1/{dp_size} of the sum: a backend whose reduction averages "
                f"over ranks must scale the loss by dp_size."
            )
        elif dp_size > 1:
            fix = (
                "check that the gradient reduction over DP ranks is a sum, runs once after the "
                "last micro-batch (finish_backward) and covers every parameter."
            )
        else:
            fix = (
                "on one rank nothing is reduced, so check that every micro-batch's backward "
                "adds into the same gradients (no zero_grad or averaging between micro-batches, "
                "no extra scaling in backward()) and that the loss function's value is "
                "backpropagated as given."
            )
        pytest.fail(
            f"[gradient invariance] {variant}: grad norm {norm:.8g} is {ratio:.4g}x the "
            f"full-batch gradient norm {baseline.grad_norm:.8g}. Gradients must be the sum over "
            f"micro-batches and DP ranks of each micro-batch's globally normalized loss: {fix}"
        )


def described(raised: dict[str, Any] | None) -> str:
    if raised is None:
        return "nothing"
    return f"{raised['types'][0]}: {raised['message'][:300]}"


def is_(raised: dict[str, Any] | None, error: str, phrase: str = "") -> bool:
    return raised is not None and error in raised["types"] and phrase in raised["message"]


def exception(call: Any) -> Exception | None:
    try:
        call()
    except Exception as e:  # the clause says which one it wanted
        return e
    return None


def probe(step: dict[str, Any], baseline: Baseline) -> str:
    """What a probe step (on the weights the engine was built with) shows, '' when nothing."""
    loss, norm = step["loss"], step["norm"]
    wrong = []
    if loss is None or not abs(loss - baseline.loss) <= RTOL * abs(baseline.loss):
        wrong.append(f"loss {loss}, want {baseline.loss:.8g} (the weights changed)")
    if not abs(norm - baseline.grad_norm) <= RTOL * baseline.grad_norm:
        wrong.append(
            f"grad norm {norm:.8g}, want {baseline.grad_norm:.8g} (a gradient was left behind)"
        )
    return "; ".join(wrong)
