"""Per-step means over a step's episodes: turns, tool calls and errors, and why episodes ended."""

from __future__ import annotations

from tensordict import TensorDict

from engine_core.rollout import (
    PROMPT_MASK,
    RESPONSE_LOSS_MASK,
    RESPONSE_MASK,
)
from engine_core_roles.batch.keys import EPISODE
from engine_core_roles.episodes.protocol import END_REASONS

__all__ = ["episode_metrics"]


def episode_metrics(gen: TensorDict) -> dict[str, float]:
    """Means over a step's episodes: turns, each count (tool calls, tool errors, ...; logged
    as ``episode/<name>``, or as it is where the name holds a ``/``), the
    episode's length in tokens, the share of its response tokens trained on, the share of
    episodes that ended for each reason, and the seconds the turn loop waited on the
    environments. Empty for a result without episodes."""
    if EPISODE not in gen.keys():
        return {}
    records = gen[EPISODE].tolist()
    n = max(len(records), 1)
    out = {"episode/turns": sum(r["turns"] for r in records) / n}
    keys = sorted({k for r in records for k in r["counts"]})
    for key in keys:  # a count already named by its group (agent/calls) keeps its name
        name = key if "/" in key else f"episode/{key}"
        out[name] = sum(r["counts"].get(key, 0.0) for r in records) / n
    lengths = (gen[PROMPT_MASK].sum(-1) + gen[RESPONSE_MASK].sum(-1)).float()
    out["episode/length"] = float(lengths.mean())
    trained = float(gen[RESPONSE_LOSS_MASK].sum()) if RESPONSE_LOSS_MASK in gen.keys() else 0.0
    out["episode/trained_token_share"] = trained / max(float(gen[RESPONSE_MASK].sum()), 1.0)
    for reason in END_REASONS:
        out[f"episode/end_{reason}"] = sum(r["end"] == reason for r in records) / n
    # the turn loop's wait on environments (per replica; the slowest one's)
    out["episode/env_wait_s"] = max((float(r.get("env_wait_s", 0.0)) for r in records), default=0.0)
    return out
