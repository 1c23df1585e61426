"""Dynamic sampling (``filter_groups``): the step's scoring stage that replaces the groups whose
samples all scored the same (under GRPO they carry no gradient) with groups that differ, drawn
from more prompts, up to ``max_extra_draws`` more generations; still short, the step is topped up
with dropped groups.

A prompt is kept or dropped whole. Most draws hold ``n`` rows a prompt, one group; agents'
sessions may hold ``k`` row slots each (a client that drifted: ``k`` groups a prompt, each the
``r``-th rows of its ``n`` sessions, all scored with their sessions' rewards), so a draw's rows
a prompt are counted from the draw itself, and a prompt's groups go together.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from engine_core.batch import ROUTED_EXPERTS
from engine_core.rollout import PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS
from engine_core.vision import VISION_KEYS
from engine_core_roles.batch.build import training_batch
from engine_core_roles.data.rewards.functions import Rewards
from engine_core_roles.trainer.generation import Drawn, Params, Synchronous
from engine_core_roles.trainer.scoring import Scored, Scorer, group_spread

__all__ = ["FilteredGroups"]


class FilteredGroups:
    """The scoring stage of a run with ``filter_groups``: ``samples_per_prompt`` samples per
    prompt, extra draws from ``generation``."""

    def __init__(
        self,
        scorer: Scorer,
        generation: Synchronous,
        params: Params,
        *,
        samples_per_prompt: int,
        max_extra_draws: int,
    ) -> None:
        self.scorer, self.generation, self.params = scorer, generation, params
        self.n, self.max_extra_draws = samples_per_prompt, max_extra_draws

    def __call__(self, step: int, drawn: Drawn) -> Scored:
        drawn, rewards, figures = self._fill(step, drawn)
        batch = training_batch(drawn.samples, self.params(step, 0))
        return drawn, batch, lambda: rewards, figures

    def _fill(self, step: int, drawn: Drawn) -> tuple[Drawn, Rewards, dict[str, float]]:
        """The step's samples with the groups whose scores all match replaced by ones that
        differ; their rewards, and the figures to log."""
        n, want = self.n, int(drawn.prompts.batch_size[0])
        prompts, gen, version = drawn.prompts, drawn.samples, drawn.version
        kept_p: list[TensorDict] = []
        kept_g: list[TensorDict] = []
        kept_r: list[Rewards] = []
        kept_rows: list[int] = []  # rows of each kept prompt, in order
        # dropped groups: the top-up when still short
        flat_p: list[TensorDict] = []
        flat_g: list[TensorDict] = []
        flat_r: list[Rewards] = []
        flat_rows: list[int] = []
        first_spread: dict[str, float] = {}
        draw, have = 0, 0
        while True:
            batch = training_batch(gen, self.params(step, 0))
            rewards = self.scorer.start(prompts, gen, batch)()
            if rewards.failures:  # the step is not trained on: nothing to fill
                return Drawn(prompts, gen, version), rewards, {}
            if draw == 0:
                first_spread = group_spread(rewards.scores, n)
            each = gen.batch_size[0] // prompts.batch_size[0]  # rows a prompt: k groups of n
            groups = rewards.scores.view(prompts.batch_size[0], each // n, n)
            differs = ((groups.max(-1).values - groups.min(-1).values) != 0).any(-1)
            for keep, into, counts in (
                (differs, (kept_p, kept_g, kept_r), kept_rows),
                (~differs, (flat_p, flat_g, flat_r), flat_rows),
            ):
                idx = keep.nonzero().flatten()
                if idx.numel():
                    rows = (idx.unsqueeze(1) * each + torch.arange(each)).flatten()
                    into[0].append(prompts[idx])
                    into[1].append(gen[rows])
                    into[2].append(_take(rewards, rows))
                    counts.extend([each] * int(idx.numel()))
            have += int(differs.sum())
            if have >= want or draw >= self.max_extra_draws:
                break
            draw += 1
            more = self.generation.redraw(step, draw)
            prompts, gen = more.prompts, more.samples
        p_all, g_all, r_all = kept_p + flat_p, kept_g + flat_g, kept_r + flat_r
        figures = {
            **{k.replace("reward/", "filter/first_draw_"): v for k, v in first_spread.items()},
            "filter/extra_draws": float(draw),
            "filter/groups_that_differ": min(have, want) / want,
        }
        taken = sum((kept_rows + flat_rows)[:want])  # the first ``want`` prompts' rows
        return (
            Drawn(_cat_left_padded(p_all)[:want], _cat_left_padded(g_all)[:taken], version),
            _cat_rewards(r_all, taken),
            figures,
        )


def _take(rewards: Rewards, rows: torch.Tensor) -> Rewards:
    """The rewards of the samples ``rows`` (metrics and shown samples kept as they are)."""
    return Rewards(rewards.scores[rows], rewards.metrics, [], rewards.samples)


def _cat_rewards(parts: list[Rewards], limit: int) -> Rewards:
    scores = torch.cat([p.scores for p in parts])[:limit]
    return Rewards(scores, parts[0].metrics, [], parts[0].samples)


_LEFT_PADDED = (PROMPT_IDS, PROMPT_MASK)


def _cat_left_padded(parts: list[TensorDict]) -> TensorDict:
    """Prompt or sample batches of different widths as one: prompts padded on the left,
    responses (and every other ``[B, L]`` field) on the right, and images (``[B, P, D]`` pixel
    patches, ``[B, I, 3]`` grids: zeros after a sample's last) to the most any part has."""
    if len(parts) == 1:
        return parts[0]
    widths: dict[str, int] = {}
    for td in parts:
        for key, value in td.items():
            if isinstance(value, torch.Tensor) and (value.dim() == 2 or key in VISION_KEYS):
                widths[key] = max(widths.get(key, 0), value.shape[1])
    padded = []
    for td in parts:
        td = td.clone()
        if ROUTED_EXPERTS in td.keys():  # [B, P + R, ...]: its prompt and response parts apart
            prompt = td[PROMPT_IDS].shape[1]
            head, tail = td[ROUTED_EXPERTS][:, :prompt], td[ROUTED_EXPERTS][:, prompt:]
            head = _pad_dim1(head, widths[PROMPT_IDS] - prompt, left=True)
            tail = _pad_dim1(tail, widths.get(RESPONSE_IDS, tail.shape[1]) - tail.shape[1])
            td[ROUTED_EXPERTS] = torch.cat([head, tail], 1)
        for key, width in widths.items():
            value = td[key]
            extra = width - value.shape[1]
            if extra:
                td[key] = _pad_dim1(value, extra, left=key in _LEFT_PADDED)
        padded.append(td)
    return torch.cat(padded)  # type: ignore[return-value,arg-type]


def _pad_dim1(x: torch.Tensor, extra: int, left: bool = False) -> torch.Tensor:
    """``x`` with ``extra`` zero columns (dim 1) before or after."""
    if not extra:
        return x
    zeros = x.new_zeros(x.shape[0], extra, *x.shape[2:])
    return torch.cat([zeros, x] if left else [x, zeros], 1)
