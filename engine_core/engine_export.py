"""Weight export of an engine: :class:`WeightExport`, a mixin of
:class:`~engine_core.engine.BaseEngine`.

It owns what leaves the engine as tensors: the full parameters under their HF names (each
backend's :meth:`~WeightExport.named_full_params`), a LoRA model's own tensors, the choice
between them for a weight sync (:data:`WeightPart`), the buckets a sync sends and the Hugging
Face folder :meth:`~WeightExport.export_hf` writes.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from engine_core.config import BUCKET_BYTES
from engine_core.rollout import CutBuckets, gather_bytes, iter_buckets

if TYPE_CHECKING:
    from engine_core.config import EngineConfig

# what a weight sync sends (BaseEngine.named_weights): the model under its HF names, LoRA
# adapters merged ("model"); a LoRA model's own tensors unmerged, base included ("peft"); or
# its adapter tensors alone ("adapters")
WeightPart = Literal["model", "peft", "adapters"]
WEIGHT_PARTS: tuple[WeightPart, ...] = ("model", "peft", "adapters")

__all__ = ["WEIGHT_PARTS", "WeightExport", "WeightPart"]


class WeightExport(abc.ABC):
    """The engine's weights as named tensors, weight-sync buckets and an HF folder."""

    if TYPE_CHECKING:  # provided by BaseEngine
        config: EngineConfig

        @property
        def is_distributed(self) -> bool: ...

        @property
        def writes_full_params(self) -> bool: ...

    @abc.abstractmethod
    def named_full_params(
        self, bucket_bytes: int = BUCKET_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, full tensor) for every weight, in the model's dtype.

        ``bucket_bytes`` is how much an engine that gathers shards holds at a time (a tensor
        bigger than that alone); it changes no name or value."""

    def named_lora_params(
        self, bucket_bytes: int = BUCKET_BYTES, *, adapters_only: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A LoRA model's tensors as its peft model names them, unmerged: every tensor (the
        frozen base layers included), or with ``adapters_only`` the adapter tensors alone (what
        trains). Gathered a bucket at a time and collective, as :meth:`named_full_params`.

        For a rollout that serves the adapters itself (its model built with the same
        ``model.lora``): it takes the base once, then the adapters alone at every sync. Engines
        that declare ``lora`` override it; the default refuses.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not stream a LoRA model's adapters; a rollout that "
            f"serves LoRA adapters needs an engine that implements named_lora_params() (the "
            f"fsdp and fsdp2 engines do), or build the rollout without model.lora so it takes "
            f"the merged weights."
        )

    def named_weights(
        self, part: WeightPart = "model", bucket_bytes: int = BUCKET_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """What a weight sync sends, by ``part`` (see :data:`WeightPart`): the model under its HF
        names (:meth:`named_full_params`), or a LoRA model's tensors unmerged ("peft") or its
        adapters alone ("adapters") (:meth:`named_lora_params`)."""
        self._check_weight_part(part)
        if part == "model":
            return self.named_full_params(bucket_bytes)
        return self.named_lora_params(bucket_bytes, adapters_only=part == "adapters")

    def _check_weight_part(self, part: str) -> None:
        if part not in WEIGHT_PARTS:
            raise ValueError(f"part must be one of {', '.join(WEIGHT_PARTS)}; got {part!r}.")
        if part != "model" and self.config.model.lora is None:
            raise ValueError(
                f"part={part!r} sends a LoRA model's own tensors, but this engine's model has no "
                f"model.lora; send part='model'."
            )

    def weight_buckets(
        self, part: WeightPart = "model", bucket_bytes: int = BUCKET_BYTES
    ) -> CutBuckets:
        """:meth:`named_weights` of ``part``, cut into buckets of at most ``bucket_bytes`` (a
        bigger tensor alone): what a weight sync sends. Collective, as the gathers are.

        The default gathers a quarter bucket at a time and cuts: a bucket is cut when the next
        tensor does not fit, so that tensor is already held while the bucket is handed on. An
        engine that gathers in buckets itself overrides it to yield each bucket as gathered,
        holding no more than one.
        """
        named = self.named_weights(part, gather_bytes(bucket_bytes))
        return CutBuckets(iter_buckets(named, bucket_bytes))

    def export_hf(self, path: str) -> str:
        """Write a Hugging Face folder (``model.safetensors`` + config) at ``path`` (a local
        folder or an fsspec URL).

        Collective: every rank must call it (full tensors are gathered one at a time); the
        collect rank of DP rank 0 writes into a temporary folder and swaps it in, so an interrupted export never leaves a
        half-written folder. An existing export at ``path`` is replaced.
        """
        import fsspec

        from engine_core.checkpoint import fresh_folder, join, replace_folder, save_safetensors
        from engine_core.models import build_hf_config

        writer = self.writes_full_params
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in self.named_full_params():
            if writer:  # own copies: tied weights must not share storage in safetensors
                tensors[name] = tensor.detach().to("cpu").contiguous().clone()
        final = str(path).rstrip("/")
        if writer:
            tmp = final + ".tmp"
            fresh_folder(tmp)
            save_safetensors(tensors, join(tmp, "model.safetensors"), metadata={"format": "pt"})
            with fsspec.open(join(tmp, "config.json"), "w", encoding="utf-8") as f:
                f.write(build_hf_config(self.config.model).to_json_string())
            replace_folder(tmp, final)
        if self.is_distributed and dist.get_world_size() > 1:
            dist.barrier()  # every rank returns once the folder is in place
        return final
