"""`engine-core train` on multimodal chats: conversations whose messages hold images, for a
tiny Qwen2.5-VL saved with its tokenizer, chat template and image processor. The rendered ids and
loss mask (the assistant's tokens only, never an image token), the engine's per-token loss
against transformers' forward, learning that reads the images, a real run of the job, and bad
rows refused with their file and row before anything is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.batch import LOG_PROBS
from engine_core.config import ModelConfig
from engine_core.errors import ConfigError
from engine_core.plugins import load_plugins
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from engine_core.testing.models import engine_config
from engine_core.testing.vision import plain_vl_log_probs
from engine_core.vision import IMAGE_GRID_THW, PIXEL_VALUES
from engine_core_roles.algorithms.supervised import supervised_loss, supervised_step
from engine_core_roles.data.datasets.chats import ChatDataConfig
from engine_core_roles.jobs.cli import RECIPES, load_recipe, main
from engine_core_roles.jobs.sft import Chats, chat_datasets, run_sft
from tests.fixtures.vl_chat import png

END = "<|im_end|>"
# each image's patch grid under the folder's processor (patch 4, merge 2): 24 x 16 pixels is
# 6 x 4 patches, 16 x 16 is 4 x 4; a merged 2 x 2 block of patches is one image token
GRIDS = {"red": [1, 4, 6], "blue": [1, 4, 4]}
SIZES = {"red": (24, 16), "blue": (16, 16)}
COLOURS = {"red": (255, 0, 0), "blue": (0, 0, 255)}


def _image(name: str) -> dict[str, str]:
    return {"type": "image", "image": f"images/{name}.png"}


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


# an image in the first user turn and one in a later turn, an answer as a list of text parts,
# and a text-only chat beside them
PICTURED = [
    {"role": "user", "content": [_image("red"), _text("1+2")]},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": [_text("and"), _image("blue")]},
    {"role": "assistant", "content": [_text("blue")]},
]
TEXT_ONLY = [
    {"role": "system", "content": "add."},
    {"role": "user", "content": "2+2"},
    {"role": "assistant", "content": "4"},
]


def _which(colour: str, answer: str) -> list[dict[str, Any]]:
    """The same question about an image of ``colour``: only the image tells the answer."""
    return [
        {"role": "user", "content": [_image(colour), _text("which?")]},
        {"role": "assistant", "content": answer},
    ]


def _write(root: Path, name: str, chats: list[list[dict[str, Any]]]) -> Path:
    path = root / name
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of chat files with their images beside them (``images/red.png``, ...)."""
    root = tmp_path_factory.mktemp("sft_vision")
    (root / "images").mkdir()
    for name, size in SIZES.items():
        png(root / "images" / f"{name}.png", size, COLOURS[name])
    _write(root, "mixed.jsonl", [PICTURED, TEXT_ONLY])
    _write(root, "which.jsonl", [_which("red", "1"), _which("blue", "2")])
    return root


def _chats(folder: str, files: Path, **extra: Any) -> Chats:
    data = ChatDataConfig(train_files=[str(files)], shuffle=False, **extra)
    return chat_datasets(data, ModelConfig(path=folder))


def _engine(folder: str, **optim: Any) -> Any:
    cfg = engine_config(model={"path": folder}, use_packing=True, optim=optim or {"lr": 1e-3})
    engine = ReferenceEngine(ReferenceEngineConfig(**cfg))
    engine.init_model()
    return engine


def test_an_image_chat_trains_on_the_assistants_tokens_only(
    vl_chat_folder: tuple[str, Any], data: Path
) -> None:
    """The ids are the template's rendering of the whole conversation with each placeholder
    expanded to its image's tokens; the mask is 1 on each answer and its end of turn and
    nowhere else (no image token, no user token, no role marker); the batch carries each row's
    pixel patches and grids, a text-only row none."""
    folder, tok = vl_chat_folder
    chats = _chats(folder, data / "mixed.jsonl")
    batch = chats.train.batch([0, 1])
    assert chats.images is not None
    image = chats.images.image_token_id
    n = int(batch["attention_mask"][0].sum())
    ids, mask = batch["input_ids"][0, :n].tolist(), batch["loss_mask"][0, :n].tolist()
    # the template's own text of the conversation, each placeholder as many tokens as its grid
    text = tok.apply_chat_template(PICTURED, tokenize=False)
    pieces = text.split("<|image_pad|>")
    counts = [GRIDS[c][1] * GRIDS[c][2] // 4 for c in ("red", "blue")]
    text = pieces[0] + "".join(
        "<|image_pad|>" * c + p for c, p in zip(counts, pieces[1:], strict=True)
    )
    whole = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == whole[: len(ids)] and tok.decode(whole[len(ids) :]) == "\n"  # after the end
    assert ids.count(image) == sum(counts)
    # trained: from each assistant turn's start to its end of turn, both included
    start = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids(END)
    want = [0] * n
    for p in range(n):
        if ids[p - len(start) : p] == start:
            q = ids.index(end, p)
            want[p : q + 1] = [1] * (q + 1 - p)
    assert mask == want
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == f"3{END}blue{END}"
    assert not any(m for t, m in zip(ids, mask, strict=True) if t == image)
    # the images: the processor's patches and grids for the first row, none for the second
    processor = chats.images.processor
    from PIL import Image

    pictures = [Image.open(data / "images" / f"{c}.png").convert("RGB") for c in ("red", "blue")]
    out = processor(images=pictures, return_tensors="pt")
    assert batch[IMAGE_GRID_THW][0].tolist() == [GRIDS["red"], GRIDS["blue"]]
    assert batch[IMAGE_GRID_THW][1].tolist() == [[0, 0, 0], [0, 0, 0]]
    patches = int(out["pixel_values"].shape[0])
    assert torch.equal(batch[PIXEL_VALUES][0, :patches], out["pixel_values"].float())
    assert not batch[PIXEL_VALUES][1].any()
    text_row = batch["input_ids"][1][batch["loss_mask"][1].bool()]
    assert tok.decode(text_row) == f"4{END}"


def test_the_engines_per_token_loss_equals_transformers(
    vl_chat_folder: tuple[str, Any], data: Path
) -> None:
    """fp32: the engine's log-probs of the trained tokens (packed, an image row and a text row)
    equal transformers' forward of each row alone with its images within 1e-5, and the loss
    is their token-mean; the same forward without the images is far off (the check would see an
    engine dropping them)."""
    folder, _ = vl_chat_folder
    batch = _chats(folder, data / "mixed.jsonl").train.batch([0, 1])
    engine = _engine(folder)
    with torch.no_grad():
        got = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
    trained = batch["loss_mask"].bool()
    want = plain_vl_log_probs(engine.module, batch)
    assert float((got - want)[trained].abs().max()) < 1e-5
    loss = supervised_loss(engine, [batch])["loss"]
    assert loss == pytest.approx(float(-want[trained].mean()), abs=1e-5)
    blind = plain_vl_log_probs(engine.module, batch, images=False)
    assert float((blind - want)[trained].abs().max()) > 1e-3


def test_the_loss_goes_down_and_the_answers_read_the_images(
    vl_chat_folder: tuple[str, Any], data: Path
) -> None:
    """Ten steps on one batch of two chats that differ only in their image (red: "1", blue:
    "2"): the loss falls, and each answer's probability exceeds what a model blind to the
    images can give both (the same text, so the same distribution: the two sum to at most 1)."""
    folder, tok = vl_chat_folder
    batch = _chats(folder, data / "which.jsonl").train.batch([0, 1])
    engine = _engine(folder, lr=2e-2, clip_grad=1.0)
    losses = [supervised_step(engine, batch)["loss"] for _ in range(10)]
    assert losses[-1] < 0.25 * losses[0], losses
    with torch.no_grad():
        probs = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS].exp()
    answers = [tok.convert_tokens_to_ids(a) for a in ("1", "2")]
    first = [int(batch["loss_mask"][i].nonzero()[0]) for i in range(2)]
    assert [int(batch["input_ids"][i, p]) for i, p in enumerate(first)] == answers
    p_red, p_blue = (float(probs[i, p]) for i, p in enumerate(first))
    assert p_red + p_blue > 1.2, (p_red, p_blue)


def _args(folder: str, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        str(RECIPES / "sft_text_tiny.yaml"),
        f"engine.model.path={folder}",
        f"output_dir={out}",
        "steps=3",
        "batch_size=2",
        "save_every=2",
        "log_every=1",
        "engine.optim.total_steps=3",
        *extra,
    ]


def test_engine_core_train_on_image_chats(vl_chat_folder: tuple[str, Any], data: Path) -> None:
    """The CLI's job, fsdp2 packed: three steps on image chats and a text chat, the loss
    on the validation chats, checkpoints, and an export with the image processor."""
    from transformers import AutoImageProcessor

    folder, _ = vl_chat_folder
    train = _write(data, "train.jsonl", [PICTURED, TEXT_ONLY, _which("red", "1")])
    out = data / "run"
    args = _args(
        folder,
        out,
        f"data.train_files=[{train}]",
        f"data.val_files=[{data / 'which.jsonl'}]",
        "eval_every=3",
    )
    assert main(args) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["loss_tokens"] > 0 for r in rows)
    assert "val/loss" in rows[-1]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["global_step_2", "global_step_3"]
    processor = AutoImageProcessor.from_pretrained(out / "hf_export")
    assert processor.merge_size == 2 and (out / "hf_export" / "config.json").is_file()


def _refusal(root: Path, name: str) -> tuple[list[list[dict[str, Any]]], list[str], str]:
    """A file of two chats whose second row is bad in the way ``name`` says; the overrides it
    needs; what the refusal says."""
    bad = _which("blue", "2")
    overrides: list[str] = []
    if name == "missing":
        bad[0]["content"][0]["image"] = "images/gone.png"
        said = "images/gone.png' does not exist"
    elif name == "corrupt":
        (root / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
        bad[0]["content"][0]["image"] = "images/broken.png"
        said = "the image cannot be read"
    elif name == "over-budget":
        bad[0]["content"][0]["image"] = "images/red.png"
        overrides = ["data.max_image_pixels=300"]
        said = "24 x 16 = 384 pixels, over data.max_image_pixels=300"
    elif name == "cut-by-max-length":
        bad[0]["content"] += [_text("1+2+3+4+5")]
        overrides = ["data.max_length=24"]
        said = "over the 24 the model takes"
    elif name == "image-in-an-answer":
        bad[1]["content"] = [_image("blue"), _text("2")]
        said = "an assistant message holds an image"
    else:  # images for the recipe's own text model
        assert name == "text-model"
        said = "holds 1 image(s) and the model is a text model"
    return [[TEXT_ONLY[1], TEXT_ONLY[2]], bad], overrides, said


@pytest.mark.parametrize(
    "name",
    [
        "missing",
        "corrupt",
        "over-budget",
        "cut-by-max-length",
        "image-in-an-answer",
        "text-model",
    ],
)
def test_a_bad_image_row_is_refused_with_its_file_and_row_before_anything_is_written(
    vl_chat_folder: tuple[str, Any], tmp_path: Path, data: Path, name: str
) -> None:
    folder, _ = vl_chat_folder
    (tmp_path / "images").symlink_to(data / "images", target_is_directory=True)
    chats, overrides, said = _refusal(data, name)
    bad = _write(tmp_path, "bad.jsonl", chats)
    out = tmp_path / "run"
    args = _args(folder, out, f"data.train_files=[{bad}]", *overrides)
    if name == "text-model":
        args.remove(f"engine.model.path={folder}")
    with pytest.raises(ConfigError) as info:
        run_sft(load_recipe(args[1], args[2:]), load_plugins())
    assert f"data.train_files: row 2 of {bad}" in str(info.value), str(info.value)
    assert said in str(info.value), str(info.value)
    assert not out.exists() or not any(out.iterdir())  # checked before anything is written
