"""A session's record as training rows, token for token (:func:`session_rows`).

A row is one causal sequence the trainer computes log-probs over: a prompt, then every token
after it, each either sampled by the rollout (trained on, with the log-prob the rollout
reported) or added by the client between two calls (not trained on).

How a session is split into rows, and why:

- A choice joins the row that ends with the choice its call *extends* (the record's
  ``extends``: the call's prompt is that choice's prompt followed by its sampled ids, token for
  token). What the client added after that choice (a tool's answer, the next user message, the
  template's end of turn) is the new prompt's remaining ids, appended with loss mask 0; the
  choice's sampled ids follow with loss mask 1. An agent that sends its whole history back each
  time, unchanged, is one row: the first call's prompt, then every token of the session.
- A choice starts a row of its own, whose prompt is its call's prompt ids as the rollout read
  them, when its call extends nothing (drift: the client re-rendered the history with other
  tokens than were sampled), when the choice it extends already has a continuation (a second
  choice of ``n``, or an agent that branched from an earlier reply), or when it is the first
  call. The sampled ids are kept as sampled in every case; nothing is re-tokenized, so every
  trained token's context in its row is exactly the context the rollout sampled it in, and the
  trainer's log-probs equal the rollout's.

Routes (a mixture of experts with routing replay): given the routes of each choice's forward
(``[P + R - 1, layers, top_k]``, by (call, choice)), a row's are stitched as an episode's turns
are: each token's experts are those of the forward that first fed it to the model. A choice's
call fed the row's tokens from the previous choice's last sampled one (or, for a row's first
choice, from the start) up to its own last sampled one but the very last, which the next call
of the row feeds, or none (a row's last token is never scored).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_core.rollout import stitch_routes

__all__ = ["SessionRow", "session_rows"]


@dataclass
class SessionRow:
    """One training row of a session: ``prompt`` ids, then ``tokens`` (``trained[i]`` 1 where
    the rollout sampled ``tokens[i]``, with ``log_probs[i]`` its log-prob; 0 and 0.0 where the
    client added it), whether its last choice stopped on length, and the calls it holds."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    truncated: bool = False
    calls: list[int] = field(default_factory=list)
    #: the experts of this row's tokens but the last, by the forward that first fed each
    #: (``[length - 1, layers, top_k]``; None: no routes given)
    routes: torch.Tensor | None = field(default=None, repr=False)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def add(self, ids: list[int], log_probs: list[float] | None) -> None:
        self.tokens += ids
        self.trained += [0 if log_probs is None else 1] * len(ids)
        self.log_probs += [0.0] * len(ids) if log_probs is None else [float(x) for x in log_probs]

    def add_routes(self, call_routes: torch.Tensor, where: str) -> None:
        """The rows of ``call_routes`` (a choice's, over its prompt, which is this row so far,
        and its sampled ids, now added) for the tokens no earlier call of the row fed."""
        if call_routes.shape[0] != self.length - 1:
            raise ValueError(
                f"{where}: routes for {call_routes.shape[0]} tokens, want {self.length - 1} "
                f"(its prompt and sampled ids but the last)."
            )
        self.routes = stitch_routes(self.routes, call_routes, call_routes.shape[0])


def session_rows(
    record: Mapping[str, Any],
    routes: Mapping[tuple[int, int], torch.Tensor] | None = None,
) -> list[SessionRow]:
    """The rows of one session's record (``Session.to_dict()``, what ending a session returns),
    in the order their first calls were made; with ``routes`` (each choice's, by (call,
    choice): :meth:`~engine_core_roles.serving.sessions.Sessions.end_with_routes`), each row's
    stitched from them."""
    rows: list[SessionRow] = []
    tails: dict[tuple[int, int], SessionRow] = {}  # the rows whose last piece is this choice
    for call in record["calls"]:
        prompt = list(call["prompt_ids"])
        parent = call.get("extends")
        for j, choice in enumerate(call["choices"]):
            row = None
            if parent is not None:
                row = tails.pop((int(parent["call"]), int(parent["choice"])), None)
            if row is None:
                row = SessionRow(prompt)
                rows.append(row)
            else:
                # the record's extends guarantees prompt starts with the row so far
                assert prompt[: row.length] == row.prompt + row.tokens
                row.add(prompt[row.length :], None)
            row.add(list(choice["token_ids"]), list(choice["logprobs"]))
            if routes is not None:
                where = f"session {record.get('id')!r}, call {call['index']}, choice {j}"
                if (int(call["index"]), j) not in routes:
                    raise ValueError(f"{where}: no routes recorded; serve with return_routes.")
                row.add_routes(routes[(int(call["index"]), j)], where)
            row.truncated = choice["finish_reason"] == "length"
            row.calls.append(int(call["index"]))
            tails[(int(call["index"]), j)] = row
    return rows
