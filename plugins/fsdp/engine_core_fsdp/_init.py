"""Model initialisation for sharded engines: full on every rank, rank 0 + broadcast, or meta.

``build_skeleton`` builds the model with parameters on the meta device (buffers stay real: rotary
tables are computed, not loaded). After the engine shards the skeleton, ``materialize`` gives
every rank real storage for its own shards only, and fills them either by reading just those
slices from the checkpoint's safetensors files (``init='meta'``) or from rank 0's full state dict
(``init='rank0_broadcast'``).
"""

from __future__ import annotations

import json
import math
import struct
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from engine_core.backend import (
    CheckpointError,
    ModelConfig,
    build_model,
)

__all__ = ["build_skeleton", "materialize", "load_sharded_safetensors"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def build_skeleton(cfg: ModelConfig) -> torch.nn.Module:
    """The model with meta-device parameters and real buffers (no parameter memory at all)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return build_model(cfg, load_weights=False)


def materialize(
    module: torch.nn.Module,
    *,
    device: torch.device,
    source: str,
    cfg: ModelConfig,
    full_state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Allocate this rank's shards of a sharded skeleton and fill them.

    ``source='meta'`` reads the shards from ``cfg.path``; ``source='rank0_broadcast'`` takes them
    from ``full_state`` (present on rank 0 only).
    """
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    module.to_empty(device=device)
    with torch.no_grad():  # to_empty replaced the buffers with garbage too: put them back
        for name, b in module.named_buffers():
            b.copy_(buffers[name])
    if source == "meta":
        assert cfg.path is not None  # enforced by the config
        load_sharded_safetensors(module, cfg.path)
    else:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(module, full_state or {}, options=options)


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(
            f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; init='meta' needs a folder "
            f"saved with save_pretrained(safe_serialization=True)."
        )
    return {name: single for name in _SafetensorsReader(single).header if name != "__metadata__"}


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _SafetensorsReader:
    """Reads row ranges of tensors from one safetensors file with plain file reads.

    Memory-mapping the file would count every touched page in the process's resident memory;
    ``readinto`` a buffer of just the requested rows keeps a rank's peak at its own shards.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(header_len))
        self.data_start = 8 + header_len

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        info = self.header[name]
        dtype, shape = _DTYPES[info["dtype"]], list(info["shape"])
        row_bytes = math.prod(shape[1:]) * dtype.itemsize if shape else dtype.itemsize
        if not shape:  # a scalar
            start, stop = 0, 1
        buf = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + info["data_offsets"][0] + start * row_bytes)
            f.readinto(buf.numpy())  # type: ignore[attr-defined]
        return buf.view(dtype).view([stop - start, *shape[1:]] if shape else [])


def load_sharded_safetensors(module: torch.nn.Module, folder: str) -> None:
    """Copy into each parameter only this rank's slice, read straight from the safetensors files.

    A tied parameter is filled once, from whichever of its names the checkpoint holds. Raises
    :class:`CheckpointError` naming every parameter the checkpoint lacks.
    """
    files = _tensor_files(Path(folder))
    names_of: dict[int, list[str]] = defaultdict(list)
    params: dict[int, torch.nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of[id(p)].append(name)
        params[id(p)] = p
    missing = [names[0] for names in names_of.values() if not any(n in files for n in names)]
    if missing:
        raise CheckpointError(
            f"{folder} lacks {len(missing)} parameter(s) of the model: {missing[:8]}; check that "
            f"model.path holds a checkpoint of this architecture."
        )
    readers = {file: _SafetensorsReader(file) for file in set(files.values())}
    with torch.no_grad():
        for key, p in params.items():
            name = next(n for n in names_of[key] if n in files)
            _copy_local_slice(p, readers[files[name]], name)
    if dist.is_initialized():
        dist.barrier()


def _copy_local_slice(param: torch.nn.Parameter, reader: _SafetensorsReader, name: str) -> None:
    """Fill this rank's part of ``param``: only its rows are read (every row for a dim>0 split)."""
    if not isinstance(param, DTensor):
        param.copy_(reader.read_rows(name, 0, param.shape[0] if param.dim() else 1))
        return
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    local = param.to_local()
    if not local.numel():
        return
    rows = reader.read_rows(name, offset[0], offset[0] + shape[0])
    rest = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
    local.copy_(rows[(slice(None), *rest)])
