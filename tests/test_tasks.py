"""The shipped digit tasks: prompts, targets and exact scoring."""

from __future__ import annotations

import torch

from engine_core.batch import LOSS_MASK
from engine_core_roles.data.tasks.digits import BOS, DIGIT0, EOS, SEP, DigitTask, TaskConfig


def test_reverse_target_and_score() -> None:
    task = DigitTask(TaskConfig(name="reverse", num_digits=3))
    digits = torch.tensor([[1, 2, 3]])
    prompt = task.prompt_ids(digits)
    assert prompt.tolist() == [[BOS, DIGIT0 + 1, DIGIT0 + 2, DIGIT0 + 3, SEP]]
    target = task.target_ids(digits)
    assert target.tolist() == [[DIGIT0 + 3, DIGIT0 + 2, DIGIT0 + 1, EOS]]
    assert task.score(prompt, target).item() == 1.0
    half = target.clone()
    half[0, 2:] = 0
    assert task.score(prompt, half).item() == 0.5
    assert task.score(prompt, target[:, :1]).item() == 0.25  # short responses are padded


def test_supervised_batch_masks_the_prompt() -> None:
    task = DigitTask(TaskConfig(name="repeat2", num_digits=2))
    batch = task.supervised_batch(4)
    assert batch["input_ids"].shape == (4, task.prompt_len + task.response_len)
    assert batch[LOSS_MASK][:, : task.prompt_len].sum() == 0
    assert (batch[LOSS_MASK][:, task.prompt_len :] == 1).all()


def test_generation_is_seeded() -> None:
    a = DigitTask(TaskConfig(seed=5)).sample_digits(8)
    b = DigitTask(TaskConfig(seed=5)).sample_digits(8)
    assert torch.equal(a, b)
