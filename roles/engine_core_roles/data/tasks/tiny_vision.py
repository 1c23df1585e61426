"""The shipped vision task: small drawn images and questions only the image answers, with the
tokenizer and image processor of a tiny Qwen2.5-VL, so ``engine-core run`` trains a
vision-language model with nothing downloaded.

Each image (24 x 24 pixels, black) holds one to three squares of one colour, red, green or
blue, at random places; each image is asked two questions, ``colour?`` (the answer ``red``,
``green`` or ``blue``) and ``how many?`` (``one``, ``two`` or ``three``). The text alone says
which kind of word to answer, never which word: a model that does not look answers at chance
(1/3). The answers are whole tokens, so a response is one word and the end of turn;
:func:`answer_reward` scores it 1 when it is the answer, else 0.

The tokenizer is the text task's (:func:`engine_core_roles.data.tasks.tiny_text.build_tokenizer`)
with the vision tokens and the answer words added, and a ChatML template that renders an image
part as ``<|vision_start|><|image_pad|><|vision_end|>``; the image processor is transformers'
Qwen2-VL one (patch 4, merge 2: a 24 x 24 image is a 6 x 6 patch grid, 9 image tokens).

``python -m engine_core_roles.data.tasks.tiny_vision FOLDER`` writes the processor folder, the
images and the data files again; ``tests/test_vlm_recipe.py`` checks that the shipped ones are
what it writes.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine_core_roles.data.tasks.tiny_text import ROLE_WORDS, build_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "COLOURS",
    "QUESTIONS",
    "SIZES",
    "VISION_TOKENS",
    "answer_reward",
    "build_processor",
    "draw",
    "write_files",
]

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2.5-VL's vision tokens, added in this order after the text task's tokens."""
COLOURS = {"red": (230, 40, 40), "green": (40, 200, 40), "blue": (50, 80, 240)}
SIZES = {"small": 6, "big": 14}
"""The square's side in pixels for each size word."""
QUESTIONS = {"colour": "colour?", "size": "size?"}
SIZE = 24
"""The images' width and height in pixels: a multiple of patch x merge (8)."""
PATCH, MERGE = 4, 2

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_processor(folder: str | Path | None = None) -> Any:
    """The tokenizer (the text task's, plus :data:`VISION_TOKENS` as special tokens and the
    answer words as whole tokens, with :data:`CHAT_TEMPLATE`), saved with a Qwen2-VL image
    processor (patch 4, merge 2, images of 64 to 1024 pixels kept at their size) to ``folder``
    when given. Returns the tokenizer."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    words = [*ROLE_WORDS, *COLOURS, *SIZES]
    tok = build_tokenizer(words=words)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tok.chat_template = CHAT_TEMPLATE
    if folder is not None:
        tok.save_pretrained(str(folder))
        Qwen2VLImageProcessorPil(
            patch_size=PATCH,
            temporal_patch_size=2,
            merge_size=MERGE,
            min_pixels=64,
            max_pixels=1024,
        ).save_pretrained(str(folder))
    return tok


def draw(colour: str, size: str, rng: random.Random) -> Any:
    """A black image of :data:`SIZE` pixels with one square of ``colour`` and ``size`` at a
    random place."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (0, 0, 0))
    side = SIZES[size]
    x, y = rng.randrange(SIZE - side + 1), rng.randrange(SIZE - side + 1)
    ImageDraw.Draw(image).rectangle((x, y, x + side - 1, y + side - 1), fill=COLOURS[colour])
    return image


def _row(image: str, kind: str, answer: str) -> dict[str, Any]:
    content = [{"type": "image", "image": image}, {"type": "text", "text": QUESTIONS[kind]}]
    return {"prompt": [{"role": "user", "content": content}], "answer": answer, "kind": kind}


def _rows(images: Sequence[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """Both questions about each image (its path, colour and size)."""
    rows = []
    for path, colour, size in images:
        rows += [_row(path, "colour", colour), _row(path, "size", size)]
    return rows


def _balanced(rows: Sequence[dict[str, Any]], total: int) -> list[dict[str, Any]]:
    """The first rows of ``rows`` holding each answer equally often, half of them of each
    question kind (``total`` of them, fewer where it does not divide evenly): the warm-up
    favours no answer, so RL starts from chance on every kind."""
    answers = {"colour": list(COLOURS), "size": list(SIZES)}
    quota = {kind: total // len(answers) // len(words) for kind, words in answers.items()}
    taken: dict[str, int] = {}
    out = []
    for r in rows:
        if taken.get(r["answer"], 0) < quota[r["kind"]]:
            taken[r["answer"]] = taken.get(r["answer"], 0) + 1
            out.append(r)
    return out


def write_files(
    folder: str | Path,
    *,
    train_images: int = 192,
    val_images: int = 48,
    demos: int = 60,
    seed: int = 0,
) -> None:
    """The processor folder (``folder/processor``), ``train_images + val_images`` images
    (``folder/images/NNN.png``; colours and sizes drawn evenly, in a seeded order), both
    questions about each of the first ``train_images`` in ``train.jsonl`` and about the rest in
    the held-out ``val.jsonl`` (rows shuffled; paths relative to the files), and
    ``demos.jsonl``: about ``demos`` training questions answered, without their images, each
    answer equally often, as conversations for the job's supervised warm-up (they teach the form
    of an answer: one word of the asked kind, then the end of turn; no image, so a model that
    learns them answers at chance)."""
    folder = Path(folder)
    build_processor(folder / "processor")
    rng = random.Random(seed)
    total = train_images + val_images
    kinds = [(c, n) for c in COLOURS for n in SIZES]
    drawn = [kinds[i % len(kinds)] for i in range(total)]
    rng.shuffle(drawn)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    images = []
    for i, (colour, size) in enumerate(drawn):
        path = f"images/{i:03d}.png"
        draw(colour, size, rng).save(folder / path, format="PNG", optimize=True)
        images.append((path, colour, size))
    train, val = _rows(images[:train_images]), _rows(images[train_images:])
    rng.shuffle(train)
    rng.shuffle(val)
    answered = [
        {
            "messages": [
                {"role": "user", "content": QUESTIONS[r["kind"]]},
                {"role": "assistant", "content": r["answer"]},
            ]
        }
        for r in _balanced(train, demos)
    ]
    for name, part in (("train.jsonl", train), ("val.jsonl", val), ("demos.jsonl", answered)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in part))


def answer_reward(prompt: str, response: str, answer: str, **_: Any) -> float:
    """1.0 when the response is the answer word (surrounding whitespace aside), else 0.0."""
    del prompt
    return float(response.strip() == answer)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m engine_core_roles.data.tasks.tiny_vision FOLDER")
    write_files(sys.argv[1])
