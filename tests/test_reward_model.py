"""RewardModel: scores from a saved sequence-classification checkpoint equal transformers';
``engine-core run`` with a ``reward_model`` adds its scores to the task's, sample by sample."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoModelForSequenceClassification

from engine_core import BatchError, CapabilityError, SamplingParams
from engine_core.configio import apply_overrides, load_yaml
from engine_core.errors import ConfigError
from engine_core.plugins import load_plugins
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from engine_core_roles.batch.keys import RM_SCORES, TOKEN_LEVEL_SCORES
from engine_core_roles.jobs.cli import RECIPES
from engine_core_roles.jobs.rl.run import run_rl_job
from engine_core_roles.models.reward_model import RewardModel
from tests._models import TINY_QWEN2, engine_config, random_batch, save_reward_model


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("rm")
    save_reward_model(folder, TINY_QWEN2)
    return folder


def _rm(folder: Path, **overrides: object) -> RewardModel:
    engine = ReferenceEngine(
        ReferenceEngineConfig(
            **engine_config(model={"path": str(folder), "value_head": True}, **overrides)
        )
    )
    engine.init_model()
    return RewardModel(engine)


@pytest.mark.parametrize("left_pad", [False, True])
@pytest.mark.parametrize("use_packing", [True, False])
def test_scores_equal_sequence_classification(
    rm_folder: Path, use_packing: bool, left_pad: bool
) -> None:
    batch = random_batch(6, seed=4, left_pad=left_pad)
    out = _rm(rm_folder, use_packing=use_packing, micro_batch_size=4).compute_rm_score(batch)
    model = AutoModelForSequenceClassification.from_pretrained(rm_folder).eval()
    want = []
    with torch.no_grad():
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
            want.append(model(input_ids=ids[mask.bool()].unsqueeze(0)).logits[0, 0])
    assert torch.allclose(out[RM_SCORES], torch.stack(want), atol=1e-5)
    token = out[TOKEN_LEVEL_SCORES]
    assert token.shape == batch["input_ids"].shape
    assert torch.allclose(token.sum(-1), out[RM_SCORES])  # one non-zero per row
    assert (token != 0).sum(-1).le(1).all()


def test_reward_model_refuses_bad_engines_and_batches(rm_folder: Path) -> None:
    policy = ReferenceEngine(ReferenceEngineConfig(**engine_config()))
    with pytest.raises(CapabilityError, match="model.value_head=true"):
        RewardModel(policy)
    rm = _rm(rm_folder)
    batch = random_batch(2)
    with pytest.raises(BatchError, match="attention_mask.*RewardModel.compute_rm_score"):
        rm.compute_rm_score(batch.exclude("attention_mask"))
    batch["attention_mask"][1] = 0
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] have no real token"):
        rm.compute_rm_score(batch)


RECIPE = RECIPES / "grpo_tiny.yaml"


def _job(out: Path, rm: Path, *overrides: str) -> dict[str, Any]:
    raw = apply_overrides(
        load_yaml(RECIPE),
        [
            f"output_dir={out}",
            "prompts_per_step=4",
            "trainer.samples_per_prompt=4",
            "reward_model.engine.backend=fsdp2",
            f"reward_model.engine.model.path={rm}",
            *overrides,
        ],
    )
    return run_rl_job(raw, load_plugins())


def test_job_reward_is_the_task_score_plus_the_weighted_model_score(
    recipe_reward_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step's samples (recorded as the trainer builds its batch) scored by transformers'
    sequence-classification model: their mean is the logged ``reward/model``, and ``reward``
    is ``reward/fn + weight * reward/model``."""
    import engine_core_roles.trainer.scoring

    batches: list[TensorDict] = []
    original = engine_core_roles.batch.build.training_batch

    def recording(gen: TensorDict, params: SamplingParams) -> TensorDict:
        batches.append(original(gen, params))
        return batches[-1]

    monkeypatch.setattr(engine_core_roles.trainer.scoring, "training_batch", recording)
    # one generation a step, scored once (the recipe's dynamic sampling would draw again)
    once = "trainer.filter_groups=false"
    _job(tmp_path, recipe_reward_model, "steps=2", "trainer.reward_model_weight=0.5", once)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    model = AutoModelForSequenceClassification.from_pretrained(recipe_reward_model).eval()
    assert len(rows) == len(batches) == 2
    for row, batch in zip(rows, batches, strict=True):
        with torch.no_grad():
            # the head on the last real token (read by position: an untrained policy samples
            # the pad id too, which transformers' own pooling would skip)
            want = [
                model.score(model.model(input_ids=ids[mask.bool()][None]).last_hidden_state)[
                    0, -1, 0
                ]
                for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
            ]
        assert row["reward/model"] == pytest.approx(float(torch.stack(want).mean()), abs=1e-5)
        assert row["reward"] == pytest.approx(
            row["reward/fn"] + 0.5 * row["reward/model"], abs=1e-6
        )


def test_job_refuses_a_reward_model_on_another_vocabulary(rm_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"vocab_size 64, the actor's model 16.*same tokenizer"):
        _job(tmp_path, rm_folder, "steps=1")
    assert not (tmp_path / "metrics.jsonl").exists()
