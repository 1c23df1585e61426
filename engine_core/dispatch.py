"""Dispatch and collect over named device meshes.

Every worker *instance* registers, per mesh name ("actor", "ref", "rollout"), its data-parallel
rank and whether it is that dp rank's collect rank. A call is dispatched one-to-all (the same
arguments everywhere), all-to-all (one argument per worker), or N-d by mesh: TensorDict
arguments are split into dp chunks, chunk ``k`` goes to every worker of dp rank ``k`` (its
tensor/pipeline replicas), and exactly one output per dp rank is collected, ordered by dp rank.
These functions are pure; every executor (in-process, local processes, Ray) uses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from tensordict import TensorDict

from engine_core.batch import META_KEY, get_meta, set_meta
from engine_core.capabilities import StrEnum
from engine_core.errors import DispatchError, MeshRegistrationError

__all__ = [
    "MeshRank",
    "Worker",
    "DispatchMode",
    "register",
    "dispatch_mode_of",
    "dispatch_one_to_all",
    "dispatch_all_to_all",
    "validate_mesh",
    "split_for_dp",
    "dispatch_nd",
    "collect_nd",
]

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
F = TypeVar("F", bound=Callable[..., Any])
_DISPATCH_ATTR = "__engine_core_dispatch__"


@dataclass(frozen=True)
class MeshRank:
    """One worker's place in a mesh."""

    dp_rank: int
    dp_size: int
    is_collect: bool

    def __post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.dp_size:
            raise MeshRegistrationError(
                f"dp_rank must be in [0, dp_size={self.dp_size}), got {self.dp_rank}."
            )


class Worker:
    """Mixin for classes run in a worker group; mesh registration is per instance.

    The registrations live in the instance's ``__dict__`` (created on first use, so subclasses
    need not call ``Worker.__init__``); nothing is shared between instances or classes.
    """

    def register_mesh(self, name: str, *, dp_rank: int, dp_size: int, is_collect: bool) -> None:
        meshes = self.__dict__.setdefault("_meshes", {})
        if name in meshes:
            raise MeshRegistrationError(
                f"mesh {name!r} is already registered on this worker ({meshes[name]}); "
                f"register each mesh once per worker."
            )
        meshes[name] = MeshRank(dp_rank, dp_size, is_collect)

    def mesh_rank(self, name: str) -> MeshRank:
        meshes = self.__dict__.get("_meshes", {})
        if name not in meshes:
            raise MeshRegistrationError(
                f"mesh {name!r} is not registered on this worker; registered: "
                f"{sorted(meshes) or 'none'}. Call register_mesh({name!r}, ...) first."
            )
        return meshes[name]

    def registered_meshes(self) -> dict[str, MeshRank]:
        return dict(self.__dict__.get("_meshes", {}))


class DispatchMode(StrEnum):
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    ND_COMPUTE = "nd_compute"


@dataclass(frozen=True)
class _Dispatch:
    mode: DispatchMode
    mesh: str | None


def register(mode: DispatchMode | str, mesh: str | None = None) -> Callable[[F], F]:
    """Mark a worker method with how its calls are dispatched (``ND_COMPUTE`` needs a mesh)."""
    mode = DispatchMode(mode)
    if mode is DispatchMode.ND_COMPUTE and not mesh:
        raise DispatchError("register(ND_COMPUTE) needs a mesh name, e.g. mesh='actor'.")

    def deco(fn: F) -> F:
        setattr(fn, _DISPATCH_ATTR, _Dispatch(mode, mesh))
        return fn

    return deco


def dispatch_mode_of(worker_cls: type, method: str) -> tuple[DispatchMode, str | None]:
    """The dispatch mode declared on ``worker_cls.method`` (one-to-all when undeclared)."""
    fn = getattr(worker_cls, method, None)
    if fn is None or not callable(fn):
        raise DispatchError(f"{worker_cls.__name__} has no method {method!r}.")
    d = getattr(fn, _DISPATCH_ATTR, None)
    return (d.mode, d.mesh) if d is not None else (DispatchMode.ONE_TO_ALL, None)


def dispatch_one_to_all(num_workers: int, args: Args, kwargs: Kwargs) -> list[tuple[Args, Kwargs]]:
    return [(args, kwargs)] * num_workers


def dispatch_all_to_all(num_workers: int, args: Args, kwargs: Kwargs) -> list[tuple[Args, Kwargs]]:
    for where, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if not isinstance(value, (list, tuple)) or len(value) != num_workers:
            raise DispatchError(
                f"all-to-all dispatch needs every argument to be a list of {num_workers} items "
                f"(one per worker); {where} is {type(value).__name__}"
                + (f" of length {len(value)}" if isinstance(value, (list, tuple)) else "")
                + "."
            )
    return [
        (tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()})
        for i in range(num_workers)
    ]


def validate_mesh(name: str, ranks: Sequence[MeshRank]) -> int:
    """Check a mesh's registrations: one dp size, every dp rank present, one collector each."""
    if not ranks:
        raise MeshRegistrationError(f"mesh {name!r}: no worker registered it.")
    sizes = {r.dp_size for r in ranks}
    if len(sizes) != 1:
        raise MeshRegistrationError(f"mesh {name!r}: workers disagree on dp_size: {sorted(sizes)}.")
    dp_size = sizes.pop()
    for dp in range(dp_size):
        members = [w for w, r in enumerate(ranks) if r.dp_rank == dp]
        collectors = [w for w in members if ranks[w].is_collect]
        if not members:
            raise MeshRegistrationError(
                f"mesh {name!r}: no worker has dp rank {dp} (dp_size={dp_size}); every dp rank "
                f"needs at least one worker."
            )
        if len(collectors) != 1:
            raise MeshRegistrationError(
                f"mesh {name!r}: dp rank {dp} has {len(collectors)} collect ranks (workers "
                f"{collectors or members}); exactly one worker per dp rank must be is_collect=True."
            )
    return dp_size


def split_for_dp(batch: TensorDict, dp_size: int) -> tuple[list[TensorDict], int]:
    """Contiguous dp chunks (views, no copy) after padding to a multiple of ``dp_size``.

    Padding repeats the first samples; :func:`collect_nd` trims it off again.
    """
    n = int(batch.batch_size[0])
    pad = (-n) % dp_size
    if pad:
        if n == 0:
            raise DispatchError("cannot dispatch an empty batch.")
        meta = get_meta(batch) if META_KEY in batch.keys() else None
        reps = torch.arange(n + pad) % n
        batch = cast(TensorDict, torch.cat([batch, batch[reps[n:]]]))
        if meta is not None:
            set_meta(batch, meta)
    chunks = list(batch.split((n + pad) // dp_size))
    return chunks, pad


def dispatch_nd(
    name: str, ranks: Sequence[MeshRank], args: Args, kwargs: Kwargs
) -> tuple[list[tuple[Args, Kwargs]], int]:
    """Split TensorDict arguments by dp rank; other arguments go to every worker unchanged."""
    dp_size = validate_mesh(name, ranks)
    pads: set[int] = set()

    def chunks_of(value: Any) -> list[Any] | None:
        if isinstance(value, TensorDict):
            chunks, pad = split_for_dp(value, dp_size)
            pads.add(pad)
            return chunks
        return None

    split_args = [chunks_of(a) for a in args]
    split_kwargs = {k: chunks_of(v) for k, v in kwargs.items()}
    if len(pads) > 1:
        raise DispatchError(f"mesh {name!r}: TensorDict arguments have different batch sizes.")
    per_worker = []
    for r in ranks:
        a = tuple(
            s[r.dp_rank] if s is not None else v for s, v in zip(split_args, args, strict=True)
        )
        kw = {k: (s[r.dp_rank] if s is not None else kwargs[k]) for k, s in split_kwargs.items()}
        per_worker.append((a, kw))
    return per_worker, (pads.pop() if pads else 0)


def collect_nd(name: str, ranks: Sequence[MeshRank], outputs: Sequence[Any], pad: int) -> Any:
    """One output per dp rank, from its collect rank, in dp order; padded samples trimmed."""
    if len(outputs) != len(ranks):
        raise DispatchError(f"mesh {name!r}: {len(outputs)} outputs for {len(ranks)} workers.")
    dp_size = validate_mesh(name, ranks)
    by_dp: dict[int, Any] = {
        r.dp_rank: out for r, out in zip(ranks, outputs, strict=True) if r.is_collect
    }
    ordered = [by_dp[dp] for dp in range(dp_size)]
    first = ordered[0]
    if isinstance(first, TensorDict):
        merged = cast(TensorDict, torch.cat(ordered))
        if META_KEY in first.keys():
            set_meta(merged, get_meta(first))
        return merged[: merged.batch_size[0] - pad] if pad else merged
    if isinstance(first, torch.Tensor):
        merged_t = torch.cat(ordered)
        return merged_t[: merged_t.shape[0] - pad] if pad else merged_t
    if isinstance(first, list):
        flat = [x for part in ordered for x in part]
        return flat[: len(flat) - pad] if pad else flat
    return ordered  # e.g. metric dicts: one per dp rank, in dp order
