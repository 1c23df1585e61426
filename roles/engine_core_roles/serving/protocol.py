"""What crosses the wire: the requests the endpoint takes (OpenAI's chat and completions
requests plus the token-in extension) and the OpenAI-style error every refusal is answered with.

Requests ignore fields they do not know: OpenAI's clients add fields with each API version
(``store``, ``metadata``, ``user``...) and refusing them would break clients for nothing. The
fields that would change what is sampled and that no rollout here honours (penalties, logit
bias, response formats...) are refused by name when set, never silently dropped.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "SamplingFields",
    "error_body",
    "parse_json_object",
    "parse_request",
]


class ApiError(Exception):
    """A refusal the endpoint answers with an OpenAI-style error object and ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI's API answers errors."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# set to anything but these values, a field changes sampling in a way no rollout here honours
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
}


class SamplingFields(BaseModel):
    """The fields both requests share: what to sample, and how."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="extension, as vLLM spells it; -1: off")
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop) or len(stop) > 8:
            raise ApiError(
                400,
                f"stop holds up to 8 non-empty strings; got {self.stop!r}.",
                param="stop",
            )
        return stop


class ChatRequest(SamplingFields):
    """``POST /v1/chat/completions``; ``prompt_token_ids`` (extension): the prompt as token
    ids, used as given instead of rendering ``messages``."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either (each
    prompt sampled ``n`` times)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)

    def token_limit(self) -> int | None:
        return self.max_tokens


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` (a request body) as a JSON object; malformed JSON or another JSON value refused
    with a 400."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(
            400,
            f"the request body is not valid JSON ({e}); send one JSON object "
            f"(Content-Type: application/json).",
        ) from None
    if not isinstance(data, dict):
        raise ApiError(
            400, f"the request body must be a JSON object; got a JSON {type(data).__name__}."
        )
    return data


def parse_request(raw: bytes, kind: type[SamplingFields]) -> Any:
    """``raw`` (a request body) as a ``kind``; malformed JSON, a body that is not an object,
    a field of the wrong type or a field no rollout here honours refused with a 400 naming it."""
    data = parse_json_object(raw)
    for name, neutral in _UNSUPPORTED.items():
        if name in data and not any(data[name] == v for v in neutral):
            raise ApiError(
                400,
                f"{name}={data[name]!r} is not supported by this server (its rollouts sample "
                f"with temperature, top_p, top_k, stop and seed only); leave {name} out.",
                param=name,
                code="unsupported_parameter",
            )
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        got = json.dumps(first.get("input"), default=str)[:120]
        raise ApiError(
            400, f"{param}: {first['msg']} (got {got}).", param=param, code="invalid_value"
        ) from None
