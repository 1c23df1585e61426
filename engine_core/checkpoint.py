"""Checkpoint folder layout shared by engines: ``<root>/global_step_<N>/``, staged, rotated.

``root`` is a local path or any URL fsspec understands (``s3://``, ``gs://``, ``memory://``,
...). A checkpoint is written into a temporary sibling folder (``global_step_<N>.tmp``) and moved
into place only when complete, so an interrupted save never leaves a half-written
``global_step_<N>`` and never touches an existing one. On local and POSIX filesystems the move is
an atomic rename; on object stores it is a copy then delete, and the ``.tmp`` name keeps an
unfinished move out of :func:`list_checkpoints`. Rotation deletes the oldest complete
checkpoints beyond the limit, each renamed ``global_step_<N>.deleting`` first, so an interrupted
deletion never leaves a partial checkpoint under a checkpoint's name.

The small I/O helpers (``save_torch``, ``load_torch``, ``save_safetensors``, ``load_safetensors``,
``is_file``, ``is_dir``) take the same kind of location, so engines never assume a local disk.

State files (``save_torch`` / ``load_torch``) hold plain data only: tensors inside dicts, lists and
tuples of str, int, float, bool and None. They are read with ``torch.load(weights_only=True)``,
so a file planted in a checkpoint folder is parsed, never executed; anything else in it, or a
damaged file, is a :class:`CheckpointError` naming the file. ``save_torch`` refuses to write
anything that would not load back that way.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from engine_core.errors import CheckpointError

__all__ = [
    "STEP_DIR_PATTERN",
    "join",
    "step_dir",
    "list_checkpoints",
    "latest_checkpoint",
    "rotate",
    "check_max_ckpt_to_keep",
    "staging_dir",
    "commit_staging",
    "remove_stale_staging",
    "is_file",
    "is_dir",
    "save_torch",
    "load_torch",
    "save_safetensors",
    "load_safetensors",
    "replace_folder",
    "fresh_folder",
    "MANIFEST_FILE",
    "JOB_STATE_FILE",
    "CheckpointPart",
    "JobCheckpoints",
    "write_manifest",
    "verify_checkpoint",
    "set_aside",
    "verify_on_every_rank",
]

MANIFEST_FILE = "manifest.json"
# the caller's state (a job's data position, say), committed with the engines' state
JOB_STATE_FILE = "job_state.pt"
_MANIFEST_FORMAT = 1

STEP_DIR_PATTERN = re.compile(r"^global_step_(\d+)$")
_DELETING = ".deleting"  # suffix of a rotated-out checkpoint while it is being deleted


def _fs(location: str | Path) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(str(location))
    return fs, path


def _is_local(location: str | Path) -> bool:
    return isinstance(_fs(location)[0], LocalFileSystem)


def join(location: str | Path, *names: str) -> str:
    """``location/name/...`` for a local path or a URL (no normalisation beyond slashes)."""
    out = str(location).rstrip("/")
    for name in names:
        out = f"{out}/{name}"
    return out


def step_dir(root: str | Path, step: int) -> str:
    if step < 0:
        raise CheckpointError(f"checkpoint step must be >= 0, got {step}.")
    return join(root, f"global_step_{step}")


def is_file(location: str | Path) -> bool:
    fs, path = _fs(location)
    return bool(fs.isfile(path))


def is_dir(location: str | Path) -> bool:
    fs, path = _fs(location)
    return bool(fs.isdir(path))


def list_checkpoints(root: str | Path) -> list[tuple[int, str]]:
    """Complete checkpoints under ``root`` as (step, location), oldest first."""
    fs, path = _fs(root)
    if not fs.isdir(path):
        return []
    found = []
    for entry in fs.ls(path, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        m = STEP_DIR_PATTERN.match(name)
        if m and entry["type"] == "directory":
            found.append((int(m.group(1)), join(root, name)))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> str | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def staging_dir(root: str | Path, step: int) -> str:
    """A fresh temporary folder to write step ``step`` into; refuses to overwrite a checkpoint."""
    final = step_dir(root, step)
    fs, final_path = _fs(final)
    if fs.exists(final_path):
        raise CheckpointError(
            f"checkpoint {final} already exists; refusing to overwrite it. Save under a new step "
            f"or another root, or delete it yourself."
        )
    tmp = final + ".tmp"
    tmp_path = final_path + ".tmp"
    if fs.exists(tmp_path):  # leftover of an interrupted save: never a complete checkpoint
        fs.rm(tmp_path, recursive=True)
    fs.makedirs(tmp_path, exist_ok=True)
    return tmp


def remove_stale_staging(root: str | Path) -> list[str]:
    """Remove the staging folders (``global_step_<N>.tmp``) that saves interrupted before their
    commit left under ``root``: never a complete checkpoint. Returns what was removed. Call it
    when a run starts, before anything saves."""
    fs, path = _fs(root)
    if not fs.isdir(path):
        return []
    removed = []
    for entry in fs.ls(path, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if name.endswith(".tmp") and STEP_DIR_PATTERN.match(name[: -len(".tmp")]):
            fs.rm(entry["name"], recursive=True)
            removed.append(join(root, name))
    return removed


def commit_staging(root: str | Path, step: int, max_ckpt_to_keep: int | None) -> str:
    """Move the staged folder into place, then rotate old checkpoints."""
    final = step_dir(root, step)
    fs, final_path = _fs(final)
    fs.mv(final_path + ".tmp", final_path, recursive=True)
    rotate(root, max_ckpt_to_keep)
    return final


def check_max_ckpt_to_keep(max_ckpt_to_keep: int | None) -> None:
    """Refuse a rotation limit other than None or an int >= 1 (before anything is written)."""
    if max_ckpt_to_keep is None:
        return
    if isinstance(max_ckpt_to_keep, bool) or not isinstance(max_ckpt_to_keep, int):
        raise CheckpointError(
            f"max_ckpt_to_keep must be an int >= 1 or None, got {max_ckpt_to_keep!r}."
        )
    if max_ckpt_to_keep < 1:
        raise CheckpointError(
            f"max_ckpt_to_keep must be >= 1 or None (keep every checkpoint), got "
            f"{max_ckpt_to_keep}."
        )


def rotate(root: str | Path, max_ckpt_to_keep: int | None) -> list[str]:
    """Delete the oldest checkpoints so at most ``max_ckpt_to_keep`` remain; return those deleted."""
    if max_ckpt_to_keep is None:
        return []
    check_max_ckpt_to_keep(max_ckpt_to_keep)
    found = list_checkpoints(root)
    doomed = [loc for _, loc in found[: max(len(found) - max_ckpt_to_keep, 0)]]
    for loc in doomed:
        # renamed out of the checkpoint names first, so an interrupted deletion never leaves a
        # half-deleted global_step_<N> behind; leftovers are cleared below on a later rotation
        fs, path = _fs(loc)
        if fs.exists(path + _DELETING):
            fs.rm(path + _DELETING, recursive=True)
        fs.mv(path, path + _DELETING, recursive=True)
    fs, path = _fs(root)
    for entry in fs.ls(path, detail=True):
        if entry["name"].rstrip("/").endswith(_DELETING):
            fs.rm(entry["name"], recursive=True)
    return doomed


def replace_folder(staged: str, final: str) -> None:
    """Swap a completely written ``staged`` folder in at ``final``, replacing what was there."""
    fs, final_path = _fs(final)
    _, staged_path = _fs(staged)
    old = final_path + ".old"
    if fs.exists(old):
        fs.rm(old, recursive=True)
    if fs.exists(final_path):
        fs.mv(final_path, old, recursive=True)
    fs.mv(staged_path, final_path, recursive=True)
    if fs.exists(old):
        fs.rm(old, recursive=True)


def fresh_folder(location: str) -> None:
    """Create ``location`` empty (removing a leftover of an interrupted write)."""
    fs, path = _fs(location)
    if fs.exists(path):
        fs.rm(path, recursive=True)
    fs.makedirs(path, exist_ok=True)


def _digest(fs: fsspec.AbstractFileSystem, path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _files_under(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, str]:
    """relative name -> full path of every file below ``root``."""
    root = root.rstrip("/")
    return {
        path[len(root) :].lstrip("/"): path
        for path in sorted(fs.find(root))
        if path.startswith(root + "/")
    }


def write_manifest(folder: str, *, step: int) -> None:
    """Write ``manifest.json`` into ``folder``: every other file with its size and SHA-256.

    Written last, just before the folder is committed: a checkpoint with a manifest is whole,
    and :func:`verify_checkpoint` can tell a damaged or changed file from an intact one.
    """
    fs, root = _fs(folder)
    files = {
        name: dict(zip(("size", "sha256"), _digest(fs, path), strict=True))
        for name, path in _files_under(fs, root).items()
        if name != MANIFEST_FILE
    }
    manifest = {"format": _MANIFEST_FORMAT, "step": step, "files": files}
    fs.pipe_file(f"{root.rstrip('/')}/{MANIFEST_FILE}", json.dumps(manifest, indent=1).encode())


def _share(sizes: Mapping[str, int], rank: int, world: int) -> set[str]:
    """The files rank ``rank`` of ``world`` hashes: largest first, each to the rank with the
    fewest bytes so far (ties to the lowest rank), so every rank reads about the same amount."""
    load = [0] * world
    mine: set[str] = set()
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += sizes[name]
        if owner == rank:
            mine.add(name)
    return mine


def verify_checkpoint(folder: str, *, rank: int = 0, world: int = 1, threads: int = 1) -> int:
    """Check the checkpoint ``folder`` against its manifest; return its step.

    Every caller reads the manifest and checks that exactly its files are there; the files' bytes
    are split between ``world`` callers by size (:func:`_share`), and this one (``rank``) hashes
    its share, ``threads`` files at a time (hashing releases the GIL, so threads use cores).
    With the defaults it hashes every file. A missing or unreadable manifest, a missing, extra,
    resized or changed file is a :class:`CheckpointError` naming the checkpoint and the file.
    Never unpickles anything.
    """
    fs, root = _fs(folder)
    where = f"checkpoint {folder}"
    manifest_path = f"{root.rstrip('/')}/{MANIFEST_FILE}"
    if not fs.isfile(manifest_path):
        raise CheckpointError(
            f"{where} has no {MANIFEST_FILE}: it was not completely written by save_checkpoint() "
            f"(or not by this engine-core version). Resume from another checkpoint."
        )
    try:
        manifest = json.loads(fs.cat_file(manifest_path))
        files = manifest["files"]
        step = manifest["step"]
        if manifest.get("format") != _MANIFEST_FORMAT or not isinstance(step, int):
            raise ValueError(f"unknown format {manifest.get('format')!r}")
        expected = {str(k): (int(v["size"]), str(v["sha256"])) for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{where}: {MANIFEST_FILE} is damaged ({type(e).__name__}: {e}). Resume from another "
            f"checkpoint."
        ) from None
    found = {k: v for k, v in _files_under(fs, root).items() if k != MANIFEST_FILE}
    missing = sorted(expected.keys() - found.keys())
    extra = sorted(found.keys() - expected.keys())
    if missing or extra:
        raise CheckpointError(
            f"{where} (step {step}) does not hold the files it was saved with: missing "
            f"{missing[:5]}, not in the manifest {extra[:5]}. Resume from another checkpoint."
        )
    mine = sorted(_share({n: size for n, (size, _) in expected.items()}, rank, world))

    def check(name: str) -> str | None:
        size, digest = _digest(fs, found[name])
        want_size, want_digest = expected[name]
        if size == want_size and digest == want_digest:
            return None
        what = f"{size} bytes, saved with {want_size}" if size != want_size else "SHA-256 differs"
        return (
            f"{where} (step {step}): {name} is damaged or was changed since it was saved "
            f"({what}). Resume from another checkpoint."
        )

    if threads > 1 and len(mine) > 1:
        with ThreadPoolExecutor(min(threads, len(mine))) as pool:
            problems = list(pool.map(check, mine))
    else:
        problems = [check(name) for name in mine]
    for problem in problems:  # the first in name order, whatever order they finished in
        if problem is not None:
            raise CheckpointError(problem)
    return step


def verify_on_every_rank(folder: str) -> int:
    """:func:`verify_checkpoint` split over every rank of the default process group, each
    hashing its share of the files at once; the first problem (lowest rank) is raised on every
    rank, sent as text (no pickle). A single process hashes every file, on as many threads as
    torch's intra-op count. Returns the step."""
    from engine_core.comm import all_gather_bytes

    rank, world = _rank_and_world()
    threads = max(1, torch.get_num_threads()) if world == 1 else 1
    step, problem = -1, ""
    try:
        step = verify_checkpoint(folder, rank=rank, world=world, threads=threads)
    except CheckpointError as e:
        problem = str(e)
    if world > 1:
        problems = [p.decode() for p in all_gather_bytes(problem.encode())]
        problem = next((p for p in problems if p), "")
    if problem:
        raise CheckpointError(problem)
    return step


def set_aside(location: str | Path) -> str:
    """Rename a checkpoint that failed verification to ``<name>.rejected`` (``.rejected-2``, ...):
    out of :func:`list_checkpoints`, its step free to be saved again, its files kept for
    inspection. Returns the new location."""
    fs, path = _fs(location)
    target, n = f"{path}.rejected", 1
    while fs.exists(target):
        n += 1
        target = f"{path}.rejected-{n}"
    fs.mv(path, target, recursive=True)
    return f"{str(location).rstrip('/')}{target[len(path) :]}"


_PLAIN_SCALARS = (str, int, float, bool, type(None))
_MAX_REASON = 200


def _non_plain(obj: Any, where: str) -> str | None:
    """Where in ``obj`` the first value that is not plain state data sits, or None."""
    if isinstance(obj, torch.Tensor) or type(obj) in _PLAIN_SCALARS:
        return None
    if type(obj) in (dict, OrderedDict):
        for k, v in obj.items():
            if type(k) not in _PLAIN_SCALARS:
                return f"a key of {where} ({type(k).__module__}.{type(k).__qualname__})"
            found = _non_plain(v, f"{where}[{k!r}]")
            if found:
                return found
        return None
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            found = _non_plain(v, f"{where}[{i}]")
            if found:
                return found
        return None
    return f"{where} ({type(obj).__module__}.{type(obj).__qualname__})"


def save_torch(obj: Any, location: str | Path) -> None:
    """Write plain state data (see the module docstring) to ``location``."""
    found = _non_plain(obj, "state")
    if found:
        raise CheckpointError(
            f"refusing to write {location}: {found} is not plain data. State files hold only "
            f"tensors in dicts, lists and tuples of str, int, float, bool and None, so that they "
            f"load with weights_only=True; convert it before saving."
        )
    with fsspec.open(str(location), "wb") as f:
        torch.save(obj, f)


def _reason(e: BaseException) -> str:
    """The informative part of a torch.load error, without torch's advice to unpickle anyway."""
    lines = [
        line.strip()
        for line in str(e).splitlines()
        if line.strip()
        and not any(
            skip in line
            for skip in ("weights_only", "Weights only", "Please file an issue", "documentation")
        )
    ]
    text = " ".join(lines) or type(e).__name__
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def load_torch(location: str | Path) -> Any:
    """Read a state file written by :func:`save_torch`; never runs code stored in it."""
    try:
        with fsspec.open(str(location), "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read the state file {location}: {e}") from e
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols it was not given
            warnings.simplefilter("ignore", UserWarning)
            obj = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        # `from None`: the chained error would repeat torch's advice to turn the safe loader off
        raise CheckpointError(
            f"{location} is not a valid engine-core state file ({_reason(e)}). State files hold "
            f"only tensors and plain containers and are never unpickled beyond that; the file is "
            f"damaged, truncated, or was not written by engine-core's save_checkpoint(). Resume "
            f"from another checkpoint."
        ) from None
    try:
        found = _non_plain(obj, "state")
    except RecursionError:
        found = "its nesting, deeper than any state engine-core writes,"
    if found:
        raise CheckpointError(
            f"{location} is not a valid engine-core state file: {found} is not plain data. "
            f"Resume from a checkpoint written by engine-core's save_checkpoint()."
        )
    return obj


def save_safetensors(
    tensors: dict[str, torch.Tensor], location: str, metadata: dict[str, str] | None = None
) -> None:
    from safetensors.torch import save, save_file

    tensors = _unshared(tensors)
    if _is_local(location):
        save_file(tensors, _fs(location)[1], metadata=metadata)  # streams to disk
        return
    fs, path = _fs(location)
    fs.pipe_file(path, save(tensors, metadata=metadata))


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each tensor that shares storage with an earlier one copied: safetensors
    refuses shared storage, and a tied embedding and output head are one tensor under two
    names. Loading puts both names back into the one parameter."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.device.index or 0) if t.numel() else (0, -1)
        if t.numel() and key in seen:
            t = t.clone()
        else:
            seen.add(key)
        out[name] = t
    return out


def load_safetensors(location: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load, load_file

    if _is_local(location):
        return load_file(_fs(location)[1])
    fs, path = _fs(location)
    return load(fs.cat_file(path))


_PART_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
ROOT_PART = ""  # the one part of a checkpoint whose files lie at the folder's root


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if _rank_and_world()[1] > 1:
        dist.barrier()


def _check_save_args(where: str, step: object, job_state: dict[str, Any] | None) -> None:
    """Refuse a step other than an int >= 0 and a job state that is not plain data."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{where}: step must be an int >= 0, got {step!r}.")
    if job_state is not None and (found := _non_plain(job_state, "job_state")):
        raise CheckpointError(
            f"{where}: {found} is not plain data; job_state holds tensors in dicts, lists and "
            f"tuples of str, int, float, bool and None."
        )


def _save_step(
    root: str,
    step: int,
    write: Callable[[str], None],
    *,
    job_state: dict[str, Any] | None,
    max_ckpt_to_keep: int | None,
) -> str:
    """The commit sequence of a checkpoint step, collective: refuse an existing step, stage
    ``global_step_<step>.tmp`` (rank 0), ``write(folder)`` on every rank, then rank 0 writes
    ``job_state`` and, last, the manifest, renames the folder into place and rotates."""
    final = step_dir(root, step)
    if is_dir(final):  # every rank sees it: all refuse, none waits at a barrier
        raise CheckpointError(
            f"checkpoint {final} already exists; refusing to overwrite it. Save under a new "
            f"step or another root, or delete it yourself."
        )
    rank, _ = _rank_and_world()
    if rank == 0:
        staging_dir(root, step)
    folder = final + ".tmp"
    write(folder)
    if rank == 0:
        if job_state is not None:
            save_torch(job_state, join(folder, JOB_STATE_FILE))
        write_manifest(folder, step=step)  # last: a folder with a manifest is whole
        commit_staging(root, step, max_ckpt_to_keep)
    _barrier()
    return final


class CheckpointPart(Protocol):
    """What :class:`JobCheckpoints` calls on each part of a job: a :class:`BaseEngine`, or a
    role's worker group (``engine_core_roles.distributed.placement.RoleGroup``) whose workers
    write their own shards."""

    def checkpoint_preflight(self, path: str, *, saving: bool) -> None: ...

    def write_checkpoint_files(self, folder: str, *, step: int) -> None: ...

    def read_checkpoint_files(self, folder: str) -> int: ...


class JobCheckpoints:
    """A job's checkpoints under ``root``: one folder per step for the whole job.

    ``global_step_<N>/`` holds each engine's files in a subfolder named after its part
    (``actor/``, ``critic/``, ...), the job's own state (``job_state.pt``: plain data, its
    data position say) and one manifest over all of them, written last. The folder is staged as
    ``global_step_<N>.tmp`` and committed by one rename, so a step is saved for every part or
    for none; rotation then deletes only older committed steps. Collective like the engines'
    methods: every rank of the engines' process group calls each method (rank 0 stages,
    writes the manifest and commits).
    """

    def __init__(self, root: str | Path, *, max_ckpt_to_keep: int | None = None) -> None:
        check_max_ckpt_to_keep(max_ckpt_to_keep)
        self.root = str(root)
        self.max_ckpt_to_keep = max_ckpt_to_keep

    def save(
        self,
        step: int,
        parts: Mapping[str, CheckpointPart],
        job_state: dict[str, Any] | None,
        *,
        where: str = "JobCheckpoints.save",
    ) -> str:
        """Write every part and ``job_state`` as step ``step``; return the committed folder.

        A single part may be named ``""``: its files then lie at the folder's root, the layout of
        :meth:`BaseEngine.save_checkpoint <engine_core.engine.BaseEngine.save_checkpoint>`, which
        is this call with the engine as that one part.
        """
        _check_save_args(where, step, job_state)
        root_part = list(parts) == [ROOT_PART]
        bad = sorted(name for name in parts if not _PART_NAME.match(name))
        if not root_part and (bad or not parts):
            raise CheckpointError(
                f"{where}: part names must be lowercase identifiers (a folder each), at least one "
                f"(or one part named '' at the folder's root); got {sorted(parts)}."
            )
        for engine in parts.values():
            engine.checkpoint_preflight(self.root, saving=True)

        def write(folder: str) -> None:
            for name, engine in parts.items():
                engine.write_checkpoint_files(join(folder, name) if name else folder, step=step)

        return _save_step(
            self.root, step, write, job_state=job_state, max_ckpt_to_keep=self.max_ckpt_to_keep
        )

    def _verify_everywhere(self, folder: str, names: list[str]) -> None:
        step = verify_on_every_rank(folder)  # the files' bytes, split over the ranks
        self._check_parts(folder, step, names)

    def verify(self, folder: str, names: list[str]) -> int:
        """Check ``folder`` against its manifest (every file hashed here, on as many threads as
        torch's intra-op count) and that it holds every part in ``names``."""
        step = verify_checkpoint(folder, threads=max(1, torch.get_num_threads()))
        self._check_parts(folder, step, names)
        return step

    def _check_parts(self, folder: str, step: int, names: list[str]) -> None:
        missing = [f"{name}/" for name in names if not is_dir(join(folder, name))]
        if not is_file(join(folder, JOB_STATE_FILE)):
            missing.append(JOB_STATE_FILE)
        if missing:
            raise CheckpointError(
                f"checkpoint {folder} (step {step}) holds no {', '.join(missing)}: it was not "
                f"saved by this job (parts {names}). Resume from a checkpoint the same job wrote."
            )

    def load(
        self, folder: str, parts: Mapping[str, CheckpointPart], *, verified: bool = False
    ) -> dict[str, Any]:
        """Verify ``folder``, restore every part from it and return its job state.

        ``verified=True``: the caller has just verified ``folder`` (e.g. with
        :meth:`newest_verified`), so its files are not hashed a second time.
        """
        for engine in parts.values():
            engine.checkpoint_preflight(self.root, saving=False)
        if not verified:
            self._verify_everywhere(folder, list(parts))
        job_state = load_torch(join(folder, JOB_STATE_FILE))
        if not isinstance(job_state, dict):
            raise CheckpointError(f"{join(folder, JOB_STATE_FILE)} holds no job state mapping.")
        for name, engine in parts.items():
            engine.read_checkpoint_files(join(folder, name))
        return job_state

    def newest_verified(self, names: list[str]) -> tuple[str, list[tuple[int, str, str]]]:
        """The newest committed step that verifies, and the newer ones that did not as
        (step, reason, where it was set aside): renamed ``*.rejected``, files kept. Single
        process (a driver's resume decision); raises when no step verifies."""
        skipped: list[tuple[int, str]] = []
        for step, location in reversed(list_checkpoints(self.root)):
            try:
                self.verify(location, names)
            except CheckpointError as e:
                skipped.append((step, str(e)))
                continue
            moved = [(bad, reason, set_aside(step_dir(self.root, bad))) for bad, reason in skipped]
            return location, moved
        if not skipped:
            raise CheckpointError(f"no checkpoint under {self.root}.")
        raise CheckpointError(
            f"no checkpoint under {self.root} verifies: "
            + " | ".join(f"step {step}: {reason}" for step, reason in skipped)
        )
