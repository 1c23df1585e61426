"""The loop both trainers' ``fit`` runs: step until a global step, the callbacks after each step,
and an early stop asked after them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

__all__ = ["Stepper", "run_steps"]


class Stepper(Protocol):
    """A trainer: ``step()`` takes one step and returns its row; ``global_step`` counts them."""

    global_step: int

    def step(self) -> dict[str, Any]: ...


T = TypeVar("T", bound=Stepper)


def run_steps(
    trainer: T,
    max_steps: int,
    callbacks: Sequence[Callable[[T, dict[str, Any]], None]],
    should_stop: Callable[[], object] | None,
) -> list[dict[str, Any]]:
    """Step ``trainer`` until its ``global_step`` reaches ``max_steps``; the rows of the steps
    run. Each callback gets ``(trainer, row)`` after every step, in order; ``should_stop``,
    asked after them, ends the loop early when it returns something true."""
    history = []
    while trainer.global_step < max_steps:
        row = trainer.step()
        history.append(row)
        for callback in callbacks:
            callback(trainer, row)
        if should_stop is not None and should_stop():
            break
    return history
