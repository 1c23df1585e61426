"""The agent function of an RL job's ``agent:``: loading it (:func:`load_agent`), reading what
it returns, and the reward of its sessions (:class:`AgentReward`).

An agent function is ``async def agent(base_url: str, api_key: str, sample: dict)``; it returns
its session's reward: a number, ``None`` (the job's reward function then scores the session's
last reply), or a dict of numbers whose ``"reward"`` entry is one of those and whose other
entries are counts to log. Anything else is an error of that session.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDict

from engine_core.errors import ConfigError
from engine_core_roles.batch.keys import EPISODE
from engine_core_roles.data.rewards.functions import Rewards, SampleReward, load_function

__all__ = ["AgentFn", "AgentReward", "BadReturn", "load_agent", "outcome"]

AgentFn = Callable[[str, str, dict[str, Any]], Awaitable[Any]]
"""``async def agent(base_url, api_key, sample) -> float | dict | None``."""


def load_agent(spec: str) -> AgentFn:
    """The agent function ``spec`` names (``pkg.module:function`` or ``path/file.py:function``),
    refused unless it is an ``async def`` taking ``(base_url, api_key, sample)``."""
    fn = load_function(spec, what="agent")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(
            f"agent={spec!r} is a {type(fn).__name__}, not an async function; write it as "
            f"'async def {getattr(fn, '__name__', 'agent')}(base_url, api_key, sample)'."
        )
    try:
        inspect.signature(fn).bind("http://x/v1", "key", {})
    except TypeError as e:
        raise ConfigError(
            f"agent={spec!r} cannot be called as agent(base_url, api_key, sample) ({e}); give "
            f"it those three parameters."
        ) from None
    return fn  # type: ignore[no-any-return]


class AgentReward(SampleReward):
    """Each row's reward, its session's: the number its agent returned; where the agent
    returned None, ``inner``'s score (the job's reward function over the session's last reply,
    its record's ``final``); 0 where the agent failed. ``inner`` also gives the decoded
    samples to log."""

    def __init__(self, inner: SampleReward) -> None:
        self.inner = inner

    def __call__(self, prompts: TensorDict, samples: TensorDict) -> Rewards:
        scored = self.inner(prompts, samples)
        records = samples[EPISODE].tolist()
        scores, agents = [], []
        for record, by_fn in zip(records, scored.scores.tolist(), strict=True):
            if record["end"] == "env_error":
                scores.append(0.0)
            elif record["agent_reward"] is None:
                scores.append(float(by_fn))
            else:
                scores.append(float(record["agent_reward"]))
                agents.append(float(record["agent_reward"]))
        metrics = {k: v for k, v in scored.metrics.items() if k != "reward/env"}
        if agents:
            metrics["reward/agent"] = sum(agents) / len(agents)
        for shown, score in zip(scored.samples, scores, strict=False):
            shown["reward"] = score
        return Rewards(torch.tensor(scores), metrics, scored.failures, scored.samples)


class BadReturn(TypeError):
    """An agent returned something other than a reward."""


def outcome(returned: Any) -> tuple[float | None, dict[str, float]]:
    """The reward and counts an agent returned (a number, None, or a dict of numbers)."""
    counts: dict[str, float] = {}
    reward = returned
    if isinstance(returned, Mapping):
        reward = returned.get("reward")
        for key, value in returned.items():
            if key == "reward":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise BadReturn(f"returned a dict whose {key!r} is {type(value).__name__}")
            counts[str(key)] = float(value)
    if reward is None:
        return None, counts
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise BadReturn(
            f"returned a reward of {reward!r}; return a number, None, or a dict with 'reward'"
        )
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise BadReturn(f"returned a reward of {reward}; return a finite number")
    return float(reward), counts
