"""Batch keys and schemas: the fields this layer adds to a batch, the prompt and training
batches passed between a rollout and the roles, and supervised batches of whole sequences.
Imports only :mod:`engine_core`.
"""

from __future__ import annotations

from engine_core_roles.batch.build import prompt_batch, sequence_batch, training_batch
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
    "sequence_batch",
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
