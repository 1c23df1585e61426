"""RewardModel: scores from a saved sequence-classification checkpoint equal transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from engine_core import BatchError, CapabilityError
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from roles.reward_model import RM_SCORES, TOKEN_LEVEL_SCORES, RewardModel
from tests._models import TINY_QWEN2, engine_config, random_batch


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = dict(TINY_QWEN2)
    hf = AutoConfig.for_model(cfg.pop("model_type"), num_labels=1, pad_token_id=0, **cfg)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("rm")
    AutoModelForSequenceClassification.from_config(hf).save_pretrained(folder)
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
