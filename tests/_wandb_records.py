"""Reads what an offline W&B run wrote (``run-<id>.wandb``): the records, as W&B's own protobuf
messages, out of the file's framing (a 7-byte header, then 32 KiB blocks of chunks, each a
7-byte header of checksum, length and type: whole, first, middle or last part of a record)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7
_WHOLE, _LAST = 1, 4


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file: {data[:7]!r}"
    pos, parts = _HEADER, []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a chunk header: padding
            pos += left
            continue
        _checksum, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:  # zeros to the end of the block
            pos += left
            continue
        parts.append(data[pos + _HEADER : pos + _HEADER + length])
        pos += _HEADER + length
        if kind in (_WHOLE, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def _key(item: Any) -> str:
    return str(item.key or "/".join(item.nested_key))


def history(path: Path) -> list[dict[str, Any]]:
    """The rows ``run.log`` logged, as W&B wrote them: a table's fields flattened
    (``samples/_type``), W&B's ``_step`` kept and its ``_runtime`` and ``_timestamp`` left
    out."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            rows.append({k: v for k, v in row.items() if k not in ("_runtime", "_timestamp")})
    return rows


def config(path: Path) -> dict[str, Any]:
    """The run's config as the run record holds it."""
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            return {
                _key(i): json.loads(i.value_json)
                for i in record.run.config.update
                if _key(i) != "_wandb"
            }
    raise AssertionError(f"{path} holds no run record")


def summary(path: Path) -> dict[str, Any]:
    """The summary's top-level values as last updated."""
    out: dict[str, Any] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                out[_key(item)] = json.loads(item.value_json)
    return out
