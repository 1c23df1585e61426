"""``EnvConfig``: an RL job's environment, and :func:`load_environment`, which builds one per episode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt

from engine_core.config import FrozenModel
from engine_core.errors import ConfigError
from engine_core_roles.data.rewards.functions import load_function
from engine_core_roles.episodes.protocol import Environment
from engine_core_roles.episodes.threads import _STEP_THREADS, _TOOL_THREADS
from engine_core_roles.episodes.tools import ToolEnvironment, _call_budget_s, hermes_tool_calls

__all__ = ["EnvConfig", "load_environment"]


class EnvConfig(FrozenModel):
    """An RL job's environment: episodes of several turns instead of one response."""

    cls: str = Field(
        "tools",
        description="'tools' (the built-in ToolEnvironment) or the import path of an "
        "Environment class or factory ('pkg.module:MyEnv', 'path/to/file.py:MyEnv'), called "
        "with `kwargs` once per episode.",
    )
    tools: list[str] = Field(
        default_factory=list,
        description="Import paths of the tool functions ('pkg.module:fn'); tools only.",
    )
    parser: str | None = Field(
        None,
        description="Import path of a function text -> list[ToolCall]; default: the "
        "Qwen2/Hermes format (a JSON object between tool_call tags). tools only.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for env.cls (or ToolEnvironment)."
    )
    max_turns: PositiveInt = Field(4, description="Assistant turns per episode at most.")
    max_episode_tokens: PositiveInt | None = Field(
        None,
        description="Tokens per episode (prompt, model and environment) at most; default the "
        "model's context length.",
    )
    tool_timeout_s: PositiveFloat = Field(
        10.0,
        description="A tool call answering later becomes an error observation; an "
        "environment's whole step may take 5 s more before its episode ends (env_error).",
    )

    @property
    def step_timeout_s(self) -> float:
        """An environment's whole step may take this long (its tool calls' timeout, and some
        room to answer with their errors) before the episode ends with ``env_error``. With tool
        processes a call may first wait up to its timeout for an idle process."""
        return _call_budget_s(self.tool_timeout_s, self.tool_processes) + 5.0

    tool_processes: NonNegativeInt = Field(
        0,
        description="0: tool calls run on threads (tools that wait). N: in N worker processes, "
        "for tools that compute (no GIL shared with the rollout) or may hang (a call past "
        "tool_timeout_s kills its process); tools must be importable by path. tools only.",
    )
    workers: PositiveInt = Field(
        32,
        description="Threads running environment steps (and as many for tool calls) across "
        "a step's episodes: tools mostly wait, so more threads than cores pay.",
    )
    demos: list[str] = Field(
        default_factory=list,
        description="JSONL files of demonstration episodes ({'messages': [...]}) for the "
        "supervised warm-up (warmup_sft_steps).",
    )


def load_environment(cfg: EnvConfig, *, prompt_key: str) -> Callable[[], Environment]:
    """A factory of one environment per episode; every import path resolved (and the tool
    schemas checked) now, by building one."""
    if cfg.cls == "tools":
        parser = cfg.parser or hermes_tool_calls
        tools = list(cfg.tools)

        def make() -> Environment:
            return ToolEnvironment(
                tools,
                prompt_key=prompt_key,
                parser=parser,
                tool_timeout_s=cfg.tool_timeout_s,
                processes=cfg.tool_processes,
                **cfg.kwargs,
            )

    else:
        if cfg.tools or cfg.parser or cfg.tool_processes:
            raise ConfigError(
                f"env.tools, env.parser and env.tool_processes configure the built-in tool "
                f"environment, but "
                f"env.cls={cfg.cls!r}; drop them, or pass them to your class through env.kwargs."
            )
        factory = load_function(cfg.cls, what="env.cls")

        def make() -> Environment:
            return factory(**cfg.kwargs)  # type: ignore[no-any-return]

    try:
        first = make()
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(
            f"env.cls={cfg.cls!r}: building an environment with env.kwargs={cfg.kwargs} "
            f"raised {type(e).__name__}: {e}"
        ) from e
    for method in ("reset", "step"):
        if not callable(getattr(first, method, None)):
            raise ConfigError(
                f"env.cls={cfg.cls!r} made a {type(first).__name__}, which has no {method}(); "
                f"an environment subclasses engine_core_roles.episodes.protocol.Environment."
            )
    _STEP_THREADS.resize(cfg.workers)
    _TOOL_THREADS.resize(cfg.workers)
    return make
