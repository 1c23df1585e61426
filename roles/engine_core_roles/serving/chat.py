"""Chat messages to prompt ids, and sampled ids back to OpenAI messages.

A request's messages are rendered by the model's own chat template (its ``tools`` argument
given the request's tools) and tokenized once, as the RL job renders prompts. A reply's text
is the sampled ids decoded (special tokens skipped) and cut at a stop string; where the request
gave tools, the template's own call format (``<tool_call>{"name", "arguments"}</tool_call>``,
Qwen2/Hermes, read by the same parser the tool environment uses) becomes OpenAI ``tool_calls``.
The ids are what a session records; the text is only what the client reads.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from engine_core.errors import ConfigError
from engine_core_roles.episodes.tools import check_tool_schema, hermes_tool_calls
from engine_core_roles.serving.protocol import ApiError

__all__ = ["render_messages", "check_tools", "reply_text", "assistant_message"]

ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any, where: str) -> str | None:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ApiError(
                    400,
                    f"{where}: a content part of type {kind!r}; this endpoint serves text, "
                    f"so send text parts ({{'type': 'text', 'text': ...}}) or a string.",
                    param=where,
                )
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: a text part without a string 'text'.", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(
        400,
        f"{where} must be a string, null or a list of text parts; got {type(content).__name__}.",
        param=where,
    )


def _template_message(message: Any, i: int) -> dict[str, Any]:
    """``messages[i]`` as the chat template takes it (tool-call arguments as objects)."""
    where = f"messages.{i}"
    if not isinstance(message, Mapping) or message.get("role") not in ROLES:
        got = message.get("role") if isinstance(message, Mapping) else type(message).__name__
        raise ApiError(
            400,
            f"{where}.role must be one of {', '.join(ROLES)}; got {got!r}.",
            param=f"{where}.role",
        )
    out: dict[str, Any] = {
        "role": message["role"],
        "content": _text(message.get("content"), f"{where}.content"),
    }
    for key in ("name", "tool_call_id"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise ApiError(
            400, f"{where}.tool_calls must be a list; got {type(calls).__name__}.", param=where
        )
    if calls:
        out["tool_calls"] = [
            _template_call(c, f"{where}.tool_calls.{j}") for j, c in enumerate(calls)
        ]
    return out


def _template_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ApiError(400, f"{where} needs function.name, a string.", param=where)
    args = fn.get("arguments", {})
    if isinstance(args, str):  # OpenAI sends arguments as JSON text; templates write objects
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError as e:
            raise ApiError(
                400, f"{where}.function.arguments is not JSON ({e}).", param=where
            ) from None
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }


def check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The request's tools, each an OpenAI function schema; a bad one refused, by index."""
    for i, tool in enumerate(tools or []):
        try:
            check_tool_schema(tool, str(i))
        except ConfigError as e:
            raise ApiError(400, f"tools.{i}: {e}", param=f"tools.{i}") from None
    return tools or None


def render_messages(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[int], list[dict[str, Any]]]:
    """The prompt ids of ``messages`` under the tokenizer's chat template (with the generation
    prompt), and the messages as the template took them."""
    if not messages:
        raise ApiError(
            400,
            "messages is empty; send at least one message (or the prompt as prompt_token_ids).",
            param="messages",
        )
    taken = [_template_message(m, i) for i, m in enumerate(messages)]
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(
            400,
            "this model's tokenizer has no chat template, so messages cannot be rendered; use "
            "/v1/completions with a prompt, or serve a model whose tokenizer has one.",
            param="messages",
        )
    try:
        text = tokenizer.apply_chat_template(
            taken, tools=tools, add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # the template's own refusal (jinja raise_exception, a bad field)
        raise ApiError(
            400,
            f"the chat template refused these messages: {type(e).__name__}: {e}",
            param="messages",
        ) from None
    return list(tokenizer(str(text), add_special_tokens=False)["input_ids"]), taken


def reply_text(tokenizer: Any, ids: list[int], stop: list[str]) -> tuple[str, bool]:
    """The text of sampled ``ids`` (special tokens skipped), cut before the first stop string,
    and whether a stop string cut it."""
    text = str(tokenizer.decode(ids, skip_special_tokens=True))
    cuts = [text.find(s) for s in stop if s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def assistant_message(text: str, with_tools: bool) -> tuple[dict[str, Any], bool]:
    """The OpenAI assistant message of a reply's ``text``, and whether it holds tool calls
    (read only where the request gave tools; an unreadable call stays in the content)."""
    calls = hermes_tool_calls(text) if with_tools else []
    if not calls or any(c.error for c in calls):
        return {"role": "assistant", "content": text}, False
    content = text[: text.index("<tool_call>")].strip()
    return {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in calls
        ],
    }, True
