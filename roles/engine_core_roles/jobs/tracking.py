"""A run's output folder: claiming it, ``metrics.jsonl`` and ``samples.jsonl`` (handed on to
the trackers of :mod:`~engine_core_roles.jobs.trackers`: TensorBoard, W&B, MLflow), a PNG plot
at the end, the run's log file holding the traceback of a failure, where a run starts or
resumes (saving a checkpoint: :mod:`~engine_core_roles.jobs.saving`).

Resuming keeps the rows up to the resumed step and drops the rest, so a resumed run's file
reads exactly like an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from rich.console import Console

from engine_core.checkpoint import JobCheckpoints, latest_checkpoint, remove_stale_staging
from engine_core.cli import raise_if_interrupted
from engine_core.errors import (
    CheckpointError,
    ConfigError,
    OutputError,
    PluginError,
    RunFailed,
    RunStopped,
    TrackerError,
)
from engine_core_roles.jobs.saving import what_is_safe, why_it_failed
from engine_core_roles.jobs.trackers import TENSORBOARD_DIR, Tracker, start_trackers

if TYPE_CHECKING:
    from engine_core_roles.jobs.config import JobConfig

__all__ = [
    "RunTracker",
    "RunFailed",
    "claim_output_dir",
    "failures_logged",
    "resume_point",
    "starting_point",
    "RUN_LOG",
]

RUN_LOG = "run.log"  # in a run's output_dir: the traceback of each failure, appended

# bad input found while a run is set up (a tracker's settings among it): reported as such (the
# CLI's usage exit), not logged; and a stop on request, which is no failure
_USAGE_ERRORS = (ConfigError, PluginError, ValidationError, TrackerError, RunStopped)


@contextlib.contextmanager
def failures_logged(out_dir: Path, *, command: str, safe: str) -> Iterator[None]:
    """Turn a failure inside into :class:`RunFailed`: what failed, in one line, where the
    traceback went (``out_dir / RUN_LOG``, appended) and ``safe``, what is still safe.

    Bad input (config, plugin and validation errors) and interrupts pass through unchanged.
    """
    try:
        yield
    except _USAGE_ERRORS:
        raise
    except Exception as e:
        log_path = out_dir / RUN_LOG
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        try:
            with log_path.open("a") as log:
                log.write(f"--- {stamp} {command} failed\n{traceback.format_exc()}\n")
            where = f"traceback in {log_path}"
        except OSError as write_error:
            where = f"the traceback could not be written to {log_path}: {write_error.strerror}"
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        what = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
        raise RunFailed(f"{command} failed: {what} ({where}; {safe})", log_path) from e


def _keep_up_to(path: Path, step: int | None) -> list[dict[str, Any]]:
    """Rewrite the JSONL file ``path`` with its rows of steps up to ``step`` (none when
    ``step`` is None: a fresh run) and return them."""
    kept: list[dict[str, Any]] = []
    if step is not None and path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        kept = [r for r in rows if r["step"] <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


# what marks a folder as holding a run's outputs
_RUN_MARKERS = ("metrics.jsonl", "checkpoints")


def claim_output_dir(out_dir: str | Path, *, command: str, resume: bool = False) -> Path:
    """Make sure ``out_dir`` can hold this run, before anything is built or written.

    A folder that holds another run (``metrics.jsonl`` or ``checkpoints/``) is refused unless
    resuming, so no command overwrites an earlier run; a folder that cannot be created or
    written is a one-line error naming it.
    """

    path = Path(out_dir)
    held = [m for m in _RUN_MARKERS if (path / m).exists()]
    if held and not resume:
        raise CheckpointError(
            f"{command}: output_dir {path} already holds a run ({', '.join(held)}); refusing to "
            f"overwrite it. Pass --resume to continue it, or choose another folder "
            f"(output_dir=...) or delete it."
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".engine-core-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"{command}: cannot write to output_dir {path} ({e.strerror or e}); choose a "
            f"writable folder (output_dir=...)."
        ) from None
    return path


class RunTracker:
    """Writes one JSON row per step to ``metrics.jsonl`` and hands it to ``trackers`` (started
    ones: :func:`~engine_core_roles.jobs.trackers.start_trackers`)."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        resume_after_step: int | None = None,
        trackers: Sequence[Tracker] = (),
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.tensorboard_dir = self.out_dir / TENSORBOARD_DIR
        self._rows = _keep_up_to(self.metrics_path, resume_after_step)
        self._file = self.metrics_path.open("a")
        self.samples_path = self.out_dir / "samples.jsonl"
        if self.samples_path.exists():
            _keep_up_to(self.samples_path, resume_after_step)
        self.trackers = list(trackers)

    @classmethod
    def for_job(cls, job: JobConfig, *, resume_after_step: int | None) -> RunTracker:
        """The tracker of ``job``'s run: its ``trackers`` started (one sentence,
        :class:`~engine_core.errors.TrackerError`, for one that cannot start), continuing the
        tracker runs of its output folder. A SIGINT the command took while it started ends
        the run here, before anything is written (:func:`engine_core.cli.raise_if_interrupted`)."""
        raise_if_interrupted()
        out = Path(job.output_dir)
        started = start_trackers(
            job.trackers,
            out,
            config=job.model_dump(mode="json"),
            wandb=job.wandb,
            mlflow=job.mlflow,
            resume_after_step=resume_after_step,
        )
        return cls(out, resume_after_step=resume_after_step, trackers=started)

    @property
    def rows(self) -> list[dict[str, Any]]:
        return list(self._rows)

    def log(self, row: dict[str, Any]) -> None:
        self._rows.append(row)
        with self._told(f"writing step {row.get('step')}'s metrics to {self.metrics_path}"):
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
            for tracker in self.trackers:
                tracker.log(row)

    def log_samples(self, step: int, samples: Sequence[dict[str, Any]]) -> None:
        """Decoded samples of ``step`` (prompt, response, reward, ...) for people to read: one
        JSON line each in ``samples.jsonl``, and to each tracker."""
        with self._told(f"writing step {step}'s samples to {self.samples_path}"):
            with self.samples_path.open("a") as f:
                for sample in samples:
                    f.write(json.dumps({"step": step, **sample}) + "\n")
            for tracker in self.trackers:
                tracker.log_samples(step, samples)

    @contextlib.contextmanager
    def _told(self, doing: str) -> Iterator[None]:
        """A write of the run's output that fails (a full disk, a read-only folder) as one
        :class:`~engine_core.errors.OutputError` sentence: what failed, why, the last safe step
        and what to do."""
        try:
            yield
        except OSError as e:
            last = latest_checkpoint(self.out_dir / "checkpoints")
            raise OutputError(
                f"{doing} failed: {why_it_failed(e, None)}. {what_is_safe(last)}"
            ) from e

    def plot(self, keys: Sequence[str], path: str | Path | None = None, title: str = "") -> Path:
        """One panel per key that was logged, against the step; saved as PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        present = [k for k in keys if any(k in r for r in self._rows)]
        cols = min(len(present), 3) or 1
        rows = math.ceil(len(present) / cols) or 1
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
        for ax, key in zip(axes.flat, present, strict=False):
            pts = [(r["step"], r[key]) for r in self._rows if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linewidth=1.2)
            ax.set_title(key, fontsize=10)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(present) :]:
            ax.axis("off")
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        out = Path(path) if path is not None else self.out_dir / "metrics.png"
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out

    def close(self, status: str = "failed", summary: Mapping[str, Any] | None = None) -> None:
        """Finish the trackers' runs (``status``: finished, stopped or failed; ``summary``, the
        run's final figures) and close the files; again: a no-op. On a full disk their last
        unwritten bytes are lost and what was written stays; nothing is raised or printed for
        it."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.finish(summary, status)
        with contextlib.suppress(OSError):
            self._file.close()


def starting_point(
    out_dir: Path,
    parts: list[str],
    *,
    resume: bool | str | None,
    configured: str,
    command: str,
    console: Console,
) -> str | None:
    """Where a run starts, decided (and ``out_dir`` claimed) before anything is built: the
    checkpoint to resume from, or ``None`` for a fresh start.

    ``resume``: the command line's (``True``: ``--resume``, the strict ``latest``; ``"auto"``;
    ``None``/``False``: the recipe's ``configured`` setting). ``latest`` refuses a folder without
    a checkpoint; ``auto`` starts fresh there (the rows a run killed before its first checkpoint
    logged are dropped as the new run logs its own) and says so; ``never`` refuses a folder
    that holds a run."""
    mode = "latest" if resume is True else (resume or configured)
    if mode not in ("never", "latest", "auto"):
        raise ConfigError(f"--resume takes auto (or nothing: the latest checkpoint); got {mode!r}.")
    root = out_dir / "checkpoints"
    if mode == "latest" and latest_checkpoint(root) is None:
        raise CheckpointError(
            f"--resume: no checkpoint under {root}; run without --resume to start fresh, or "
            f"with --resume auto to start fresh whenever there is none."
        )
    claim_output_dir(out_dir, command=command, resume=mode != "never")
    for stale in remove_stale_staging(root):
        console.print(f"removed {stale}: the staging folder of a save that never committed.")
    if mode == "never":
        return None
    if latest_checkpoint(root) is None:
        console.print(f"--resume auto: no checkpoint under {root}; starting fresh.")
        return None
    return resume_point(root, parts, console)


def resume_point(root: Path, parts: list[str], console: Console) -> str:
    """``--resume``: the newest step under ``root`` whose checkpoint (``parts`` and the job
    state) verifies; newer ones are set aside (renamed ``*.rejected``, kept) and the console
    says which and why."""
    try:
        folder, skipped = JobCheckpoints(root).newest_verified(parts)
    except CheckpointError as e:
        raise CheckpointError(f"--resume: {e}") from None
    for step, reason, moved in skipped:
        console.print(
            f"[yellow]--resume: skipped step {step}: {reason} Set aside as {moved}.[/yellow]",
            soft_wrap=True,
        )
    return folder
