"""Serving a LoRA policy's adapters in a rollout whose backend loads them from a folder.

A rollout built with ``model.lora`` names the peft model's tensors in its expected weights, so a
weight link sends it the policy's peft tensors unmerged once, then the adapters alone
(:mod:`engine_core.models`, ``is_adapter_name``). A backend that serves adapters itself (vLLM's
and SGLang's LoRA support) keeps the base in its model and takes the adapters from a folder in
peft's on-disk format: :class:`AdapterFolders` writes each received version there, and
:func:`split_peft_tensors` tells the base tensors (under the base model's names) from the
adapters.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine_core.config import LoraConfig
from engine_core.errors import WeightSyncError
from engine_core.models import adapted_modules, is_adapter_name, peft_base_name

__all__ = ["AdapterFolders", "split_peft_tensors"]

_ADAPTER_NAME = ".default."  # peft's name for the one adapter a model trains


def split_peft_tensors(
    named: Iterable[tuple[str, torch.Tensor]], adapters: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base tensors of a peft stream under the base model's names; each adapter tensor is
    copied into ``adapters`` (the stream's buffers may be reused once a bucket is loaded)."""
    for name, tensor in named:
        if is_adapter_name(name):
            adapters[name] = tensor.detach().to("cpu", copy=True)
        else:
            yield peft_base_name(name), tensor


class AdapterFolders:
    """Each version of a policy's adapters in a folder of its own, in peft's on-disk format
    (``adapter_model.safetensors`` and ``adapter_config.json``), as LoRA-serving backends load
    them. Only the newest version's folder is kept."""

    def __init__(self, lora: LoraConfig, prefix: str = "engine-core-adapters-") -> None:
        self.lora = lora
        self._root = tempfile.TemporaryDirectory(prefix=prefix)
        self.version = 0

    def write(self, adapters: dict[str, torch.Tensor]) -> Path:
        """Write ``adapters`` (peft state-dict names -> tensors) as the next version; the folder.

        The set of adapted modules is read from the names, so ``target_modules: all-linear``
        becomes the list peft resolved it to.
        """
        if not adapters:
            raise WeightSyncError("no LoRA adapter tensors were received; nothing to serve.")
        modules = adapted_modules(adapters)
        folder = Path(self._root.name) / f"v{self.version + 1}"
        folder.mkdir()
        tensors = {name.replace(_ADAPTER_NAME, "."): t.contiguous() for name, t in adapters.items()}
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.lora.rank,
            "lora_alpha": self.lora.alpha,
            "lora_dropout": 0.0,
            "target_modules": modules,
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
        }
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
        self.version += 1
        old = Path(self._root.name) / f"v{self.version - 1}"
        if old.exists():
            shutil.rmtree(old)
        return folder

    def cleanup(self) -> None:
        self._root.cleanup()
