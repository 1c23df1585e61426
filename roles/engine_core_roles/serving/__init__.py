"""An OpenAI-compatible endpoint in front of any rollout, with sessions recorded token for token
and trained on as rows (agents written with any OpenAI client: :class:`AgentRollout`;
``docs/serving.md``). Needs the ``serve`` extra: ``pip install 'engine-core-roles[serve]'``."""

from __future__ import annotations

from engine_core_roles.serving.agent_function import AgentFn, AgentReward, load_agent
from engine_core_roles.serving.agents import AgentRollout
from engine_core_roles.serving.app import Endpoint, build_app
from engine_core_roles.serving.config import ServeConfig, is_loopback
from engine_core_roles.serving.limits import SESSION_HEADER
from engine_core_roles.serving.protocol import ApiError
from engine_core_roles.serving.rows import SessionRow, session_rows
from engine_core_roles.serving.sampler import Sampled, ServedRollout
from engine_core_roles.serving.server import BackgroundServer, serve, served_rollout
from engine_core_roles.serving.sessions import Call, Choice, Session, Sessions

__all__ = [
    "AgentFn",
    "AgentReward",
    "AgentRollout",
    "ApiError",
    "BackgroundServer",
    "Call",
    "Choice",
    "Endpoint",
    "SESSION_HEADER",
    "Sampled",
    "ServeConfig",
    "ServedRollout",
    "Session",
    "SessionRow",
    "Sessions",
    "build_app",
    "is_loopback",
    "load_agent",
    "serve",
    "served_rollout",
    "session_rows",
]
