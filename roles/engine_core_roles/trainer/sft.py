"""``SFTTrainer``: supervised training, the RL trainer's counterpart for ``engine-core train`` and
the RL job's warm-up.

One :meth:`SFTTrainer.step` reads: the next batch, the supervised step every job shares
(:func:`~engine_core_roles.algorithms.supervised.supervised_step`: token-mean NLL on the loss
mask, one optimizer step, one LR step), the validation loss where due, then one row of metrics.
What varies is a part picked once, when the trainer is built: where the step runs (an engine in
this process, or a worker group's ranks, each on its share: :func:`supervised_update`) and
whether, and when, held-out data is measured (:class:`Validation`, :class:`NoValidation`).
``engine-core train`` (:mod:`engine_core_roles.jobs.sft`) is this trainer plus config files,
checkpoints, a progress bar and plots.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from tensordict import TensorDict

from engine_core import ATTENTION_MASK
from engine_core.engine import BaseEngine, loss_mask_of
from engine_core_roles.algorithms.supervised import supervised_loss, supervised_step
from engine_core_roles.trainer.steps import run_steps

__all__ = [
    "NoValidation",
    "SFTCallback",
    "SFTTrainer",
    "SupervisedRole",
    "SupervisedUpdate",
    "Validation",
    "supervised_update",
]

SupervisedUpdate = Callable[[TensorDict], dict[str, float]]
"""One supervised step on a batch; returns its figures (``loss``, ``grad_norm``, ``lr``, ...)."""

SFTCallback = Callable[["SFTTrainer", dict[str, Any]], None]
"""Called by :meth:`SFTTrainer.fit` after every step with the trainer and that step's row."""


class SupervisedRole(Protocol):
    """A worker group that takes the supervised step on its ranks
    (:class:`~engine_core_roles.distributed.placement.ActorGroup`)."""

    def supervised_step(self, batch: TensorDict) -> dict[str, float]: ...


def supervised_update(part: BaseEngine | SupervisedRole) -> SupervisedUpdate:
    """The supervised step of ``part``, wherever it is: its engine in this process, or its
    worker group (each DP rank on its share of the batch). The same step, LR schedule included,
    in either (see :func:`~engine_core_roles.algorithms.supervised.supervised_step`)."""
    if isinstance(part, BaseEngine):
        return functools.partial(supervised_step, part)
    return part.supervised_step


class NoValidation:
    """A run without held-out data: no ``val/*`` figures."""

    def __call__(self, step: int) -> dict[str, float]:
        """Step ``step``'s ``val/*`` figures (empty where none is due)."""
        return {}


class Validation(NoValidation):
    """The loss on held-out batches (``val/loss``, ``val/target_prob``: token-means over every
    loss token, no update) every ``every`` steps and at ``last_step``."""

    def __init__(
        self,
        engine: BaseEngine,
        batches: Callable[[], Iterable[TensorDict]],
        *,
        every: int,
        last_step: int,
    ) -> None:
        if every < 1:
            raise ValueError(
                f"Validation every={every}: measure every N >= 1 steps, or build the trainer "
                f"with NoValidation() (no held-out data)."
            )
        self.engine, self.batches = engine, batches
        self.every, self.last_step = every, last_step

    def __call__(self, step: int) -> dict[str, float]:
        if step % self.every and step != self.last_step:
            return {}
        val = supervised_loss(self.engine, self.batches())
        return {f"val/{k}": v for k, v in val.items()}


class SFTTrainer:
    """Supervised steps on the batches ``batches()`` gives, one a step, through ``update``
    (:func:`supervised_update`); ``validation`` measures held-out data where due.
    ``global_step`` is the number of steps already taken (set it when resuming a checkpoint).

    >>> trainer = SFTTrainer(supervised_update(engine), lambda: data.next_batch(32))  # doctest: +SKIP
    >>> history = trainer.fit(100, callbacks=[lambda t, row: print(row["loss"])])  # doctest: +SKIP
    """

    def __init__(
        self,
        update: SupervisedUpdate,
        batches: Callable[[], TensorDict],
        *,
        validation: NoValidation | None = None,
        global_step: int = 0,
    ) -> None:
        self._update, self._batches = update, batches
        self._validation = validation or NoValidation()
        self.global_step = global_step

    def step(self) -> dict[str, Any]:
        """One supervised step; returns its metrics row (``step``, ``loss``, ``grad_norm``,
        ``lr``, ``loss_tokens``, ``tokens_per_s``, ``time_s``, ``val/*`` where due)."""
        step, batch = self.global_step + 1, self._batches()
        t0 = time.perf_counter()
        result = self._update(batch)
        dt = time.perf_counter() - t0
        row: dict[str, Any] = {
            "step": step,
            **result,
            "loss_tokens": int(loss_mask_of(batch).sum()),
            "tokens_per_s": int(batch[ATTENTION_MASK].sum()) / dt,
            "time_s": dt,
            **self._validation(step),
        }
        self.global_step = step
        return row

    def fit(
        self,
        max_steps: int,
        *,
        callbacks: Sequence[SFTCallback] = (),
        should_stop: Callable[[], object] | None = None,
    ) -> list[dict[str, Any]]:
        """Step until ``global_step`` reaches ``max_steps``; returns the rows of the steps run.

        Each callback gets ``(trainer, row)`` after every step, in order; ``should_stop``, asked
        after them, ends the loop early when it returns something true.
        """
        return run_steps(self, max_steps, callbacks, should_stop)
