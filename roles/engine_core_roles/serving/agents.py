"""Agents written against an OpenAI client, trained through the endpoint: :class:`AgentRollout`.

An *agent function* is ``async def agent(base_url: str, api_key: str, sample: dict)``: given a
session's own base URL on the endpoint (``http://127.0.0.1:PORT/sessions/ID/v1``), the key the
endpoint asks for, and one dataset row, it runs the user's agent with any client (the
``openai`` package, the Agents SDK, ...) and returns the session's reward: a number, ``None``
(the job's reward function then scores the session's last reply:
:class:`~engine_core_roles.serving.agent_function.AgentReward`), or a
dict of numbers whose ``"reward"`` entry is that (``None`` or absent: the same) and whose other
entries are logged as ``agent/<name>`` means. An agent that raises, runs past its timeout, or
returns anything else scores 0, is counted (``agent/errors``), and the run goes on.

:class:`AgentRollout` is a :class:`~engine_core.rollout.BaseRollout` whose ``generate`` runs
``n`` agents per prompt (``max_concurrency`` at once, on one event loop of its own), one session
each, ends each session, and returns every session's :func:`~engine_core_roles.serving.rows.
session_rows` in the shape of an episode rollout's result: the response holds the sampled and
the client's tokens exactly as the endpoint recorded them, :data:`RESPONSE_LOSS_MASK` 1 on the
sampled ones, the rollout's log-probs there, and an :data:`EPISODE` record per row.

Rows and groups. A session is one row unless its client drifted (``rows``). Every session of
a step is given the same number of rows, ``k`` (the most any session of the step has), the
missing ones empty (no token to train on), and the result lists them prompt by prompt, row slot
by row slot, session by session: so the trainer's groups (``n`` adjacent rows) are the ``r``-th
rows of one prompt's ``n`` sessions, each row scored with its session's reward, and a group's
mean and spread are those of the prompt's sessions, whatever each session's row count. A
session that drifted three times is not counted four times in its prompt's baseline, and each
of its rows gets the advantage its session earned. The cost: a step where a session drifted
carries ``k`` times the rows, the empty ones one token each.

The endpoint is started on the first ``generate`` (127.0.0.1, a free port, a random key) and
served until :meth:`AgentRollout.shutdown`; every generation goes through it. It samples at the
temperature the rollout was built with (a request that names another is refused: the trainer
computes its log-probs at that one) and at most ``max_tokens`` a call; a call that names no
seed draws from its session's own (sample ``j`` of prompt ``i``'s, as ``generate`` derives
them), so a step's sessions do not depend on what else the endpoint serves. Weights go to the
rollout behind it between two generations, and each load bumps the weight version the
endpoint reports: the first load is version 0 (the initial policy), the next 1, and so on
(:attr:`AgentRollout.next_version`; a resumed job sets it to its step).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tensordict import NonTensorStack, TensorDict

from engine_core.capabilities import Capability
from engine_core.errors import ConfigError
from engine_core.rollout import (
    BaseRollout,
    SamplingParams,
    SentBucket,
    WeightBucket,
    sample_seeds,
)
from engine_core_roles.batch.build import prompt_batch, turns_batch
from engine_core_roles.batch.keys import EPISODE, ROW
from engine_core_roles.serving.agent_function import AgentFn, BadReturn, outcome
from engine_core_roles.serving.config import ServeConfig
from engine_core_roles.serving.rows import SessionRow, session_rows
from engine_core_roles.serving.sampler import ServedRollout
from engine_core_roles.serving.server import BackgroundServer

__all__ = ["AgentRollout"]


@dataclass
class _Session:
    """One agent's run: its reward (None: the reward function scores it), counts, its error,
    the endpoint's record, and the rows built from it."""

    reward: float | None = None
    counts: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    record: dict[str, Any] = field(default_factory=dict)
    rows: list[SessionRow] = field(default_factory=list)
    seconds: float = 0.0


class AgentRollout(BaseRollout):
    """Agents over ``inner`` (any :class:`BaseRollout` in this process) through the endpoint.

    ``agent``: the agent function; ``tokenizer``: the model's, with its chat template;
    ``temperature``: what the endpoint samples at (the trainer's); ``max_tokens``: the most a
    call may sample; ``stop_token_ids``: what ends a reply (the trainer's stop tokens);
    ``max_concurrency``: agents running at once; ``timeout_s``: an agent running longer is
    cancelled (an error); ``scored_by_fn``: whether a reward function scores sessions whose
    agent returned None (without one, such a session is an error)."""

    def __init__(
        self,
        inner: BaseRollout,
        agent: AgentFn,
        tokenizer: Any,
        *,
        temperature: float,
        max_tokens: int,
        stop_token_ids: list[int],
        max_concurrency: int = 32,
        timeout_s: float = 600.0,
        scored_by_fn: bool = False,
        max_prompt_tokens: int = 1 << 20,
    ) -> None:
        super().__init__(inner.config)
        self.inner, self.agent, self.tokenizer = inner, agent, tokenizer
        self.capabilities = frozenset(inner.capabilities) - {  # type: ignore[misc]
            Capability.ASYNC_GENERATION,
            Capability.WEIGHT_SYNC_GROUP,
            Capability.ROUTING_REPLAY,
        }
        self.pad_token_id = inner.pad_token_id
        self.temperature, self.max_concurrency, self.timeout_s = (
            temperature,
            max_concurrency,
            timeout_s,
        )
        self.scored_by_fn = scored_by_fn
        self.api_key = secrets.token_urlsafe(24)  # only this job's agents may sample
        self.config_serve = ServeConfig(
            port=0,
            api_key=self.api_key,
            max_tokens=max_tokens,
            default_max_tokens=max_tokens,
            max_prompt_tokens=max_prompt_tokens,
            temperature=temperature,
        )
        self.served = ServedRollout(inner, tokenizer)
        self.served.stop_token_ids = list(stop_token_ids)
        self._server: BackgroundServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        #: the weight version the next load is reported as (0: the initial policy's); a job
        #: resumed after step ``k`` sets ``k``
        self.next_version = 0

    # -- weights and memory: the inner rollout's, between two generations ----------------------
    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return self.inner.expected_weights()

    def load_weights(self, buckets: Iterable[SentBucket]) -> list[WeightBucket]:
        # the first load is the initial policy's (version 0), each later one an update's
        done = self.served.load_weights(buckets, self.next_version)
        self.next_version += 1
        return done

    def release(self) -> None:
        self.served.between_calls(self.inner.release).result()

    def resume(self) -> None:
        self.served.between_calls(self.inner.resume).result()

    @property
    def server(self) -> BackgroundServer:
        """The endpoint (started on first use)."""
        if self._server is None:
            self._server = BackgroundServer(self.config_serve, self.served)
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(
                target=self._loop.run_forever, name="engine-core-agents", daemon=True
            )
            self._loop_thread.start()
        return self._server

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._loop is not None and self._loop_thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(10)
            self._loop.close()
            self._loop = None
        self.served.close()

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        if ROW not in prompts.keys():
            raise ConfigError(
                f"an agent rollout hands each agent its dataset row, from the {ROW!r} field of "
                f"the prompt batch (PromptData(..., rows=True) puts it there); got "
                f"{sorted(prompts.keys())}."
            )
        if params.temperature != self.temperature:
            raise ConfigError(
                f"this agent rollout's endpoint samples at temperature {self.temperature} (set "
                f"when it was built, the trainer's); generate asked {params.temperature}. Build "
                f"the rollout with the temperature the trainer computes its log-probs at."
            )
        rows = [dict(r) for r in prompts[ROW].tolist()] if prompts.batch_size[0] else []
        # session j of prompt i draws the calls that name no seed from its own seed
        seeds = sample_seeds(prompts, params) if rows else None
        server = self.server
        assert self._loop is not None
        t0 = time.perf_counter()
        running = asyncio.run_coroutine_threadsafe(
            self._run_all(server, rows, params.n, seeds), self._loop
        )
        sessions = running.result()
        wall = time.perf_counter() - t0
        return self._result(sessions, params.n, wall)

    async def _run_all(
        self,
        server: BackgroundServer,
        rows: list[dict[str, Any]],
        n: int,
        seeds: list[int] | None,
    ) -> list[_Session]:
        bound = asyncio.Semaphore(self.max_concurrency)

        async def one(row: dict[str, Any], seed: int | None) -> _Session:
            async with bound:
                return await self._run_one(server, row, seed)

        work = [row for row in rows for _ in range(n)]
        each = seeds if seeds is not None else [None] * len(work)
        return list(await asyncio.gather(*(one(r, s) for r, s in zip(work, each, strict=True))))

    async def _run_one(
        self, server: BackgroundServer, row: dict[str, Any], seed: int | None
    ) -> _Session:
        sessions = server.endpoint.sessions
        sid = sessions.new_id()
        if seed is not None:
            sessions.seed(sid, seed)
        out = _Session()
        t0 = time.perf_counter()
        try:
            returned = await asyncio.wait_for(
                self.agent(server.session_url(sid), self.api_key, dict(row)), self.timeout_s
            )
            out.reward, out.counts = outcome(returned)
            if out.reward is None and not self.scored_by_fn:
                out.error = (
                    "the agent returned no reward and the job has no reward.fn to score the "
                    "session; return a number, or set reward.fn"
                )
        except BadReturn as e:
            out.error = f"the agent {e}"
        except TimeoutError:
            out.error = f"the agent ran past agent_timeout_s={self.timeout_s:g} s"
        except Exception as e:  # the run goes on: this session scores 0, counted
            out.error = f"the agent raised {type(e).__name__}: {e}"
        out.seconds = time.perf_counter() - t0
        out.record = sessions.end(sid)  # later calls of this session are refused (409)
        out.rows = session_rows(out.record)
        return out

    def _result(self, sessions: list[_Session], n: int, wall: float) -> TensorDict:
        """Every session's rows, ``k`` slots each, laid out prompt, slot, session."""
        k = max([len(s.rows) for s in sessions] + [1])
        empty = SessionRow([int(self.pad_token_id)])
        order: list[tuple[SessionRow, dict[str, Any]]] = []
        records = [self._record(s, wall) for s in sessions]
        for p in range(len(sessions) // n):
            for r in range(k):
                for j in range(p * n, (p + 1) * n):
                    rows = sessions[j].rows
                    order.append((rows[r] if r < len(rows) else empty, records[j]))
        prompts = prompt_batch([row.prompt for row, _ in order], pad_token_id=self.pad_token_id)
        out = turns_batch(
            prompts,
            [(row.tokens, row.trained, row.log_probs, row.truncated) for row, _ in order],
            pad_token_id=self.pad_token_id,
        )
        out[EPISODE] = NonTensorStack.from_list([record for _, record in order])
        return out

    def _record(self, s: _Session, wall: float) -> dict[str, Any]:
        """A session as an episode record (what the episode metrics and the reward read)."""
        calls = s.record.get("calls", [])
        final = ""
        if calls and calls[-1]["choices"]:
            ids = calls[-1]["choices"][0]["token_ids"]
            final = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        messages = [dict(m) for m in (_last_messages(calls) or [])]
        messages.append({"role": "assistant", "content": final})
        if s.error is not None:
            messages.append({"role": "error", "content": s.error})
        versions = [int(c["weight_version"]) for c in calls]
        counts = {
            "agent/calls": float(len(calls)),
            "agent/drift_calls": float(s.record.get("drift", 0)),
            "agent/rows": float(len(s.rows)),
            "agent/errors": float(s.error is not None),
            "agent/seconds": s.seconds,
            **({"agent/weight_version": sum(versions) / len(versions)} if versions else {}),
            **{f"agent/{k}": v for k, v in s.counts.items()},
        }
        return {
            "turns": len(calls),
            "end": "env_error" if s.error is not None else "done",
            "reward": 0.0,  # an environment's share of the reward: none (AgentReward scores)
            "agent_reward": None if s.error is not None else s.reward,
            "counts": counts,
            "final": final,
            "messages": messages,
            "env_wait_s": wall,
            "session": s.record,
        }


def _last_messages(calls: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages of the session's last chat call that sent messages (None: none did)."""
    for call in reversed(calls):
        if call.get("messages"):
            return list(call["messages"])
    return None
