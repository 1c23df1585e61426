"""The shipped algorithms, registered through the same hook as a third-party plugin's.

This module is the ``algorithms`` entry point of ``engine-core-roles`` (group
``engine_core.plugins``); :func:`engine_core_roles.algorithms.select.algorithm_manager` also
registers it directly when autoload is off, so the shipped names are always there.
"""

from __future__ import annotations

from engine_core.hookspecs import BackendRegistry, hookimpl

__all__ = ["engine_core_register", "PLUGIN_NAME"]

PLUGIN_NAME = "algorithms"
_HERE = "engine_core_roles.algorithms.builtin"


@hookimpl
def engine_core_register(registry: BackendRegistry) -> None:
    adv = registry.register_advantage
    adv("gae", f"{_HERE}:GAE", needs=["critic"], description="PPO: GAE over a critic's values.")
    adv(
        "grpo",
        f"{_HERE}:GRPO",
        params=f"{_HERE}:GRPOParams",
        needs=["groups"],
        description="Scores normalized within each prompt's group (normalize_std=false: Dr. GRPO).",
    )
    adv("rloo", f"{_HERE}:RLOO", needs=["groups"], description="Leave-one-out baseline.")
    adv(
        "reinforce_pp",
        f"{_HERE}:ReinforcePP",
        description="REINFORCE++: discounted returns whitened over the batch.",
    )
    adv(
        "reinforce_pp_baseline",
        f"{_HERE}:ReinforcePPBaseline",
        needs=["groups"],
        description="REINFORCE++ with the group mean as baseline.",
    )
    loss = registry.register_policy_loss
    loss(
        "ppo_clip",
        f"{_HERE}:PPOClip",
        params=f"{_HERE}:PPOClipParams",
        description="PPO clipped surrogate, dual clip.",
    )
    loss(
        "gspo",
        f"{_HERE}:GSPO",
        params=f"{_HERE}:GSPOParams",
        needs=["groups"],
        description="Sequence-level ratio, clipped per sequence.",
    )
    loss(
        "cispo",
        f"{_HERE}:CISPO",
        params=f"{_HERE}:CISPOParams",
        description="Clipped, detached importance weights; gradient through the log-prob.",
    )
