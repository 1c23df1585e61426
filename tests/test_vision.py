"""Vision-language models in an engine: images as batch fields, 3-D positions, parity with
transformers per sample (padded and packed), and the refusals before anything runs."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from tensordict import TensorDict

from engine_core.batch import ATTENTION_MASK, LOG_PROBS
from engine_core.capabilities import Capability
from engine_core.errors import BatchError, CapabilityError, ConfigError
from engine_core.model_inputs import InputPart, ModelInputs
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from engine_core.testing.models import engine_config, nll_loss
from engine_core.testing.vision import (
    TINY_QWEN2_5_VL,
    TINY_QWEN3_VL,
    VL_IMAGE_TOKEN,
    image_batch,
    image_prompts,
    plain_vl_log_probs,
)
from engine_core.vision import IMAGE_GRID_THW, PIXEL_VALUES, ROPE_POSITIONS, VisionInputs
from tests.fixtures.vl_chat import png

FAMILIES = {"qwen2_5_vl": TINY_QWEN2_5_VL, "qwen3_vl": TINY_QWEN3_VL}
# three image sizes (one of two frames), a row with two images and a text-only row
GRIDS = [[(1, 4, 4)], [], [(1, 2, 6), (1, 4, 2)], [(2, 4, 4)]]


def _engine(family: str, cls: type[ReferenceEngine] = ReferenceEngine, **extra: Any) -> Any:
    engine = cls(
        ReferenceEngineConfig(**engine_config(model={"config": dict(FAMILIES[family])}, **extra))
    )
    engine.init_model()
    return engine


def _gap(engine: Any, batch: TensorDict) -> float:
    with torch.no_grad():
        got = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
    want = plain_vl_log_probs(engine.module, batch)
    real = batch[ATTENTION_MASK].bool()
    return float((got - want)[real].abs().max())


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(
    "layout",
    [
        {"use_packing": False},
        {"use_packing": True},
        {"use_packing": True, "max_tokens_per_micro_batch": 60},  # reordered, 3 calls
    ],
    ids=["padded", "packed", "packed-token-budget"],
)
def test_log_probs_with_images_equal_transformers_per_sample(family: str, layout: dict) -> None:
    engine = _engine(family, **layout)
    batch = image_batch(GRIDS, seq_len=48)
    keys = set(batch.keys())
    assert _gap(engine, batch) < 1e-5
    assert set(batch.keys()) == keys  # the positions were computed on a copy


def test_the_3d_positions_are_the_models_own_and_travel_with_the_batch() -> None:
    engine = _engine("qwen2_5_vl", use_packing=True)
    batch = image_batch(GRIDS, seq_len=48)
    from engine_core.vision import rope_positions

    batch[ROPE_POSITIONS] = rope_positions(engine.module, batch)
    image_row = batch[ROPE_POSITIONS][0][batch["input_ids"][0] == VL_IMAGE_TOKEN]
    assert len({tuple(r) for r in image_row.tolist()}) == image_row.shape[0] > 1  # 2-D grid
    assert _gap(engine, batch) < 1e-5
    shuffled = batch[torch.tensor([3, 1, 0, 2])]  # the fields follow their rows
    assert _gap(engine, shuffled) < 1e-5
    wrong = batch.clone()
    wrong[ROPE_POSITIONS] = wrong[ROPE_POSITIONS].flip(0)  # another sample's positions
    assert _gap(engine, wrong) > 1e-3


class _ImagesDropped(VisionInputs):
    """The bug class to guard against: the images looked for where they are not, so the model
    is called without them (and without their grids)."""

    @classmethod
    def build(cls, micro_batch: TensorDict, inputs: ModelInputs) -> VisionInputs | None:
        part = super().build(micro_batch.exclude(PIXEL_VALUES, IMAGE_GRID_THW), inputs)
        return part


class _DropsImages(ReferenceEngine):
    def input_parts(self) -> tuple[type[InputPart], ...]:
        return tuple(_ImagesDropped if p is VisionInputs else p for p in super().input_parts())


def test_an_engine_that_drops_the_images_fails_the_parity_check() -> None:
    batch = image_batch(GRIDS, seq_len=48)
    assert _gap(_engine("qwen2_5_vl", _DropsImages, use_packing=True), batch) > 1e-3


def test_a_training_step_reaches_the_vision_tower() -> None:
    engine = _engine("qwen2_5_vl", use_packing=True)
    engine.set_loss_fn(nll_loss)
    with engine.train_mode():
        engine.forward_backward_step(image_batch(GRIDS, seq_len=48))
    tower = [p.grad for n, p in engine.module.named_parameters() if ".visual." in f".{n}"]
    assert tower and all(g is not None for g in tower)
    assert sum(float(g.abs().sum()) for g in tower) > 0


class _NoVision(ReferenceEngine):
    capabilities: ClassVar[frozenset[Capability]] = ReferenceEngine.capabilities - {
        Capability.VISION
    }


def _refused(engine: Any, batch: TensorDict, error: type[Exception], *words: str) -> None:
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with pytest.raises(error) as info:
        engine.forward_backward_step(batch, forward_only=True)
    for word in words:
        assert word in str(info.value)
    after = engine.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_an_engine_without_the_vision_capability_refuses_images() -> None:
    _refused(
        _engine("qwen2_5_vl", _NoVision),
        image_batch(GRIDS, seq_len=48),
        CapabilityError,
        "_NoVision does not feed",
        "vision capability",
    )


def _broken(change: str) -> TensorDict:
    batch = image_batch(GRIDS, seq_len=48)
    if change == "one image token too many":
        batch["input_ids"][0, 1] = VL_IMAGE_TOKEN
    elif change == "grids without pixels":
        del batch[PIXEL_VALUES]
    elif change == "another processor's patches":
        batch[PIXEL_VALUES] = batch[PIXEL_VALUES][..., :40]
    elif change == "grids beyond the patches":
        batch[IMAGE_GRID_THW][3, 0, 0] = 9
    elif change == "positions of another shape":
        batch[ROPE_POSITIONS] = torch.zeros(4, 48, dtype=torch.long)
    return batch


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("one image token too many", ("sample 0 holds", "image tokens", "do not truncate")),
        ("grids without pixels", ("without pixel_values",)),
        ("another processor's patches", ("width 40", "takes 96")),
        ("grids beyond the patches", ("samples [3]", "more than")),
        ("positions of another shape", ("rope_positions has shape (4, 48)",)),
    ],
)
def test_a_batch_whose_images_do_not_match_is_refused_before_anything_runs(
    change: str, words: tuple[str, ...]
) -> None:
    _refused(_engine("qwen2_5_vl"), _broken(change), BatchError, *words)


def test_a_text_model_refuses_images() -> None:
    engine = ReferenceEngine(ReferenceEngineConfig(**engine_config()))
    engine.init_model()
    batch = image_batch([[(1, 2, 2)], []], seq_len=16)
    batch["input_ids"] = batch["input_ids"].clamp_max(30)
    _refused(engine, batch, BatchError, "has no vision tower")


def test_the_model_class_comes_from_the_config() -> None:
    from transformers import AutoConfig

    from engine_core.config import ModelConfig
    from engine_core.models import model_class

    raw = dict(TINY_QWEN2_5_VL)
    hf = AutoConfig.for_model(raw.pop("model_type"), **raw)
    assert model_class(ModelConfig(config=dict(TINY_QWEN2_5_VL)), hf).__name__ == (
        "AutoModelForImageTextToText"
    )
    with pytest.raises(ConfigError, match="value head on a vision-language model"):
        model_class(ModelConfig(config=dict(TINY_QWEN2_5_VL), value_head=True), hf)


def test_megatron_refuses_a_vision_language_model_before_any_process_starts(tmp_path) -> None:
    pytest.importorskip("engine_core_megatron")
    from engine_core_megatron.config import MegatronEngineConfig
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="a vision-language model of model_type 'qwen2_5_vl'"):
        MegatronEngineConfig(backend="megatron", model={"config": dict(TINY_QWEN2_5_VL)})
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_vl", "vision_config": {}}')
    with pytest.raises(ValidationError, match="maps the families llama, qwen2"):
        MegatronEngineConfig(backend="megatron", model={"path": str(tmp_path)})


def test_balancing_and_the_token_budget_count_pixel_patches() -> None:
    from engine_core.balance import balance_batch
    from engine_core.batch import sample_workloads, sequence_lengths
    from engine_core.microbatch import prepare_micro_batches

    batch = image_batch([[(2, 4, 4)], [], [(1, 2, 2)], []], seq_len=48)
    work = sample_workloads(batch)
    assert (work - sequence_lengths(batch)).tolist() == [32, 0, 4, 0]
    reordered, perm = balance_batch(batch, 2)
    assert 0 in perm[:2] and 2 in perm[2:] or 0 in perm[2:] and 2 in perm[:2]
    assert torch.equal(reordered[PIXEL_VALUES], batch[PIXEL_VALUES][torch.from_numpy(perm)])
    heaviest = int(work.max())
    micro, _ = prepare_micro_batches(batch, max_tokens_per_micro_batch=heaviest)
    assert sum(int(sample_workloads(m).sum()) for m in micro) == int(work.sum())
    assert all(int(sample_workloads(m).sum()) <= heaviest for m in micro)
    with pytest.raises(BatchError):
        prepare_micro_batches(batch, max_tokens_per_micro_batch=heaviest - 1)


def test_qwen3_vl_moe_replays_the_given_routes_with_images(tmp_path) -> None:
    from engine_core.batch import ROUTED_EXPERTS
    from engine_core.config import ModelConfig
    from engine_core.models import build_model
    from engine_core.testing.vision import TINY_QWEN3_VL_MOE, vl_own_routes

    torch.manual_seed(0)
    model: Any = build_model(ModelConfig(config=dict(TINY_QWEN3_VL_MOE))).eval()
    model.save_pretrained(str(tmp_path))
    batch = image_batch(GRIDS, seq_len=48)
    routes = vl_own_routes(model, batch)
    routes[:, ::3] = (routes[:, ::3] + 1) % 4  # not the routers' own choice
    want = plain_vl_log_probs(model, batch, routes=routes)
    own = plain_vl_log_probs(model, batch)
    engine = ReferenceEngine(
        ReferenceEngineConfig(**engine_config(model={"path": str(tmp_path)}, use_packing=True))
    )
    engine.init_model()
    batch[ROUTED_EXPERTS] = routes
    with torch.no_grad():
        got = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
    real = batch[ATTENTION_MASK].bool()
    assert float((got - want)[real].abs().max()) < 1e-5
    assert float((got - own)[real].abs().max()) > 1e-3


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine_core.config import ModelConfig
    from engine_core.models import build_model

    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        build_model(ModelConfig(config=dict(TINY_QWEN2_5_VL))).save_pretrained(str(folder))
    return str(folder)


def _hf_rollout(folder: str) -> Any:
    from engine_core_hf.rollout import HFRollout, HFRolloutConfig

    return HFRollout(HFRolloutConfig(backend="hf", model={"path": folder}, generation_batch_size=2))


def test_the_hf_rollout_samples_from_the_images_and_the_trainer_agrees(vl_folder: str) -> None:
    """Seeded samples of prompts with images (three sizes, two in one prompt, one prompt
    without), in two generate calls: the trainer's log-probs of the samples, with the images
    carried into the training batch, equal the rollout's; another image changes its own
    prompt's samples and no other's."""
    from engine_core.rollout import ROLLOUT_LOG_PROBS, SamplingParams
    from engine_core_roles.batch.build import training_batch

    rollout = _hf_rollout(vl_folder)
    prompts = image_prompts([[(1, 4, 4)], [], [(1, 2, 6), (1, 4, 2)], [(2, 4, 4)]])
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=3)
    out = rollout.generate(prompts, params)
    assert torch.equal(out[IMAGE_GRID_THW], prompts[IMAGE_GRID_THW].repeat_interleave(2, 0))
    batch = training_batch(out, params)
    engine = ReferenceEngine(
        ReferenceEngineConfig(**engine_config(model={"path": vl_folder}, use_packing=True))
    )
    engine.init_model()
    with torch.no_grad():
        got = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
    trained = batch["loss_mask"].bool()
    assert float((got - batch[ROLLOUT_LOG_PROBS])[trained].abs().max()) < 1e-5

    other = prompts.clone()
    other[PIXEL_VALUES][0] = torch.randn_like(other[PIXEL_VALUES][0])
    again = rollout.generate(other, params)
    lp, lp2 = out[ROLLOUT_LOG_PROBS], again[ROLLOUT_LOG_PROBS]
    assert not torch.allclose(lp[:2], lp2[:2])  # prompt 0's samples saw another image
    assert torch.equal(lp[2:], lp2[2:])  # the other prompts' samples did not change


def test_prompts_with_images_are_refused_where_they_cannot_be_used(vl_folder: str) -> None:
    from engine_core_example.rollout import ExampleRollout
    from engine_core_hf.rollout import HFRollout, HFRolloutConfig

    from engine_core.config import ModelConfig
    from engine_core.rollout import RolloutConfig, SamplingParams

    prompts = image_prompts([[(1, 2, 2)], []])
    params = SamplingParams(max_new_tokens=2)
    example = ExampleRollout(RolloutConfig(backend="example", model={"path": vl_folder}))
    with pytest.raises(CapabilityError, match="does not declare vision"):
        example.generate(prompts, params)
    rollout = _hf_rollout(vl_folder)
    broken = prompts.clone()
    broken["prompt_ids"][1, -1] = VL_IMAGE_TOKEN  # an image token without its image
    with pytest.raises(BatchError, match="sample 1 holds 1 image tokens"):
        rollout.generate(broken, params)
    text = HFRollout(
        HFRolloutConfig(
            backend="hf", model=ModelConfig(config=dict(engine_config()["model"]["config"]))
        )
    )
    safe = prompts.clone()
    safe["prompt_ids"] = safe["prompt_ids"].clamp_max(30)
    with pytest.raises(BatchError, match="has no vision tower"):
        text.generate(safe, params)


def test_a_sync_that_changes_only_the_vision_tower_changes_the_samples(vl_folder: str) -> None:
    """The engine's full parameters, the vision tower's included, reach the hf rollout
    (names, shapes and checksums verified); after an update of the tower alone the rollout's
    log-probs on the same images follow the new weights, as the trainer computes them."""
    from engine_core.rollout import ROLLOUT_LOG_PROBS, SamplingParams, sent_buckets
    from engine_core_roles.batch.build import training_batch

    engine = ReferenceEngine(
        ReferenceEngineConfig(**engine_config(model={"path": vl_folder}, use_packing=True))
    )
    engine.init_model()
    rollout = _hf_rollout(vl_folder)
    names = {n for n, _ in engine.named_full_params()}
    assert any(".visual." in f".{n}" for n in names) and names == set(rollout.expected_weights())
    prompts = image_prompts([[(1, 4, 4)], [(1, 2, 6), (1, 4, 2)]])
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0, seed=5)
    before = rollout.generate(prompts, params)
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if ".visual." in f".{name}":
                p.add_(0.05 * torch.randn_like(p))
    rollout.load_weights(sent_buckets(engine.named_full_params()))
    after = rollout.generate(prompts, params)
    assert not torch.allclose(before[ROLLOUT_LOG_PROBS], after[ROLLOUT_LOG_PROBS])
    batch = training_batch(after, params)
    with torch.no_grad():
        got = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
    trained = batch["loss_mask"].bool()
    assert float((got - batch[ROLLOUT_LOG_PROBS])[trained].abs().max()) < 1e-5


def test_chat_prompts_with_images_render_through_the_folders_template_and_processor(
    vl_chat_folder: tuple[str, Any], tmp_path: Any
) -> None:
    """Two images, one a file beside the data and one as bytes: one image token per merged
    patch of each image's grid, and the engine's log-probs of the rendered prompt with its
    images equal transformers' with the same inputs."""
    from engine_core_roles.data.datasets.images import ImagePromptRenderer

    folder, tok = vl_chat_folder
    png(tmp_path / "red.png", (24, 16), (200, 30, 30))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "red.png"},
                {"type": "text", "text": "123"},
                {"type": "image", "image": {"bytes": png(None, (40, 40), (0, 0, 255))}},
            ],
        }
    ]
    renderer = ImagePromptRenderer(folder, tok)
    out = renderer.render(messages, base=tmp_path, where="train.jsonl, row 0")
    assert out.grids is not None and out.pixel_values is not None
    assert out.grids.tolist() == [[1, 4, 6], [1, 8, 8]]
    assert out.ids.count(renderer.image_token_id) == (24 + 64) // 4
    from engine_core.batch import make_batch
    from engine_core.vision import vision_fields

    ids = torch.tensor([out.ids])
    batch = make_batch(ids, torch.ones_like(ids))
    for key, value in vision_fields([out.pixel_values], [out.grids]).items():
        batch[key] = value
    engine = ReferenceEngine(
        ReferenceEngineConfig(**engine_config(model={"path": folder}, use_packing=True))
    )
    engine.init_model()
    with torch.no_grad():
        got = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
        logits = engine.module(
            input_ids=ids,
            pixel_values=out.pixel_values,
            image_grid_thw=out.grids,
            mm_token_type_ids=(ids == renderer.image_token_id).int(),
        ).logits
    want = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert float((got[0, 1:] - want).abs().max()) < 1e-5


def test_a_bad_image_row_is_refused_with_its_file_and_row(
    vl_chat_folder: tuple[str, Any], tmp_path: Any
) -> None:
    from engine_core_roles.data.datasets.images import ImagePromptRenderer

    folder, tok = vl_chat_folder
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    png(tmp_path / "big.png", (80, 80), (1, 2, 3))
    renderer = ImagePromptRenderer(folder, tok, max_image_pixels=4096)

    def refused(part: Any, *words: str, max_length: int | None = None, extra: int = 0) -> None:
        content = [{"type": "image", "image": part}] + [{"type": "text", "text": "7"}] * extra
        with pytest.raises(ConfigError) as info:
            renderer.render(
                [{"role": "user", "content": content}],
                base=tmp_path,
                where="data/train.jsonl, row 5",
                max_length=max_length,
            )
        assert "data/train.jsonl, row 5" in str(info.value)
        for word in words:
            assert word in str(info.value)

    refused("missing.png", "missing.png", "does not exist")
    refused("broken.png", "cannot be read")
    refused("big.png", "80 x 80 = 6400 pixels", "max_image_pixels=4096")
    refused(png(None, (16, 16), (9, 9, 9)), "cut through its image tokens", max_length=8)
    text_only = ImagePromptRenderer(folder, tok)
    text_only.tokenizer = type(tok).from_pretrained(folder)
    text_only.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ConfigError, match="renders 0 image placeholder"):
        text_only.render(
            [{"role": "user", "content": [{"type": "image", "image": "big.png"}]}],
            base=tmp_path,
            where="row 1",
        )


def _image_job(
    folder: str, root: Any, out: Any, rows: list[dict[str, Any]], *extra: str
) -> dict[str, Any]:
    import json

    from engine_core.configio import apply_overrides, load_yaml
    from engine_core_roles.jobs.cli import RECIPES

    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(
        "def says(prompt, response, answer, **row):\n    return float(answer in response)\n"
    )
    raw = load_yaml(RECIPES / "grpo_tiny.yaml")
    raw.pop("task")
    raw["engine"]["model"] = {"path": folder}
    raw["data"] = {"train_files": [str(root / "train.jsonl")]}
    raw["reward"] = {"fn": f"{root / 'rewards.py'}:says"}
    raw["trainer"].update({"max_new_tokens": 3, "samples_per_prompt": 2})
    base = [f"output_dir={out}", "steps=2", "prompts_per_step=2", "log_every=1", "save_every=2"]
    return apply_overrides(raw, [*base, "engine.backend=reference", *extra])


def _image_rows(root: Any) -> list[dict[str, Any]]:
    colours = {"1": (255, 0, 0), "2": (0, 255, 0), "3": (0, 0, 255)}
    (root / "images").mkdir(exist_ok=True)
    for name, colour in colours.items():
        png(root / "images" / f"{name}.png", (16 + 8 * int(name), 16), colour)
    return [
        {
            "prompt": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": f"images/{name}.png"},
                        {"type": "text", "text": "which?"},
                    ],
                }
            ],
            "answer": name,
        }
        for name in colours
    ]


def test_an_rl_job_trains_on_prompts_with_images(
    vl_chat_folder: tuple[str, Any], tmp_path: Any
) -> None:
    """`engine-core run`'s job on chat rows with images (files beside the data): the hf rollout
    samples from them and the trainer's log-probs of the samples, with the images, equal the
    rollout's at every step; the warm-up before it trains on demonstrations with images."""
    import json

    from engine_core.plugins import load_plugins
    from engine_core_roles.data.datasets.images import ImagePromptRenderer
    from engine_core_roles.episodes.demos import demo_batch
    from engine_core_roles.jobs.rl.run import run_rl_job

    folder, tok = vl_chat_folder
    rows = _image_rows(tmp_path)
    # warm-up demonstrations with images, in a folder of their own (paths relative to it)
    demos = tmp_path / "demos"
    demos.mkdir()
    png(demos / "d.png", (16, 24), (9, 200, 9))
    shown = [{"type": "image", "image": "d.png"}, {"type": "text", "text": "which?"}]
    demo = [{"role": "user", "content": shown}, {"role": "assistant", "content": "2"}]
    (demos / "demos.jsonl").write_text(json.dumps({"messages": demo}) + "\n")
    warm = demo_batch(tok, None, [demo], images=ImagePromptRenderer(folder, tok), bases=[demos])
    assert warm[IMAGE_GRID_THW].tolist() == [[[1, 6, 4]]]
    extra = [f"data.demos=[{demos / 'demos.jsonl'}]", "warmup_sft_steps=2", "warmup_batch_size=2"]
    raw = _image_job(folder, tmp_path, tmp_path / "run", rows, *extra)
    run_rl_job(raw, load_plugins())
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all(r["rollout/logprob_diff_max"] < 1e-5 for r in rows)


def test_image_rows_train_asynchronously_and_resume_where_they_stopped(
    vl_chat_folder: tuple[str, Any], tmp_path: Any
) -> None:
    """With the rollout in a process of its own and ``max_staleness=1``, the prompts' images
    cross to it and back as tensors while the trainer trains on the step before; a run stopped
    after step 2 and resumed gives the same metrics as one that ran through (the rows' order
    and the state in the checkpoint)."""
    import json

    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.rl.run import run_rl_job
    from engine_core_roles.trainer.metrics import TIMING_KEYS

    def rows(out: Any) -> list[dict[str, Any]]:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS} for x in lines]

    folder, _ = vl_chat_folder
    data = _image_rows(tmp_path)
    extra = ("rollout_placement=process", "trainer.max_staleness=1", "trainer.filter_groups=false")
    whole, part = tmp_path / "whole", tmp_path / "part"
    run_rl_job(_image_job(folder, tmp_path, whole, data, *extra, "steps=3"), load_plugins())
    run_rl_job(_image_job(folder, tmp_path, part, data, *extra), load_plugins())
    run_rl_job(
        _image_job(folder, tmp_path, part, data, *extra, "steps=3"), load_plugins(), resume=True
    )
    assert rows(part) == rows(whole)
    assert [r["rollout/staleness"] for r in rows(whole)] == [0.0, 1.0, 1.0]
    # the export loads as the user's folder did: the model, its tokenizer, its image processor
    from transformers import AutoImageProcessor

    assert AutoImageProcessor.from_pretrained(str(whole / "hf_export")).merge_size == 2


def test_a_job_with_a_bad_image_row_is_refused_before_anything_is_written(
    vl_chat_folder: tuple[str, Any], tmp_path: Any
) -> None:
    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.rl.run import run_rl_job

    folder, _ = vl_chat_folder
    rows = _image_rows(tmp_path)
    rows[2]["prompt"][0]["content"][0]["image"] = "images/gone.png"
    raw = _image_job(folder, tmp_path, tmp_path / "run", rows)
    with pytest.raises(ConfigError) as info:
        run_rl_job(raw, load_plugins())
    assert "train.jsonl, row 2" in str(info.value) and "gone.png" in str(info.value)
    out = tmp_path / "run"
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
