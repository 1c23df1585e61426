"""Weight sync across processes: a trainer rank streams verified buckets to rollout processes.

A :class:`WeightSyncGroup` is a process group of its own (a TCP store and a gloo group; NCCL
on CUDA hosts), separate from the trainer's default group, between the trainer's sending rank
(rank 0 of the sync group) and one or more rollout processes (ranks 1..N). It does not touch
``torch.distributed``'s default group, so a trainer under ``torchrun`` and a rollout in its own
process can both join it.

- :func:`send_weights` (rank 0) groups (HF name, tensor) pairs into bounded buckets and, per
  bucket, broadcasts a header (names, shapes, dtypes, the bucket's :func:`tensor_checksum`) and
  then the bucket's bytes, which the receiver takes into one flat buffer: a tensor of at least
  :data:`STAGE_BYTES` straight from its own memory, runs of smaller ones through one staging
  copy of at most that size (:func:`pieces`). The sender holds no copy of a bucket.
- Headers, end/abort markers and verdicts are fixed-format messages: versioned UTF-8 JSON after
  an int64 length, validated field by field on receipt (known dtype names only, byte count
  consistent with shapes). Nothing that crosses the wire is unpickled.
- :func:`receive_weights` (ranks ≥ 1) rebuilds each bucket and hands it, with the sender's
  checksum, to the rollout's :meth:`BaseRollout.load_weights`, which checks names and shapes
  against its model before loading and compares the checksum of what it loaded with the
  sender's: one comparison, end to end, which a corrupted transfer fails as a failed load does
  (naming the bucket's parameters). Each bucket is hashed twice in all: once by the sender,
  once as loaded.
- Every receiver reports back; the sender raises :class:`WeightSyncError` with each failing
  receiver's message, so a sync is never silent on either side. After a failure the receiver
  still drains the stream, so both sides stay in step for the next sync.

Executed here on CPU with gloo (trainer and rollout in separate processes, 1 and 2 trainer
ranks, 1 and 2 rollout processes). The NCCL path (``backend="nccl"``, buffers on the current CUDA device) is written
against the same public API and has never run.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import itertools
import json
import math
import socket
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine_core.errors import WeightSyncError
from engine_core.rollout import (
    BUCKET_BYTES,
    CutBuckets,
    SentBucket,
    WeightBucket,
    WeightLoader,
    run_through,
    sent_buckets,
)

__all__ = ["WeightSyncGroup", "send_weights", "receive_weights"]

_PREFIX = "engine-core-weight-sync"
PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20  # a header for ~10^5 parameters; anything longer is refused
# the dtypes a bucket may carry, by the name on the wire (never looked up on the torch module)
_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True)
class _Header:
    """What the sender says about the bucket whose bytes follow."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    checksum: str
    nbytes: int


@dataclass(frozen=True)
class _End:
    """The stream is complete."""


@dataclass(frozen=True)
class _Abort:
    """The sender failed mid-stream; ``reason`` says why."""

    reason: str


@dataclass(frozen=True)
class _Verdict:
    """A receiver's outcome: ``error`` is '' when every bucket was loaded and verified."""

    error: str


_Message = _Header | _End | _Abort | _Verdict
_KINDS: dict[str, type] = {"bucket": _Header, "end": _End, "abort": _Abort, "verdict": _Verdict}
_FIELDS = {
    "bucket": {"names", "shapes", "dtypes", "checksum", "nbytes"},
    "end": set(),
    "abort": {"reason"},
    "verdict": {"error"},
}


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=_DTYPES[dtype]).element_size()


def encode_message(msg: _Message) -> bytes:
    """``msg`` as UTF-8 JSON: the only format that crosses the wire (nothing is unpickled)."""
    body: dict[str, Any]
    if isinstance(msg, _Header):
        body = {
            "kind": "bucket",
            "names": list(msg.names),
            "shapes": [list(s) for s in msg.shapes],
            "dtypes": list(msg.dtypes),
            "checksum": msg.checksum,
            "nbytes": msg.nbytes,
        }
    elif isinstance(msg, _End):
        body = {"kind": "end"}
    elif isinstance(msg, _Abort):
        body = {"kind": "abort", "reason": msg.reason}
    else:
        body = {"kind": "verdict", "error": msg.error}
    return json.dumps({"v": PROTOCOL_VERSION, **body}, separators=(",", ":")).encode()


def _malformed(what: str, data: bytes) -> WeightSyncError:
    shown = data[:80] + (b"..." if len(data) > 80 else b"")
    return WeightSyncError(
        f"malformed weight-sync message: {what} (received {len(data)} bytes: {shown!r}). Both "
        f"ends must run engine-core with weight-sync protocol v{PROTOCOL_VERSION}; the group is "
        f"out of step now: close it and create a new one."
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _str_list(body: dict[str, Any], key: str, data: bytes) -> tuple[str, ...]:
    value = body[key]
    if type(value) is not list or any(type(v) is not str for v in value):
        raise _malformed(f"{key!r} must be a list of strings", data)
    return tuple(value)


def decode_message(data: bytes) -> _Message:
    """Parse and validate one message; raises :class:`WeightSyncError` on anything unexpected."""
    try:
        body = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _malformed(f"not UTF-8 JSON ({type(e).__name__})", data) from None
    if type(body) is not dict:
        raise _malformed("not a JSON object", data)
    if body.get("v") != PROTOCOL_VERSION:
        raise _malformed(f"protocol version {body.get('v')!r}, expected {PROTOCOL_VERSION}", data)
    kind = body.get("kind")
    if kind not in _KINDS:
        raise _malformed(f"unknown kind {kind!r}; allowed: {', '.join(_KINDS)}", data)
    if set(body) - {"v", "kind"} != _FIELDS[kind]:
        fields = sorted(set(body) - {"v", "kind"})
        raise _malformed(
            f"the {kind!r} message has exactly the fields {sorted(_FIELDS[kind])}, got {fields}",
            data,
        )
    if kind == "end":
        return _End()
    if kind in ("abort", "verdict"):
        (field,) = _FIELDS[kind]
        if type(body[field]) is not str:
            raise _malformed(f"{field!r} must be a string", data)
        return _Abort(body[field]) if kind == "abort" else _Verdict(body[field])
    names, dtypes = _str_list(body, "names", data), _str_list(body, "dtypes", data)
    shapes = body["shapes"]
    if type(shapes) is not list or any(
        type(s) is not list or any(type(d) is not int or d < 0 for d in s) for s in shapes
    ):
        raise _malformed("'shapes' must be lists of non-negative integers", data)
    if not len(names) == len(shapes) == len(dtypes):
        raise _malformed("'names', 'shapes' and 'dtypes' differ in length", data)
    unknown = sorted(set(dtypes) - set(_DTYPES))
    if unknown:
        raise _malformed(f"unknown dtypes {unknown}; allowed: {', '.join(_DTYPES)}", data)
    checksum, nbytes = body["checksum"], body["nbytes"]
    if type(checksum) is not str:
        raise _malformed("'checksum' must be a string", data)
    expected = sum(math.prod(s) * _element_size(dt) for s, dt in zip(shapes, dtypes, strict=True))
    if type(nbytes) is not int or nbytes != expected:
        raise _malformed(f"'nbytes' is {nbytes!r}, the shapes and dtypes make {expected}", data)
    return _Header(names, tuple(tuple(s) for s in shapes), dtypes, checksum, nbytes)


def _loopback_address(host: str, port: int) -> tuple[socket.AddressFamily, str] | None:
    """(family, address) to bind when ``host`` names this machine's loopback only, else None."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return None  # let torch report the unresolvable host as before
    addresses = [str(info[4][0]).split("%")[0] for info in infos]  # drop an IPv6 scope id
    try:
        loopback = bool(infos) and all(ipaddress.ip_address(a).is_loopback for a in addresses)
    except ValueError:
        return None
    return (infos[0][0], addresses[0]) if loopback else None


def _listen_fd(host: str, port: int) -> int | None:
    """A socket listening on ``host``'s loopback address only (None: not a loopback host).

    Torch's store server listens on every interface when given a port; handing it a bound
    socket keeps a loopback-only group unreachable from other machines.
    """
    found = _loopback_address(host, port)
    if found is None:
        return None
    family, address = found
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()


class WeightSyncGroup:
    """Rank ``rank`` of a ``world_size``-process group used only for weight sync.

    Rank 0 (the trainer's sender) hosts the TCP store at ``host:port``; every member must be
    constructed with the same ``host``, ``port`` and ``world_size``. When ``host`` is a loopback
    address (``127.0.0.1``, ``localhost``) the store listens on loopback only; any other address
    is an explicit choice to accept other machines, and the store listens on every interface.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> None:
        if world_size < 2:
            raise ValueError(
                f"a weight-sync group needs the sender and at least one rollout process, got "
                f"world_size={world_size}."
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}.")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}.")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        fd = _listen_fd(host, port) if rank == 0 else None
        try:
            self._store = dist.TCPStore(
                host, port, world_size, is_master=rank == 0, timeout=timeout, master_listen_fd=fd
            )
        except BaseException:
            if fd is not None:
                with contextlib.suppress(OSError):
                    socket.close(fd)
            raise
        store = dist.PrefixStore(_PREFIX, self._store)
        if backend == "nccl":  # written against the public API; never executed here
            self.device = torch.device("cuda", torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()  # CUDA builds of torch only
            options._timeout = timeout
            self._pg: Any = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self.device = torch.device("cpu")
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Broadcast ``tensor`` (on :attr:`device`) from ``src`` in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._pg.broadcast([tensor], opts).wait()
        return tensor

    def broadcast_bytes(self, data: bytes, src: int) -> bytes:
        """Broadcast ``data`` (ignored on other ranks) from ``src``: its length, then its bytes.

        Raises :class:`WeightSyncError` on a receiving rank when the announced length is out of
        bounds (the bytes are not received then: the group is out of step).
        """
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.rank == src:
            if len(data) > MAX_MESSAGE_BYTES:
                raise ValueError(
                    f"a message is at most {MAX_MESSAGE_BYTES} bytes, got {len(data)}."
                )
            size.fill_(len(data))
        self.broadcast(size, src)
        n = int(size.item())
        if not 0 <= n <= MAX_MESSAGE_BYTES:
            raise _malformed(f"announced length {n} outside [0, {MAX_MESSAGE_BYTES}]", b"")
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        if self.rank == src and n:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf, src)
        return data if self.rank == src else buf.cpu().numpy().tobytes()

    def broadcast_message(self, msg: _Message | None, src: int) -> _Message:
        """Broadcast ``msg`` from ``src`` as a fixed-format JSON message; every rank returns it."""
        if self.rank == src:
            if msg is None:
                raise ValueError("the source rank must give the message to broadcast.")
            self.broadcast_bytes(encode_message(msg), src)
            return msg
        return decode_message(self.broadcast_bytes(b"", src))

    def close(self) -> None:
        """Drop the group and the store (the port is free once every member has closed)."""
        self._pg = None
        self._store = None  # type: ignore[assignment]


# a tensor of at least this many bytes is broadcast from its own memory; smaller ones travel
# together through a staging buffer of at most this size (one broadcast for many small tensors)
STAGE_BYTES = 1 << 20


def pieces(nbytes: Sequence[int]) -> list[range]:
    """How a bucket of tensors of ``nbytes`` each is broadcast: ranges of tensor indices, one
    broadcast each, in order. A tensor of at least :data:`STAGE_BYTES` alone; consecutive
    smaller ones together while they fit in :data:`STAGE_BYTES`. Both ends compute it from the
    header, so the receiver takes each piece into its slice of the bucket's flat buffer."""
    out: list[range] = []
    start, size = 0, 0
    for i, n in enumerate(nbytes):
        if n >= STAGE_BYTES or size + n > STAGE_BYTES:
            if i > start:
                out.append(range(start, i))
            start, size = i, 0
        size += n
        if n >= STAGE_BYTES:
            out.append(range(i, i + 1))
            start, size = i + 1, 0
    if len(nbytes) > start:
        out.append(range(start, len(nbytes)))
    return out


def _raw(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)


def _broadcast_bucket(group: WeightSyncGroup, bucket: list[tuple[str, torch.Tensor]]) -> None:
    """The sending side of a bucket's bytes, piece by piece (:func:`pieces`)."""
    sizes = [t.numel() * t.element_size() for _, t in bucket]
    for piece in pieces(sizes):
        parts = [_raw(bucket[i][1], group.device) for i in piece]
        group.broadcast(parts[0] if len(parts) == 1 else torch.cat(parts), 0)


def _receive_bucket(group: WeightSyncGroup, sizes: Sequence[int]) -> list[torch.Tensor]:
    """The receiving side: each tensor's bytes, as slices of one flat buffer on the CPU, which
    the bucket's broadcasts filled piece by piece."""
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=group.device)
    offsets = [0, *itertools.accumulate(sizes)]
    for piece in pieces(sizes):
        group.broadcast(flat[offsets[piece.start] : offsets[piece.stop]], 0)
    flat = flat.cpu()
    return [flat[a:b] for a, b in itertools.pairwise(offsets)]


def _header(bucket: list[tuple[str, torch.Tensor]], checksum: str) -> _Header:
    dtypes = tuple(str(t.dtype).removeprefix("torch.") for _, t in bucket)
    unknown = sorted({(n, d) for (n, _), d in zip(bucket, dtypes, strict=True) if d not in _DTYPES})
    if unknown:
        raise WeightSyncError(
            f"cannot send {', '.join(f'{n} ({d})' for n, d in unknown)}: weight sync carries the "
            f"dtypes {', '.join(_DTYPES)}; cast the tensor first."
        )
    return _Header(
        names=tuple(n for n, _ in bucket),
        shapes=tuple(tuple(t.shape) for _, t in bucket),
        dtypes=dtypes,
        checksum=checksum,
        nbytes=sum(t.numel() * t.element_size() for _, t in bucket),
    )


def send_weights(
    group: WeightSyncGroup | None,
    named: Iterable[tuple[str, torch.Tensor]] | CutBuckets,
    *,
    bucket_bytes: int = BUCKET_BYTES,
    receiver_names: Sequence[str] | None = None,
) -> list[WeightBucket]:
    """Stream ``named`` to every rollout process of ``group`` and wait for their verdicts:
    (name, tensor) pairs cut into buckets of ``bucket_bytes``, or an engine's
    :class:`~engine_core.rollout.CutBuckets` as they come.

    Call it on every trainer rank: sharded engines gather full parameters collectively, so each
    rank iterates ``named``; ranks that are not the sender pass ``group=None`` and send nothing.
    Raises :class:`WeightSyncError` naming each receiver that refused a bucket: as
    ``receiver_names[r - 1]`` for rank ``r`` when given (one name per receiving rank), else as
    "rollout rank r".
    """
    if group is None:
        run_through(named)  # take part in the engine's collectives
        return []
    if group.rank != 0:
        raise ValueError(f"send_weights runs on rank 0 of the sync group, not rank {group.rank}.")
    done: list[WeightBucket] = []
    names: list[str] | None = None
    try:
        names = _receiver_names(group, receiver_names)
        for bucket, checksum in sent_buckets(named, bucket_bytes):
            header = _header(bucket, checksum)
            group.broadcast_message(header, 0)
            _broadcast_bucket(group, bucket)
            done.append(WeightBucket(header.names, header.shapes, header.checksum))
            del bucket  # not held while the next bucket is gathered
    except BaseException as e:
        # the receivers are waiting for a header: tell them the stream ended badly
        group.broadcast_message(_Abort(f"{type(e).__name__}: {e}"), 0)
        _collect_verdicts(group, names=names)
        raise
    group.broadcast_message(_End(), 0)
    failures = [f"{names[r - 1]}: {msg}" for r, msg in _collect_verdicts(group, names=names) if msg]
    if failures:
        raise WeightSyncError("weight sync failed on the rollout side; " + " | ".join(failures))
    return done


def _receiver_names(group: WeightSyncGroup, given: Sequence[str] | None) -> list[str]:
    """How failures name each receiving rank 1..N: ``given`` in rank order, or "rollout rank r"."""
    if given is None:
        return [f"rollout rank {r}" for r in range(1, group.world_size)]
    if isinstance(given, str) or len(given) != group.world_size - 1:
        raise ValueError(
            f"receiver_names names each receiving rank 1..{group.world_size - 1} of the sync "
            f"group in order, so it needs {group.world_size - 1} name(s); got {given!r}. Pass one "
            f"name per rollout process, or None for 'rollout rank r'."
        )
    return [str(n) for n in given]


def _collect_verdicts(
    group: WeightSyncGroup, mine: str | None = None, *, names: Sequence[str] | None = None
) -> list[tuple[int, str]]:
    """Every receiver broadcasts its verdict ('' when fine) in rank order."""
    out = []
    for r in range(1, group.world_size):
        msg = group.broadcast_message(_Verdict(mine or "") if r == group.rank else None, r)
        if not isinstance(msg, _Verdict):
            who = names[r - 1] if names is not None else f"rollout rank {r}"
            raise WeightSyncError(
                f"{who} sent a {type(msg).__name__.strip('_').lower()} message where "
                f"its verdict was expected; the weight-sync group is out of step."
            )
        out.append((r, msg.error))
    return out


class _ReceivedStream:
    """The buckets rank 0 sends, as (name, tensor) pairs; each bucket's checksum verified."""

    def __init__(self, group: WeightSyncGroup) -> None:
        self.group = group
        self.finished = False
        self.broken = False  # a malformed message: the stream cannot be followed any further
        self.abort: str | None = None

    def _next_bucket(self) -> SentBucket | None:
        try:
            msg = self.group.broadcast_message(None, 0)
            if not isinstance(msg, _Header | _End | _Abort):
                raise WeightSyncError(
                    f"the trainer sent a {type(msg).__name__.strip('_').lower()} message in the "
                    f"weight stream; the weight-sync group is out of step."
                )
        except WeightSyncError:
            self.finished = self.broken = True
            raise
        if not isinstance(msg, _Header):
            self.finished = True
            if isinstance(msg, _Abort):
                self.abort = msg.reason
            return None
        sizes = [
            int(torch.Size(shape).numel()) * _element_size(dtype)
            for shape, dtype in zip(msg.shapes, msg.dtypes, strict=True)
        ]
        raws = _receive_bucket(self.group, sizes)
        bucket = []
        for name, shape, dtype, raw in zip(msg.names, msg.shapes, msg.dtypes, raws, strict=True):
            if raw.storage_offset() % _element_size(dtype):  # after a narrower dtype: realign
                raw = raw.clone()
            bucket.append((name, raw.view(_DTYPES[dtype]).reshape(shape)))
        return bucket, msg.checksum  # compared with what the rollout loads, once

    def __iter__(self) -> Iterator[SentBucket]:
        while not self.finished:
            sent = self._next_bucket()
            if sent is None:
                break
            yield sent
            del sent  # not held while the next bucket arrives
        if self.abort is not None:
            raise WeightSyncError(f"the trainer aborted the weight sync: {self.abort}")

    def drain(self) -> None:
        while not self.finished:
            try:
                self._next_bucket()
            except WeightSyncError:
                continue


def receive_weights(group: WeightSyncGroup, rollout: WeightLoader) -> list[WeightBucket]:
    """Load the weights rank 0 streams into ``rollout``, verified; report the verdict back.

    A malformed message from the sender is raised at once: the stream cannot be followed past it,
    so no verdict is sent and the group must be recreated.
    """
    if group.rank == 0:
        raise ValueError("receive_weights runs on a rollout rank (>= 1) of the sync group.")
    stream = _ReceivedStream(group)
    try:
        done = rollout.load_weights(stream)
    except Exception as e:
        if stream.broken:
            raise
        stream.drain()
        if stream.broken:
            raise
        _collect_verdicts(group, str(e) if isinstance(e, WeightSyncError) else repr(e))
        raise
    stream.drain()
    _collect_verdicts(group, "")
    return done
