"""What a job reads: the tokenizer and its chat template, prompt and chat datasets (read from
files, drawn in a seeded order), stop strings, reward functions and their contract, and the
tasks shipped with the SDK.
"""

from __future__ import annotations

from engine_core_roles.data.datasets.chats import (
    ChatData,
    ChatDataConfig,
    ChatRenderer,
    check_conversation,
)
from engine_core_roles.data.datasets.files import SeededOrder, read_rows
from engine_core_roles.data.datasets.prompts import DataConfig, PromptData
from engine_core_roles.data.datasets.stop_strings import stop_token_ids
from engine_core_roles.data.datasets.tokenizer import load_tokenizer
from engine_core_roles.data.rewards.answers import (
    BUILTINS,
    exact_match,
    extract_answer,
    format_reward,
    math_answer,
    normalize_answer,
)
from engine_core_roles.data.rewards.functions import (
    RewardConfig,
    RewardError,
    RewardFn,
    Rewards,
    SampleReward,
    Scored,
    accepts,
    load_function,
    score_samples,
)
from engine_core_roles.data.rewards.text import TextReward
from engine_core_roles.data.tasks.digits import (
    BOS,
    EOS,
    PAD,
    SEP,
    VOCAB_SIZE,
    DigitTask,
    TaskConfig,
)

__all__ = [
    "extract_answer",
    "normalize_answer",
    "exact_match",
    "math_answer",
    "format_reward",
    "BUILTINS",
    "DataConfig",
    "PromptData",
    "ChatDataConfig",
    "ChatData",
    "ChatRenderer",
    "check_conversation",
    "read_rows",
    "SeededOrder",
    "RewardError",
    "RewardConfig",
    "load_function",
    "Scored",
    "score_samples",
    "accepts",
    "RewardFn",
    "Rewards",
    "SampleReward",
    "stop_token_ids",
    "PAD",
    "BOS",
    "SEP",
    "EOS",
    "VOCAB_SIZE",
    "TaskConfig",
    "DigitTask",
    "TextReward",
    "load_tokenizer",
]
