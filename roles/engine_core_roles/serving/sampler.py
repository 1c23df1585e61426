"""``ServedRollout``: the one door from the endpoint to a rollout.

Every request's prompts go through :meth:`ServedRollout.sample`, which runs the rollout's
``generate`` on one worker thread, one call at a time. Requests from concurrent clients are
serialized rather than merged into one batch: a ``BaseRollout`` promises nothing about being
called from two threads at once, a weight load must never interleave with a generation (each
call's tokens carry the one weight version that produced them), and on the backends that batch
internally (vllm, sglang, process replicas) a call's own prompts already fill the engine.
Merging concurrent requests that share their settings into one ``generate`` (a seeded prompt's
samples do not depend on the rest of its batch, so merging would not change them) is left for
the load benchmark to justify.

The event loop stays free while a call runs: requests are parsed, refused, and streamed while
the rollout works.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from engine_core.rollout import (
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TRUNCATED,
    BaseRollout,
    SamplingParams,
    SentBucket,
    WeightBucket,
)
from engine_core_roles.batch.build import prompt_batch
from engine_core_roles.serving.sessions import Choice

__all__ = ["Sampled", "ServedRollout"]

T = TypeVar("T")


@dataclass(frozen=True)
class Sampled:
    """One call's result: ``choices[i]`` are prompt ``i``'s ``n`` samples."""

    choices: list[list[Choice]]
    weight_version: int


class ServedRollout:
    """A rollout and its tokenizer, behind one worker thread, with the weight version its
    current weights are (0 as built; :meth:`load_weights` sets it)."""

    def __init__(self, rollout: BaseRollout, tokenizer: Any) -> None:
        self.rollout, self.tokenizer = rollout, tokenizer
        self.weight_version = 0
        raw = rollout.config.model.raw_config()
        self.vocab_size = int(raw.get("vocab_size") or len(tokenizer))
        self.context = raw.get("max_position_embeddings")
        eos = tokenizer.eos_token_id
        self.stop_token_ids: list[int] = [] if eos is None else [int(eos)]
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="engine-core-serve")

    async def sample(self, prompts: list[list[int]], params: SamplingParams) -> Sampled:
        """``params.n`` samples of each prompt, on the worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, self._generate, prompts, params)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> Sampled:
        out = self.rollout.generate(prompt_batch(prompts), params)
        ids, mask = out[RESPONSE_IDS].tolist(), out[RESPONSE_MASK].tolist()
        logps, cut = out[ROLLOUT_LOG_PROBS].tolist(), out[TRUNCATED].tolist()
        rows = []
        for k in range(len(ids)):
            size = int(sum(mask[k]))
            rows.append(Choice(ids[k][:size], logps[k][:size], "length" if cut[k] else "stop"))
        n = params.n
        return Sampled(
            [rows[i * n : (i + 1) * n] for i in range(len(prompts))], self.weight_version
        )

    def between_calls(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the worker thread once the calls queued before it are done, and before
        any queued after it starts: what must never overlap a generation (a weight load, a
        release of the rollout's memory)."""
        return self._worker.submit(fn)

    def load_weights(self, buckets: Iterable[SentBucket], version: int) -> list[WeightBucket]:
        """Load a weight stream between two generations and report ``version`` from then on."""

        def load() -> list[WeightBucket]:
            done = self.rollout.load_weights(buckets)
            self.weight_version = version
            return done

        return self.between_calls(load).result()

    def close(self) -> None:
        self._worker.shutdown(wait=True)
