"""Small synthetic sequence tasks shipped with the SDK, so examples run with no downloads.

Token ids: ``0`` pad, ``1`` BOS, ``2`` SEP, ``3`` EOS, digits ``d`` are ``4 + d``. A sample is
``BOS prompt SEP response EOS``; the response is a deterministic function of the prompt digits,
so a rule-based reward can score generations exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from pydantic import Field

from engine_core.batch import make_batch
from engine_core.config import Seeded

__all__ = ["PAD", "BOS", "SEP", "EOS", "VOCAB_SIZE", "TaskConfig", "DigitTask"]

PAD, BOS, SEP, EOS = 0, 1, 2, 3
DIGIT0 = 4
VOCAB_SIZE = 16  # 4 specials + 10 digits, rounded up

_TARGETS: dict[str, Callable[[list[int]], list[int]]] = {
    "copy": lambda d: list(d),
    "reverse": lambda d: list(reversed(d)),
    "repeat2": lambda d: list(d) + list(d),
}


class TaskConfig(Seeded):
    """Which digit task, and how long its prompts are; ``seed``: the order prompts are drawn in."""

    name: Literal["copy", "reverse", "repeat2"] = "reverse"
    num_digits: int = Field(3, ge=1, le=32)


class DigitTask:
    """Generates prompts and supervised examples, and scores responses."""

    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg
        self._gen = torch.Generator().manual_seed(cfg.seed)
        self._target = _TARGETS[cfg.name]

    @property
    def prompt_len(self) -> int:
        return self.cfg.num_digits + 2  # BOS digits SEP

    @property
    def response_len(self) -> int:
        return len(self._target([0] * self.cfg.num_digits)) + 1  # + EOS

    def rng_state(self) -> torch.Tensor:
        """The sampler's state, for exact resume."""
        return self._gen.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._gen.set_state(state)

    def sample_digits(self, n: int) -> torch.Tensor:
        return torch.randint(0, 10, (n, self.cfg.num_digits), generator=self._gen)

    def prompt_ids(self, digits: torch.Tensor) -> torch.Tensor:
        n = digits.shape[0]
        return torch.cat([torch.full((n, 1), BOS), digits + DIGIT0, torch.full((n, 1), SEP)], dim=1)

    def target_ids(self, digits: torch.Tensor) -> torch.Tensor:
        rows = [self._target(d.tolist()) for d in digits]
        t = torch.tensor(rows, dtype=torch.long) + DIGIT0
        return torch.cat([t, torch.full((digits.shape[0], 1), EOS)], dim=1)

    def supervised_batch(self, n: int):  # type: ignore[no-untyped-def]
        """A batch of full examples with the loss on the response tokens only."""
        digits = self.sample_digits(n)
        prompt, target = self.prompt_ids(digits), self.target_ids(digits)
        ids = torch.cat([prompt, target], dim=1)
        loss_mask = torch.zeros_like(ids)
        loss_mask[:, prompt.shape[1] :] = 1
        return make_batch(ids, loss_mask=loss_mask)

    def score(self, prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
        """Fraction of target positions (EOS included) the response gets right, per sample."""
        digits = prompt[:, 1 : 1 + self.cfg.num_digits] - DIGIT0
        target = self.target_ids(digits)
        width = target.shape[1]
        resp = torch.full_like(target, PAD)
        k = min(width, response.shape[1])
        resp[:, :k] = response[:, :k]
        return (resp == target).float().mean(-1)
