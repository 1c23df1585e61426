"""``ServedRollout``: the one door from the endpoint to a rollout.

Every request's prompts go through :meth:`ServedRollout.sample`, which queues them for one
worker thread; the rollout is only ever called from that thread, one ``generate`` at a time (a
``BaseRollout`` promises nothing about being called from two threads at once).

Requests from concurrent clients are merged: when the worker is free it takes every request
waiting, and those that share their sampling settings (all but the seed) go to the rollout as
one ``generate`` call. That is what keeps a batching engine (vllm, sglang, replicas) busy when
many agents each send one prompt. A rollout that declares ``continuous_batching`` (vllm) is fed
instead: each request joins the engine's running batch as it arrives and the worker steps the
batch while any request runs, so agents whose calls end at different times never fall into
cohorts that wait for each other's batch. Merging never changes a sample: a seeded request's prompts
travel with their own seeds (the ``prompt_seed`` column, ``derive_seed(seed, i)`` for its
prompt ``i``, what ``generate`` would derive for the request alone), and a rollout draws a
prompt's samples from its seed whatever else is in the batch (``engine_core.rollout``). A merged
call that fails is retried request by request, so that one request never fails another.

What must not overlap a generation (a weight load) runs through :meth:`between_calls`: after
every request queued before it, before any queued after it. Each call's tokens carry the one
weight version that produced them.

Routes. With :attr:`ServedRollout.return_routes` set (a mixture of experts trained with routing
replay through agents), every request asks the rollout for its routes (``return_routes``), and
each choice comes back with the experts each token of its prompt and its sampled ids went to,
``[P + R - 1, layers, top_k]`` (the last sampled token was never fed to the model): what the
session's training rows are stitched from (:mod:`~engine_core_roles.serving.rows`).

The event loop stays free while the rollout works: requests are parsed, refused and streamed
meanwhile.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch

from engine_core.capabilities import Capability
from engine_core.rollout import (
    PROMPT_MASK,
    PROMPT_SEED,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ROLLOUT_TOP_IDS,
    ROLLOUT_TOP_LOG_PROBS,
    TRUNCATED,
    BaseRollout,
    SamplingParams,
    SentBucket,
    WeightBucket,
    derive_seed,
    unplace_routes,
)
from engine_core_roles.batch.build import prompt_batch
from engine_core_roles.serving.sessions import Choice

__all__ = ["Sampled", "ServedRollout"]

T = TypeVar("T")
MERGED_PROMPTS = 256
"""The most prompts one merged ``generate`` call takes (a request's own are never split)."""


@dataclass(frozen=True)
class Sampled:
    """One request's result: ``choices[i]`` are prompt ``i``'s ``n`` samples; with routes asked
    for, ``routes[i][j]`` those of ``choices[i][j]``'s forward over its prompt and sampled ids
    (``[P + R - 1, layers, top_k]``)."""

    choices: list[list[Choice]]
    weight_version: int
    routes: list[list[torch.Tensor]] | None = None
    #: with ``top_logprobs`` asked: ``tops[i][j][pos]``, choice ``j`` of prompt ``i``'s most
    #: likely tokens at response position ``pos``, (id, log-prob), most likely first
    tops: list[list[list[list[tuple[int, float]]]]] | None = None


@dataclass
class _Job:
    """A request waiting for the rollout, or (``fn`` set) work between two generations."""

    done: Future[Any] = field(default_factory=Future)
    prompts: list[list[int]] = field(default_factory=list)
    params: SamplingParams | None = None
    fn: Callable[[], Any] | None = None

    def key(self) -> str:
        """Requests with one key share a ``generate`` call: the same settings but the seed."""
        assert self.params is not None
        seeded = self.params.seed is not None
        return f"{seeded}:{self.params.model_dump_json(exclude={'seed'})}"


class ServedRollout:
    """A rollout and its tokenizer behind one worker thread, with the weight version its
    current weights are (0 as built; :meth:`load_weights` sets it)."""

    def __init__(self, rollout: BaseRollout, tokenizer: Any) -> None:
        self.rollout, self.tokenizer = rollout, tokenizer
        self.weight_version = 0
        #: ask the rollout for every call's routes (``SamplingParams.return_routes``)
        self.return_routes = False
        raw = rollout.config.model.raw_config()
        self.vocab_size = int(raw.get("vocab_size") or len(tokenizer))
        self.context = raw.get("max_position_embeddings")
        eos = tokenizer.eos_token_id
        self.stop_token_ids: list[int] = [] if eos is None else [int(eos)]
        #: ``generate`` calls made, and the requests they served (merging: fewer calls)
        self.generate_calls = 0
        self.requests = 0
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._work, name="engine-core-serve", daemon=True)
        self._worker.start()

    # -- what callers use ----------------------------------------------------------------------
    async def sample(self, prompts: list[list[int]], params: SamplingParams) -> Sampled:
        """``params.n`` samples of each prompt, from the worker thread."""
        if self.return_routes and not params.return_routes:
            params = params.validated_copy(return_routes=True)
        job = _Job(prompts=prompts, params=params)
        self._queue.put(job)
        result: Sampled = await asyncio.wrap_future(job.done)
        return result

    def between_calls(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the worker thread after every request queued before it and before any
        queued after it: what must never overlap a generation (a weight load, a release of
        the rollout's memory)."""
        job = _Job(fn=fn)
        self._queue.put(job)
        return job.done

    def load_weights(self, buckets: Iterable[SentBucket], version: int) -> list[WeightBucket]:
        """Load a weight stream between two generations and report ``version`` from then on."""

        def load() -> list[WeightBucket]:
            done = self.rollout.load_weights(buckets)
            self.weight_version = version
            return done

        return self.between_calls(load).result()

    def waiting(self) -> int:
        """Jobs queued and not yet taken by the worker."""
        return self._queue.qsize()

    def close(self) -> None:
        """Stop the worker once the jobs queued are done (the rollout stays the caller's)."""
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()

    # -- the worker thread ---------------------------------------------------------------------
    def _work(self) -> None:
        if Capability.CONTINUOUS_BATCHING in self.rollout.capabilities:
            self._work_continuously()
        else:
            self._work_merged()

    def _work_continuously(self) -> None:
        """Each request joins the rollout's running batch as it arrives (``submit``), and the
        worker steps the batch (``advance``) while any request runs: no request waits for a
        batch it missed to finish, as a batching engine's own server works. A barrier
        (``between_calls``, closing) waits for the running requests to finish and holds back
        what came after it."""
        running: dict[int, _Job] = {}
        held: deque[_Job | None] = deque()  # a barrier taken while requests ran
        while True:
            while True:  # take what has arrived, waiting for it only when nothing runs
                if held:
                    job = held.popleft()
                elif running:
                    try:
                        job = self._queue.get_nowait()
                    except queue.Empty:
                        break
                else:
                    job = self._queue.get()
                if job is None or job.fn is not None:
                    if running:
                        held.appendleft(job)
                        break
                    if job is None:
                        return
                    if job.fn is not None and job.done.set_running_or_notify_cancel():
                        _settle(job, job.fn)
                    continue
                if not job.done.set_running_or_notify_cancel():  # its caller gave up waiting
                    continue
                assert job.params is not None
                try:
                    running[self.rollout.submit(prompt_batch(job.prompts), job.params)] = job
                except Exception as e:  # refused: this request's own failure
                    job.done.set_exception(e)
            if not running:
                continue
            try:
                finished = self.rollout.advance()
            except Exception as e:  # the engine failed: every request in its batch with it
                for job in running.values():
                    job.done.set_exception(e)
                running.clear()
                continue
            for ticket in finished:
                job = running.pop(ticket)
                _settle(job, partial(self._collected, ticket, job))

    def _collected(self, ticket: int, job: _Job) -> Sampled:
        out = self.rollout.collect(ticket)
        self.generate_calls += 1
        self.requests += 1
        return self._sampled(out, [job])[0]

    def _work_merged(self) -> None:
        held: deque[_Job | None] = deque()  # taken from the queue, not run yet
        while True:
            job = held.popleft() if held else self._queue.get()
            if job is None:
                return
            if not job.done.set_running_or_notify_cancel():  # its caller gave up waiting
                continue
            if job.fn is not None:
                _settle(job, job.fn)
                continue
            batch = [job]
            while sum(len(j.prompts) for j in batch) < MERGED_PROMPTS:
                if not held and self._queue.empty():
                    break
                nxt = held.popleft() if held else self._queue.get()
                if nxt is None or nxt.fn is not None:  # a barrier: what came later waits
                    held.appendleft(nxt)
                    break
                if nxt.done.set_running_or_notify_cancel():
                    batch.append(nxt)
            groups: dict[str, list[_Job]] = {}
            for j in batch:
                groups.setdefault(j.key(), []).append(j)
            for group in groups.values():
                self._run(group)

    def _run(self, group: list[_Job]) -> None:
        if len(group) == 1:
            _settle(group[0], partial(self._alone, group[0]))
            return
        try:
            results = self._generate(group)
        except Exception:  # retried alone: one request's failure is its own
            for job in group:
                _settle(job, partial(self._alone, job))
            return
        for job, result in zip(group, results, strict=True):
            job.done.set_result(result)

    def _alone(self, job: _Job) -> Sampled:
        return self._generate([job])[0]

    def _generate(self, group: list[_Job]) -> list[Sampled]:
        params = group[0].params
        assert params is not None
        prompts = [p for job in group for p in job.prompts]
        batch = prompt_batch(prompts)
        if params.seed is not None:  # each request's prompts keep their own seeds
            seeds = [
                derive_seed(job.params.seed, i)
                for job in group
                if job.params is not None and job.params.seed is not None
                for i in range(len(job.prompts))
            ]
            batch[PROMPT_SEED] = torch.tensor(seeds, dtype=torch.int64)
        out = self.rollout.generate(batch, params)
        self.generate_calls += 1
        self.requests += len(group)
        return self._sampled(out, group)

    def _sampled(self, out: Any, group: list[_Job]) -> list[Sampled]:
        """Each job's samples of ``out``, the rollout's result of the group's prompts."""
        params = group[0].params
        assert params is not None
        ids, mask = out[RESPONSE_IDS].tolist(), out[RESPONSE_MASK].tolist()
        logps, cut = out[ROLLOUT_LOG_PROBS].tolist(), out[TRUNCATED].tolist()
        choices, routes, tops = [], [], []
        for k in range(len(ids)):
            size = int(sum(mask[k]))
            choices.append(Choice(ids[k][:size], logps[k][:size], "length" if cut[k] else "stop"))
        if params.top_logprobs:
            top_ids, top_lps = out[ROLLOUT_TOP_IDS].tolist(), out[ROLLOUT_TOP_LOG_PROBS].tolist()
            for k, choice in enumerate(choices):
                tops.append(
                    [
                        list(zip(top_ids[k][pos], top_lps[k][pos], strict=True))
                        for pos in range(len(choice.token_ids))
                    ]
                )
        if params.return_routes:  # each sample's rows of the tokens fed: all but the last
            heads = out[PROMPT_MASK].sum(1).tolist()
            routes = unplace_routes(out, heads, [len(c.token_ids) - 1 for c in choices])
        n, start, results = params.n, 0, []
        for job in group:
            spans = [range((start + i) * n, (start + i + 1) * n) for i in range(len(job.prompts))]
            rows = [[choices[k] for k in span] for span in spans]
            taken = [[routes[k] for k in span] for span in spans] if routes else None
            top = [[tops[k] for k in span] for span in spans] if tops else None
            results.append(Sampled(rows, self.weight_version, taken, top))
            start += len(job.prompts)
        return results


def _settle(job: _Job, fn: Callable[[], Any]) -> None:
    """Run ``fn`` and hand its result, or what it raised, to the job's waiter."""
    try:
        job.done.set_result(fn())
    except Exception as e:
        job.done.set_exception(e)
