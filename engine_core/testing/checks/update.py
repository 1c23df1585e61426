"""The update: the engine's weights after a few steps on batches with a loss mask against a
plain PyTorch AdamW loop's (a mismatch named by the usual bug it matches), on one and two DP
ranks, and the optimizer's and the schedule's own promises.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine_core.batch import LOG_PROBS
from engine_core.capabilities import Capability
from engine_core.testing.checks.registry import Check, Context, Layout
from engine_core.testing.checks.verdict import result
from engine_core.testing.drive import build, forward, oracle_steps, params, skip_a_step
from engine_core.testing.oracle import (
    UPDATE_CAUSES,
    UPDATE_OPTIM,
    UPDATE_STEPS,
    Baseline,
    eval_batch,
    plain_log_probs,
    plain_update,
    train_batch,
)

__all__ = [
    "CHECKS",
    "UPDATE_TOL",
    "check_update",
    "distance",
    "oracle_log_probs",
    "test_optimizer_step_semantics",
    "test_update_matches_a_plain_adamw_loop_single_process",
    "test_update_matches_a_plain_adamw_loop_two_dp_ranks",
    "update_oracle",
]


def _update(c: Context, **overrides: Any) -> dict[str, Any]:
    """The engine's weights (and log-probs) after the oracle's steps on the same batches."""
    engine = build(c.backend, model=c.policy, optim=dict(UPDATE_OPTIM), **overrides)
    oracle_steps(engine)
    export = Capability.WEIGHT_EXPORT in c.caps
    return {
        "params": params(engine) if export else None,
        "log_probs": forward(engine, eval_batch())[LOG_PROBS],
    }


def _single_update(c: Context) -> dict[str, Any]:
    # micro-batches: a token budget where the engine declares one
    if Capability.DYNAMIC_BATCH in c.caps:
        return _update(c, max_tokens_per_micro_batch=40)
    return _update(c, micro_batch_size=3)


UPDATE_SINGLE = Check("update", Layout.SINGLE, _single_update)
UPDATE_TWO = Check("update", Layout.TWO, lambda c: _update(c, micro_batch_size=2))


def _optimizer(c: Context) -> dict[str, Any]:
    optim = {"lr": 1e-2, "warmup_steps": 4, "clip_grad": None}
    engine = build(c.backend, model=c.policy, optim=optim)
    start = params(engine)
    lrs = []
    for s in range(2):
        with engine.train_mode():
            engine.forward_backward_step(engine.shard_data(train_batch(s)))
            engine.optimizer_step()
            lrs.append(engine.lr_scheduler_step())
            engine.optimizer_zero_grad()
    moved = any(not torch.equal(v, start[k]) for k, v in params(engine).items())
    # a non-finite gradient norm must skip the update
    before = params(engine)
    nan_norm = skip_a_step(engine, seed=7)
    unchanged = all(torch.equal(v, before[k]) for k, v in params(engine).items())
    return {"moved": moved, "lrs": lrs, "nan_norm": nan_norm, "unchanged_after_nan": unchanged}


OPTIMIZER = Check("optimizer", Layout.SINGLE, _optimizer)

CHECKS = (OPTIMIZER, UPDATE_SINGLE, UPDATE_TWO)


def test_optimizer_step_semantics(single: dict) -> None:
    opt = result(single, OPTIMIZER, "optimizer")
    assert opt["moved"], "[optimizer] optimizer_step() did not change any weight"
    assert opt["lrs"] == pytest.approx([0.005, 0.0075]), (
        f"[optimizer] lr_scheduler_step() returned {opt['lrs']} with 4 warm-up steps and lr "
        f"1e-2; want the new learning rate after each step ([0.005, 0.0075])"
    )
    assert opt["nan_norm"] != opt["nan_norm"], (
        f"[optimizer] a NaN loss gave grad norm {opt['nan_norm']}; optimizer_step() must "
        f"return the non-finite norm"
    )
    assert opt["unchanged_after_nan"], "[optimizer] a non-finite grad norm must skip the update"


UPDATE_TOL = 1e-3  # of the update's size: float noise is ~1e-5, the bugs the oracle names >= 0.05


@pytest.fixture(scope="session")
def update_oracle(kit_baseline: Baseline) -> dict[str | None, dict[str, torch.Tensor]]:
    """The plain loop's weights after the update checks' steps: the correct update (key None),
    and each named bug's (computed when an engine fails, to say which it matches)."""
    return {None: plain_update(kit_baseline.policy_dir)}


def distance(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> tuple[float, str, float]:
    """|got - want| / |want - start| over all weights together, and the worst weight's."""
    num = den = 0.0
    worst, worst_rel = "", -1.0
    for name, w in want.items():
        diff = float((got[name].float() - w).pow(2).sum())
        moved = float((w - start[name]).pow(2).sum())
        num, den = num + diff, den + moved
        rel = (diff / moved) ** 0.5 if moved > 0 else (0.0 if diff == 0 else float("inf"))
        if rel > worst_rel:
            worst, worst_rel = name, rel
    return (num / den) ** 0.5 if den > 0 else float("inf"), worst, worst_rel


def oracle_log_probs(state: dict[str, torch.Tensor], baseline: Baseline) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(baseline.policy_dir, dtype=torch.float32)
    model.load_state_dict(state)
    return plain_log_probs(model.eval(), eval_batch())[0]


def check_update(
    got_update: dict[str, Any],
    oracle: dict[str | None, dict[str, torch.Tensor]],
    baseline: Baseline,
    layout: str,
) -> None:
    """The engine's weights after the kit's steps against the plain loop's; on a mismatch, the
    loop's variant with a named bug that the weights match instead, if any."""
    weights = got_update["params"]
    if weights is not None:
        missing = sorted(set(oracle[None]) - set(weights))
        if missing:
            pytest.fail(
                f"[update] {layout}: named_full_params() has no {missing[:3]}; see [export]."
            )
        start = baseline.state_dict

        def gap(want: dict[str, torch.Tensor]) -> tuple[float, str, float]:
            return distance(weights, want, start)

        what = "weights"
    else:  # no weight export: the log-probs of the updated model
        lp0 = {"log_probs": baseline.log_probs}
        got = {"log_probs": got_update["log_probs"]}

        def gap(want: dict[str, torch.Tensor]) -> tuple[float, str, float]:
            return distance(got, {"log_probs": oracle_log_probs(want, baseline)}, lp0)

        what = "log-probs"
    rel, worst, worst_rel = gap(oracle[None])
    if rel <= UPDATE_TOL:
        return
    matches = []
    for cause in UPDATE_CAUSES:
        if cause not in oracle:
            oracle[cause] = plain_update(baseline.policy_dir, cause=cause)
        matches.append((gap(oracle[cause])[0], cause))
    best, cause = min(matches)
    if best <= 10 * UPDATE_TOL:
        why = f"They match a loop in which {UPDATE_CAUSES[cause]}."
    else:
        why = (
            "They match none of the usual bugs (loss_mask ignored, no clipping, a double step, "
            "no schedule). Each step must be: the loss over loss_mask tokens, its gradient "
            "summed over micro-batches and DP ranks, clipped to optim.clip_grad, one AdamW step "
            "at the scheduled lr, then lr_scheduler_step()."
        )
    pytest.fail(
        f"[update] {layout}: after {UPDATE_STEPS} steps on batches with a loss_mask (prompt "
        f"holes, a fully masked sample), the engine's {what} differ from a plain PyTorch AdamW "
        f"loop's by {rel:.3g} of the update's size (tolerance {UPDATE_TOL:g}; worst: {worst}, "
        f"{worst_rel:.3g}). {why}"
    )


def test_update_matches_a_plain_adamw_loop_single_process(
    single: dict, update_oracle: dict, kit_baseline: Baseline
) -> None:
    got = result(single, UPDATE_SINGLE, "update")
    check_update(got, update_oracle, kit_baseline, "1 rank, micro-batches")


def test_update_matches_a_plain_adamw_loop_two_dp_ranks(
    double: list, update_oracle: dict, kit_baseline: Baseline
) -> None:
    for rank, r in enumerate(double):
        check_update(
            result(r, UPDATE_TWO, "update"), update_oracle, kit_baseline, f"dp=2 rank {rank}"
        )
