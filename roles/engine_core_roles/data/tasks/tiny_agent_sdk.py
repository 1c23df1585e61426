"""The shipped tool task's agent written with the OpenAI Agents SDK, for an RL job's ``agent:``.

:func:`solve` is an agent function (``async def agent(base_url, api_key, sample)``): an Agents
SDK ``Agent`` whose one tool, ``lookup``, is the task's own
(:func:`engine_core_roles.data.tasks.tiny_agent.lookup`) wrapped with ``@function_tool``, run by
``Runner.run`` on an ``OpenAIChatCompletionsModel`` over an ``AsyncOpenAI`` client pointed at
the session's base URL on the job's endpoint. Tracing is off, so nothing leaves the machine.

The SDK sends the tool's schema with every call (the chat template renders its name in a
system message, as the tool environment's prompts have it), reads the replies the endpoint
parses from the template's ``<tool_call>`` format as OpenAI ``tool_calls``, runs the tool, and
sends the whole history back: the model's call (arguments as JSON text, rendered as an object
again by the endpoint) and the tool's answer. A session whose model writes its call as the
template does is one training row.

It returns the session's reward (:func:`~engine_core_roles.data.tasks.tiny_agent.answer_reward`
on the final answer; 0 for a run that ended without one) and counts logged as ``agent/<name>``:
``tool_calls``, ``tool_errors`` (calls answered with an error: a bad key, bad arguments, a tool
name the agent does not have; the run goes on, as in the tool environment) and ``unfinished``
(runs past :data:`MAX_TURNS` model calls, or stopped by the SDK on the model's behaviour).

``engine-core run roles/engine_core_roles/recipes/agent_sdk_tiny.yaml`` trains it; it needs the
Agents SDK: ``pip install 'engine-core-roles[agents]'``.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import Any

try:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        RunConfig,
        RunContextWrapper,
        Runner,
        function_tool,
    )
    from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
    from agents.items import RunItem, ToolCallItem, ToolCallOutputItem
    from agents.run_config import ToolErrorFormatterArgs
    from openai import AsyncOpenAI
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        f"engine_core_roles.data.tasks.tiny_agent_sdk is written with the OpenAI Agents SDK, "
        f"which is not installed ({e}); pip install 'engine-core-roles[agents]'."
    ) from e

from engine_core_roles.data.tasks.tiny_agent import answer_reward, lookup

__all__ = ["MAX_TURNS", "MODEL", "RUN_CONFIG", "build_agent", "client_for", "solve"]

MODEL = "engine-core"  # the name the job's endpoint serves
MAX_TURNS = 3  # model calls a run may make: the tool environment's max_turns in agent_tiny


def _tool_error(ctx: RunContextWrapper[Any], error: Exception) -> str:
    """What the model reads when a call fails: the tool environment's ``error:`` message."""
    del ctx
    return f"error: {error}"


def _other_error(args: ToolErrorFormatterArgs[Any]) -> str:
    """What it reads when it calls a tool the agent does not have (the run goes on)."""
    if args.kind == "tool_not_found":
        return f"error: no tool {args.tool_name!r}; the tools are lookup"
    return f"error: {args.default_message}"


#: tracing off (nothing leaves the machine); a call to a tool the agent lacks is answered with
#: an error, as the tool environment answers it, instead of ending the run
RUN_CONFIG = RunConfig(
    tracing_disabled=True,
    tool_not_found_behavior="return_error_to_model",
    tool_error_formatter=_other_error,
)


@function_tool(name_override="lookup", failure_error_function=_tool_error)
def lookup_tool(key: str) -> str:
    """Look up the value stored under a key.

    Args:
        key: two lowercase letters
    """
    return lookup(key)


# one client per event loop, its connection pool shared by the loop's sessions: building a
# client builds a TLS context (0.1-0.2 s of CPU here), more than a session's model calls cost
_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncOpenAI] = (
    weakref.WeakKeyDictionary()
)


def client_for(base_url: str, api_key: str) -> AsyncOpenAI:
    """An ``AsyncOpenAI`` client for the session at ``base_url``: a copy, with the session's
    base URL and key, of the running event loop's one client (the copies share its
    connections)."""
    loop = asyncio.get_running_loop()
    shared = _CLIENTS.get(loop)
    if shared is None:
        shared = _CLIENTS[loop] = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return shared.with_options(base_url=base_url, api_key=api_key)


def build_agent(base_url: str, api_key: str) -> Agent[Any]:
    """The agent, its model served at ``base_url``: no instructions (the task's prompts have
    no system message but the tools'), one tool."""
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client_for(base_url, api_key))
    return Agent(name="lookup", tools=[lookup_tool], model=model)


@dataclass
class _Counts:
    tool_calls: int = 0
    tool_errors: int = 0

    @classmethod
    def of(cls, items: list[RunItem]) -> _Counts:
        out = cls()
        for item in items:
            if isinstance(item, ToolCallItem):
                out.tool_calls += 1
            elif isinstance(item, ToolCallOutputItem) and str(item.output).startswith("error:"):
                out.tool_errors += 1
        return out


async def solve(base_url: str, api_key: str, sample: dict[str, Any]) -> dict[str, float]:
    """One episode of the tool task: the row's user message to the agent, its final answer
    scored against the row's ``answer``."""
    agent = build_agent(base_url, api_key)
    try:
        result = await Runner.run(
            agent, list(sample["prompt"]), max_turns=MAX_TURNS, run_config=RUN_CONFIG
        )
    except (MaxTurnsExceeded, ModelBehaviorError) as e:
        # the run ended without an answer: every turn called a tool, or the SDK stopped it
        counts = _Counts.of(list(e.run_data.new_items) if e.run_data else [])
        return {
            "reward": 0.0,
            "tool_calls": float(counts.tool_calls),
            "tool_errors": float(counts.tool_errors),
            "unfinished": 1.0,
        }
    counts = _Counts.of(result.new_items)
    answer = str(result.final_output or "")
    return {
        "reward": answer_reward(sample["key"], answer, sample["answer"]),
        "tool_calls": float(counts.tool_calls),
        "tool_errors": float(counts.tool_errors),
        "unfinished": 0.0,
    }
