"""Chats with images (the RL job's prompts, the SFT job's conversations): chat messages whose
content holds images, rendered through the model folder's own chat template and image processor
into token ids and the batch's vision fields.

A message's ``content`` may be a list of parts, ``{"type": "text", "text": ...}`` and
``{"type": "image", "image": ...}``, the image given as a file path (relative to the data file
it is read from), its bytes, a ``{"bytes": ..., "path": ...}`` mapping (a ``datasets`` Image
column's storage, as Parquet holds it) or a PIL image. The chat template renders one placeholder
per image (the model's image token, between its vision start and end tokens, as the Qwen
templates do); each placeholder becomes as many image tokens as the image processor's grid
gives the model (``t * h * w / merge**2``), which is what the model's processor does, checked
again on the ids. Whatever is wrong is refused with the data file and row named, before any
training starts: a missing or unreadable image, an image over the pixel budget, a template that
renders another count of placeholders than the row has images, a prompt that would be cut
through its image tokens.

The image processor is the folder's (``AutoImageProcessor``); transformers picks its PIL
backend where torchvision is not installed.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_core import ConfigError
from engine_core.config import ModelConfig
from engine_core.vision import is_vision_config

__all__ = ["EncodedTexts", "ImagePromptRenderer", "RenderedPrompt", "image_parts", "image_renderer"]


@dataclass(frozen=True)
class RenderedPrompt:
    """One prompt: its token ids, its images' pixel patches ``[p, D]`` and grids ``[n, 3]``
    (None for a prompt without images)."""

    ids: list[int]
    pixel_values: torch.Tensor | None
    grids: torch.Tensor | None


@dataclass(frozen=True)
class EncodedTexts:
    """Pieces of one rendered conversation as token ids (one list per piece), and its images'
    pixel patches ``[p, D]`` and grids ``[n, 3]`` (None without images)."""

    ids: list[list[int]]
    pixel_values: torch.Tensor | None
    grids: torch.Tensor | None


def image_parts(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The image parts of ``messages``' contents, in order."""
    found = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            found += [p for p in content if isinstance(p, Mapping) and p.get("type") == "image"]
    return found


class ImagePromptRenderer:
    """Renders chat prompts with images for the vision-language model saved in ``folder``
    (its config, image processor) with ``tokenizer`` (whose chat template renders image parts).

    ``image_token_id``: the model's image token (default: read from ``folder``'s config, the
    model's own). ``max_image_pixels``: an image with more pixels (width x height) than this
    is refused (None: any size; the image processor resizes within its own budget either
    way)."""

    def __init__(
        self,
        folder: str,
        tokenizer: Any,
        *,
        image_token_id: int | None = None,
        max_image_pixels: int | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoImageProcessor

        if image_token_id is None:
            config = AutoConfig.from_pretrained(folder)
            if getattr(config, "vision_config", None) is None:
                raise ConfigError(
                    f"{folder}: the prompts hold images but the model ({config.model_type}) "
                    f"has no vision tower; use a vision-language model, or drop the images."
                )
            image_token_id = int(config.image_token_id)
        try:
            self.processor = AutoImageProcessor.from_pretrained(folder)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{folder}: no image processor to read the prompts' images with "
                f"(preprocessor_config.json, saved by the model's processor): {e}"
            ) from None
        self.tokenizer, self.max_image_pixels = tokenizer, max_image_pixels
        self.image_token_id = int(image_token_id)
        self.placeholder = str(tokenizer.convert_ids_to_tokens(self.image_token_id))
        self.merge = int(getattr(self.processor, "merge_size", 1))

    def open(self, part: Mapping[str, Any], base: Path, where: str) -> Any:
        """The PIL image of one image part, read and checked (``where``: the file and row)."""
        from PIL import Image, UnidentifiedImageError

        value = part.get("image")
        if isinstance(value, Image.Image):
            image = value
        else:
            if isinstance(value, Mapping):  # a datasets Image column's storage
                value = value.get("bytes") or value.get("path")
            if isinstance(value, str):
                path = Path(value) if Path(value).is_absolute() else base / value
                if not path.is_file():
                    raise ConfigError(
                        f"{where}: the image {str(path)!r} does not exist (a relative path is "
                        f"read from the data file's folder); fix the path, or drop the row."
                    )
                source: Any = path
            elif isinstance(value, bytes | bytearray):
                source = io.BytesIO(value)
            else:
                raise ConfigError(
                    f"{where}: an image part holds {type(value).__name__}; give a file path, "
                    f"bytes, or a datasets Image value ({{'image': ...}})."
                )
            try:
                image = Image.open(source)
                image.load()
            except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
                raise ConfigError(f"{where}: the image cannot be read ({e}).") from None
        pixels = image.width * image.height
        if self.max_image_pixels is not None and pixels > self.max_image_pixels:
            raise ConfigError(
                f"{where}: an image of {image.width} x {image.height} = {pixels} pixels, over "
                f"data.max_image_pixels={self.max_image_pixels}; shrink the image or raise the "
                f"budget."
            )
        return image.convert("RGB")

    def read(
        self, parts: Sequence[Mapping[str, Any]], base: Path, where: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pixel patches ``[p, D]`` and grids ``[n, 3]`` of these image parts, read (paths
        relative to ``base``), checked and processed; a batch reads its rows' images this way
        rather than keeping every row's pixels."""
        images = [self.open(p, base, where) for p in parts]
        out = self.processor(images=images, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def encode(
        self,
        texts: Sequence[str],
        parts: Sequence[Mapping[str, Any]],
        *,
        base: Path,
        where: str,
    ) -> EncodedTexts:
        """Pieces of one rendered conversation (``texts``, in order, holding the template's
        placeholders of ``parts``' images one after another) as token ids, each placeholder
        expanded to its image's tokens; with the images' pixel patches and grids."""
        slots = sum(t.count(self.placeholder) for t in texts)
        if slots != len(parts):
            raise ConfigError(
                f"{where}: the chat template renders {slots} image placeholder(s) "
                f"({self.placeholder!r}) for the row's {len(parts)} image(s); use the model's "
                f"own chat template, which renders one per image part."
            )
        if not parts:
            return EncodedTexts([self._ids(t) for t in texts], None, None)
        pixel_values, grids = self.read(parts, base, where)
        counts = iter((grids.prod(-1) // self.merge**2).tolist())
        ids = []
        for text in texts:
            pieces = text.split(self.placeholder)
            expanded = pieces[0] + "".join(
                self.placeholder * next(counts) + piece for piece in pieces[1:]
            )
            ids.append(self._ids(expanded))
        want = int((grids.prod(-1) // self.merge**2).sum())
        got = sum(piece.count(self.image_token_id) for piece in ids)
        if got != want:
            raise ConfigError(
                f"{where}: the row holds {got} image tokens after rendering, the image "
                f"processor's grids give {want}; the tokenizer splits the placeholder "
                f"{self.placeholder!r} (it must be one added token)."
            )
        return EncodedTexts(ids, pixel_values, grids)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        base: Path,
        where: str,
        max_length: int | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> RenderedPrompt:
        """``messages`` (with the generation prompt) as token ids and vision fields."""
        text = self.tokenizer.apply_chat_template(
            list(messages), tools=tools, add_generation_prompt=True, tokenize=False
        )
        out = self.encode([text], image_parts(messages), base=base, where=where)
        ids = out.ids[0]
        if max_length is not None and len(ids) > max_length and out.grids is not None:
            images = ids.count(self.image_token_id)
            raise ConfigError(
                f"{where}: the prompt is {len(ids)} tokens ({images} of them its images'), "
                f"over the {max_length} it may have; it would be cut through its image tokens. "
                f"Raise data.max_prompt_length, shrink the images, or drop the row."
            )
        return RenderedPrompt(ids, out.pixel_values, out.grids)


def image_renderer(
    model: ModelConfig, hf_config: Any, tokenizer: Any, *, max_image_pixels: int | None
) -> ImagePromptRenderer | None:
    """The renderer of the rows' images for ``model`` (whose transformers config is
    ``hf_config``), its image processor read from ``model.tokenizer`` or ``model.path``; None
    for a text model (whose rows with images are refused where they are rendered)."""
    if not is_vision_config(hf_config):
        return None
    folder = model.tokenizer or model.path
    if folder is None:
        raise ConfigError(
            "a vision-language model built from a config has no image processor; set "
            "engine.model.tokenizer to a folder holding its tokenizer and image processor."
        )
    return ImagePromptRenderer(
        folder,
        tokenizer,
        image_token_id=int(hf_config.image_token_id),
        max_image_pixels=max_image_pixels,
    )
