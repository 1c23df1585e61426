"""BaseRollout's contract: abstract methods enforced, weight sync verified (names, shapes, checksums)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from engine_core.config import ModelConfig
from engine_core.engine import BaseEngine
from engine_core.errors import WeightSyncError
from engine_core.models import build_model
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from engine_core.rollout import (
    BaseRollout,
    RolloutConfig,
    SamplingParams,
    iter_buckets,
    sent_buckets,
    tensor_checksum,
)
from tests._models import TINY_QWEN2, engine_config


class ModelHoldingRollout(BaseRollout):
    """The weight-loading half of a rollout, on a real transformers model (generation is not under test)."""

    def __init__(self, drop: str | None = None) -> None:
        super().__init__(RolloutConfig(backend="test", model=ModelConfig(config=dict(TINY_QWEN2))))
        torch.manual_seed(123)  # different init from the trainer, so a sync is visible
        self.model = build_model(ModelConfig(config=dict(TINY_QWEN2)))
        self.drop = drop  # a parameter this rollout "forgets" to load

    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        raise NotImplementedError

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.model.state_dict().items()}

    def load_weight_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> str:
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in bucket:
                if name != self.drop:
                    state[name].copy_(tensor)
        return tensor_checksum((name, state[name]) for name, _ in bucket)


def trainer() -> ReferenceEngine:
    engine = ReferenceEngine(ReferenceEngineConfig(**engine_config()))
    engine.init_model()
    return engine


def test_abstract_methods_are_enforced() -> None:
    with pytest.raises(TypeError, match="abstract"):
        BaseRollout(RolloutConfig(backend="x", model=ModelConfig(config=dict(TINY_QWEN2))))  # type: ignore[abstract]
    with pytest.raises(TypeError, match="abstract"):
        BaseEngine(ReferenceEngineConfig(**engine_config()))  # type: ignore[abstract]


def test_sync_moves_the_weights_and_reports_buckets() -> None:
    engine, rollout = trainer(), ModelHoldingRollout()
    buckets = rollout.load_weights(sent_buckets(engine.named_full_params(), 64 << 10))
    assert len(buckets) > 1
    assert sum(len(b.names) for b in buckets) == len(rollout.expected_weights())
    for name, tensor in engine.module.state_dict().items():
        assert torch.equal(rollout.model.state_dict()[name], tensor), name


def test_wrong_shape_is_refused_with_the_name() -> None:
    engine, rollout = trainer(), ModelHoldingRollout()
    named = [(n, t[:1] if n == "lm_head.weight" else t) for n, t in engine.named_full_params()]
    with pytest.raises(WeightSyncError, match="lm_head.weight: got"):
        rollout.load_weights(sent_buckets(named))


def test_unknown_and_missing_parameters_are_caught() -> None:
    engine, rollout = trainer(), ModelHoldingRollout()
    named = list(engine.named_full_params())
    with pytest.raises(WeightSyncError, match="no such parameter"):
        rollout.load_weights(sent_buckets([*named, ("extra.weight", torch.zeros(2))]))
    with pytest.raises(WeightSyncError, match="never sent"):
        rollout.load_weights(sent_buckets(named[1:]))


def test_a_parameter_not_loaded_is_a_checksum_mismatch() -> None:
    engine, rollout = trainer(), ModelHoldingRollout(drop="model.norm.weight")
    with torch.no_grad():
        engine.module.model.norm.weight.add_(1.0)  # so the skipped load is a real difference
    with pytest.raises(WeightSyncError, match="checksum mismatch.*model.norm.weight"):
        rollout.load_weights(sent_buckets(engine.named_full_params(), 1 << 30))


def test_buckets_respect_the_bound() -> None:
    tensors = [(f"t{i}", torch.zeros(100)) for i in range(10)]  # 400 bytes each
    sizes = [sum(t.numel() * 4 for _, t in b) for b in iter_buckets(tensors, 1000)]
    assert sizes == [800] * 5
    assert [len(b) for b in iter_buckets([("big", torch.zeros(1000))], 100)] == [1]


def test_sampling_params_validation() -> None:
    with pytest.raises(ValueError, match="top_k=0"):
        SamplingParams(top_k=0)
    assert SamplingParams(temperature=0).greedy


def test_saved_model_folder_leaves_the_global_rng_alone() -> None:
    """Building a rollout's model from a config is seeded on a fork of the RNG."""
    from engine_core.config import ModelConfig
    from engine_core.rollout import saved_model_folder
    from engine_core.testing.models import TINY_QWEN2

    torch.manual_seed(7)
    before = torch.get_rng_state()
    folders = [
        saved_model_folder(ModelConfig(config=dict(TINY_QWEN2)), 3, "rng-") for _ in range(2)
    ]
    assert torch.equal(torch.get_rng_state(), before)
    from safetensors.torch import load_file

    a, b = (load_file(f"{f.name}/model.safetensors") for f in folders)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same seed, the same weights
    for f in folders:
        f.cleanup()
