"""Batch keys and schemas: the fields this layer adds to a batch, and the prompt and training
batches passed between a rollout and the roles. Imports only :mod:`engine_core`.
"""

from __future__ import annotations

from engine_core_roles.batch.build import prompt_batch, training_batch
from engine_core_roles.batch.keys import (
    ADVANTAGES,
    EPISODE,
    OLD_LOG_PROBS,
    OLD_VALUES,
    REF_LOG_PROBS,
    RETURNS,
    RM_SCORES,
    ROW,
    ROW_INDEX,
    TOKEN_LEVEL_SCORES,
)

__all__ = [
    "prompt_batch",
    "training_batch",
    "ADVANTAGES",
    "EPISODE",
    "OLD_LOG_PROBS",
    "OLD_VALUES",
    "REF_LOG_PROBS",
    "RETURNS",
    "RM_SCORES",
    "ROW",
    "ROW_INDEX",
    "TOKEN_LEVEL_SCORES",
]
