"""Each step's prompts and their samples: drawn in step order, generated now (:class:`Synchronous`)
or one step ahead on the rollout's processes (:class:`Asynchronous`), the trainer's choice made
once, when it is built.

With ``max_staleness >= 1`` the rollout generates step ``t + 1``'s samples while the actor trains
on step ``t``'s, with the weights of before that update (one version old): a non-blocking call
to a rollout that declares ``async_generation``
(:meth:`engine_core.rollout.BaseRollout.generate_async`: a
:class:`engine_core.remote_rollout.ProcessRollout`'s replicas, or agents whose endpoint forwards
to them), no thread here. Every
sample's weight version is known, and the generation in flight is part of the trainer's state,
so a resumed run trains on exactly the samples a straight one would.

A step's samples count as one weight version: the one synced when their generation started,
or, where the rollout records the version of every sampled token (the agents' endpoint: each
row's oldest, :data:`~engine_core_roles.batch.keys.WEIGHT_VERSION`), the oldest of the rows'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from tensordict import TensorDict

from engine_core import BaseRollout, EngineCoreError, SamplingParams
from engine_core.rollout import PROMPT_IDS, PROMPT_MASK, Pending
from engine_core_roles.batch.build import prompt_batch
from engine_core_roles.batch.keys import WEIGHT_VERSION
from engine_core_roles.trainer.protocols import PromptBatch, PromptSource

__all__ = [
    "Asynchronous",
    "Drawn",
    "Generation",
    "PromptReader",
    "PromptsExhausted",
    "Synchronous",
    "as_prompts",
    "sampled_version",
]


@dataclass
class Drawn:
    """One step's prompts, their samples (``n`` adjacent per prompt), and the actor's weight
    version that generated them."""

    prompts: TensorDict
    samples: TensorDict
    version: int


def sampled_version(samples: TensorDict, synced: int) -> int:
    """The weight version ``samples`` count as: their rows' oldest where the rollout recorded
    each row's (:data:`WEIGHT_VERSION`), else ``synced``, the version the rollout held when the
    generation started. A recorded version newer than that was never synced by this trainer:
    refused, since the staleness counted from it would be wrong."""
    if WEIGHT_VERSION not in samples.keys() or not samples.batch_size[0]:
        return synced
    versions = samples[WEIGHT_VERSION]
    newest = int(versions.max())
    if newest > synced:
        raise EngineCoreError(
            f"the rollout recorded samples of weight version {newest}, but the trainer had "
            f"synced version {synced} when their generation started: the rollout numbers its "
            f"weight loads otherwise than the trainer counts its steps. A rollout that counts "
            f"its loads (AgentRollout.next_version) must count from the trainer's global_step: "
            f"0 for a new run, the step resumed from for a resumed one; set it to global_step "
            f"again before a sync of your own (RLTrainer.sync_weights after loading weights)."
        )
    return int(versions.min())


class PromptsExhausted(RuntimeError):
    """The prompt source (an iterable) has no prompts left for the step asked for."""


def as_prompts(batch: PromptBatch) -> TensorDict:
    return batch if isinstance(batch, TensorDict) else prompt_batch(batch)


class PromptReader:
    """Step ``step``'s prompts from a :data:`PromptSource`, drawn in step order and checked
    against the model's length (``max_positions()`` None: not checked)."""

    def __init__(
        self,
        source: PromptSource,
        *,
        max_positions: Callable[[], int | None],
        max_new_tokens: int,
    ) -> None:
        self._read = _reader(source)
        self._max_positions, self._max_new_tokens = max_positions, max_new_tokens

    def __call__(self, step: int) -> TensorDict:
        prompts = self._read(step)
        longest = int(prompts[PROMPT_MASK].sum(-1).max()) if PROMPT_MASK in prompts.keys() else 0
        longest = longest or int(prompts[PROMPT_IDS].shape[1])
        limit = self._max_positions()
        if limit is not None and longest + self._max_new_tokens > limit:
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={self._max_new_tokens} "
                f"exceeds the model's max_position_embeddings ({limit}); shorten the prompts "
                f"or lower max_new_tokens."
            )
        return prompts


def _reader(source: PromptSource) -> Callable[[int], TensorDict]:
    if callable(source):
        fn = source
        return lambda step: as_prompts(fn(step))
    it: Iterator[PromptBatch] = iter(source)

    def read(step: int) -> TensorDict:
        try:
            return as_prompts(next(it))
        except StopIteration:
            raise PromptsExhausted(
                f"the prompt source ran out before step {step}; give an endless iterable "
                "(e.g. a generator with a `while True` loop) or a callable taking the step."
            ) from None

    return read


Params = Callable[[int, int], SamplingParams]
"""Step ``step``'s sampling for draw ``draw`` (0: the step's own; more: extra draws)."""


class Generation:
    """Generates on ``rollout``; ``version()`` is the weight version the rollout holds."""

    def __init__(
        self,
        rollout: BaseRollout,
        prompts: PromptReader,
        params: Params,
        version: Callable[[], int],
    ) -> None:
        self.rollout, self.prompts, self.params = rollout, prompts, params
        self._version = version

    def draw(self, step: int) -> Drawn:
        """Step ``step``'s prompts and samples."""
        raise NotImplementedError

    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        """Samples of ``prompts`` now."""
        samples: TensorDict = self.rollout.generate(prompts, params)
        return samples

    def version_metrics(self, drawn: Drawn, staleness: int) -> dict[str, float]:
        """The step's row figures of the weights that generated ``drawn`` (none here)."""
        return {}

    def settle(self, *, quiet: bool = False) -> None:
        """Wait for a generation in flight (none here); ``quiet``: its error is not raised
        here (it stays the next step's to raise)."""

    def in_flight(self) -> Drawn | None:
        """The generation in flight, waited for (None: none, or it failed)."""
        return None

    def restore(self, drawn: Drawn) -> None:
        """Resume with ``drawn`` as the generation in flight (a synchronous run has none)."""

    def close(self) -> None:
        """Wait for a generation in flight and forget it."""


class Synchronous(Generation):
    """Each step generates its samples when it runs, with the weights of the step before."""

    def draw(self, step: int) -> Drawn:
        return self.redraw(step, 0)

    def redraw(self, step: int, draw: int) -> Drawn:
        """More prompts for step ``step``, generated with extra draw ``draw``'s seeds."""
        prompts, synced = self.prompts(step), self._version()
        samples = self.generate(prompts, self.params(step, draw))
        return Drawn(prompts, samples, sampled_version(samples, synced))


class _Pending(Protocol):
    def result(self) -> Drawn: ...


class _Generating:
    """A generation in flight: its samples, as drawn, computed once when first asked for."""

    def __init__(self, pending: Pending, prompts: TensorDict, version: int) -> None:
        self._pending, self._prompts, self._version = pending, prompts, version
        self._drawn: Drawn | None = None

    def result(self) -> Drawn:
        if self._drawn is None:
            gen = self._pending.result()  # raises what the generation raised, every time asked
            self._drawn = Drawn(self._prompts, gen, sampled_version(gen, self._version))
        return self._drawn


class _Settled:
    """A generation already done (restored by a resume) or that could not start."""

    def __init__(self, value: Drawn | None = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def result(self) -> Drawn:
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value


class Asynchronous(Generation):
    """Step ``t + 1`` generates on the rollout's processes while step ``t`` trains.

    ``before_next`` runs between taking a step's samples and starting the next generation:
    the trainer syncs the latest update's weights there, so the next generation starts with
    them."""

    def __init__(
        self,
        rollout: BaseRollout,
        prompts: PromptReader,
        params: Params,
        version: Callable[[], int],
        *,
        before_next: Callable[[], None],
    ) -> None:
        super().__init__(rollout, prompts, params, version)
        self._remote, self._before_next = rollout, before_next
        self._pending: _Pending | None = None

    def draw(self, step: int) -> Drawn:
        pending, self._pending = self._pending or self._submit(step), None
        drawn = pending.result()
        self._before_next()
        self._pending = self._submit(step + 1)
        return drawn

    def _submit(self, step: int) -> _Pending:
        """Start step ``step``'s generation (prompts drawn here, in order) without waiting."""
        try:
            prompts = self.prompts(step)
        except PromptsExhausted as e:  # raised when (and if) that step is run
            return _Settled(error=e)
        params, version = self.params(step, 0), self._version()
        pending = self._remote.generate_async(prompts, params)
        return _Generating(pending, prompts, version)

    def version_metrics(self, drawn: Drawn, staleness: int) -> dict[str, float]:
        """The weight version that generated the samples, and how many updates old they are."""
        return {
            "rollout/weight_version": float(drawn.version),
            "rollout/staleness": float(staleness),
        }

    def settle(self, *, quiet: bool = False) -> None:
        if self._pending is None:
            return
        if not quiet:
            self._pending.result()
            return
        with contextlib.suppress(Exception):  # its error is the next step's to raise
            self._pending.result()

    def in_flight(self) -> Drawn | None:
        if self._pending is None:
            return None
        try:
            return self._pending.result()
        except Exception:  # its error belongs to a step never run: nothing to resume
            return None

    def restore(self, drawn: Drawn) -> None:
        self._pending = _Settled(drawn)

    def close(self) -> None:
        self.settle(quiet=True)
        self._pending = None
