"""A full disk during a save: one sentence, every committed step intact, no staging folder left,
and with ``on_save_failure=continue`` a run that trains on.

The run's output folder is a real tmpfs mount sized for one checkpoint and the run's other
files, not two checkpoints: the save of step 2 fails (the rotation of step 1 comes only after a
commit), with ENOSPC from the reference engine's files, or inside DCP's writes for fsdp2, where
torch's stream writer reports the short write as a RuntimeError. The classifier itself is
checked on the errors each writer raises, wrapped as DCP and the workers wrap them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console
from torch.distributed.checkpoint.api import CheckpointException

from engine_core.checkpoint import JobCheckpoints, list_checkpoints
from engine_core.errors import CheckpointError
from engine_core_roles.jobs.cli import RECIPES, main
from engine_core_roles.jobs.saving import (
    a_write_failure,
    export_hf,
    out_of_space,
    save_checkpoint,
    why_it_failed,
)
from tests._forkserver import JOB_MODULES, ForkServer

# one checkpoint of this run is about 0.97 MB (reference) or 1.18 MB (fsdp2's DCP shards and
# state files), its export and plot about 0.45 MB: a step's save fails inside its largest file
SIZE = "1600k"


@contextlib.contextmanager
def _small_disk(folder: Path) -> Iterator[Path]:
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"this machine does not let the tests mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        # lazily: a writer abandoned on the full disk may still hold its file open
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _args(out: Path, *extra: str) -> list[str]:
    return [
        "run",
        str(RECIPES / "grpo_tiny.yaml"),
        f"output_dir={out}",
        "steps=3",
        "save_every=1",
        "max_ckpt_to_keep=1",
        "prompts_per_step=2",
        "trainer.samples_per_prompt=2",
        "log_every=1",
        *extra,
    ]


# the reference engine's files fail with ENOSPC; fsdp2's inside DCP's writes, where torch's
# stream writer says "unexpected pos" (a RuntimeError carried by DCP's CheckpointException).
# on_save_failure=continue trains on the same way for every backend: checked once.
@pytest.mark.parametrize(
    ("backend", "on_failure", "writer"),
    [
        ("reference", "stop", "engine_core/checkpoint.py"),
        ("reference", "continue", "engine_core/checkpoint.py"),
        ("fsdp2", "stop", "torch/distributed/checkpoint/"),
        ("megatron", "stop", "megatron/core/dist_checkpointing/"),
    ],
    ids=["reference-stop", "reference-continue", "fsdp2-stop", "megatron-stop"],
)
def test_a_full_disk_is_one_sentence_and_keeps_what_was_committed(
    tmp_path: Path, backend: str, on_failure: str, writer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with _small_disk(tmp_path / "disk") as disk:
        out = disk / "run"
        code = main(_args(out, f"engine.backend={backend}", f"on_save_failure={on_failure}"))
        err = capsys.readouterr()
        root = out / "checkpoints"
        # step 1 is committed and whole; the failed saves left no staging folder
        assert [s for s, _ in list_checkpoints(root)] == [1]
        assert JobCheckpoints(root).verify(str(root / "global_step_1"), ["actor"]) == 1
        assert not list(root.glob("*.tmp"))
        said = f"saving the checkpoint of step 2 under {root} failed: {_NO_SPACE}"
        if on_failure == "stop":
            assert code == 1
            lines = [line for line in err.err.splitlines() if line.strip()]
            assert len(lines) == 1, err.err
            assert said in lines[0] and "the last safe one is" in lines[0], lines[0]
            assert str(root / "global_step_1") in lines[0] and "--resume auto" in lines[0]
            # the space the save needs, and what is free
            assert re.search(r"needs about [0-9.]+ [kMG]B .* [0-9.]+ [kMG]B is free", lines[0])
            assert writer in (out / "run.log").read_text()  # where the disk ran out
        else:  # the run trains to its end; each failed save is said, the next one tries again
            assert code == 0, err.err
            printed = " ".join(err.out.split())
            assert printed.count(_NO_SPACE) == 2, printed  # steps 2 and 3
            assert "training goes on" in printed
            assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


# what torch's stream writer raised inside DCP's save on a full 3 MB tmpfs (fsdp2's step 3)
SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def _raised(error: BaseException) -> BaseException:
    """``error`` raised and caught: with its traceback, as a writer's error arrives."""
    try:
        raise error
    except BaseException as caught:
        return caught


def _dcp(error: BaseException) -> CheckpointException:
    """``error`` wrapped the way DCP's save wraps a rank's failure."""
    caught = _raised(error)
    return CheckpointException(
        "save failed", {0: (caught, traceback.extract_tb(caught.__traceback__))}
    )


def _caused(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


def _in_context(outer: BaseException, context: BaseException) -> BaseException:
    outer.__context__ = context
    return outer


_NO_SPACE = os.strerror(errno.ENOSPC)
PLENTY = 10**9  # bytes free at the failure: the error alone must tell


@pytest.mark.parametrize(
    ("error", "free", "full", "said"),
    [
        (
            _dcp(RuntimeError(SHORT_WRITE)),
            PLENTY,
            True,
            f"{_NO_SPACE} (RuntimeError: {SHORT_WRITE})",
        ),
        (
            _dcp(RuntimeError("[enforce fail at inline_container.cc:471] . file write failed")),
            PLENTY,
            True,
            None,
        ),
        (
            _caused(RuntimeError("shard 0"), OSError(errno.ENOSPC, _NO_SPACE, "/c/x.distcp")),
            PLENTY,
            True,
            f"{_NO_SPACE} (/c/x.distcp)",
        ),
        (
            _in_context(ValueError("closing"), OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))),
            PLENTY,
            True,
            os.strerror(errno.EDQUOT),
        ),
        (
            _dcp(OSError(errno.EFBIG, os.strerror(errno.EFBIG))),
            PLENTY,
            True,
            os.strerror(errno.EFBIG),
        ),
        # a worker's error arrives as text (its type not rebuilt on the driver)
        (
            RuntimeError(
                f"worker 0 raised in 'write_checkpoint_files': OSError: [Errno 28] {_NO_SPACE}"
            ),
            PLENTY,
            True,
            None,
        ),
        # no evidence in the error: the space free at the failure, before the cleanup, tells
        (
            RuntimeError("torch.save failed"),
            4096,
            True,
            f"{_NO_SPACE} (4.1 kB free when it failed)",
        ),
        (RuntimeError("torch.save failed"), PLENTY, False, None),
        (_dcp(ValueError("a shape mismatch")), PLENTY, False, None),
        (ConnectionResetError(errno.ECONNRESET, "reset by peer"), PLENTY, False, None),
    ],
    ids=[
        "dcp-short-write",
        "dcp-file-write-failed",
        "enospc-cause",
        "edquot-context",
        "dcp-efbig",
        "worker-text",
        "free-at-failure",
        "not-space",
        "dcp-other",
        "connection",
    ],
)
def test_a_save_is_out_of_space_by_its_errors_evidence_or_the_space_left(
    error: BaseException, free: int, full: bool, said: str | None
) -> None:
    assert out_of_space(error, free) is full
    assert a_write_failure(error, free) is full
    if said is not None:
        assert why_it_failed(error, free) == said
    elif full:
        assert why_it_failed(error, free).startswith(_NO_SPACE)


def test_a_read_only_folder_is_a_write_failure_not_a_full_disk() -> None:
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/c/global_step_2.tmp")
    error = _dcp(denied)
    assert not out_of_space(error, PLENTY) and a_write_failure(error, PLENTY)
    assert why_it_failed(error, PLENTY) == f"{os.strerror(errno.EACCES)} (/c/global_step_2.tmp)"


class _FullCheckpoints:
    """Checkpoints whose save writes part of its staging folder, then fails as ``error``."""

    def __init__(self, root: Path, error: BaseException) -> None:
        self.root, self.error = str(root), error

    def save(self, step: int, parts: object, state: object) -> str:
        staging = Path(self.root) / f"global_step_{step}.tmp"
        staging.mkdir(parents=True)
        (staging / "__0_0.distcp").write_bytes(b"x" * 1000)
        raise self.error


def _export_fails(error: BaseException) -> object:
    def write(path: str) -> str:
        Path(f"{path}.tmp").mkdir()
        raise error

    return write


@pytest.mark.parametrize("on_failure", ["stop", "continue"])
@pytest.mark.parametrize("what", ["checkpoint", "export"])
def test_every_save_is_the_same_sentence_and_honours_on_save_failure(
    tmp_path: Path, what: str, on_failure: str
) -> None:
    """A DCP short write in the checkpoint, an ENOSPC in the export: one sentence (the space
    needed: the last checkpoint's, the export's it replaces), the staging folder removed, the
    configured on_save_failure."""
    console = Console(record=True, width=400)
    last = tmp_path / "checkpoints" / "global_step_1"
    last.mkdir(parents=True)
    (last / "model.pt").write_bytes(b"x" * 250_000)
    if what == "checkpoint":
        root = tmp_path / "checkpoints"
        doing, staging = f"saving the checkpoint of step 2 under {root}", root / "global_step_2.tmp"
        checkpoints = _FullCheckpoints(root, _dcp(RuntimeError(SHORT_WRITE)))

        def save() -> str | None:
            return save_checkpoint(
                checkpoints,  # type: ignore[arg-type]
                2,
                {},
                {},
                last=str(last),
                on_failure=on_failure,
                console=console,
            )
    else:
        path = tmp_path / "hf_export"
        doing, staging = f"writing the Hugging Face export {path}", tmp_path / "hf_export.tmp"
        write = _export_fails(OSError(errno.ENOSPC, _NO_SPACE))
        path.mkdir()  # the export it replaces: what it needs, and kept
        (path / "model.safetensors").write_bytes(b"x" * 250_000)

        def save() -> str | None:
            return export_hf(write, path, last=str(last), on_failure=on_failure, console=console)  # type: ignore[arg-type]

    if on_failure == "stop":
        with pytest.raises(CheckpointError) as raised:
            save()
        message = str(raised.value)
    else:
        assert save() is None
        message = " ".join(console.export_text().split())
        assert "on_save_failure=continue" in message
    assert message.startswith(f"{doing} failed: {_NO_SPACE}"), message
    assert "it needs about 0.25 MB (the last save's size)" in message
    assert f"the last safe one is {last}" in message and "--resume auto" in message
    assert not staging.exists()


# -- a disk that fills at a chosen point of a save ------------------------------------------------

# Each run is forked from one server (tests/_forkserver.py) and watched by an audit hook: when
# the run opens for writing the first file whose path holds ``fill_at``, the hook fills the
# rest of the tmpfs (a file beside the run's folder, written until ENOSPC), so that exactly that
# file's write meets a full disk, whichever writer writes it (DCP's, megatron's, torch.save,
# safetensors) and whatever its size.
FILL_SETUP = (
    JOB_MODULES
    + r"""
import os, sys
from engine_core.cli import main
import engine_core_roles.jobs.rl.run  # noqa: F401
# the megatron runs' engine, and megatron-core, which it imports only as it builds: seconds of
# each of those runs, paid once here
import engine_core_megatron.engine, megatron.core  # noqa: F401

def _fill(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 1 << 16, 1 << 12, 1 << 9, 1):
            block = b"\0" * size
            try:
                while True:
                    os.write(fd, block)
            except OSError:
                pass
    finally:
        os.close(fd)

def run(request):
    at, filler, done = request["fill_at"], request["filler"], [False]

    def hook(event, args):
        if done[0] or event != "open" or not args or not isinstance(args[0], (str, os.PathLike)):
            return
        mode, flags = (args[1] if len(args) > 1 else None), (args[2] if len(args) > 2 else 0)
        writing = (isinstance(mode, str) and set(mode) & set("wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR)
        )
        if writing and at in os.fspath(args[0]):
            done[0] = True
            _fill(filler)

    sys.addaudithook(hook)
    return main(["run", *request["args"]])
"""
)

# where the second save (or the export at the end) meets the full disk, per engine: the
# checkpoint's shards (model and optimizer state in one DCP save), the metadata its writer
# commits last, the engine's own state, the job's state, and the Hugging Face export (the
# engine's writer). The job's state is written by the core's checkpoint writer after every
# engine's part, the same code whatever the engine: it is filled under fsdp2 only (a megatron
# run here costs about four fsdp2 runs)
FILL_POINTS = {
    "fsdp2": {
        "shards": "global_step_2.tmp/actor/",
        "engine_state": "global_step_2.tmp/actor/engine_state_rank",
        "job_state": "global_step_2.tmp/job_state.pt",
        "export": "hf_export",
    },
    "megatron": {
        "shards": "global_step_2.tmp/actor/dist_ckpt/",
        "engine_state": "global_step_2.tmp/actor/engine_state_rank",
        "export": "hf_export",
    },
}


@pytest.fixture(scope="module")
def filling() -> Iterator[ForkServer]:
    server = ForkServer(FILL_SETUP)
    yield server
    server.close()


@pytest.mark.parametrize(
    ("backend", "point"),
    [(b, p) for b, points in FILL_POINTS.items() for p in points],
)
def test_a_disk_full_anywhere_in_a_save_is_one_sentence_and_resumes(
    filling: ForkServer, tmp_path: Path, backend: str, point: str
) -> None:
    """The disk fills as the save of step 2 (or the export) opens the file named: the run
    stops with one line naming what failed and the last safe step; once space is freed,
    ``--resume auto`` removes the staging folder and finishes from step 1."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"this machine does not let the tests mount a tmpfs: {mounted.stderr.strip()}")
    try:
        out, filler, log = folder / "run", folder / "filler", tmp_path / "run.log"
        steps = 2 if point == "export" else 3
        args = [*_args(out, f"engine.backend={backend}")[1:], f"steps={steps}"]
        at = FILL_POINTS[backend][point]
        code = filling.run(timeout=600, args=args, fill_at=at, filler=str(filler), log=str(log))
        err = log.read_text()
        # stdout's step lines share the log; what is said besides them is one line
        lines = [x for x in err.splitlines() if x.strip() and not x.startswith("step ")]
        assert filler.exists(), f"the run never opened {at!r} for writing:\n{err[-3000:]}"
        assert code == 1, err[-3000:]
        assert len(lines) == 1 and _NO_SPACE in lines[0], err[-3000:]
        root = out / "checkpoints"
        if point == "export":
            assert "writing the Hugging Face export" in lines[0], lines[0]
            safe = 2
        else:
            assert f"saving the checkpoint of step 2 under {root}" in lines[0], lines[0]
            assert str(root / "global_step_1") in lines[0] and "--resume auto" in lines[0]
            safe = 1
        assert [s for s, _ in list_checkpoints(root)] == [safe]
        assert JobCheckpoints(root).verify(str(root / f"global_step_{safe}"), ["actor"]) == safe
        filler.unlink()  # space freed: the same command again, resumed
        code = filling.run(
            timeout=600, args=[*args, "--resume", "auto"], fill_at="\0", filler="", log=str(log)
        )
        assert code == 0, log.read_text()[-3000:]
        assert not list(root.glob("*.tmp")) and not list(out.glob("*.tmp"))
        assert [s for s, _ in list_checkpoints(root)] == [steps]
        assert (out / "hf_export" / "config.json").exists()
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_disk_under_the_runs_metrics_is_one_sentence(tmp_path: Path) -> None:
    """The run's own rows (``metrics.jsonl``, each tracker's) meeting a full disk between two
    saves: one sentence naming the file and the step, the reason, the last safe step and what
    to do, raised as :class:`~engine_core.errors.OutputError` (the job turns it into its one
    failure line)."""
    from engine_core.errors import OutputError
    from engine_core_roles.jobs.tracking import RunTracker

    with _small_disk(tmp_path / "disk") as disk:
        tracker = RunTracker(disk / "run")
        tracker.log({"step": 1, "reward": 0.5})
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):
            while True:  # every page of the tmpfs taken
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        with pytest.raises(OutputError) as raised:
            for step in range(2, 100):  # the first row the disk cannot take
                tracker.log({"step": step, "text": "x" * 8192})
        said = str(raised.value)
        assert said.startswith("writing step ") and f"metrics to {disk / 'run'}" in said, said
        assert _NO_SPACE in said and "the last safe one is none yet" in said, said
        assert "--resume auto" in said and "\n" not in said, said
        tracker.close()
        assert (disk / "run" / "metrics.jsonl").read_text().splitlines()[0].startswith('{"step": 1')
