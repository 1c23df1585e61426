"""Plain data between processes that share no Python objects: the frames of
:mod:`engine_core.executors.interpreter`.

A rollout replica may run in another interpreter (``rollout_python``: another virtual
environment, with its own torch and Python). What crosses between the two must mean the same
on both sides whatever their versions, and nothing read is ever unpickled. A message is one
frame::

    b"ECW1" | header length (u32, big-endian) | blob length (u64) | header | blob

- the header is UTF-8 JSON: the message's structure, where a value that JSON has no form for
  is a tagged object (``{"$t": key}`` a tensor, ``{"$td": ...}`` a TensorDict, ``{"$model":
  name, ...}`` a config, ...);
- the blob is a safetensors file (names, dtypes and shapes in its fixed-format header, then
  the raw bytes) holding every tensor of the message under the key its tag names.

Only the types below are encoded, and a tag names a class only from a fixed allow-list
(:data:`MODELS`, :data:`ENUMS`, :data:`RECORDS`): a frame cannot make the reader import or
build anything else. Anything else is refused with :class:`WireError` on the side that meets
it: when encoding, naming the type; when decoding, naming the tag.

Encoded: ``None``, ``bool``, ``int``, ``float``, ``str``, lists, tuples, sets and frozensets,
dicts (any of those keys: a dict whose keys are not all strings is a list of pairs),
tensors (any dtype safetensors stores; made contiguous; a tensor sharing memory with another
of the same message is copied), TensorDicts (tensors, nested TensorDicts, non-tensor data and
per-row non-tensor stacks of encodable values; batch size kept), the allow-listed pydantic
models (by their JSON dump), enums (by value) and records (dataclasses of those, by field).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import os
import struct
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from tensordict import NonTensorData, NonTensorStack, TensorDict

from engine_core.errors import EngineCoreError

__all__ = [
    "ENUMS",
    "MAGIC",
    "MODELS",
    "RECORDS",
    "WireError",
    "decode",
    "decode_frame",
    "encode",
    "read",
    "read_frame",
    "write",
]

MAGIC = b"ECW1"
_PREFIX = struct.Struct(">4sIQ")  # magic, header length, blob length
MAX_HEADER_BYTES = 256 << 20
"""A header larger than this is refused before it is read (a corrupted length, not data)."""

MODELS = frozenset(
    {
        "engine_core.batch.BatchMeta",
        "engine_core.rollout.SamplingParams",
    }
)
"""Pydantic models a frame may carry (rebuilt with ``model_validate`` of their JSON dump)."""

ENUMS = frozenset({"engine_core.capabilities.Capability"})
"""Enums a frame may carry (by value)."""

RECORDS = frozenset({"engine_core.dispatch.MeshRank", "engine_core.rollout.WeightBucket"})
"""Dataclasses of plain fields a frame may carry (rebuilt field by field)."""


class WireError(EngineCoreError):
    """A value that cannot cross between interpreters, or a frame that is not one."""


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _allowed(name: str, allowed: frozenset[str], what: str) -> Any:
    if name not in allowed:
        raise WireError(
            f"a frame names {what} {name!r}, which is not on the allow-list {sorted(allowed)}; "
            "the two sides run different versions of engine-core, or the frame is corrupted."
        )
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def tensor(self, t: torch.Tensor) -> dict[str, Any]:
        data = t.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        data = data.contiguous()
        # safetensors refuses tensors that share memory: a second view of the same storage
        # travels as a copy of its own
        storage = data.untyped_storage().data_ptr() if data.numel() else -1
        if storage in self._storages:
            data = data.clone()
            storage = data.untyped_storage().data_ptr()
        if data.numel():
            self._storages.add(storage)
        key = str(len(self.tensors))
        self.tensors[key] = data
        return {"$t": key}

    def value(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, enum.Enum):
            name = _name(type(obj))
            if name not in ENUMS:
                raise WireError(f"cannot send enum {name} across interpreters: not allow-listed.")
            return {"$enum": name, "value": obj.value}
        if isinstance(obj, (int, float)):
            return obj
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, (NonTensorStack, NonTensorData)):
            return self.non_tensor(obj)
        if isinstance(obj, TensorDict):
            return {
                "$td": {
                    "batch_size": list(obj.batch_size),
                    "items": {str(k): self.value(obj.get(k)) for k in obj.keys()},
                }
            }
        if isinstance(obj, (list, tuple)):
            items = [self.value(x) for x in obj]
            return items if isinstance(obj, list) else {"$tuple": items}
        if isinstance(obj, (set, frozenset)):
            return {"$set": [self.value(x) for x in obj], "frozen": isinstance(obj, frozenset)}
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj):
                if any(k.startswith("$") for k in obj):
                    return {"$dict": [[k, self.value(v)] for k, v in obj.items()]}
                return {k: self.value(v) for k, v in obj.items()}
            return {"$dict": [[self.value(k), self.value(v)] for k, v in obj.items()]}
        name = _name(type(obj))
        if name in MODELS:
            return {"$model": name, "data": obj.model_dump(mode="json")}
        if name in RECORDS and dataclasses.is_dataclass(obj):
            fields = {f.name: self.value(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            return {"$record": name, "fields": fields}
        raise WireError(
            f"cannot send a {name} across interpreters: only plain data (None, bool, int, "
            f"float, str, lists, tuples, sets, dicts), tensors, TensorDicts and the allow-listed "
            f"configs ({sorted(MODELS | ENUMS | RECORDS)}) cross; send its fields instead."
        )

    def non_tensor(self, obj: NonTensorStack | NonTensorData) -> dict[str, Any]:
        if isinstance(obj, NonTensorStack):
            return {
                "$nts": [self.value(x) for x in obj.tolist()],
                "batch_size": list(obj.batch_size),
            }
        return {"$ntd": self.value(obj.data), "batch_size": list(obj.batch_size)}


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def value(self, obj: Any) -> Any:
        if isinstance(obj, list):
            return [self.value(x) for x in obj]
        if not isinstance(obj, dict):
            return obj
        tags = [k for k in obj if k.startswith("$")]
        if not tags:
            return {k: self.value(v) for k, v in obj.items()}
        tag = tags[0]
        if tag == "$t":
            if obj["$t"] not in self.tensors:
                raise WireError(f"a frame refers to tensor {obj['$t']!r}, which its blob lacks.")
            return self.tensors[obj["$t"]]
        if tag == "$tuple":
            return tuple(self.value(x) for x in obj["$tuple"])
        if tag == "$set":
            items = [self.value(x) for x in obj["$set"]]
            return frozenset(items) if obj.get("frozen") else set(items)
        if tag == "$dict":
            return {self.value(k): self.value(v) for k, v in obj["$dict"]}
        if tag == "$td":
            spec = obj["$td"]
            out = TensorDict({}, batch_size=spec["batch_size"])
            for key, item in spec["items"].items():
                out[key] = self.value(item)
            return out
        if tag == "$nts":
            return NonTensorStack.from_list([self.value(x) for x in obj["$nts"]])
        if tag == "$ntd":
            return NonTensorData(self.value(obj["$ntd"]), batch_size=obj["batch_size"])
        if tag == "$enum":
            return _allowed(obj["$enum"], ENUMS, "enum")(obj["value"])
        if tag == "$model":
            return _allowed(obj["$model"], MODELS, "config").model_validate(obj["data"])
        if tag == "$record":
            cls = _allowed(obj["$record"], RECORDS, "record")
            return cls(**{k: self.value(v) for k, v in obj["fields"].items()})
        raise WireError(f"a frame holds an unknown tag {tag!r}; it is corrupted or not ours.")


def _encoded(obj: Any) -> tuple[bytes, bytes]:
    """A frame's two parts: the prefix with the JSON header, and the tensor blob."""
    enc = _Encoder()
    header = json.dumps(enc.value(obj), allow_nan=True).encode()
    blob = save_tensors(enc.tensors) if enc.tensors else b""
    return _PREFIX.pack(MAGIC, len(header), len(blob)) + header, blob


def encode(obj: Any) -> bytes:
    """One frame holding ``obj``."""
    head, blob = _encoded(obj)
    return head + blob


def decode(frame: bytes) -> Any:
    """The value :func:`encode` put in ``frame``; a frame that is not one is refused."""
    if len(frame) < _PREFIX.size:
        raise WireError(f"a frame of {len(frame)} bytes is shorter than its own prefix.")
    magic, header_len, blob_len = _PREFIX.unpack_from(frame)
    if magic != MAGIC:
        raise WireError(f"a frame starts with {magic!r}, not {MAGIC!r}: not an engine-core frame.")
    if len(frame) != _PREFIX.size + header_len + blob_len:
        raise WireError(
            f"a frame of {len(frame)} bytes announces {header_len} + {blob_len} bytes after its "
            "prefix: it is truncated or corrupted."
        )
    start = _PREFIX.size + header_len
    return _payload(frame[_PREFIX.size : start], frame[start:] if blob_len else b"")


def _payload(header: bytes, blob: bytes) -> Any:
    try:
        tree = json.loads(header.decode())
        tensors = load_tensors(blob) if blob else {}
    except (UnicodeDecodeError, ValueError, RuntimeError, SafetensorError) as e:
        raise WireError(
            f"a frame's header or tensors cannot be read ({e}): it is corrupted."
        ) from e
    return _Decoder(tensors).value(tree)


def write(fd: int, obj: Any) -> None:
    """Send ``obj`` as one frame on file descriptor ``fd`` (blocking until it is all written).
    The tensor blob is written from where safetensors put it, not copied into one frame."""
    for part in _encoded(obj):
        view = memoryview(part)
        while view:
            view = view[os.write(fd, view) :]


def _read_exactly(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            raise EOFError(f"the other side closed its end after {n - left} of {n} bytes.")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read(fd: int) -> Any:
    """One frame's value from file descriptor ``fd``; :class:`EOFError` when the other side has
    closed it before a frame began or during one."""
    return decode_frame(*read_frame(fd))


def read_frame(fd: int) -> tuple[bytes, bytes]:
    """One whole frame's header and tensor bytes from ``fd``, not decoded: a frame whose value
    then fails to decode (:func:`decode_frame`) leaves the stream in step for the next one.
    :class:`EOFError` when the other side has closed ``fd``; :class:`WireError` when what
    arrives is not a frame (the stream is out of step then)."""
    prefix = _read_exactly(fd, _PREFIX.size)
    magic, header_len, blob_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise WireError(f"a frame starts with {magic!r}, not {MAGIC!r}: not an engine-core frame.")
    if header_len > MAX_HEADER_BYTES:
        raise WireError(
            f"a frame announces a {header_len}-byte header (at most {MAX_HEADER_BYTES}): corrupted."
        )
    header = _read_exactly(fd, header_len)
    return header, _read_exactly(fd, blob_len) if blob_len else b""


def decode_frame(header: bytes, blob: bytes) -> Any:
    """The value of a frame :func:`read_frame` read."""
    return _payload(header, blob)
