"""The chat template's rendering of an environment's turn: the tokens of the messages that follow
the model's turn are the difference between the template applied to a fixed conversation with
and without them, so they are what the template would have written at that place whatever came
before. :func:`check_template` refuses a template that cannot be rendered that way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine_core.errors import ConfigError
from engine_core_roles.episodes.protocol import Message

__all__ = ["check_template", "check_messages"]

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
        return self.ids(self.after_turn_text(model_text, observations))

    def after_turn_text(self, model_text: str, observations: list[Message]) -> str:
        """:meth:`after_turn`'s text, before it is tokenized."""
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
        return missing + rest


def check_template(tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
    """Refuse a chat template under which an environment's messages cannot be appended to a
    model's turn (its rendering of earlier turns changes once more messages follow)."""
    _Template(tokenizer, tools).after_turn("", [{"role": "user", "content": "?"}])


def check_messages(messages: Any, who: str) -> None:
    if not isinstance(messages, list) or not all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m
        for m in messages
    ):
        raise ConfigError(
            f"{who} returned {str(messages)[:80]!r}; return a list of messages, each a dict "
            f"with 'role' and 'content'."
        )
