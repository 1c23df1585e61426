"""The environment protocol: what a user writes to run episodes of several turns.

:class:`Environment` gives an episode's first messages from its dataset row
(:meth:`~Environment.reset`), answers each assistant message with observation messages, a
reward contribution and whether the episode is over (:meth:`~Environment.step`), and may score
the whole episode at its end (:meth:`~Environment.score`). :class:`Episode` is one as it ran.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Message", "END_REASONS", "StepResult", "Episode", "Environment"]

Message = dict[str, Any]


END_REASONS = ("done", "max_turns", "token_budget", "max_new_tokens", "env_error")
"""Why an episode ended: the environment said so, or a limit stopped it (``env_error``: the
environment's own reset or step raised, which ends that episode only)."""


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
