"""Modes and devices: what ``train_mode()`` and ``eval_mode()`` set inside them and restore
when they exit (the module's mode, autograd; with ``offload``, state loaded onto the device
and offloaded again), what ``to()`` moves (and that a round trip changes no output), and that
``offload`` trains the same.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine_core.batch import LOG_PROBS
from engine_core.capabilities import Capability
from engine_core.engine import BaseEngine
from engine_core.testing.checks.registry import Check, Context, Layout
from engine_core.testing.checks.verdict import ATOL, RTOL, result
from engine_core.testing.drive import build, forward, train
from engine_core.testing.oracle import eval_batch, train_batch

__all__ = [
    "CHECKS",
    "test_modes_restore_the_module_and_autograd_on_exit",
    "test_offload_loads_on_entering_a_mode_and_offloads_on_exit",
    "test_offload_trains_the_same",
    "test_to_moves_what_its_flags_say",
    "test_to_round_trip_keeps_outputs",
    "test_train_and_eval_modes",
]


def _modes(c: Context) -> dict[str, Any]:
    engine = build(c.backend, model=c.policy)
    module = engine.module
    assert module is not None
    seen: dict[str, Any] = {}
    with engine.train_mode():
        seen["train"] = (module.training, torch.is_grad_enabled())
    with engine.eval_mode():
        seen["eval"] = (module.training, torch.is_grad_enabled())
    before = forward(engine, eval_batch())[LOG_PROBS]
    engine.to("cpu")
    engine.to(engine.device)
    seen["to_round_trip"] = float((forward(engine, eval_batch())[LOG_PROBS] - before).abs().max())
    return seen


MODES = Check("modes", Layout.SINGLE, _modes)


def _state_devices(engine: BaseEngine) -> dict[str, list[str]]:
    """Device types of the engine's parameters, their gradients and its optimizer state."""

    def types(tensors: Any) -> list[str]:
        return sorted({t.device.type for t in tensors})

    module = engine.module
    assert module is not None
    params = list(module.parameters())
    optimizer: Any = getattr(engine, "optimizer", None)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps its own
    state = [
        v
        for per_param in (getattr(inner, "state", {}) or {}).values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    ]
    return {
        "model": types(params),
        "grads": types(p.grad for p in params if p.grad is not None),
        "optimizer": types(state),
    }


def _to(c: Context) -> dict[str, Any]:
    """``to("meta", ...)`` with each pair of flags, after a step and a backward (so optimizer
    state and gradients exist): where model, gradients and optimizer state went. The meta device
    makes a forgotten tensor visible on a host with one device; an engine may refuse a device
    (an EngineCoreError), which the contract allows only without ``offload``."""
    from engine_core.errors import EngineCoreError

    seen: dict[str, Any] = {}
    for model, optimizer in ((True, True), (True, False), (False, True)):
        engine = build(c.backend, model=c.policy, optim={"lr": 1e-3})
        with engine.train_mode():
            engine.forward_backward_step(engine.shard_data(train_batch(0)))
            engine.optimizer_step()
            engine.forward_backward_step(engine.shard_data(train_batch(1)))
        try:
            engine.to("meta", model=model, optimizer=optimizer)
        except EngineCoreError as e:
            seen[f"model={model},optimizer={optimizer}"] = {"refused": str(e)}
            continue
        seen[f"model={model},optimizer={optimizer}"] = _state_devices(engine)
    return seen


TO_META = Check("to_meta", Layout.SINGLE, _to)


def _offload(c: Context) -> dict[str, Any]:
    optim = {"lr": 1e-2, "clip_grad": 1.0}
    return {
        "on": train(build(c.backend, model=c.policy, optim=optim, offload=True), range(2)),
        "off": train(build(c.backend, model=c.policy, optim=optim), range(2)),
    }


OFFLOAD = Check("offload", Layout.SINGLE, _offload, needs=frozenset({Capability.OFFLOAD}))


class _LeftByRaising(Exception):
    """Raised inside a mode by the kit, to leave it by an exception."""


def _restored(c: Context) -> list[tuple[str, tuple[bool, bool], tuple[bool, bool]]]:
    """Each way of entering and leaving ``train_mode()`` / ``eval_mode()`` from a module state
    the mode changes: (case, (module.training, grad enabled) before, the same after)."""
    engine = build(c.backend, model=c.policy)
    module = engine.module
    assert module is not None

    def state() -> tuple[bool, bool]:
        return module.training, torch.is_grad_enabled()

    def leave_raising(mode: Any) -> None:
        try:
            with mode():
                raise _LeftByRaising
        except _LeftByRaising:
            pass

    def leave(mode: Any) -> None:
        with mode():
            pass

    seen: list[tuple[str, tuple[bool, bool], tuple[bool, bool]]] = []
    cases = (
        ("train_mode() entered in eval mode", False, lambda: leave(engine.train_mode)),
        ("eval_mode() entered in train mode", True, lambda: leave(engine.eval_mode)),
        ("train_mode() left by an exception", False, lambda: leave_raising(engine.train_mode)),
        ("eval_mode() left by an exception", True, lambda: leave_raising(engine.eval_mode)),
    )
    for case, training, run in cases:
        module.train(training)
        before = state()
        run()
        seen.append((case, before, state()))
    with engine.train_mode():
        before = state()
        leave(engine.eval_mode)
        seen.append(("eval_mode() inside train_mode()", before, state()))
    return seen


RESTORED = Check("modes_restored", Layout.SINGLE, _restored)


def _offloaded(c: Context) -> dict[str, Any]:
    """With ``offload: true``, the calls to ``to()`` each mode makes before its body runs and
    after it ends: (device, model, optimizer) of each."""
    engine = build(c.backend, model=c.policy, offload=True)
    calls: list[tuple[str, bool, bool]] = []
    own = engine.to

    def recording(
        device: torch.device | str, *, model: bool = True, optimizer: bool = True
    ) -> None:
        calls.append((torch.device(device).type, model, optimizer))
        own(device, model=model, optimizer=optimizer)

    engine.to = recording  # type: ignore[method-assign]
    seen: dict[str, Any] = {"device": engine.device.type}
    for name, mode in (("train_mode", engine.train_mode), ("eval_mode", engine.eval_mode)):
        calls.clear()
        with mode():
            entered = list(calls)
            calls.clear()
        seen[name] = {"entry": entered, "exit": list(calls)}
    del engine.to
    return seen


OFFLOADED = Check(
    "modes_offloaded", Layout.SINGLE, _offloaded, needs=frozenset({Capability.OFFLOAD})
)

CHECKS = (MODES, RESTORED, TO_META, OFFLOAD, OFFLOADED)


def test_train_and_eval_modes(single: dict) -> None:
    modes = result(single, MODES, "modes")
    assert modes["train"] == (True, True), (
        f"[modes] inside train_mode() module.training, grad enabled = {modes['train']}; want "
        f"(True, True)"
    )
    assert modes["eval"] == (False, False), (
        f"[modes] inside eval_mode() module.training, grad enabled = {modes['eval']}; want "
        f"(False, False)"
    )


def test_to_round_trip_keeps_outputs(single: dict) -> None:
    diff = result(single, MODES, "to")["to_round_trip"]
    assert diff <= ATOL, f"[to] outputs changed by {diff:.3g} after to('cpu') and back"


def test_to_moves_what_its_flags_say(single: dict, caps: frozenset) -> None:
    moved = result(single, TO_META, "to")
    for flags, where in moved.items():
        if "refused" in where:
            if Capability.OFFLOAD in caps:
                pytest.fail(
                    f"[to] to('meta', {flags}) raised ({where['refused']}), but the engine "
                    f"declares offload: to() must move model and optimizer state anywhere."
                )
            continue  # an engine without offload may refuse devices other than its own
        model, optimizer = (part.split("=")[1] == "True" for part in flags.split(","))
        want = {
            "model": ["meta"] if model else ["cpu"],
            "grads": ["meta"] if model else ["cpu"],
            "optimizer": ["meta"] if optimizer else ["cpu"],
        }
        wrong = {k: v for k, v in where.items() if v and v != want[k]}
        if wrong:
            left = ", ".join(f"{k} on {v}" for k, v in wrong.items())
            pytest.fail(
                f"[to] after to('meta', {flags}): {left}, want {want}. to() moves the "
                f"parameters and their gradients when model=True, and every tensor of the "
                f"optimizer state (AdamW's exp_avg, exp_avg_sq and step) when optimizer=True; "
                f"a sharded optimizer moves this rank's shard."
            )


def test_offload_trains_the_same(single: dict, caps: frozenset) -> None:
    if not OFFLOAD.applies(caps):
        pytest.skip("offload not declared")
    off = result(single, OFFLOAD, "offload")
    for (a, na), (b, nb) in zip(off["on"], off["off"], strict=True):
        assert a == pytest.approx(b, rel=RTOL) and na == pytest.approx(nb, rel=RTOL), (
            f"[offload] offload=true changed training: {off['on']} vs {off['off']}"
        )


def test_modes_restore_the_module_and_autograd_on_exit(single: dict) -> None:
    for case, before, after in result(single, RESTORED, "modes: restored"):
        if tuple(after) != tuple(before):
            pytest.fail(
                f"[modes: restored] {case}: (module.training, grad enabled) was {tuple(before)} "
                f"before and {tuple(after)} after. train_mode() and eval_mode() restore on exit, "
                f"an exception's included, the module's mode and autograd as they found them "
                f"(BaseEngine's do: keep them, or restore in a finally)."
            )


def test_offload_loads_on_entering_a_mode_and_offloads_on_exit(
    single: dict, caps: frozenset
) -> None:
    if not OFFLOADED.applies(caps):
        pytest.skip("offload not declared")
    got = result(single, OFFLOADED, "modes: offload")
    device = got["device"]
    for mode in ("train_mode", "eval_mode"):
        entry, exit_ = got[mode]["entry"], got[mode]["exit"]
        if (device, True, True) not in [tuple(c) for c in entry]:
            pytest.fail(
                f"[modes: offload] with offload: true, {mode}() called to() with {entry} before "
                f"its body ran; want the model and optimizer state loaded onto the engine's "
                f"device first (to({device!r}), BaseEngine's modes do it)."
            )
        if ("cpu", True, True) not in [tuple(c) for c in exit_]:
            pytest.fail(
                f"[modes: offload] with offload: true, {mode}() called to() with {exit_} when "
                f"it ended; want the model and optimizer state offloaded to the CPU again "
                f"(to('cpu') on exit, as BaseEngine's modes do), or offload keeps nothing off "
                f"the device between steps."
            )
