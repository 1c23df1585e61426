"""The shipped vision recipe (``vlm_tiny.yaml``): its data are the generator's, its reward, a short
run with images end to end, and the rollout's guard the run relies on (a sampled vision token
ends its sample)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine_core_roles.data.tasks.tiny_vision import (
    COLOURS,
    QUESTIONS,
    SIZES,
    answer_reward,
    write_files,
)
from engine_core_roles.jobs.cli import RECIPES, load_recipe

SHIPPED = RECIPES / "tiny_vision"


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_shipped_files_are_what_the_generator_writes(tmp_path: Path) -> None:
    from PIL import Image

    write_files(tmp_path)
    for name in ("train.jsonl", "val.jsonl", "demos.jsonl"):
        assert (tmp_path / name).read_text() == (SHIPPED / name).read_text(), name
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        ours, shipped = tmp_path / "processor" / name, SHIPPED / "processor" / name
        assert ours.read_text() == shipped.read_text(), name
    ours, shipped = (
        json.loads((f / "processor" / "preprocessor_config.json").read_text())
        for f in (tmp_path, SHIPPED)
    )
    assert ours == shipped
    names = sorted(p.name for p in (tmp_path / "images").iterdir())
    assert names == sorted(p.name for p in (SHIPPED / "images").iterdir())
    for name in names:  # the pixels, not the bytes: another zlib compresses differently
        with (
            Image.open(tmp_path / "images" / name) as a,
            Image.open(SHIPPED / "images" / name) as b,
        ):
            assert a.size == b.size and a.tobytes() == b.tobytes(), name


def test_only_the_image_tells_the_answer() -> None:
    """Every question of the training data is asked with every answer of its kind, about as
    often (the text alone scores chance), the held-out images are not trained on, and the
    warm-up's demonstrations have no image and favour no answer."""
    train, val = _rows(SHIPPED / "train.jsonl"), _rows(SHIPPED / "val.jsonl")
    for kind, words in (("colour", COLOURS), ("size", SIZES)):
        asked = [
            r["answer"] for r in train if r["prompt"][0]["content"][1]["text"] == QUESTIONS[kind]
        ]
        counts = [asked.count(w) for w in words]
        assert min(counts) > 0.8 * len(asked) / len(words), (kind, counts)

    def images(rows: list[dict[str, Any]]) -> set[str]:
        return {r["prompt"][0]["content"][0]["image"] for r in rows}

    assert not images(train) & images(val)
    demos = [r["messages"] for r in _rows(SHIPPED / "demos.jsonl")]
    assert all(isinstance(m[0]["content"], str) for m in demos)
    answers = [m[1]["content"] for m in demos]
    assert len({answers.count(w) for w in COLOURS}) == 1
    assert len({answers.count(w) for w in SIZES}) == 1


def test_the_reward_is_an_exact_answer_word() -> None:
    assert answer_reward("", "red", answer="red") == 1.0
    assert answer_reward("", " red\n", answer="red") == 1.0
    assert answer_reward("", "blue", answer="red") == 0.0
    assert answer_reward("", "redred", answer="red") == 0.0
    assert answer_reward("", "", answer="small") == 0.0


def test_the_recipe_trains_two_steps_on_its_images(tmp_path: Path) -> None:
    """Two RL steps of the shipped recipe after two warm-up steps, with an evaluation: the
    prompts carry their images into the rollout and the trainer (the trainer's log-probs of
    the samples equal the rollout's), and the rewards are scored."""
    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.rl.run import run_rl_job

    raw = load_recipe(
        RECIPES / "vlm_tiny.yaml",
        [
            f"output_dir={tmp_path / 'run'}",
            "steps=2",
            "prompts_per_step=4",
            "trainer.samples_per_prompt=4",
            "warmup_sft_steps=2",
            "log_every=1",
            "save_every=2",
            "eval.every=2",
            "eval.max_prompts=8",
        ],
    )
    run_rl_job(raw, load_plugins())
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/logprob_diff_max"] < 1e-5 for r in rows)
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows)
    assert "val/pass@1" in rows[-1]
    samples = _rows(tmp_path / "run" / "samples.jsonl")
    assert samples and all("<|image_pad|>" in s["prompt"] for s in samples)


def test_a_sampled_vision_token_ends_its_sample_and_the_trainer_agrees(tmp_path: Path) -> None:
    """A model that samples its image token as often as another token: no response holds a
    vision token (each sample that drew one ends before it, unfinished), and the trainer's
    log-probs of what is left equal the rollout's (with the token left in, the trainer refuses
    the batch: more image tokens than images)."""
    from engine_core_hf.rollout import HFRollout, HFRolloutConfig

    from engine_core.batch import LOG_PROBS
    from engine_core.config import ModelConfig
    from engine_core.models import build_model
    from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
    from engine_core.rollout import (
        RESPONSE_IDS,
        RESPONSE_MASK,
        ROLLOUT_LOG_PROBS,
        TRUNCATED,
        SamplingParams,
    )
    from engine_core.testing.models import engine_config
    from engine_core.testing.vision import TINY_QWEN2_5_VL, VL_IMAGE_TOKEN, image_prompts
    from engine_core_roles.batch.build import training_batch

    torch.manual_seed(0)
    model: Any = build_model(ModelConfig(config=dict(TINY_QWEN2_5_VL)))
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head[VL_IMAGE_TOKEN] = head[7]  # as likely as token 7 everywhere
    model.save_pretrained(str(tmp_path))
    rollout = HFRollout(HFRolloutConfig(backend="hf", model={"path": str(tmp_path)}))
    params = SamplingParams(n=8, max_new_tokens=6, temperature=1.0, seed=1, stop_token_ids=[2])
    out = rollout.generate(image_prompts([[(1, 4, 4)], [(1, 2, 6)]]), params)
    kept = out[RESPONSE_MASK].bool()
    assert not (out[RESPONSE_IDS][kept] == VL_IMAGE_TOKEN).any()
    stopped = ((out[RESPONSE_IDS] == 2) & kept).any(-1)
    cut = ~stopped & (kept.sum(-1) < 6)  # ended with no stop before the budget: a cut
    assert cut.any() and out[TRUNCATED][cut].all()
    batch = training_batch(out, params)
    engine = ReferenceEngine(
        ReferenceEngineConfig(**engine_config(model={"path": str(tmp_path)}, use_packing=True))
    )
    engine.init_model()
    with torch.no_grad():
        got = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
    trained = batch["loss_mask"].bool()
    assert float((got - batch[ROLLOUT_LOG_PROBS])[trained].abs().max()) < 1e-5


def test_the_recipes_token_ids_are_its_tokenizers() -> None:
    from transformers import AutoTokenizer

    config = load_recipe(RECIPES / "vlm_tiny.yaml")["engine"]["model"]
    tok = AutoTokenizer.from_pretrained(config["tokenizer"])
    raw = config["config"]
    for key, token in (
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
    ):
        assert raw[key] == tok.convert_tokens_to_ids(token), key
    assert raw["text_config"]["eos_token_id"] == tok.eos_token_id
    assert raw["text_config"]["vocab_size"] >= len(tok)
    text = raw["text_config"]
    assert text["hidden_size"] // text["num_attention_heads"] == 32  # vLLM's CPU attention
