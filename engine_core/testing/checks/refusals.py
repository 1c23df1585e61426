"""Refusals and what must leave no trace: the caller's batch left unmodified, batches refused
before anything runs (and the engine unchanged after), forward-only steps that accumulate no
gradient, a failed step cleared by ``optimizer_zero_grad()``, and a step skipped for a NaN
gradient norm that leaves the optimizer's state as it was.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from engine_core.batch import ATTENTION_MASK, INPUT_IDS, LOG_PROBS, with_meta
from engine_core.capabilities import Capability
from engine_core.testing.checks.registry import Check, Context, Layout
from engine_core.testing.checks.update import UPDATE_TOL, distance, oracle_log_probs
from engine_core.testing.checks.verdict import RTOL, described, is_, probe, result
from engine_core.testing.drive import build, first_step, forward, params, raised_by, skip_a_step
from engine_core.testing.models import TINY_QWEN2, nll_loss, random_batch
from engine_core.testing.oracle import (
    UPDATE_OPTIM,
    Baseline,
    eval_batch,
    masked_batch,
    plain_loss_and_grad_norm,
    plain_update,
    train_batch,
)

__all__ = [
    "CHECKS",
    "first_step_oracle",
    "test_a_refused_batch_changes_nothing",
    "test_a_skipped_step_leaves_the_optimizer_as_it_was",
    "test_forward_only_accumulates_no_gradient",
    "test_inputs_left_unmodified",
    "test_optimizer_zero_grad_clears_a_failed_step",
]


def _inputs_unmodified(c: Context) -> dict[str, Any]:
    """A training step and a forward pass must leave the caller's batch as it was."""
    engine = build(c.backend, model=c.policy, micro_batch_size=3)
    batch = eval_batch()  # one rank: the whole batch is this rank's
    before = batch.clone()
    keys = sorted(str(k) for k in batch.keys())
    with engine.train_mode():
        engine.forward_backward_step(batch)
        engine.optimizer_zero_grad()
    engine.set_loss_fn(None)
    with engine.eval_mode():
        engine.forward_backward_step(batch, forward_only=True)
    after_keys = sorted(str(k) for k in batch.keys())
    changed = [k for k in keys if k in after_keys and not _same(batch, before, k)]
    return {
        "added": sorted(set(after_keys) - set(keys)),
        "removed": sorted(set(keys) - set(after_keys)),
        "changed": changed,
    }


def _same(a: TensorDict, b: TensorDict, key: str) -> bool:
    x, y = a.get(key), b.get(key)
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and not key == "meta":
        return x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
    return bool(a.get_non_tensor(key) == b.get_non_tensor(key))


# an lr too small to move any weight: a probe step (first_step on train_batch(), whose loss and
# grad norm the baseline holds) then runs on the weights the engine was built with, however
# many came before it, and shows what an earlier call left behind (a gradient, say)
PROBE_OPTIM: dict[str, Any] = {"lr": 1e-30, "clip_grad": None}


def _refused_batches(caps: frozenset[Capability]) -> dict[str, tuple[str, TensorDict]]:
    """Training batches a step must refuse before anything runs: {case: (error, batch)}."""
    from engine_core.batch import ROUTED_EXPERTS

    wrong_mask = train_batch()
    wrong_mask[ATTENTION_MASK] = wrong_mask[ATTENTION_MASK][:, :-1]
    outside = train_batch()
    outside[INPUT_IDS][0, 0] = TINY_QWEN2["vocab_size"]  # a real token: batches pad on the right
    longest = TINY_QWEN2["max_position_embeddings"] + 1
    cases = {
        "attention_mask of another shape than input_ids": ("BatchError", wrong_mask),
        "a token id outside the model's vocabulary": ("BatchError", outside),
        "a sample longer than max_position_embeddings": (
            "BatchError",
            random_batch(2, seq_len=longest, min_len=longest),
        ),
    }
    if Capability.ROUTING_REPLAY not in caps:
        routed = train_batch()
        routed[ROUTED_EXPERTS] = torch.zeros(*routed[INPUT_IDS].shape, 1, 1, dtype=torch.long)
        cases["routed_experts without routing_replay"] = ("CapabilityError", routed)
        asks: dict[str, Any] = {"moe_aux": {"coef": 0.1}, "return_routes": True}
        for field_name, value in asks.items():
            cases[f"BatchMeta({field_name}={value}) without routing_replay"] = (
                "CapabilityError",
                with_meta(train_batch(), **{field_name: value}),
            )
    if Capability.VISION not in caps:
        from engine_core.vision import IMAGE_GRID_THW, PIXEL_VALUES

        pictured = train_batch()
        b = pictured[INPUT_IDS].shape[0]
        pictured[PIXEL_VALUES] = torch.zeros(b, 4, 96)
        pictured[IMAGE_GRID_THW] = torch.tensor([1, 2, 2]).expand(b, 1, 3).clone()
        cases["images without vision"] = ("CapabilityError", pictured)
    if Capability.ROUTING_REPLAY in caps:
        cases["BatchMeta.moe_aux without the loss_mask it aggregates over"] = (
            "BatchError",
            with_meta(train_batch(), moe_aux={"coef": 0.1}),
        )
    return cases


def _no_trace(c: Context) -> dict[str, Any]:
    """Calls that must leave the engine as it was, each kind followed by a probe step: refused
    batches and a training step without a loss function; forward-only steps (in train mode,
    autograd on); a step whose loss function raises on its second micro-batch, then
    ``optimizer_zero_grad()``."""
    engine = build(c.backend, model=c.policy, optim=dict(PROBE_OPTIM), micro_batch_size=3)

    def train(batch: TensorDict) -> None:
        with engine.train_mode():
            engine.forward_backward_step(batch)

    refused = {
        case: (error, raised_by(partial(train, batch)))
        for case, (error, batch) in _refused_batches(c.caps).items()
    }
    engine.set_loss_fn(None)
    refused["a training step with no loss function"] = (
        "EngineCoreError",
        raised_by(partial(train, train_batch())),
    )
    engine.set_loss_fn(nll_loss)
    after_refused = first_step(engine, train_batch())

    with engine.train_mode():
        with_loss = engine.forward_backward_step(train_batch(), forward_only=True).loss
        engine.set_loss_fn(None)
        cleared = engine.loss_fn is None
        without_loss = engine.forward_backward_step(train_batch(), forward_only=True).loss
        engine.set_loss_fn(nll_loss)
    forward_only = {
        "loss": with_loss,
        "loss_without_fn": without_loss,
        "loss_fn_kept": cleared and engine.loss_fn is nll_loss,
    }
    after_forward_only = first_step(engine, train_batch())

    calls: list[int] = []

    def failing(mb: TensorDict, out: TensorDict, ctx: Any) -> Any:
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("kit: the loss function failed on micro-batch 2")
        return nll_loss(mb, out, ctx)

    engine.set_loss_fn(failing)
    failed = raised_by(partial(train, train_batch()))
    engine.set_loss_fn(nll_loss)
    engine.optimizer_zero_grad()
    return {
        "refused": refused,
        "after_refused": after_refused,
        "forward_only": forward_only,
        "after_forward_only": after_forward_only,
        "failed": failed,
        "after_failed": first_step(engine, train_batch()),
    }


def _skipped_step(c: Context) -> dict[str, Any]:
    """A step skipped for a NaN gradient norm, then the update oracle's first step: its
    grad norm and the weights after it (the log-probs, without ``weight_export``)."""
    engine = build(c.backend, model=c.policy, optim=dict(UPDATE_OPTIM), micro_batch_size=3)
    skipped = skip_a_step(engine)
    with engine.train_mode():
        engine.forward_backward_step(engine.shard_data(masked_batch(0)))
        norm = engine.optimizer_step()
        engine.lr_scheduler_step()
        engine.optimizer_zero_grad()
    export = Capability.WEIGHT_EXPORT in c.caps
    return {
        "skipped_norm": skipped,
        "norm": norm,
        "params": params(engine) if export else None,
        "log_probs": None if export else forward(engine, eval_batch())[LOG_PROBS],
    }


INPUTS = Check("inputs", Layout.SINGLE, _inputs_unmodified)
NO_TRACE = Check("no_trace", Layout.SINGLE, _no_trace)
SKIPPED_STEP = Check("skipped_step", Layout.SINGLE, _skipped_step)

CHECKS = (INPUTS, NO_TRACE, SKIPPED_STEP)


def test_inputs_left_unmodified(single: dict) -> None:
    got = result(single, INPUTS, "inputs unmodified")
    problems = {k: v for k, v in got.items() if v}
    assert not problems, (
        f"[inputs unmodified] forward_backward_step changed the caller's batch: {problems}. "
        f"Work on copies (micro-batches are views of the batch: never write into them in place)."
    )


def test_a_refused_batch_changes_nothing(single: dict, kit_baseline: Baseline) -> None:
    got = result(single, NO_TRACE, "refused")
    for case, (error, raised) in got["refused"].items():
        if not is_(raised, error):
            pytest.fail(
                f"[refused] forward_backward_step with {case} raised {described(raised)}; want a "
                f"{error} before anything runs (BaseEngine.forward_backward_step checks the "
                f"batch, the model's limits, routing keys and the loss first: call it before "
                f"running the model, or check the same)."
            )
    wrong = probe(got["after_refused"], kit_baseline)
    if wrong:
        pytest.fail(
            f"[refused] after the refused calls ({', '.join(got['refused'])}) a training step "
            f"gave {wrong}: a refused call must leave the engine as it was."
        )


def test_forward_only_accumulates_no_gradient(single: dict, kit_baseline: Baseline) -> None:
    got = result(single, NO_TRACE, "forward only")
    fo = got["forward_only"]
    loss = fo["loss"]
    if loss is None or not abs(loss - kit_baseline.loss) <= RTOL * abs(kit_baseline.loss):
        pytest.fail(
            f"[forward only] forward_backward_step(forward_only=True) with a loss function set "
            f"returned loss {loss}; want the global loss {kit_baseline.loss:.8g}, as a "
            f"training step reports it."
        )
    if fo["loss_without_fn"] is not None:
        pytest.fail(
            f"[forward only] after set_loss_fn(None) the step returned loss "
            f"{fo['loss_without_fn']}; want None (EngineOutput.loss without a loss function)."
        )
    assert fo["loss_fn_kept"], "[forward only] loss_fn is not what set_loss_fn() last set"
    wrong = probe(got["after_forward_only"], kit_baseline)
    if wrong:
        pytest.fail(
            f"[forward only] after two forward-only steps in train_mode() (autograd on) a "
            f"training step gave {wrong}: forward_only=True must run no backward (the default "
            f"loop runs the micro-batches under torch.no_grad())."
        )


def test_optimizer_zero_grad_clears_a_failed_step(single: dict, kit_baseline: Baseline) -> None:
    got = result(single, NO_TRACE, "failed step")
    if not is_(got["failed"], "RuntimeError", "kit: the loss function failed"):
        pytest.fail(
            f"[failed step] the loss function raised RuntimeError('kit: the loss function "
            f"failed on micro-batch 2') in a step of 3 micro-batches; the step raised "
            f"{described(got['failed'])}. Let an exception inside a step propagate as raised."
        )
    wrong = probe(got["after_failed"], kit_baseline)
    if wrong:
        pytest.fail(
            f"[failed step] after the failed step and optimizer_zero_grad() a training step "
            f"gave {wrong}: optimizer_zero_grad() must clear what the micro-batches before the "
            f"failure accumulated, and the engine train on as before (no gradient sync or "
            f"schedule state left half-way)."
        )


@pytest.fixture(scope="session")
def first_step_oracle(kit_baseline: Baseline) -> dict[str, Any]:
    """The plain loop's first step on the update oracle's first batch: its grad norm (before
    clipping) and the weights after it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(kit_baseline.policy_dir, dtype=torch.float32)
    _, norm = plain_loss_and_grad_norm(model, masked_batch(0))
    return {"norm": norm, "params": plain_update(kit_baseline.policy_dir, steps=1)}


def test_a_skipped_step_leaves_the_optimizer_as_it_was(
    single: dict, kit_baseline: Baseline, request: pytest.FixtureRequest
) -> None:
    got = result(single, SKIPPED_STEP, "skipped step")
    oracle = request.getfixturevalue("first_step_oracle")
    norm, clip = got["norm"], UPDATE_OPTIM["clip_grad"]
    if abs(norm - clip) <= 1e-3 * clip < abs(oracle["norm"] - clip):
        pytest.fail(
            f"[optimizer] optimizer_step() returned {norm:.8g}, the norm after clipping to "
            f"{clip}; return the norm before clipping ({oracle['norm']:.8g} here)."
        )
    if not abs(norm - oracle["norm"]) <= RTOL * oracle["norm"]:
        pytest.fail(
            f"[skipped step] the step after one skipped for a NaN grad norm "
            f"({got['skipped_norm']}) had grad norm {norm:.8g}, a plain loop's first step "
            f"{oracle['norm']:.8g}: the skipped step's gradients outlived optimizer_zero_grad()."
        )
    if got["params"] is not None:
        rel, worst, worst_rel = distance(got["params"], oracle["params"], kit_baseline.state_dict)
    else:
        start = {"log_probs": kit_baseline.log_probs}
        want = {"log_probs": oracle_log_probs(oracle["params"], kit_baseline)}
        rel, worst, worst_rel = distance({"log_probs": got["log_probs"]}, want, start)
    if not rel <= UPDATE_TOL:
        pytest.fail(
            f"[skipped step] after a step skipped for a NaN grad norm, the next step's weights "
            f"differ from a plain AdamW loop's first step by {rel:.3g} of the update's size "
            f"(tolerance {UPDATE_TOL:g}; worst: {worst}, {worst_rel:.3g}): the skipped step "
            f"changed the optimizer's state (AdamW's moments or step count) or the learning "
            f"rate. On a non-finite norm return before optimizer.step() (clip_and_step does)."
        )
