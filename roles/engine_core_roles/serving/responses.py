"""The bodies the endpoint answers with: OpenAI's chat and completions objects, whole or as
server-sent-event chunks, plus the token-out extension on each choice.

Extension fields (an OpenAI client keeps them as extra attributes): on every choice
``token_ids`` (the sampled ids, the stop token included where one ended the choice) and
``token_logprobs`` (their log-probs, as the rollout reported them); on the response
``prompt_token_ids``, ``weight_version`` and, in a session, ``session_id`` and ``call_index``.

A stream carries the same reply as the whole body would, cut into OpenAI's chunks: a rollout's
``generate`` returns whole responses, so the chunks are sent once the choice is sampled (one
content chunk per choice), not token by token.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine_core_roles.serving.sessions import Choice

__all__ = ["Reply", "chat_body", "chat_chunks", "completion_body", "completion_chunks", "sse"]


@dataclass(frozen=True)
class Reply:
    """One choice as the client reads it: its message (chat) or text, its finish reason, and
    the sampled ids and log-probs it came from."""

    index: int
    choice: Choice
    text: str
    message: dict[str, Any] | None  # chat only
    finish_reason: str
    token_texts: list[str] | None  # each sampled token's text, where logprobs were asked for
    #: each position's most likely tokens, (text, log-prob), where top log-probs were asked for
    top: list[list[tuple[str, float]]] | None = None


def _head(kind: str, model: str, extra: dict[str, Any]) -> dict[str, Any]:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        **extra,
    }


def _usage(prompt_tokens: int, replies: list[Reply]) -> dict[str, int]:
    done = sum(len(r.choice.token_ids) for r in replies)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": done,
        "total_tokens": prompt_tokens + done,
    }


def _tokens_out(r: Reply) -> dict[str, Any]:
    return {"token_ids": r.choice.token_ids, "token_logprobs": r.choice.logprobs}


def _chat_logprobs(r: Reply) -> dict[str, Any] | None:
    if r.token_texts is None:
        return None
    tops = r.top or [[] for _ in r.token_texts]
    return {
        "content": [
            {
                "token": t,
                "logprob": lp,
                "bytes": list(t.encode()),
                "top_logprobs": [
                    {"token": text, "logprob": v, "bytes": list(text.encode())} for text, v in top
                ],
            }
            for t, lp, top in zip(r.token_texts, r.choice.logprobs, tops, strict=True)
        ],
        "refusal": None,
    }


def chat_body(model: str, prompt_tokens: int, replies: list[Reply], extra: dict[str, Any]) -> Any:
    return {
        **_head("chat.completion", model, extra),
        "choices": [
            {
                "index": r.index,
                "message": r.message,
                "finish_reason": r.finish_reason,
                "logprobs": _chat_logprobs(r),
                **_tokens_out(r),
            }
            for r in replies
        ],
        "usage": _usage(prompt_tokens, replies),
    }


def chat_chunks(
    model: str, prompt_tokens: int, replies: list[Reply], extra: dict[str, Any], usage: bool
) -> Iterator[dict[str, Any]]:
    """The chunks of a streamed chat reply: per choice its role, its content (and tool calls),
    then its finish reason; the usage last when asked for (``stream_options.include_usage``)."""
    head = _head("chat.completion.chunk", model, extra)

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**head, "choices": choices, **({"usage": None} if usage else {})}

    for r in replies:
        assert r.message is not None
        delta: dict[str, Any] = {"role": "assistant", "content": ""}
        yield chunk([{"index": r.index, "delta": delta, "finish_reason": None, "logprobs": None}])
        delta = {"content": r.message["content"]}
        if r.message.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(r.message["tool_calls"])]
        yield chunk(
            [
                {
                    "index": r.index,
                    "delta": delta,
                    "finish_reason": None,
                    "logprobs": _chat_logprobs(r),
                    **_tokens_out(r),
                }
            ]
        )
        yield chunk(
            [{"index": r.index, "delta": {}, "finish_reason": r.finish_reason, "logprobs": None}]
        )
    if usage:
        yield {**head, "choices": [], "usage": _usage(prompt_tokens, replies)}


def _completion_logprobs(r: Reply) -> dict[str, Any] | None:
    if r.token_texts is None:
        return None
    offsets, at = [], 0
    for t in r.token_texts:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": r.token_texts,
        "token_logprobs": r.choice.logprobs,
        # OpenAI's legacy form: a token's text to its log-prob, per position
        "top_logprobs": None if r.top is None else [dict(top) for top in r.top],
        "text_offset": offsets,
    }


def _completion_choice(r: Reply, finish: str | None) -> dict[str, Any]:
    return {
        "index": r.index,
        "text": r.text,
        "finish_reason": finish,
        "logprobs": _completion_logprobs(r),
        **_tokens_out(r),
    }


def completion_body(
    model: str, prompt_tokens: int, replies: list[Reply], extra: dict[str, Any]
) -> Any:
    return {
        **_head("text_completion", model, extra),
        "choices": [_completion_choice(r, r.finish_reason) for r in replies],
        "usage": _usage(prompt_tokens, replies),
    }


def completion_chunks(
    model: str, prompt_tokens: int, replies: list[Reply], extra: dict[str, Any], usage: bool
) -> Iterator[dict[str, Any]]:
    head = _head("text_completion", model, extra)
    for r in replies:
        yield {**head, "choices": [_completion_choice(r, None)]}
        end = {"index": r.index, "text": "", "finish_reason": r.finish_reason, "logprobs": None}
        yield {**head, "choices": [end]}
    if usage:
        yield {**head, "choices": [], "usage": _usage(prompt_tokens, replies)}


def sse(chunks: Iterator[dict[str, Any]]) -> Iterator[str]:
    """Server-sent events of ``chunks``, ended by ``data: [DONE]`` as OpenAI's are."""
    for c in chunks:
        yield f"data: {json.dumps(c)}\n\n"
    yield "data: [DONE]\n\n"
