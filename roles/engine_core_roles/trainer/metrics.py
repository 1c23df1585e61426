"""Which metrics a run's rows hold that measure time, and which are worth a plot panel."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TIMING_KEYS", "plot_keys"]

TIMING_KEYS = ("time_s", "tokens_per_s", "weight_sync/time_s", "episode/env_wait_s")
"""Row keys that measure time: they differ between otherwise identical runs."""


def plot_keys(rows: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The metrics worth a plot panel for these rows.

    Always how the run goes (reward, response length, grad norm, step time, tokens/s, pg loss,
    entropy, rollout-vs-trainer log-prob difference); the clip fraction and the policy's
    approximate KL only where an update took more than one optimizer step (with one on-policy
    step they are exactly 0); the KL loss and the value loss where they were logged; skipped
    (non-finite) updates where there were any; the share of prompts whose samples all scored
    the same, steps not trained on for unscored samples, episodes' turns, tool errors and the
    share ended by the environment, and the validation figures where they were logged.
    """
    keys = [
        "reward",
        "response_length",
        "actor/pg_loss",
        "actor/entropy",
        "actor/grad_norm",
        "rollout/logprob_diff_max",
        "time_s",
        "tokens_per_s",
    ]
    if any(r.get("actor/num_optimizer_steps", 1.0) > 1 for r in rows):
        keys += ["actor/clipfrac", "actor/approx_kl"]
    keys += [k for k in ("actor/kl_loss", "critic/vf_loss") if any(k in r for r in rows)]
    if any(r.get("actor/num_skipped_steps", 0.0) for r in rows):
        keys.append("actor/num_skipped_steps")
    keys += [
        k
        for k in (
            "reward/zero_variance_groups",
            "reward/failed_samples",
            "episode/turns",
            "episode/tool_errors",
            "episode/end_done",
        )
        if any(k in r for r in rows)
    ]
    keys += sorted({k for r in rows for k in r if k.startswith("val/")})
    return tuple(keys)
