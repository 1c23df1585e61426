"""The shipped text task: its files are what the builder writes, its reward on hand cases, and a
recipe's ./paths resolve beside the recipe."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tensordict import TensorDict

from engine_core.rollout import PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK
from engine_core_roles.data.tasks.tiny_text import digits_reward, write_files
from engine_core_roles.jobs.cli import RECIPES, recipe_relative
from engine_core_roles.trainer.config import TrainerConfig
from engine_core_roles.trainer.dynamic_sampling import _cat_left_padded

SHIPPED = RECIPES / "tiny_text"


def test_the_shipped_files_are_what_the_builder_writes(tmp_path: Path) -> None:
    write_files(tmp_path)
    for name in ("train.jsonl", "val.jsonl", "demos.jsonl", "chats_train.jsonl", "chats_val.jsonl"):
        assert (tmp_path / name).read_text() == (SHIPPED / name).read_text(), name
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        ours, shipped = (tmp_path / "tokenizer" / name), (SHIPPED / "tokenizer" / name)
        assert ours.read_text() == shipped.read_text(), name
    train = {
        json.loads(line)["answer"] for line in (SHIPPED / "train.jsonl").read_text().splitlines()
    }
    val = {json.loads(line)["answer"] for line in (SHIPPED / "val.jsonl").read_text().splitlines()}
    assert len(train) == 900 and len(val) == 100 and not train & val  # held out


def test_digits_reward_on_hand_cases() -> None:
    assert digits_reward("", "321", answer="321") == 1.0
    assert digits_reward("", "32", answer="321") == 2 / 3
    assert digits_reward("", "3210", answer="321") == 3 / 4
    assert digits_reward("", "", answer="321") == 0.0
    assert digits_reward("", "123", answer="321") == 1 / 3


def test_recipe_paths_starting_with_dot_are_beside_the_recipe(tmp_path: Path) -> None:
    raw = {"a": "./x.jsonl", "b": ["../y", "z", "/abs"], "c": {"d": "./t"}, "e": 3}
    got = recipe_relative(raw, tmp_path / "r")
    assert got == {
        "a": str(tmp_path / "r" / "x.jsonl"),
        "b": [str(tmp_path / "y"), "z", "/abs"],
        "c": {"d": str(tmp_path / "r" / "t")},
        "e": 3,
    }


def test_batches_of_different_widths_join_with_prompts_left_padded() -> None:
    a = TensorDict(
        {
            PROMPT_IDS: torch.tensor([[5, 6]]),
            PROMPT_MASK: torch.tensor([[1, 1]]),
            RESPONSE_IDS: torch.tensor([[7]]),
            RESPONSE_MASK: torch.tensor([[1]]),
        },
        batch_size=[1],
    )
    b = TensorDict(
        {
            PROMPT_IDS: torch.tensor([[9]]),
            PROMPT_MASK: torch.tensor([[1]]),
            RESPONSE_IDS: torch.tensor([[3, 4]]),
            RESPONSE_MASK: torch.tensor([[1, 1]]),
        },
        batch_size=[1],
    )
    joined = _cat_left_padded([a, b])
    assert joined[PROMPT_IDS].tolist() == [[5, 6], [0, 9]]
    assert joined[PROMPT_MASK].tolist() == [[1, 1], [0, 1]]
    assert joined[RESPONSE_IDS].tolist() == [[7, 0], [3, 4]]
    assert joined[RESPONSE_MASK].tolist() == [[1, 0], [1, 1]]


def test_filter_groups_is_refused_for_asynchronous_runs() -> None:
    import pytest

    with pytest.raises(ValueError, match="filter_groups draws more prompts within a step"):
        TrainerConfig(filter_groups=True, max_staleness=1)
