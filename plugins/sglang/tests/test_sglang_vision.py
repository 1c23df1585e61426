"""The SGLang rollout on prompts with images.

Without SGLang: how a prompt's patches become SGLang's ``image_data`` (an HF processor's output
with the prompt's ids as they are), how a sync's names become SGLang's, and what is refused.
With SGLang's CPU environment (``make sglang-env``): tiny Qwen2.5-VL, Qwen2-VL and Qwen3-VL
sample from images of several sizes (and a prompt without) in a replica there, and the
trainer's log-probs of the samples on the same images equal SGLang's; a sync that changes only
the vision tower is followed; a sampled vision token ends its sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_core_sglang.rollout import (
    SGLangRolloutConfig,
    build_requests,
    parse_outputs,
    to_sglang_sampling_params,
)
from engine_core_sglang.vision import (
    check_vision_model,
    sglang_weight_names,
)
from tensordict import TensorDict

from engine_core.errors import BatchError, CapabilityError, ConfigError, WeightSyncError
from engine_core.rollout import (
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TRUNCATED,
    SamplingParams,
    sent_buckets,
)
from engine_core.testing.models import TINY_QWEN2
from engine_core.testing.vision import (
    TINY_QWEN2_5_VL,
    TINY_QWEN3_VL,
    TINY_QWEN3_VL_MOE,
    VL_END,
    VL_IMAGE_TOKEN,
    VL_START,
    VL_VIDEO_TOKEN,
    image_prompts,
)
from engine_core.vision import IMAGE_GRID_THW, PIXEL_VALUES

# the shared tiny Qwen2.5-VL with patches of 14 x 14 (1,176 wide), the only width SGLang's
# Qwen2.5-VL runs its tower on; its windows as many patches wide as the shared config's
SGLANG_QWEN2_5_VL: dict[str, Any] = {
    **TINY_QWEN2_5_VL,
    "vision_config": {**TINY_QWEN2_5_VL["vision_config"], "patch_size": 14, "window_size": 56},
}
# Qwen2-VL: the same decoder, its own tower (no windows); its channel count also under the name
# released Qwen2-VL configs give it, which SGLang reads
SGLANG_QWEN2_VL: dict[str, Any] = {
    **{k: v for k, v in TINY_QWEN2_5_VL.items() if k != "vision_config"},
    "model_type": "qwen2_vl",
    "vision_config": {
        "depth": 2,
        "embed_dim": 24,
        "hidden_size": 64,
        "mlp_ratio": 2,
        "num_heads": 2,
        "in_channels": 3,
        "in_chans": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}
# one-frame images of three sizes, two in one prompt, and a prompt without
GRIDS = [[(1, 4, 4)], [], [(1, 2, 6), (1, 4, 2)], [(1, 6, 4)]]
PARAMS = SamplingParams(n=2, max_new_tokens=6, temperature=0.8, seed=2)
VISION_IDS = {VL_IMAGE_TOKEN, VL_VIDEO_TOKEN, VL_START, VL_END}


def _hf_config(raw: dict[str, Any]) -> Any:
    from engine_core.config import ModelConfig
    from engine_core.models import build_hf_config

    return build_hf_config(ModelConfig(config=dict(raw)))


def _prompts(raw: dict[str, Any], grids: list[Any], seed: int = 0) -> TensorDict:
    """:func:`image_prompts` with patches as wide as the model ``raw``'s tower takes."""
    from engine_core.vision import patch_width

    prompts = image_prompts(grids, seed=seed)
    width = patch_width(_hf_config(raw).vision_config)
    g = torch.Generator().manual_seed(seed)
    prompts[PIXEL_VALUES] = torch.randn(*prompts[PIXEL_VALUES].shape[:2], width, generator=g)
    return prompts


# -- without SGLang -------------------------------------------------------------------------
def test_a_prompts_images_go_as_an_hf_processors_output_with_its_ids_unchanged() -> None:
    """Each sample of a prompt with images carries them as one processor-output entry (its
    real patches, its grids without padding rows); a prompt without images has none; the ids
    go as the prompt holds them (placeholders expanded), and the vision tokens stop a sample."""
    prompts = _prompts(SGLANG_QWEN2_5_VL, GRIDS)
    req = build_requests(
        prompts, PARAMS, deterministic=True, model_config=_hf_config(SGLANG_QWEN2_5_VL)
    )
    mask = prompts["prompt_mask"].bool()
    assert req.input_ids[::2] == [
        row[m].tolist() for row, m in zip(prompts["prompt_ids"], mask, strict=True)
    ]
    assert req.image_data is not None
    assert [len(e) for e in req.image_data] == [1, 1, 0, 0, 1, 1, 1, 1]
    two = req.image_data[4][0]
    assert two["format"] == "processor_output" and req.image_data[5][0] is two
    assert two[IMAGE_GRID_THW].tolist() == [[1, 2, 6], [1, 4, 2]]
    assert torch.equal(two[PIXEL_VALUES], prompts[PIXEL_VALUES][2, :20])
    assert req.images is not None and torch.equal(req.images[PIXEL_VALUES], prompts[PIXEL_VALUES])
    assert set(req.sampling_params[0]["stop_token_ids"]) == VISION_IDS
    vision = _hf_config(SGLANG_QWEN2_5_VL)
    text = build_requests(prompts[1:2], PARAMS, deterministic=True, model_config=vision)
    assert text.image_data is None  # the samples still carry the (empty) image fields


def test_images_are_refused_without_a_vision_model_and_as_several_frames() -> None:
    prompts = _prompts(SGLANG_QWEN2_5_VL, GRIDS)
    with pytest.raises(CapabilityError, match="does not declare vision"):
        build_requests(prompts, SamplingParams())
    with pytest.raises(BatchError, match="has no vision tower"):
        build_requests(prompts, SamplingParams(), model_config=_hf_config(TINY_QWEN2))
    with pytest.raises(BatchError, match="prompt 1: image grids \\[\\[2, 2, 2\\]\\] have 2 frames"):
        build_requests(
            _prompts(SGLANG_QWEN2_5_VL, [[(1, 2, 2)], [(2, 2, 2)]]),
            SamplingParams(),
            model_config=_hf_config(SGLANG_QWEN2_5_VL),
        )
    broken = _prompts(SGLANG_QWEN2_5_VL, [[(1, 2, 2)], []])
    broken["prompt_ids"][1, -1] = VL_IMAGE_TOKEN  # an image token without its image
    with pytest.raises(BatchError, match="sample 1 holds 1 image tokens"):
        build_requests(broken, SamplingParams(), model_config=_hf_config(SGLANG_QWEN2_5_VL))


def test_families_sglang_would_not_serve_from_patches_are_refused() -> None:
    """Qwen3-VL-MoE, and a Qwen2.5-VL whose patches SGLang would take for embeddings."""
    check_vision_model(_hf_config(SGLANG_QWEN2_5_VL))
    check_vision_model(_hf_config(SGLANG_QWEN2_VL))
    check_vision_model(_hf_config(TINY_QWEN3_VL))
    with pytest.raises(CapabilityError, match="'qwen3_vl_moe'.*rollout.backend=hf"):
        check_vision_model(_hf_config(TINY_QWEN3_VL_MOE))
    with pytest.raises(CapabilityError, match="1176 wide .* this model's are 96 wide"):
        check_vision_model(_hf_config(TINY_QWEN2_5_VL))
    vision = {k: v for k, v in SGLANG_QWEN2_VL["vision_config"].items() if k != "in_chans"}
    with pytest.raises(CapabilityError, match='Add "in_chans": 3 to vision_config'):
        check_vision_model(_hf_config({**SGLANG_QWEN2_VL, "vision_config": vision}))


def test_a_sampled_vision_token_ends_its_sample_unfinished() -> None:
    prompts = _prompts(SGLANG_QWEN2_5_VL, [[(1, 2, 2)], []])
    lens = prompts["prompt_mask"].sum(-1).tolist()

    def out(tokens: list[int], k: int) -> dict[str, Any]:
        return {
            "output_ids": tokens,
            "meta_info": {
                "finish_reason": {"type": "stop", "matched": tokens[-1]},
                "prompt_tokens": lens[k],
                "output_token_logprobs": [(-0.5, t, None) for t in tokens],
            },
        }

    got = parse_outputs([out([5, 6, VL_START], 0), out([7, 2], 1)], prompts, 1, cut=VISION_IDS)
    assert got[RESPONSE_MASK].sum(-1).tolist() == [2, 2]
    assert got[RESPONSE_IDS][0, :2].tolist() == [5, 6] and got[TRUNCATED].tolist() == [True, False]
    assert to_sglang_sampling_params(SamplingParams(stop_token_ids=[2]), cut={2, 9})[
        "stop_token_ids"
    ] == [2, 9]


def test_a_syncs_names_become_the_ones_sglangs_loader_takes() -> None:
    """Every tensor of a vision-language model under the original checkpoint's name (the
    tower's ``visual.*``, the decoder's ``model.*``): SGLang's Qwen2.5-VL loader would skip
    transformers' own names without a word."""
    from engine_core.backend import checkpoint_tensors, meta_model, model_weight_shapes
    from engine_core.config import ModelConfig

    model = ModelConfig(config=dict(SGLANG_QWEN2_5_VL))
    shapes = model_weight_shapes(model)
    named = [(n, torch.zeros(s)) for n, s in shapes.items()]
    names = [n for n, _ in sglang_weight_names(checkpoint_tensors(meta_model(model), named))]
    assert len(names) == len(set(names)) == len(shapes)
    assert {n.split(".")[0] for n in names} == {"visual", "model", "lm_head"}
    assert not [n for n in names if n.startswith(("model.visual.", "model.language_model."))]
    assert sum(n.startswith("visual.blocks.") for n in names) == sum(
        ".visual.blocks." in f".{n}" for n in shapes
    )
    renamed = sglang_weight_names([("model.visual.merger.mlp.0.bias", torch.zeros(1))])
    assert [n for n, _ in renamed] == ["visual.merger.mlp.0.bias"]
    with pytest.raises(WeightSyncError, match="'vision_tower.x'.*would not be loaded"):
        sglang_weight_names([("vision_tower.x", torch.zeros(1))])


def test_a_vision_model_without_a_processor_is_refused_before_sglang_starts() -> None:
    from engine_core_sglang.rollout import SGLangRollout

    config = SGLangRolloutConfig(
        backend="sglang", model={"config": dict(SGLANG_QWEN2_5_VL)}, device="cpu"
    )
    with pytest.raises(ConfigError, match="needs the model's HF processor"):
        SGLangRollout(config)


# -- SGLang's CPU engine in its own environment ----------------------------------------------
def _sglang_python() -> str | None:
    import os

    default = Path(__file__).resolve().parents[3] / ".venv-sglang" / "bin" / "python"
    return os.environ.get("ENGINE_CORE_SGLANG_PYTHON") or (
        str(default) if default.is_file() else None
    )


SGLANG_PYTHON = _sglang_python()
live = pytest.mark.skipif(
    SGLANG_PYTHON is None,
    reason="needs SGLang's CPU environment: make sglang-env (or ENGINE_CORE_SGLANG_PYTHON)",
)


def _saved(raw: dict[str, Any], folder: Path) -> str:
    """The model saved with a tokenizer that names its 128 ids and an image processor, as a
    model folder comes (SGLang builds its image input from the folder's processor)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from engine_core.config import ModelConfig
    from engine_core.models import build_model

    special = {VL_IMAGE_TOKEN: "<|image_pad|>", VL_VIDEO_TOKEN: "<|video_pad|>"}
    special |= {VL_START: "<|vision_start|>", VL_END: "<|vision_end|>"}
    vocab = {special.get(i, f"t{i}"): i for i in range(128)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
        unk_token="t0",
        pad_token="t0",
        additional_special_tokens=list(special.values()),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        build_model(ModelConfig(config=dict(raw))).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    patch = int(raw["vision_config"]["patch_size"])
    Qwen2VLImageProcessorPil(patch_size=patch, temporal_patch_size=2, merge_size=2).save_pretrained(
        str(folder)
    )
    return str(folder)


def _rollout(folder: str) -> Any:
    from engine_core.remote_rollout import ProcessRollout

    config = SGLangRolloutConfig(
        backend="sglang",
        model={"path": folder},
        dtype="float32",
        device="cpu",
        deterministic_inference=True,
        mem_fraction_static=0.05,
        max_total_tokens=4096,
        context_length=256,
    )
    assert SGLANG_PYTHON is not None
    return ProcessRollout(config, replicas=1, timeout_s=600, python=SGLANG_PYTHON)


def _trainer(folder: str) -> Any:
    from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
    from engine_core.testing.models import engine_config

    engine = ReferenceEngine(
        ReferenceEngineConfig(**engine_config(model={"path": folder}, use_packing=True))
    )
    engine.init_model()
    return engine


def _gap(engine: Any, out: TensorDict, params: SamplingParams) -> float:
    """The largest difference between the trainer's log-probs of the samples (their prompts'
    images carried into the training batch) and SGLang's."""
    from engine_core.batch import LOG_PROBS
    from engine_core_roles.batch.build import training_batch

    batch = training_batch(out, params)
    with torch.no_grad():
        got = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
    trained = batch["loss_mask"].bool()
    return float((got - batch[ROLLOUT_LOG_PROBS])[trained].abs().max())


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _saved(SGLANG_QWEN2_5_VL, tmp_path_factory.mktemp("sglang-qwen2_5_vl"))


@pytest.fixture(scope="module")
def vl_rollout(vl_folder: str) -> Iterator[Any]:
    rollout = _rollout(vl_folder)
    yield rollout
    rollout.shutdown()


@pytest.fixture(scope="module")
def trainer(vl_folder: str) -> Any:
    return _trainer(vl_folder)


@live
def test_samples_from_images_score_the_same_in_the_trainer(vl_rollout: Any, trainer: Any) -> None:
    """Seeded samples of prompts with images: each sample carries its prompt's images, the
    trainer's log-probs of the samples on them equal SGLang's, and another image changes its
    own prompt's samples only."""
    prompts = _prompts(SGLANG_QWEN2_5_VL, GRIDS)
    out = vl_rollout.generate(prompts, PARAMS)
    assert torch.equal(out[IMAGE_GRID_THW], prompts[IMAGE_GRID_THW].repeat_interleave(2, 0))
    assert torch.equal(out[PIXEL_VALUES], prompts[PIXEL_VALUES].repeat_interleave(2, 0))
    gap = _gap(trainer, out, PARAMS)
    print(f"sglang cpu Qwen2.5-VL fp32 rollout-vs-trainer log-prob gap: {gap:.3g}")
    assert gap <= 1e-5

    other = prompts.clone()
    fresh = torch.Generator().manual_seed(1)  # not the global RNG: seeded 0 as the pixels were
    other[PIXEL_VALUES][0] = torch.randn(other[PIXEL_VALUES][0].shape, generator=fresh)
    again = vl_rollout.generate(other, PARAMS)
    lp, lp2 = out[ROLLOUT_LOG_PROBS], again[ROLLOUT_LOG_PROBS]
    assert not torch.allclose(lp[:2], lp2[:2])  # prompt 0's samples saw another image
    assert torch.allclose(lp[2:], lp2[2:], atol=1e-5)  # the others' did not change


@live
def test_a_sync_that_changes_only_the_vision_tower_is_followed(
    vl_rollout: Any, vl_folder: str, trainer: Any
) -> None:
    """The trainer's full parameters, the vision tower's included, reach SGLang verified
    (names, shapes, checksums); after an update of the tower alone, SGLang's samples on images
    it has already encoded follow the new tower."""
    engine = _trainer(vl_folder)
    names = {n for n, _ in engine.named_full_params()}
    tower = {n for n in names if ".visual." in f".{n}"}
    assert tower and names == set(vl_rollout.expected_weights())
    prompts = _prompts(SGLANG_QWEN2_5_VL, GRIDS[:3])
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
        print(f"sglang cpu tower-only sync: gap before {stale:.3g}, after {synced:.3g}")
        assert stale > 1e-3 and synced <= 1e-5
    finally:  # the other tests' rollout keeps the folder's weights
        vl_rollout.load_weights(sent_buckets(trainer.named_full_params()))


@live
def test_a_sampled_vision_token_ends_its_sample_and_the_trainer_agrees(
    vl_rollout: Any, vl_folder: str, trainer: Any
) -> None:
    """With the image token as likely as token 7 (its output row copied, synced into SGLang),
    no response holds a vision token: each sample that drew one ends before it, unfinished,
    and the trainer's log-probs of what is left equal SGLang's."""
    engine = _trainer(vl_folder)
    head = engine.module.get_output_embeddings().weight
    with torch.no_grad():
        head[VL_IMAGE_TOKEN] = head[7]
    vl_rollout.load_weights(sent_buckets(engine.named_full_params()))
    try:
        params = SamplingParams(n=8, max_new_tokens=6, temperature=1.0, seed=1, stop_token_ids=[2])
        out = vl_rollout.generate(_prompts(SGLANG_QWEN2_5_VL, [[(1, 4, 4)], [(1, 2, 6)]]), params)
        kept = out[RESPONSE_MASK].bool()
        assert not (out[RESPONSE_IDS][kept] >= VL_IMAGE_TOKEN).any()  # the vision ids, 124-127
        stopped = ((out[RESPONSE_IDS] == 2) & kept).any(-1)
        cut = ~stopped & (kept.sum(-1) < 6)  # ended with no stop before the budget: a cut
        assert cut.any() and out[TRUNCATED][cut].all()
        assert _gap(engine, out, params) <= 1e-5
    finally:  # the other tests' rollout keeps the folder's weights
        vl_rollout.load_weights(sent_buckets(trainer.named_full_params()))


@live
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_the_other_families_score_the_same_in_the_trainer(family: str, tmp_path: Path) -> None:
    """Qwen2-VL (a tower without windows) and Qwen3-VL (its tower's deepstack features fed to
    the first decoder layers) on SGLang's CPU engine: the trainer's log-probs of their samples
    equal SGLang's."""
    raw = {"qwen2_vl": SGLANG_QWEN2_VL, "qwen3_vl": TINY_QWEN3_VL}[family]
    folder = _saved(raw, tmp_path)
    rollout = _rollout(folder)
    try:
        out = rollout.generate(_prompts(raw, GRIDS), PARAMS)
        gap = _gap(_trainer(folder), out, PARAMS)
        print(f"sglang cpu {family} fp32 rollout-vs-trainer log-prob gap: {gap:.3g}")
        assert gap <= 1e-5
    finally:
        rollout.shutdown()
