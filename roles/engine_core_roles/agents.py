"""Multi-turn episodes: the model and an environment take turns; only what the model wrote trains.

- :class:`Environment` is what a user writes: :meth:`~Environment.reset` gives an episode's
  first messages from its dataset row, :meth:`~Environment.step` answers each assistant
  message with observation messages, a reward contribution and whether the episode is over,
  and the optional :meth:`~Environment.score` scores the whole episode at its end.
- :class:`ToolEnvironment` is the built-in one: Python functions with a JSON schema (the
  OpenAI function format) offered to the model through the chat template's ``tools``, called
  when the model writes a tool call (``<tool_call>{json}</tool_call>``, Qwen2/Hermes; the
  parser is pluggable), their results appended as ``tool`` messages. A tool that raises,
  returns something other than text, or runs past ``tool_timeout_s`` becomes an error
  observation, as does a malformed call; the run goes on.
- :class:`EpisodeRollout` runs the episodes on any :class:`engine_core.BaseRollout`: each turn
  generates for every unfinished episode in one ``generate`` call, appends the tokens of what
  the environment answered, and goes on until every episode is over or stopped by a limit
  (``max_turns``, the episode's token budget, a turn that hits ``max_new_tokens``). Its result
  is a ``generate`` result whose response holds the model's and the environment's tokens,
  exactly as sampled and appended (never a re-tokenization of the decoded conversation), with
  :data:`~engine_core.rollout.RESPONSE_LOSS_MASK` 1 on the model's tokens only.

The environment's tokens are the chat template's rendering of its messages after the model's
turn: the difference between the template applied to a fixed conversation with and without
them, so they are what the template would have written at that place whatever came before.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt
from tensordict import NonTensorStack, TensorDict

from engine_core import BaseRollout, SamplingParams
from engine_core.config import FrozenModel
from engine_core.errors import ConfigError
from engine_core.remote_rollout import RolloutWorker
from engine_core.rollout import (
    FINISH_REASON,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_SEED,
    RESPONSE_IDS,
    RESPONSE_LOSS_MASK,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    WeightBucket,
    derive_seed,
    sample_seeds,
)
from engine_core_roles.batches import prompt_batch
from engine_core_roles.rewards import load_function
from engine_core_roles.tool_processes import TOOL_PROCESSES

__all__ = [
    "EPISODE",
    "ROW",
    "EnvConfig",
    "Environment",
    "Episode",
    "EpisodeRollout",
    "EpisodeWorker",
    "StepResult",
    "ToolCall",
    "ToolEnvironment",
    "check_messages",
    "check_template",
    "check_tool_schema",
    "demo_batch",
    "episode_metrics",
    "hermes_tool_calls",
    "load_environment",
    "tool_schema",
]

EPISODE = "episode"
"""The field of an episode rollout's result holding each episode's record (a dict: turns, tool
calls and errors, why it ended, the final answer, the environment's reward, the messages)."""

ROW = "row"
"""The field of a prompt batch holding each prompt's dataset row (a dict), for ``reset``."""

Message = dict[str, Any]

END_REASONS = ("done", "max_turns", "token_budget", "max_new_tokens", "env_error")
"""Why an episode ended: the environment said so, or a limit stopped it (``env_error``: the
environment's own reset or step raised, which ends that episode only)."""


# -- the protocol --------------------------------------------------------------------------------


@dataclass
class StepResult:
    """What an environment answers to one assistant message."""

    messages: list[Message] = field(default_factory=list)
    """Observation messages appended after the model's turn (``tool`` results, a user's reply)."""
    reward: float = 0.0
    """This step's contribution to the episode's reward."""
    done: bool = False
    """The episode is over (the model's message was its final answer)."""
    counts: dict[str, float] = field(default_factory=dict)
    """Counted per episode and logged as ``episode/<name>`` means (``tool_calls``, ...)."""


@dataclass
class Episode:
    """One episode as it ran: the messages (the first ones, then each assistant message and its
    observations), the turns the model took, the summed rewards of the steps, counts, and why
    it ended. Handed to :meth:`Environment.score`."""

    row: dict[str, Any]
    messages: list[Message]
    turns: int = 0
    reward: float = 0.0
    counts: dict[str, float] = field(default_factory=dict)
    end: str = ""

    @property
    def final(self) -> str:
        """The content of the model's last message (the answer a reward function reads)."""
        for m in reversed(self.messages):
            if m.get("role") == "assistant":
                return str(m.get("content") or "")
        return ""


class Environment(ABC):
    """An episode's other side. One instance per episode (``reset`` once, then ``step`` per
    assistant turn), made by the factory ``env.cls`` names with ``env.kwargs``.

    ``tools`` (OpenAI function schemas) are rendered into the prompt by the chat template's
    ``tools`` argument when set.
    """

    tools: list[dict[str, Any]] | None = None

    @abstractmethod
    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """The episode's first messages (chat messages with ``role`` and ``content``)."""

    @abstractmethod
    def step(self, message: Message) -> StepResult:
        """Answer the model's message (``{"role": "assistant", "content": text}``)."""

    def score(self, episode: Episode) -> float | None:
        """An extra reward for the whole episode at its end (None: none)."""
        return None


# -- tools ---------------------------------------------------------------------------------------


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
    (:mod:`engine_core_roles.tool_processes`; a call past its timeout kills its process) instead
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
                text = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                _TOOL_THREADS.abandoned()
                text = f"error: tool {call.name!r} did not answer within {self.tool_timeout_s:g} s"
            if text.startswith("error:"):
                errors += 1
            out.append({"role": "tool", "name": call.name or "unknown", "content": text})
        return StepResult(out, counts={"tool_calls": len(calls), "tool_errors": errors})

    def _call(self, call: ToolCall) -> str:
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
        if not isinstance(result, str):
            return f"error: tool {call.name!r} returned {type(result).__name__}, not text"
        return result


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


class _Daemons:
    """Daemon threads that run environment steps and tool calls. A call that runs past its
    timeout is abandoned (a thread cannot be stopped): :meth:`abandoned` adds a thread in
    place of the one it holds, and being daemons they never hold up the process's exit."""

    def __init__(self, threads: int) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._target = threads

    def _spawn(self) -> None:
        threading.Thread(target=self._run, name="engine-core-env", daemon=True).start()
        self._threads += 1

    def _run(self) -> None:
        while True:
            fut, fn, args = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on it
                fut.set_exception(e)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        with self._lock:
            while self._threads < self._target:
                self._spawn()
        fut: Future[Any] = Future()
        self._queue.put((fut, fn, args))
        return fut

    def abandoned(self) -> None:
        with self._lock:
            self._spawn()

    def resize(self, threads: int) -> None:
        with self._lock:
            self._target = max(self._target, threads)


# two pools: an environment's step (on a step thread) may wait on its tool calls
_STEP_THREADS = _Daemons(32)
_TOOL_THREADS = _Daemons(32)


# -- configuration -------------------------------------------------------------------------------


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
                f"an environment subclasses engine_core_roles.agents.Environment."
            )
    _STEP_THREADS.resize(cfg.workers)
    _TOOL_THREADS.resize(cfg.workers)
    return make


# -- rendering -----------------------------------------------------------------------------------

# a conversation the template is applied to, to find where its parts go (only as text)
_PROBE_USER = {"role": "user", "content": "@@probe-user@@"}
_PROBE_REPLY = "@@probe-reply@@"


class _Template:
    """The chat template's token ids for what an environment appends after a model's turn."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
        self.tokenizer, self.tools = tokenizer, tools
        base = [_PROBE_USER, {"role": "assistant", "content": _PROBE_REPLY}]
        self._base = self.render(base, generation=False)
        # what the template writes after an assistant's content: its end of turn, and more
        self._tail = self._base[self._base.index(_PROBE_REPLY) + len(_PROBE_REPLY) :]
        self._base_messages = base

    def render(self, messages: list[Message], *, generation: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            add_generation_prompt=generation,
            tokenize=False,
        )
        return str(text)

    def end_of_turn(self) -> str:
        """The text of the token that ends an assistant turn in this template (the first token
        the template writes after an assistant's content, when it is a special one), else
        the tokenizer's EOS: what a model writes, and stops on, to end its turn."""
        first = self.ids(self._tail)[:1]
        if first and first[0] in set(self.tokenizer.all_special_ids):
            return str(self.tokenizer.decode(first, skip_special_tokens=False))
        return str(self.tokenizer.eos_token or "")

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: list[Message]) -> list[int]:
        return self.ids(self.render(messages, generation=True))

    def after_turn(self, model_text: str, observations: list[Message]) -> list[int]:
        """Ids the template puts after a model turn whose text (special tokens kept) is
        ``model_text``, for ``observations``, up to the next assistant turn's start."""
        full = self.render([*self._base_messages, *observations], generation=True)
        if not full.startswith(self._base):
            raise ConfigError(
                "the chat template renders a conversation's beginning differently once more "
                "messages follow, so the environment's tokens cannot be appended to what the "
                "model sampled; use a template whose rendering of earlier turns does not "
                "depend on later ones."
            )
        rest = full[len(self._base) :]
        # the template's end of the assistant turn that the model did not write itself
        tail = self._tail
        for k in range(len(tail), -1, -1):
            if model_text.endswith(tail[:k]):
                missing = tail[k:]
                break
        return self.ids(missing + rest)


def check_template(tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
    """Refuse a chat template under which an environment's messages cannot be appended to a
    model's turn (its rendering of earlier turns changes once more messages follow)."""
    _Template(tokenizer, tools).after_turn("", [{"role": "user", "content": "?"}])


# -- the episode loop ----------------------------------------------------------------------------


@dataclass
class _Running:
    env: Environment | None
    episode: Episode
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish: str = "stop"
    seed: int | None = None

    def append(self, ids: Sequence[int], lps: Sequence[float] | None) -> None:
        self.tokens += ids
        self.trained += [1 if lps is not None else 0] * len(ids)
        self.log_probs += list(lps) if lps is not None else [0.0] * len(ids)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)


class EpisodeRollout(BaseRollout):
    """Episodes over ``inner`` (any :class:`BaseRollout`): a ``generate`` whose prompts carry
    their dataset rows (:data:`ROW`) and whose result is each episode as one sample.

    ``environment`` makes one :class:`Environment` per episode; ``tokenizer`` is the actor's
    (with the chat template); ``max_turns``, ``max_episode_tokens`` and the sampling params'
    ``max_new_tokens`` (per turn) bound an episode. The result's ``prompt_ids`` are the
    rendered first messages (with the environment's tools), its response every token after
    them, :data:`RESPONSE_LOSS_MASK` 1 on the model's tokens, ``rollout_log_probs`` the
    model's log-probs there (0 on the environment's), and :data:`EPISODE` the record of each.
    Weights, release and resume go to ``inner``.
    """

    def __init__(
        self,
        inner: BaseRollout,
        environment: Callable[[], Environment],
        tokenizer: Any,
        *,
        max_turns: int = 4,
        max_episode_tokens: int,
        step_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(inner.config)
        self.inner, self.environment, self.tokenizer = inner, environment, tokenizer
        self.capabilities = inner.capabilities  # type: ignore[misc]
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.step_timeout_s = step_timeout_s
        self.pad_token_id = int(getattr(inner, "pad_token_id", None) or tokenizer.pad_token_id or 0)
        self._templates: dict[str, _Template] = {}

    # weights and memory: the inner rollout's
    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return self.inner.expected_weights()

    def load_weights(self, buckets: Any) -> list[WeightBucket]:
        return self.inner.load_weights(buckets)

    def release(self) -> None:
        self.inner.release()

    def resume(self) -> None:
        self.inner.resume()

    def _template(self, tools: list[dict[str, Any]] | None) -> _Template:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._templates:
            self._templates[key] = _Template(self.tokenizer, tools)
        return self._templates[key]

    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        if ROW not in prompts.keys():
            raise ConfigError(
                f"an episode rollout needs each prompt's dataset row in the {ROW!r} field of the "
                f"prompt batch (engine_core_roles.text.PromptData(..., rows=True) puts them "
                f"there); got {sorted(prompts.keys())}."
            )
        rows = list(prompts[ROW].tolist()) if prompts.batch_size[0] else []
        n = params.n
        t_env = 0.0
        # a prompt's n episodes adjacent, as a rollout's n samples are
        running = [self._start(dict(row)) for row in rows for _ in range(n)]
        # episode j of prompt i samples its turns from streams of its own seed, so an episode
        # does not depend on which others share a turn's batch (or a replica)
        seeds = sample_seeds(prompts, params) if rows else None
        if seeds is not None:
            for r, seed in zip(running, seeds, strict=True):
                r.seed = seed
        active = [r for r in running if r.env is not None]
        turn = 0
        while active:
            turn += 1
            # episodes that cannot fit another full turn end on the budget
            fits = []
            for r in active:
                if r.length + params.max_new_tokens > self.max_episode_tokens:
                    r.episode.end, r.finish = "token_budget", "length"
                else:
                    fits.append(r)
            active = fits
            if not active:
                break
            turn_params = params.model_copy(update={"n": 1})
            ids = [r.prompt + r.tokens for r in active]
            batch = prompt_batch(ids, pad_token_id=self.pad_token_id)
            if seeds is not None:
                turn_seeds = [derive_seed(r.seed, turn) for r in active]  # type: ignore[arg-type]
                batch[PROMPT_SEED] = torch.tensor(turn_seeds, dtype=torch.int64)
            out = self.inner.generate(batch, turn_params)
            resp, mask = out[RESPONSE_IDS], out[RESPONSE_MASK]
            lps = out[ROLLOUT_LOG_PROBS]
            reasons = out[FINISH_REASON].tolist() if FINISH_REASON in out.keys() else None
            stepping = []
            for j, r in enumerate(active):
                keep = mask[j].bool()
                sampled = resp[j][keep].tolist()
                r.append(sampled, lps[j][keep].tolist())
                r.episode.turns += 1
                text = self.tokenizer.decode(sampled, skip_special_tokens=False)
                stopped = (reasons[j] if reasons is not None else "stop") == "stop"
                content = str(self.tokenizer.decode(sampled, skip_special_tokens=True))
                r.episode.messages.append({"role": "assistant", "content": content})
                if not stopped:
                    r.episode.end, r.finish = "max_new_tokens", "length"
                    continue
                stepping.append((r, text))
            t1 = time.perf_counter()
            results = self._step_all([(r, dict(r.episode.messages[-1])) for r, _ in stepping])
            t_env += time.perf_counter() - t1
            active = []
            for (r, text), res in zip(stepping, results, strict=True):
                if isinstance(res, str):  # the environment failed on this episode
                    r.episode.end = "env_error"
                    r.episode.counts["env_errors"] = r.episode.counts.get("env_errors", 0) + 1
                    r.episode.messages.append({"role": "error", "content": res})
                    continue
                r.episode.reward += float(res.reward)
                for key, v in res.counts.items():
                    r.episode.counts[key] = r.episode.counts.get(key, 0) + float(v)
                if res.done:
                    r.episode.end = "done"
                    continue
                if r.episode.turns >= self.max_turns:
                    r.episode.end, r.finish = "max_turns", "length"
                    continue
                assert r.env is not None
                obs_ids = self._template(r.env.tools).after_turn(text, res.messages)
                if r.length + len(obs_ids) + 1 > self.max_episode_tokens:
                    r.episode.end, r.finish = "token_budget", "length"
                    continue
                r.episode.messages += res.messages
                r.append(obs_ids, None)
                active.append(r)
        for r in running:
            if r.env is not None:
                extra = _call_quietly(r.env.score, r.episode)
                if isinstance(extra, int | float) and not isinstance(extra, bool):
                    r.episode.reward += float(extra)
        return self._result(running, t_env)

    def _start(self, row: dict[str, Any]) -> _Running:
        try:
            env = self.environment()
            first = env.reset(row)
            check_messages(first, f"{type(env).__name__}.reset")
            ids = self._template(env.tools).prompt(first)
        except Exception as e:
            episode = Episode(row, [{"role": "error", "content": f"{type(e).__name__}: {e}"}])
            episode.end = "env_error"
            episode.counts["env_errors"] = 1.0
            pad = [int(self.pad_token_id)]
            return _Running(None, episode, pad, finish="length")
        return _Running(env, Episode(row, list(first)), ids)

    def _step_all(self, work: list[tuple[_Running, Message]]) -> list[StepResult | str]:
        futures = []
        for r, msg in work:
            assert r.env is not None
            futures.append(_STEP_THREADS.submit(r.env.step, msg))
        deadline = time.monotonic() + self.step_timeout_s
        out: list[StepResult | str] = []
        for (r, _), fut in zip(work, futures, strict=True):
            name = type(r.env).__name__
            try:
                res = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                _STEP_THREADS.abandoned()
                out.append(f"{name}.step did not answer within {self.step_timeout_s:g} s")
                continue
            except Exception as e:
                out.append(f"{name}.step raised {type(e).__name__}: {e}")
                continue
            if not isinstance(res, StepResult):
                out.append(
                    f"{name}.step returned {type(res).__name__}; return a "
                    f"engine_core_roles.agents.StepResult"
                )
                continue
            if isinstance(res.reward, bool) or not isinstance(res.reward, int | float):
                out.append(f"{name}.step returned a reward of {res.reward!r}; give a number")
                continue
            try:
                check_messages(res.messages, f"{name}.step")
            except ConfigError as e:
                out.append(str(e))
                continue
            out.append(res)
        return out

    def _result(self, running: list[_Running], env_wait_s: float) -> TensorDict:
        prompts = prompt_batch([r.prompt for r in running], pad_token_id=self.pad_token_id)
        width = max([len(r.tokens) for r in running] + [1])
        total = len(running)
        resp = torch.full((total, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((total, width), dtype=torch.long)
        trained = torch.zeros((total, width), dtype=torch.long)
        lps = torch.zeros((total, width), dtype=torch.float32)
        for k, r in enumerate(running):
            m = len(r.tokens)
            if m:
                resp[k, :m] = torch.tensor(r.tokens, dtype=torch.long)
                mask[k, :m] = 1
                trained[k, :m] = torch.tensor(r.trained, dtype=torch.long)
                lps[k, :m] = torch.tensor(r.log_probs, dtype=torch.float32)
        out = TensorDict(
            {
                PROMPT_IDS: prompts[PROMPT_IDS],
                PROMPT_MASK: prompts[PROMPT_MASK],
                RESPONSE_IDS: resp,
                RESPONSE_MASK: mask,
                RESPONSE_LOSS_MASK: trained,
                ROLLOUT_LOG_PROBS: lps,
            },
            batch_size=[total],
        )
        finish: list[Any] = [r.finish for r in running]
        out[FINISH_REASON] = NonTensorStack.from_list(finish)
        out[EPISODE] = NonTensorStack.from_list([_record(r.episode, env_wait_s) for r in running])
        return out


def _record(ep: Episode, env_wait_s: float) -> dict[str, Any]:
    return {
        "env_wait_s": env_wait_s,
        "turns": ep.turns,
        "end": ep.end,
        "reward": ep.reward,
        "counts": dict(ep.counts),
        "final": ep.final,
        "messages": ep.messages,
    }


def _call_quietly(fn: Callable[[Episode], Any], episode: Episode) -> Any:
    try:
        return fn(episode)
    except Exception as e:
        episode.counts["env_errors"] = episode.counts.get("env_errors", 0) + 1
        episode.messages.append({"role": "error", "content": f"score raised {e!r}"})
        return None


def check_messages(messages: Any, who: str) -> None:
    if not isinstance(messages, list) or not all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m
        for m in messages
    ):
        raise ConfigError(
            f"{who} returned {str(messages)[:80]!r}; return a list of messages, each a dict "
            f"with 'role' and 'content'."
        )


# -- what the trainer logs -----------------------------------------------------------------------


def episode_metrics(gen: TensorDict) -> dict[str, float]:
    """Means over a step's episodes: turns, each count (tool calls, tool errors, ...), the
    episode's length in tokens, the share of its response tokens trained on, the share of
    episodes that ended for each reason, and the seconds the turn loop waited on the
    environments. Empty for a result without episodes."""
    if EPISODE not in gen.keys():
        return {}
    records = gen[EPISODE].tolist()
    n = max(len(records), 1)
    out = {"episode/turns": sum(r["turns"] for r in records) / n}
    keys = sorted({k for r in records for k in r["counts"]})
    for key in keys:
        out[f"episode/{key}"] = sum(r["counts"].get(key, 0.0) for r in records) / n
    lengths = (gen[PROMPT_MASK].sum(-1) + gen[RESPONSE_MASK].sum(-1)).float()
    out["episode/length"] = float(lengths.mean())
    trained = float(gen[RESPONSE_LOSS_MASK].sum()) if RESPONSE_LOSS_MASK in gen.keys() else 0.0
    out["episode/trained_token_share"] = trained / max(float(gen[RESPONSE_MASK].sum()), 1.0)
    for reason in END_REASONS:
        out[f"episode/end_{reason}"] = sum(r["end"] == reason for r in records) / n
    # the turn loop's wait on environments (per replica; the slowest one's)
    out["episode/env_wait_s"] = max((float(r.get("env_wait_s", 0.0)) for r in records), default=0.0)
    return out


# -- supervised warm-up on demonstrations --------------------------------------------------------


def demo_batch(
    tokenizer: Any, tools: list[dict[str, Any]] | None, episodes: Sequence[Sequence[Message]]
) -> TensorDict:
    """A supervised batch of demonstration episodes, tokenized the way :class:`EpisodeRollout`
    tokenizes episodes (the first messages rendered with the generation prompt, then each
    assistant turn's content and end of turn, then the template's rendering of what follows):
    ``input_ids``, ``attention_mask``, ``position_ids`` and ``loss_mask`` (1 on the
    assistant's tokens only)."""
    from engine_core import make_batch

    template = _Template(tokenizer, tools)
    eos = template.end_of_turn()
    rows: list[tuple[list[int], list[int]]] = []
    for i, messages in enumerate(episodes):
        msgs = [dict(m) for m in messages]
        check_messages(msgs, f"demonstration {i}")
        first = next((j for j, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if first is None:
            raise ConfigError(f"demonstration {i} has no assistant message to learn from.")
        ids = template.prompt(msgs[:first])
        trained = [0] * len(ids)
        j = first
        while j < len(msgs):
            content = _assistant_text(msgs[j])
            turn = template.ids(content + eos)
            ids += turn
            trained += [1] * len(turn)
            k = j + 1
            while k < len(msgs) and msgs[k]["role"] != "assistant":
                k += 1
            if k > j + 1:
                obs = template.after_turn(content + eos, msgs[j + 1 : k])
                ids += obs
                trained += [0] * len(obs)
            j = k
        rows.append((ids, trained))
    width = max(len(ids) for ids, _ in rows)
    pad = int(tokenizer.pad_token_id or 0)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attn = torch.zeros_like(input_ids)
    loss = torch.zeros_like(input_ids)
    for i, (ids, trained) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attn[i, : len(ids)] = 1
        loss[i, : len(ids)] = torch.tensor(trained)
    return make_batch(input_ids, attn, loss_mask=loss)


def _assistant_text(message: Message) -> str:
    """An assistant message as the model writes it: its content, then each of its
    ``tool_calls`` in the Hermes format."""
    text = str(message.get("content") or "")
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        text += "<tool_call>" + json.dumps({"name": fn["name"], "arguments": args}) + "</tool_call>"
    return text


# -- in a rollout replica ------------------------------------------------------------------------


class EpisodeWorker(RolloutWorker):
    """A rollout replica that runs whole episodes (``ProcessRollout(worker_cls=EpisodeWorker,
    worker_args=(settings,))``): the backend it hosts is wrapped in an :class:`EpisodeRollout`
    built from ``settings`` (``env``: an :class:`EnvConfig` as a dict, ``prompt_key``,
    ``max_episode_tokens``), the tokenizer read from the rollout's model config as the job
    reads it. Every turn of an episode runs on the replica that started it."""

    def __init__(self, config: dict[str, Any], settings: dict[str, Any]) -> None:
        super().__init__(config)
        from engine_core_roles.text import load_tokenizer

        env = EnvConfig.model_validate(settings["env"])
        tokenizer = load_tokenizer(self.rollout.config.model, None)
        self.rollout = EpisodeRollout(
            self.rollout,
            load_environment(env, prompt_key=str(settings["prompt_key"])),
            tokenizer,
            max_turns=env.max_turns,
            max_episode_tokens=int(settings["max_episode_tokens"]),
            step_timeout_s=env.step_timeout_s,
        )
