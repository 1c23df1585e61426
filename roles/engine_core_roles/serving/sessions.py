"""Sessions: every call of an episode recorded token for token, as plain data.

A session is one episode of an agent: the calls it made through the endpoint under one session
id (a header, or a base URL per session). Each call is recorded as the rollout produced it: the
prompt's token ids, each choice's sampled ids and their log-probs, and the weight version that
produced them, never a re-tokenization of text.

Drift: an agent usually sends its whole history again on each call. Where the next call's
prompt starts with an earlier call's prompt followed by one of its choices' sampled ids, token
for token, the call *extends* that choice (recorded as ``extends``), and the two belong in one
training row. Where it extends none (the client re-rendered the history, or edited it), the
call is counted in ``drift``: its sampled ids are still recorded as they were sampled, so a
trainer can start a new row there rather than train on tokens the model never produced.

Once ended, a session's id is refused for good: a late call of a finished episode cannot slip
into the next one that happens to reuse the id.

A session issued by the server (:meth:`Sessions.issue`) has a key of its own, good for that
session only: an agent handed it can call, read, reward and end its session, and nothing else.
A session may be given its reward once (:meth:`Sessions.reward`), by whoever holds its key or
the server's: a grader that scores the episode apart from the agent.

Routes (a mixture of experts served with ``return_routes``) are kept beside the record, one
tensor per choice, never in it: the record stays plain data, and :meth:`Sessions.end_with_routes`
hands both to the trainer in this process.
"""

from __future__ import annotations

import hmac
import math
import re
import secrets
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from engine_core.rollout import derive_seed
from engine_core_roles.serving.protocol import ApiError

__all__ = ["Choice", "Call", "Session", "Sessions", "check_session_id"]

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


def check_session_id(session_id: str) -> str:
    """``session_id`` if it is 1-128 letters, digits, ``_ . : -`` (starting with a letter or
    digit), else a 400 naming what is allowed."""
    if not _ID.fullmatch(session_id):
        raise ApiError(
            400,
            f"session id {session_id[:40]!r} is not allowed; use 1-128 letters, digits, '_', "
            f"'.', ':' or '-', starting with a letter or digit (a UUID works).",
            param="session_id",
            code="invalid_session_id",
        )
    return session_id


@dataclass(frozen=True)
class Choice:
    """One sampled continuation: its ids, their log-probs, and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token or string) or "length"


@dataclass(frozen=True)
class Call:
    """One request of a session, as the rollout served it."""

    index: int
    endpoint: str  # "chat.completions" or "completions"
    prompt_ids: list[int]
    choices: list[Choice]
    weight_version: int
    extends: dict[str, int] | None  # {"call": i, "choice": j}: the choice this prompt extends
    messages: list[dict[str, Any]] | None  # the chat request's messages (None: token-in)
    created: float


@dataclass
class Session:
    """The calls of one session so far, and how many of them drifted."""

    id: str
    calls: list[Call] = field(default_factory=list)
    drift: int = 0
    ended: bool = False
    reward: float | None = None  # given by the session's reward call (None: none given)
    # (call, choice) -> the routes of that choice's forward, where the rollout returned them
    routes: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def extended(self, prompt: list[int]) -> dict[str, int] | None:
        """The latest earlier choice whose prompt + sampled ids ``prompt`` starts with."""
        for call in reversed(self.calls):
            head = len(call.prompt_ids)
            if prompt[:head] != call.prompt_ids:
                continue
            for j, choice in enumerate(call.choices):
                if prompt[head : head + len(choice.token_ids)] == choice.token_ids:
                    return {"call": call.index, "choice": j}
        return None

    def to_dict(self) -> dict[str, Any]:
        """The session as plain data (JSON-ready)."""
        return {
            "id": self.id,
            "ended": self.ended,
            "drift": self.drift,
            "reward": self.reward,
            "calls": [asdict(c) for c in self.calls],
        }


class Sessions:
    """The open sessions and the ids of the ended ones; safe to call from any thread."""

    def __init__(self, max_open: int, max_calls: int) -> None:
        self.max_open, self.max_calls = max_open, max_calls
        self._open: dict[str, Session] = {}
        self._ended: set[str] = set()
        # a session's own seed (given by whoever opened it) and the seeds drawn from it so far
        self._seeds: dict[str, tuple[int, int]] = {}
        # a session's own temperature, where its opener pinned one (over the server's)
        self._temperatures: dict[str, float] = {}
        # the keys of the sessions the server issued, kept after they end (a late call with
        # one is told its session ended, not that its key is wrong)
        self._keys: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def new_id(self) -> str:
        return uuid.uuid4().hex

    def issue(self) -> tuple[str, str]:
        """A new session id and the key of that session alone."""
        sid, key = self.new_id(), secrets.token_urlsafe(24)
        with self._lock:
            self._keys[sid] = key.encode()
        return sid, key

    def key_matches(self, session_id: str, given: bytes) -> bool:
        """Whether ``given`` is the key issued for ``session_id`` (compared in constant time)."""
        with self._lock:
            key = self._keys.get(session_id)
        return key is not None and hmac.compare_digest(given, key)

    def _refuse(self, session_id: str, *, opening: bool) -> None:
        """Refuse an ended id (409); for a call (``opening``), a new session past the limit of
        open ones (429) or a call past the limit of one session's (400)."""
        if session_id in self._ended:
            raise ApiError(
                409,
                f"session {session_id!r} has ended and its id cannot be used again; start a "
                f"new session with a new id (POST /v1/sessions issues one).",
                param="session_id",
                code="session_ended",
            )
        session = self._open.get(session_id)
        if opening and session is not None and len(session.calls) >= self.max_calls:
            raise ApiError(
                400,
                f"session {session_id!r} has recorded {len(session.calls)} calls, the most one "
                f"session may (max_session_calls); end it and start another.",
                param="session_id",
                code="session_too_long",
            )
        if opening and session is None and len(self._open) >= self.max_open:
            raise ApiError(
                429,
                f"{len(self._open)} sessions are open, the most this server keeps "
                f"(max_sessions); end finished sessions (POST /v1/sessions/ID/end).",
                code="too_many_sessions",
            )

    def seed(self, session_id: str, seed: int) -> None:
        """Give a session a seed of its own: its calls that name no seed draw the ``i``-th of
        them from ``derive_seed(seed, i)``, so a session is reproducible whatever else the
        server serves meanwhile (an agent that calls one at a time)."""
        with self._lock:
            self._refuse(session_id, opening=False)
            self._seeds[session_id] = (seed, 0)

    def pin_temperature(self, session_id: str, temperature: float) -> None:
        """Sample every call of a session at ``temperature`` (one naming another is refused):
        what its opener trains, or evaluates, the session's tokens at."""
        with self._lock:
            self._refuse(session_id, opening=False)
            self._temperatures[session_id] = float(temperature)

    def temperature(self, session_id: str) -> float | None:
        """The temperature a session is pinned to (None: not pinned)."""
        with self._lock:
            return self._temperatures.get(session_id)

    def next_seed(self, session_id: str) -> int | None:
        """The seed of a session's next call that names none (None: the session has no seed)."""
        with self._lock:
            if session_id not in self._seeds:
                return None
            seed, drawn = self._seeds[session_id]
            self._seeds[session_id] = (seed, drawn + 1)
            return derive_seed(seed, drawn)

    def check(self, session_id: str) -> None:
        """Refuse, before anything is sampled, a call under an ended id or past the limit."""
        with self._lock:
            self._refuse(session_id, opening=True)

    def record(
        self, session_id: str, *, routes: list[torch.Tensor] | None = None, **call: Any
    ) -> Call:
        """Append a call (the fields of :class:`Call` but its index and ``extends``), with its
        choices' routes where the rollout returned them."""
        with self._lock:
            self._refuse(session_id, opening=True)
            session = self._open.setdefault(session_id, Session(session_id))
            extends = session.extended(call["prompt_ids"]) if session.calls else None
            if session.calls and extends is None:
                session.drift += 1
            recorded = Call(index=len(session.calls), extends=extends, created=time.time(), **call)
            session.calls.append(recorded)
            for j, taken in enumerate(routes or []):
                session.routes[(recorded.index, j)] = taken
            return recorded

    def reward(self, session_id: str, reward: Any) -> dict[str, Any]:
        """Give a session its reward, once: a finite number (400 otherwise; 409 for a second
        one or an ended session). Returns the session's id and reward."""
        if (
            isinstance(reward, bool)
            or not isinstance(reward, int | float)
            or not math.isfinite(reward)
        ):
            raise ApiError(
                400,
                f'reward {str(reward)[:40]!r} is not a finite number; send {{"reward": 0.5}}.',
                param="reward",
            )
        with self._lock:
            self._refuse(session_id, opening=True)
            session = self._open.setdefault(session_id, Session(session_id))
            if session.reward is not None:
                raise ApiError(
                    409,
                    f"session {session_id!r} was given its reward ({session.reward:g}) already; "
                    f"a session takes one.",
                    param="reward",
                    code="reward_given",
                )
            session.reward = float(reward)
            return {"id": session_id, "reward": session.reward}

    def get(self, session_id: str) -> dict[str, Any]:
        """A session's record so far (an id never used: an empty one)."""
        with self._lock:
            self._refuse(session_id, opening=False)
            return self._open.get(session_id, Session(session_id)).to_dict()

    def end(self, session_id: str) -> dict[str, Any]:
        """Close a session for good and return its record (an id never used ends empty)."""
        return self.end_with_routes(session_id)[0]

    def end_with_routes(
        self, session_id: str
    ) -> tuple[dict[str, Any], dict[tuple[int, int], torch.Tensor]]:
        """:meth:`end`, with the routes of the session's choices, by (call, choice)."""
        with self._lock:
            self._refuse(session_id, opening=False)
            session = self._open.pop(session_id, None) or Session(session_id)
            self._seeds.pop(session_id, None)
            self._temperatures.pop(session_id, None)
            self._ended.add(session_id)
            session.ended = True
            return session.to_dict(), session.routes
