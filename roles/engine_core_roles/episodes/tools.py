"""The built-in environment: :class:`ToolEnvironment`, Python functions with a JSON schema (the
OpenAI function format) offered to the model through the chat template's ``tools``, called when
the model writes a tool call (``<tool_call>{json}</tool_call>``, Qwen2/Hermes, parsed by
:func:`hermes_tool_calls`; the parser is pluggable), their results appended as ``tool`` messages.
A tool that raises, returns something other than text, or runs past ``tool_timeout_s`` becomes an
error observation, as does a malformed call; the run goes on.

For a vision-language model a tool may also show images: it returns a PIL image, or a list of
content parts (``{"type": "text", "text": ...}``, ``{"type": "image", "image": ...}``), which
become the ``tool`` message's content (the episode renders the images where they stand, see
:mod:`engine_core_roles.episodes.rollout`). Tools in processes of their own return text only.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from engine_core.errors import ConfigError
from engine_core_roles.data.rewards.functions import load_function
from engine_core_roles.episodes.protocol import Environment, Message, StepResult
from engine_core_roles.episodes.threads import _TOOL_THREADS
from engine_core_roles.episodes.tool_processes import TOOL_PROCESSES

__all__ = ["ToolCall", "hermes_tool_calls", "tool_schema", "check_tool_schema", "ToolEnvironment"]


@dataclass
class ToolCall:
    """A call the model wrote: the tool's name and its arguments (``error``: why it could not
    be read, the other fields then empty)."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def hermes_tool_calls(text: str) -> list[ToolCall]:
    """Tool calls in the Qwen2/Hermes format: ``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>``, each a JSON object; an unreadable one is a call with ``error`` set."""
    calls = []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(error=f"the tool call {body.strip()[:80]!r} is not JSON ({e})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(
                ToolCall(error=f"the tool call {body.strip()[:80]!r} has no string 'name'")
            )
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(error=f"the arguments of {obj['name']!r} are not an object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    if not calls and "<tool_call>" in text:
        calls.append(ToolCall(error="a <tool_call> is opened but never closed"))
    return calls


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s schema in the OpenAI function format: its ``schema`` attribute when it has one,
    else derived from its type hints and Google-style docstring (transformers'
    ``get_json_schema``); checked either way."""
    schema = getattr(fn, "schema", None)
    name = getattr(fn, "__name__", repr(fn))
    if schema is None:
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as e:
            raise ConfigError(
                f"tool {name}: no schema could be derived ({type(e).__name__}: {e}); give "
                f"every argument a type hint and an 'Args:' line in the docstring, or set "
                f"{name}.schema to its OpenAI function schema."
            ) from e
    check_tool_schema(schema, name)
    return dict(schema)


def check_tool_schema(schema: Any, name: str) -> None:
    """Refuse a schema that is not ``{"type": "function", "function": {"name", "description",
    "parameters": <a JSON schema of an object>}}``, saying what is wrong."""
    import jsonschema

    where = f"tool {name}: its schema"
    if not isinstance(schema, Mapping) or schema.get("type") != "function":
        raise ConfigError(
            f'{where} must be a dict with "type": "function" and a "function" entry (the '
            f"OpenAI function format); got {str(schema)[:80]!r}."
        )
    fn = schema.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ConfigError(f"{where} needs function.name, a non-empty string.")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping) or params.get("type") != "object":
        raise ConfigError(
            f'{where}: function.parameters must be a JSON schema of type "object"; got '
            f"{str(params)[:80]!r}."
        )
    try:
        jsonschema.Draft202012Validator.check_schema(dict(params))
    except jsonschema.SchemaError as e:
        raise ConfigError(
            f"{where}: function.parameters is not a valid JSON schema: {e.message}."
        ) from None


class _Tool:
    def __init__(self, fn: Callable[..., Any], schema: dict[str, Any]) -> None:
        import jsonschema

        self.fn, self.schema = fn, schema
        self.name = str(schema["function"]["name"])
        params = schema["function"].get("parameters", {"type": "object", "properties": {}})
        self.validator = jsonschema.Draft202012Validator(params)


class ToolEnvironment(Environment):
    """The built-in environment: the row's prompt messages first; then each assistant message
    either calls tools (each call answered by a ``tool`` message, run concurrently with the
    other calls of the turn) or, calling none, is the final answer and ends the episode.

    ``tools`` are callables (or import paths of them); each returns text. ``parser`` reads the
    calls out of a message's text (default: :func:`hermes_tool_calls`). ``prompt_key`` is the
    row's column of prompt messages (or text, sent as one user message). A call that fails in
    any way becomes a ``tool`` message starting ``error:``, counted in ``tool_errors``.
    ``processes`` > 0 runs the calls in that many worker processes
    (:mod:`engine_core_roles.episodes.tool_processes`; a call past its timeout kills its process) instead
    of on threads; the tools must then be importable by path.
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any] | str] = (),
        *,
        prompt_key: str = "prompt",
        parser: Callable[[str], list[ToolCall]] | str = hermes_tool_calls,
        tool_timeout_s: float = 10.0,
        processes: int = 0,
    ) -> None:
        fns = [load_function(t, what="env.tools") if isinstance(t, str) else t for t in tools]
        paths = [t if isinstance(t, str) else _import_path(t) if processes else "" for t in tools]
        self._tools: dict[str, _Tool] = {}
        self._paths: dict[str, str] = {}
        self.processes = processes
        if processes:
            TOOL_PROCESSES.resize(processes, paths)
            TOOL_PROCESSES.warm()  # started (once), the tools imported, before a call is timed
        for fn, path in zip(fns, paths, strict=True):
            tool = _Tool(fn, tool_schema(fn))
            self._paths[tool.name] = path
            if tool.name in self._tools:
                raise ConfigError(f"env.tools: two tools are named {tool.name!r}; rename one.")
            self._tools[tool.name] = tool
        self.tools = [t.schema for t in self._tools.values()] or None
        self.parser = (
            load_function(parser, what="env.parser") if isinstance(parser, str) else parser
        )
        self.prompt_key, self.tool_timeout_s = prompt_key, tool_timeout_s

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        if self.prompt_key not in row:
            raise ConfigError(
                f"the row has no {self.prompt_key!r} column (it has {', '.join(row)}); set "
                f"data.prompt_key."
            )
        prompt = row[self.prompt_key]
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [dict(m) for m in prompt]

    def step(self, message: Message) -> StepResult:
        calls = self.parser(str(message.get("content") or ""))
        if not calls:
            return StepResult(done=True, counts={"tool_calls": 0, "tool_errors": 0})
        futures = [_TOOL_THREADS.submit(self._call, c) for c in calls]
        # a call in a process returns by its own deadlines (a kill ends the tool's run): wait
        # for that, and a little more
        wait = _call_budget_s(self.tool_timeout_s, self.processes)
        deadline = time.monotonic() + wait + (2.0 if self.processes else 0.0)
        out, errors = [], 0
        for call, fut in zip(calls, futures, strict=True):
            try:
                content = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                _TOOL_THREADS.abandoned()
                content = (
                    f"error: tool {call.name!r} did not answer within {self.tool_timeout_s:g} s"
                )
            if isinstance(content, str) and content.startswith("error:"):
                errors += 1
            out.append({"role": "tool", "name": call.name or "unknown", "content": content})
        return StepResult(out, counts={"tool_calls": len(calls), "tool_errors": errors})

    def _call(self, call: ToolCall) -> str | list[dict[str, Any]]:
        if call.error:
            return f"error: {call.error}"
        tool = self._tools.get(call.name)
        if tool is None:
            return f"error: no tool {call.name!r}; the tools are {', '.join(self._tools)}"
        problems = sorted(tool.validator.iter_errors(call.arguments), key=str)
        if problems:
            return f"error: bad arguments for {call.name!r}: {problems[0].message}"
        if self.processes:
            return TOOL_PROCESSES.call(
                self._paths[call.name], call.name, call.arguments, self.tool_timeout_s
            )
        try:
            result = tool.fn(**call.arguments)
        except Exception as e:
            return f"error: tool {call.name!r} raised {type(e).__name__}: {e}"
        if isinstance(result, str):
            return result
        return _shown(result, call.name)


def _shown(result: Any, name: str) -> str | list[dict[str, Any]]:
    """A tool's result that is not text as a message's content parts: a PIL image, or a list
    of text and image parts; anything else an error observation."""
    if hasattr(result, "convert") and hasattr(result, "size"):  # a PIL image
        return [{"type": "image", "image": result}]
    if isinstance(result, list) and all(
        isinstance(p, dict)
        and (
            (p.get("type") == "text" and isinstance(p.get("text"), str))
            or (p.get("type") == "image" and p.get("image") is not None)
        )
        for p in result
    ):
        return [dict(p) for p in result]
    return (
        f"error: tool {name!r} returned {type(result).__name__}, not text (nor a PIL image or a "
        f"list of text and image parts)"
    )


def _call_budget_s(tool_timeout_s: float, processes: int) -> float:
    """How long one tool call may take: its timeout, and with tool processes first as long
    again waiting for an idle process."""
    return tool_timeout_s * (2 if processes else 1)


def _import_path(fn: Callable[..., Any]) -> str:
    """``module:name`` of a tool a worker process can import; a ConfigError for one it cannot."""
    path = f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', '')}"
    try:
        found = load_function(path, what="env.tools")
    except ConfigError:
        found = None
    if found is not fn:
        raise ConfigError(
            f"tool {getattr(fn, '__name__', fn)!r} cannot run in a tool process: worker "
            f"processes import each tool by path, and {path!r} does not name it (a lambda, a "
            f"nested function, or one defined in __main__). Define it at module level and name "
            f"it in env.tools as 'pkg.module:function', or set env.tool_processes=0."
        )
    return path
