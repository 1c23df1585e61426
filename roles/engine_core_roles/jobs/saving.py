"""Saving a job's checkpoint and its Hugging Face export, and a save the disk cannot hold told
in one sentence, whatever wrote it: DCP shards (fsdp, fsdp2), megatron's distributed
checkpoint, the reference engine's state files, the job state, the export's safetensors.

Whether a save failed for want of space is read off the error itself first:

* an ``OSError`` with errno ENOSPC, EDQUOT or EFBIG anywhere in its chain: ``__cause__`` and
  ``__context__``, and for a distributed-checkpoint failure (``CheckpointException``, a
  ``BaseException`` of torch's) each failing rank's own exception;
* the message torch's writers give for a write the disk cut short, a ``RuntimeError`` without
  an errno (``unexpected pos 704 vs 598``, ``file write failed``, ``short write``), or the
  system's own words for a full disk in the text a worker sent back;

and then off the disk: less than 1 MiB free where the save wrote, measured at the failure,
before the failed save's staging folder is removed (removing it frees the space again). Any
other ``OSError`` of the file system (a folder turned read-only) fails a save the same way,
told with its own reason; a broken connection to a worker does not.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console

from engine_core.checkpoint import JobCheckpoints
from engine_core.errors import CheckpointError

__all__ = [
    "save_checkpoint",
    "export_hf",
    "out_of_space",
    "a_write_failure",
    "what_is_safe",
    "why_it_failed",
]

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# what torch's stream writer raises for a short write, and the system's words for a full disk
# in the text of an error a worker sent back
_FULL_TEXTS = (
    "unexpected pos",
    "file write failed",
    "short write",
    os.strerror(errno.ENOSPC),
    os.strerror(errno.EDQUOT),
    os.strerror(errno.EFBIG),
)
_NEARLY_FULL = 1 << 20  # bytes free at a failure below which the disk was full


def causes(e: BaseException) -> Iterator[BaseException]:
    """``e`` and every exception behind it, nearest first: its ``__cause__`` and
    ``__context__``, and each failing rank's exception of a distributed-checkpoint failure."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__]
        if isinstance(x, CheckpointException):
            for _, failure in sorted((x.failures or {}).items()):
                todo.append(failure[0] if isinstance(failure, tuple) else failure)


def _text(x: BaseException) -> str:
    try:
        return str(x)
    except Exception:  # an exception whose __str__ fails says nothing
        return ""


def _full_line(x: BaseException) -> str | None:
    """The line of ``x``'s message that says the disk was full, or None."""
    if isinstance(x, OSError) and x.errno in _FULL_ERRNOS:
        return x.strerror or os.strerror(x.errno)
    for line in _text(x).splitlines():
        if any(text in line for text in _FULL_TEXTS):
            return line.strip()
    return None


def _a_file_error(x: BaseException) -> bool:
    return isinstance(x, OSError) and not isinstance(x, ConnectionError)


def out_of_space(e: BaseException, free_at_failure: int | None) -> bool:
    """Whether the save that raised ``e`` failed for want of space: by the error's own evidence,
    or by the space free where it wrote (``free_at_failure``: measured before its staging folder
    was removed; None: unknown)."""
    if any(_full_line(x) is not None for x in causes(e)):
        return True
    return free_at_failure is not None and free_at_failure < _NEARLY_FULL


def a_write_failure(e: BaseException, free_at_failure: int | None) -> bool:
    """Whether the save that raised ``e`` failed for its writes: out of space, or an ``OSError``
    of the file system anywhere in its chain."""
    return out_of_space(e, free_at_failure) or any(_a_file_error(x) for x in causes(e))


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def why_it_failed(e: BaseException, free_at_failure: int | None) -> str:
    """What the sentence says failed: the system's reason (and file), the writer's words behind
    ``No space left on device``, or the space that was left."""
    no_space = os.strerror(errno.ENOSPC)
    chain = list(causes(e))
    for x in chain:
        if isinstance(x, OSError) and x.errno in _FULL_ERRNOS:
            return f"{x.strerror or os.strerror(x.errno)}" + (
                f" ({x.filename})" if x.filename else ""
            )
    for x in chain:
        line = _full_line(x)
        if line is not None:
            return no_space if line == no_space else f"{no_space} ({_short(line)})"
    for x in chain:
        if isinstance(x, OSError) and _a_file_error(x):
            return f"{x.strerror or x}" + (f" ({x.filename})" if x.filename else "")
    return f"{no_space} ({size(free_at_failure)} free when it failed)"


def size(n: int | None) -> str:
    """Bytes for people: GB, MB or kB."""
    if n is None:
        return "unknown"
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale / 10:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1e3:.1f} kB"


def _size(folder: str | Path | None) -> int | None:
    """Bytes under a local ``folder`` (None: not a local folder)."""
    if folder is None or not os.path.isdir(folder):
        return None
    return sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files
    )


def _free(path: Path) -> int | None:
    """Bytes free on the file system of ``path`` (its nearest existing folder)."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def what_is_safe(last: str | None) -> str:
    """The end of every write failure's sentence: what is intact, and what to do."""
    return (
        f"Every committed step is intact; the last safe one is {last or 'none yet'}. Free space "
        f"(or make the folder writable), or move output_dir, and rerun with --resume auto."
    )


def _write_failure_told(
    e: BaseException,
    *,
    staging: str | Path,
    doing: str,
    where: Path,
    needed: int | None,
    last: str | None,
    on_failure: str,
    then: str,
    console: Console,
) -> bool:
    """When the failed save ``doing`` failed for its writes: remove its ``staging`` folder, then
    raise the one sentence (``stop``) or print it (``continue``, followed by ``then``: what the
    run does next) and return True. False, with nothing done, for a failure of another kind.
    The space free is measured first: removing the staging folder frees it."""
    free_at_failure = _free(where)
    if not a_write_failure(e, free_at_failure):
        return False
    shutil.rmtree(staging, ignore_errors=True)
    need = (
        f"it needs about {size(needed)} (the last save's size)"
        if needed is not None
        else "what it needs is not known yet (no earlier save)"
    )
    message = (
        f"{doing} failed: {why_it_failed(e, free_at_failure)}; {need} and {size(_free(where))} "
        f"is free there. {what_is_safe(last)}"
    )
    if on_failure != "continue":
        raise CheckpointError(message) from e
    console.print(f"[yellow]{message} on_save_failure=continue: {then}[/yellow]", soft_wrap=True)
    return True


def save_checkpoint(
    checkpoints: JobCheckpoints,
    step: int,
    parts: Mapping[str, Any],
    state: dict[str, Any],
    *,
    last: str | None,
    on_failure: str,
    console: Console,
) -> str | None:
    """Save step ``step``; return the committed folder, or None when the save failed and
    ``on_failure`` is ``continue``.

    Before the save, a warning when the last checkpoint (``last``) is larger than the free
    space. A save that fails for its writes (see the module docstring) leaves every committed
    step as it was; the space free is measured, then its staging folder is removed, and the
    failure is one sentence: what failed, the space the save needs (the last one's size), the
    space free, the last safe checkpoint and what to do. ``stop``: raised as
    :class:`CheckpointError`; ``continue``: printed, and the run trains on. A
    distributed-checkpoint failure of another kind is raised as a :class:`CheckpointError`
    naming its first failing rank's error."""
    from torch.distributed.checkpoint.api import CheckpointException

    root = Path(checkpoints.root)
    needed, free = _size(last), _free(root)
    if needed is not None and free is not None and free < needed:
        console.print(
            f"[yellow]step {step}: {size(free)} free under {root}, and the last checkpoint "
            f"took {size(needed)}: this save may fail for want of space.[/yellow]",
            soft_wrap=True,
        )
    try:
        return checkpoints.save(step, parts, state)
    # a distributed-checkpoint failure is a BaseException of its own
    except (Exception, CheckpointException) as e:
        if _write_failure_told(
            e,
            staging=root / f"global_step_{step}.tmp",
            doing=f"saving the checkpoint of step {step} under {root}",
            where=root,
            needed=needed,
            last=last,
            on_failure=on_failure,
            then="training goes on, and the next save tries again.",
            console=console,
        ):
            return None
        if isinstance(e, Exception):
            raise
        first = next((x for x in causes(e) if isinstance(x, Exception)), e)
        raise CheckpointError(
            f"saving the checkpoint of step {step} under {root} failed: "
            f"{type(first).__name__}: {_short(_text(first).strip())}"
        ) from e


def export_hf(
    export: Callable[[str], str],
    path: Path,
    *,
    tokenizer: Any = None,
    image_processor: Any = None,
    last: str | None,
    on_failure: str,
    console: Console,
) -> str | None:
    """The Hugging Face export at ``path``: ``export(path)`` (an engine's ``export_hf``), then
    ``tokenizer`` and ``image_processor`` (when given) saved into the folder it wrote, so that
    ``from_pretrained``, the tokenizer and the image processor all load it; return the folder,
    or None when it could not be written and ``on_failure`` is ``continue`` (the run then
    finishes without it).

    A write failure is the checkpoints' one sentence (the space it needs: the export it
    replaces, when there is one); the half-written ``<path>.tmp`` is removed."""
    from torch.distributed.checkpoint.api import CheckpointException

    needed = _size(path)
    try:
        folder = export(str(path))
        for part in (tokenizer, image_processor):
            if part is not None:
                part.save_pretrained(folder)
        return folder
    except (Exception, CheckpointException) as e:
        if _write_failure_told(
            e,
            staging=f"{path}.tmp",
            doing=f"writing the Hugging Face export {path}",
            where=path,
            needed=needed,
            last=last,
            on_failure=on_failure,
            then="the run finishes without it.",
            console=console,
        ):
            return None
        raise
