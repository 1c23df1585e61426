"""Multi-turn episodes: the environment protocol, the built-in tool environment and its
parsers, tool processes, the chat template's turn rendering, the turn loop over any rollout,
demonstrations and per-step episode metrics.
"""

from __future__ import annotations

from engine_core_roles.episodes.config import EnvConfig, load_environment
from engine_core_roles.episodes.demos import DemoRenderer, demo_batch
from engine_core_roles.episodes.metrics import episode_metrics
from engine_core_roles.episodes.protocol import (
    END_REASONS,
    Environment,
    Episode,
    Message,
    StepResult,
)
from engine_core_roles.episodes.rollout import EpisodeRollout, EpisodeWorker
from engine_core_roles.episodes.template import check_messages, check_template
from engine_core_roles.episodes.tool_processes import TOOL_PROCESSES, ToolProcesses, serve
from engine_core_roles.episodes.tools import (
    ToolCall,
    ToolEnvironment,
    check_tool_schema,
    hermes_tool_calls,
    tool_schema,
)

__all__ = [
    "EnvConfig",
    "load_environment",
    "DemoRenderer",
    "demo_batch",
    "episode_metrics",
    "Message",
    "END_REASONS",
    "StepResult",
    "Episode",
    "Environment",
    "EpisodeRollout",
    "EpisodeWorker",
    "check_template",
    "check_messages",
    "ToolProcesses",
    "TOOL_PROCESSES",
    "serve",
    "ToolCall",
    "hermes_tool_calls",
    "tool_schema",
    "check_tool_schema",
    "ToolEnvironment",
]
