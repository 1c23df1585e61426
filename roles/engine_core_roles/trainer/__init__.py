"""``RLTrainer`` and the parts its step is made of: configuration, generation (synchronous or
asynchronous), dynamic sampling, scoring, the old-log-prob stage with its routing, the reference
and critic stages, advantage estimation, guards, metrics and resumable state; and
``SFTTrainer``, the supervised steps of ``engine-core train`` and the RL job's warm-up.
"""

from __future__ import annotations

from engine_core_roles.trainer.config import (
    EXTRA_DRAW_STRIDE,
    SEED_STRIDE,
    TrainerConfig,
)
from engine_core_roles.trainer.generation import PromptsExhausted
from engine_core_roles.trainer.guards import LogProbGapError
from engine_core_roles.trainer.loop import RLTrainer, StepCallback
from engine_core_roles.trainer.metrics import TIMING_KEYS, plot_keys
from engine_core_roles.trainer.protocols import (
    PolicyRole,
    PromptBatch,
    PromptSource,
    ReferenceRole,
    RewardRole,
    ValueRole,
)
from engine_core_roles.trainer.sft import SFTTrainer

__all__ = [
    "SEED_STRIDE",
    "EXTRA_DRAW_STRIDE",
    "TrainerConfig",
    "PromptsExhausted",
    "LogProbGapError",
    "StepCallback",
    "RLTrainer",
    "SFTTrainer",
    "TIMING_KEYS",
    "plot_keys",
    "PromptBatch",
    "PromptSource",
    "PolicyRole",
    "ValueRole",
    "ReferenceRole",
    "RewardRole",
]
