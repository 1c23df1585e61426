"""What every request is held to before anything is sampled: the API key, the body's size, the
session it names, the model, ``n``, ``max_tokens``, and the prompt's ids and length. Each
refusal is an :class:`~engine_core_roles.serving.protocol.ApiError` naming what was received,
what is allowed, and what to change."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from engine_core.rollout import SamplingParams
from engine_core_roles.serving.config import ServeConfig
from engine_core_roles.serving.protocol import ApiError, SamplingFields
from engine_core_roles.serving.sessions import check_session_id

__all__ = [
    "SESSION_HEADER",
    "check_key",
    "read_body",
    "session_of",
    "sampling_params",
    "check_prompt",
]

SESSION_HEADER = "X-Session-Id"


def check_key(
    authorization: str, key: bytes | None, session_key: Callable[[bytes], bool] | None = None
) -> None:
    """Refuse a request whose ``Authorization`` header carries neither ``key`` (none: any) nor,
    where ``session_key`` says so, the key of the session the request names."""
    if key is None:
        return
    scheme, _, given = authorization.partition(" ")
    # compared in constant time, so the time taken says nothing about the key
    good = scheme.lower() == "bearer" and (
        hmac.compare_digest(given.encode(), key)
        or (session_key is not None and session_key(given.encode()))
    )
    if not good:
        raise ApiError(
            401,
            "missing or wrong API key; send it as 'Authorization: Bearer KEY' (the openai "
            "client's api_key).",
            type="authentication_error",
            code="invalid_api_key",
        )


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body has {size} bytes or more; this server takes at most {limit} "
        f"(max_body_bytes).",
        code="request_too_large",
    )


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a Starlette ``request``, read no further than ``limit`` bytes."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit)
    body, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(size, limit)
        body.append(part)
    return b"".join(body)


def session_of(path: str | None, header: str | None) -> str | None:
    """The session a request names, in its URL (``/sessions/ID/v1/...``) or its header."""
    if path is not None and header is not None and header != path:
        raise ApiError(
            400,
            f"the URL names session {path!r} and the {SESSION_HEADER} header {header!r}; name "
            f"one session, in one place.",
            param="session_id",
        )
    sid = path if path is not None else header
    return None if sid is None else check_session_id(sid)


def sampling_params(
    req: SamplingFields,
    config: ServeConfig,
    *,
    max_tokens: int | None,
    stop: list[str],
    stop_token_ids: list[int],
    pinned: float | None = None,
    pinned_by: str = "this server",
) -> SamplingParams:
    """The rollout's sampling parameters of ``req``, the model it names and its ``n`` and
    ``max_tokens`` (the config's default where it sets none) held to the config's bounds, and
    its temperature to ``pinned`` (``pinned_by``'s: a session's, else the config's), where
    set."""
    if req.model != config.model_name:
        raise ApiError(
            404,
            f"the model {req.model!r} does not exist here; this server serves "
            f"{config.model_name!r} (GET /v1/models).",
            param="model",
            code="model_not_found",
        )
    if req.n > config.max_n:
        raise ApiError(400, f"n={req.n}; this server allows at most {config.max_n}.", param="n")
    tokens = max_tokens or config.default_max_tokens
    if tokens > config.max_tokens:
        raise ApiError(
            400,
            f"max_tokens={tokens}; this server allows at most {config.max_tokens} per choice.",
            param="max_tokens",
        )
    temperature = req.temperature
    if pinned is None:
        pinned = config.temperature
    if pinned is not None:
        if "temperature" in req.model_fields_set and req.temperature != pinned:
            raise ApiError(
                400,
                f"temperature={req.temperature}; {pinned_by} samples at temperature {pinned} "
                f"only (what its model is trained or evaluated at); send that, or leave "
                f"temperature out.",
                param="temperature",
            )
        temperature = pinned
    try:
        return SamplingParams(
            temperature=temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            n=req.n,
            seed=req.seed,
            max_new_tokens=tokens,
            stop_token_ids=stop_token_ids,
            stop_strings=stop,
        )
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        param = ".".join(str(x) for x in first["loc"])
        raise ApiError(400, f"{param}: {first['msg']}.", param=param) from None


def check_prompt(
    ids: list[int],
    config: ServeConfig,
    *,
    vocab_size: int,
    context: int | None,
    max_new: int,
    param: str,
) -> None:
    """Refuse a prompt that is empty, holds an id outside the vocabulary, or is longer than
    ``max_prompt_tokens`` or than what the model's ``context`` leaves beside ``max_new``."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(
            400,
            f"token id(s) {bad[:8]} are outside the model's vocabulary [0, {vocab_size}).",
            param=param,
        )
    if not ids:
        raise ApiError(400, "the prompt is empty; send at least one token.", param=param)
    most = (
        config.max_prompt_tokens
        if context is None
        else min(config.max_prompt_tokens, context - max_new)
    )
    if len(ids) > most:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens; at most {most} fit here (max_prompt_tokens "
            f"{config.max_prompt_tokens}, the model's context {context} less max_tokens "
            f"{max_new}). Shorten the prompt or ask for fewer tokens.",
            param=param,
            code="context_length_exceeded",
        )
