"""Engine-agnostic RL roles (Actor, Critic, Reference, RewardModel) built on engine_core's API."""

from __future__ import annotations

__all__: list[str] = []
