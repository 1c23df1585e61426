"""Where a run's metrics go besides ``metrics.jsonl`` (always written, by
:class:`~engine_core_roles.jobs.tracking.RunTracker`): TensorBoard, Weights & Biases and MLflow,
chosen by the job's ``trackers: [tensorboard, wandb, mlflow]``, each a :class:`Tracker`.

Each tracker gets every step's numbers, the decoded samples (TensorBoard: one text entry; W&B
and MLflow: a table) and, when the run ends, how it ended; W&B and MLflow also get the run's
config when they start and the final summary. TensorBoard writes event files under
``output_dir/tensorboard``, one file per session, a resumed session dropping the events after
the step it resumed from. One output folder is one W&B or MLflow run: their run ids are kept in
``output_dir/trackers.json``, so ``--resume`` (and ``--resume auto``) continue the same run. A
tracker that cannot start is one sentence before training
(:class:`~engine_core.errors.TrackerError`); a W&B or MLflow tracker that fails later is warned
about once and dropped, while ``metrics.jsonl`` keeps every row.

What has run here: W&B in offline mode (its files under ``output_dir/wandb``, uploaded later
with ``wandb sync``) and MLflow with a local file store. Online W&B and an MLflow server take the
same calls and have not been exercised by the tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import re
import textwrap
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import Field

from engine_core.config import FrozenModel
from engine_core.errors import ConfigError, TrackerError
from engine_core.launch import set_default_for_process
from engine_core.settings import mlflow_tracking_uri

__all__ = [
    "TRACKERS",
    "TRACKERS_RECORD",
    "TENSORBOARD_DIR",
    "MlflowConfig",
    "Tracker",
    "WandbConfig",
    "check_trackers",
    "mlflow_key",
    "start_trackers",
]

TrackerName = Literal["tensorboard", "wandb", "mlflow"]
TRACKERS: tuple[str, ...] = ("tensorboard", "wandb", "mlflow")
TRACKERS_RECORD = "trackers.json"  # in output_dir: the tracker runs this folder's run logs to
TENSORBOARD_DIR = "tensorboard"  # in output_dir: TensorBoard's event files

# the package each tracker imports, and the extra that installs it
_PACKAGES = {
    "tensorboard": ("tensorboardX", "engine-core-roles"),
    "wandb": ("wandb", "engine-core-roles[wandb]"),
    "mlflow": ("mlflow", "engine-core-roles[mlflow]"),
}


class WandbConfig(FrozenModel):
    """The Weights & Biases run (``trackers: [wandb]``)."""

    project: str = Field("engine-core", description="The W&B project.")
    entity: str | None = Field(None, description="The team or user (None: the account's).")
    name: str | None = Field(None, description="The run's display name (None: W&B picks one).")
    group: str | None = None
    tags: list[str] = Field(default_factory=list)
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: files under output_dir/wandb, uploaded later with `wandb sync "
        "output_dir/wandb/offline-run-*`; online: logged as the run goes (needs WANDB_API_KEY "
        "or `wandb login`).",
    )


class MlflowConfig(FrozenModel):
    """The MLflow run (``trackers: [mlflow]``)."""

    tracking_uri: str | None = Field(
        None,
        description="Where runs are stored: a server (http://host:5000), a database "
        "(sqlite:///mlflow.db) or a folder (file:///path). None: MLFLOW_TRACKING_URI when set, "
        "else the file store output_dir/mlruns.",
    )
    experiment: str = Field("engine-core", description="The experiment the run belongs to.")
    run_name: str | None = Field(None, description="The run's name (None: MLflow picks one).")


class Tracker(Protocol):
    """What the job calls on a tracker. W&B and MLflow never raise from ``log``,
    ``log_samples`` or ``finish`` (see :class:`_Guarded`); TensorBoard writes files in the
    output folder beside ``metrics.jsonl``, and fails as writing that file does."""

    name: str

    def log(self, row: Mapping[str, Any]) -> None: ...

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None: ...

    def finish(self, summary: Mapping[str, Any] | None, status: str) -> None: ...


def check_trackers(names: list[TrackerName]) -> list[TrackerName]:
    """``trackers`` as given, once each, every one installed: refused otherwise, while the
    config is read (the install command in the message)."""
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"trackers: {twice} named more than once; name each tracker once.")
    for name in names:
        module, extra = _PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"trackers: {name} needs the {module} package, which is not installed; "
                f"pip install '{extra}', or remove {name} from trackers."
            )
    return names


def mlflow_key(key: str, stems: set[str] | frozenset[str] = frozenset()) -> str:
    """``key`` as MLflow allows a metric's name (letters, digits, ``_ - . / `` and space;
    ``val/pass@1`` is ``val/pass_at_1``). A key that also heads a group of others (``stems``:
    ``reward`` beside ``reward/zero_variance_groups``) is ``reward/value``, since a file store
    cannot hold a metric and a group of the same name."""
    name = re.sub(r"[^\w\-. /]", "_", key.replace("@", "_at_"))
    return f"{name}/value" if key in stems else name


def _stems(keys: Iterable[str]) -> set[str]:
    """Every group a key is in: ``a/b/c`` is in ``a`` and ``a/b``."""
    parts = (k.split("/") for k in keys)
    return {"/".join(p[:i]) for p in parts for i in range(1, len(p))}


def _numbers(row: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a row, ``step`` aside (booleans and text are not metrics)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as ``a.b.c: value`` strings (MLflow's parameters)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = json.dumps(value) if not isinstance(value, str) else value
    return out


def sample_text(sample: Mapping[str, Any]) -> tuple[str, str]:
    """A sample's prompt and response as text; an episode is its turns (role: content) as the
    response."""
    episode = sample.get("episode")
    if episode:
        turns = "\n".join(f"{m.get('role')}: {m.get('content')}" for m in episode)
        return "", turns
    return str(sample.get("prompt", "")), str(sample.get("response", ""))


class _Wandb:
    name = "wandb"

    def __init__(
        self, cfg: WandbConfig, out_dir: Path, config: Mapping[str, Any], run_id: str | None
    ) -> None:
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name,
            group=cfg.group,
            tags=cfg.tags or None,
            mode=cfg.mode,
            dir=str(out_dir),
            id=run_id,
            resume="allow" if run_id else None,
            config=dict(config),
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
            reinit="create_new",
        )
        self.run_id = str(self.run.id)
        # W&B's step is the run's: after a resume the next row continues where the last ended
        self.run.define_metric("*", step_metric="step")

    def record(self) -> dict[str, Any]:
        return {"id": self.run_id, "project": self.run.project}

    def log(self, row: Mapping[str, Any]) -> None:
        self.run.log({"step": row["step"], **_numbers(row)}, step=row["step"])

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        table = self._wandb.Table(columns=["step", "prompt", "response", "reward"])
        for sample in samples:
            table.add_data(step, *sample_text(sample), sample.get("reward"))
        self.run.log({"samples": table}, step=step)

    def finish(self, summary: Mapping[str, Any] | None, status: str) -> None:
        if summary:
            self.run.summary.update(
                {k: v for k, v in summary.items() if isinstance(v, (int, float, str))}
            )
        self.run.finish(exit_code=0 if status == "finished" else 1)


class _Mlflow:
    name = "mlflow"

    def __init__(
        self, cfg: MlflowConfig, out_dir: Path, config: Mapping[str, Any], run_id: str | None
    ) -> None:
        uri = cfg.tracking_uri or mlflow_tracking_uri()
        if uri is None:
            uri = (out_dir / "mlruns").resolve().as_uri()
            # MLflow 3 refuses a file store unless asked for it; a folder in the run's output
            # is what runs without a server (or a database) need
            set_default_for_process("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.stems: set[str] = set()  # the groups of the keys logged so far
        if run_id is None:
            experiment = self.client.get_experiment_by_name(cfg.experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(cfg.experiment)
            )
            run = self.client.create_run(experiment_id, run_name=cfg.run_name)
            self.run_id = str(run.info.run_id)
            params = [Param(k, v[:6000]) for k, v in _flat(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes 100 parameters a call
                self.client.log_batch(self.run_id, params=params[i : i + 100])
            self.client.log_dict(self.run_id, dict(config), "config.json")
        else:
            self.run_id = run_id
            self.client.get_run(run_id)  # an id that is not there fails here, before training
            self.client.update_run(run_id, status="RUNNING")

    def record(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def log(self, row: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        stamp, step, numbers = _now_ms(), int(row["step"]), _numbers(row)
        self.stems |= _stems(numbers)
        metrics = [Metric(mlflow_key(k, self.stems), v, stamp, step) for k, v in numbers.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        texts = [sample_text(s) for s in samples]
        table = {
            "step": [step] * len(samples),
            "prompt": [t[0] for t in texts],
            "response": [t[1] for t in texts],
            "reward": [s.get("reward") for s in samples],
        }
        with warnings.catch_warnings():  # pandas' notices about MLflow's own calls
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            # appended to the table of the earlier steps
            self.client.log_table(self.run_id, data=table, artifact_file="samples.json")

    def finish(self, summary: Mapping[str, Any] | None, status: str) -> None:
        if summary:
            self.client.log_dict(self.run_id, dict(summary), "summary.json")
        state = {"finished": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, status=state)


class _TensorBoard:
    """Event files under ``out_dir/tensorboard``: each step's finite numbers as one event, the
    samples as one text entry of their step."""

    name = "tensorboard"

    def __init__(self, out_dir: Path, resume_after_step: int | None) -> None:
        from tensorboardX import SummaryWriter

        # a file of its own for each session: the file's name holds the second it was made,
        # and a resume within that second would otherwise empty the first's file
        self.writer: Any = SummaryWriter(
            str(out_dir / TENSORBOARD_DIR),
            purge_step=(resume_after_step or 0) + 1,
            filename_suffix=f".{uuid.uuid4().hex[:8]}",
        )

    def log(self, row: Mapping[str, Any]) -> None:
        """The row's finite numbers as one event of the step (one event per number cost 3 ms
        a step for 19 numbers; one for all of them, 0.2 ms)."""
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.summary import scalar

        values = [
            scalar(key, value).value[0]
            for key, value in row.items()
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value)
        ]
        if values:
            self.writer.file_writer.add_summary(Summary(value=values), row["step"])

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        if samples:
            text = "\n\n".join(
                f"**reward {s.get('reward')}**\n\n    " + _shown(s).replace("\n", "\n    ")
                for s in samples
            )
            self.writer.add_text("samples", text, step)

    def finish(self, summary: Mapping[str, Any] | None, status: str) -> None:
        """Close the event files. On a full disk their last unwritten bytes are lost and what
        was written stays; nothing is raised or printed for it."""
        try:
            self.writer.close()
        except OSError:
            _abandon_event_writers(self.writer)


def _abandon_event_writers(tb: Any) -> None:
    """A TensorBoard writer whose last flush failed (a full disk): stop its thread and mark it
    closed, so that its exit hook does not flush again and print the same failure."""
    for writer in list((getattr(tb, "all_writers", None) or {}).values()):
        events = getattr(writer, "event_writer", None)
        worker = getattr(events, "_worker", None)
        with contextlib.suppress(Exception):
            if worker is not None:
                worker.stop()
        if events is not None:
            events._closed = True


def _shown(sample: Mapping[str, Any]) -> str:
    """A sample as text: an episode turn by turn (role: content), else prompt then response."""
    prompt, response = sample_text(sample)
    return prompt + response


def _now_ms() -> int:
    return int(time.time() * 1000)


class _Guarded:
    """A tracker whose failure after it started is one warning and the end of that tracker:
    the run goes on, and ``metrics.jsonl`` holds every row."""

    def __init__(self, tracker: Any) -> None:
        self.tracker, self.name = tracker, tracker.name
        self.failed = False

    def _call(self, what: str, *args: Any) -> None:
        if self.failed:
            return
        try:
            getattr(self.tracker, what)(*args)
        except Exception as e:
            self.failed = True
            warnings.warn(
                f"the {self.name} tracker failed ({what}: {type(e).__name__}: {e}); it logs "
                f"nothing more in this run, and metrics.jsonl keeps every row.",
                RuntimeWarning,
                stacklevel=3,
            )

    def log(self, row: Mapping[str, Any]) -> None:
        self._call("log", row)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        self._call("log_samples", step, samples)

    def finish(self, summary: Mapping[str, Any] | None, status: str) -> None:
        self._call("finish", summary, status)


def _read_record(out_dir: Path) -> dict[str, Any]:
    path = out_dir / TRACKERS_RECORD
    if not path.exists():
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # unreadable: new tracker runs, as for a fresh folder
    return record if isinstance(record, dict) else {}


def start_trackers(
    names: Sequence[str],
    out_dir: Path,
    *,
    config: Mapping[str, Any],
    wandb: WandbConfig,
    mlflow: MlflowConfig,
    resume_after_step: int | None = None,
) -> list[Tracker]:
    """Start the trackers ``names`` asks for, TensorBoard first (its events after
    ``resume_after_step`` dropped), W&B and MLflow continuing the runs ``out_dir`` recorded;
    record the runs they log to.

    A W&B or MLflow tracker that cannot start is a :class:`TrackerError` naming it, the cause
    and what to do; the trackers started before it are finished first. TensorBoard starts after
    them, so that a run refused there leaves no event file."""
    record, started = _read_record(out_dir), list[Tracker]()
    kinds: dict[str, Any] = {"wandb": (_Wandb, wandb), "mlflow": (_Mlflow, mlflow)}
    for name in names:
        if name not in kinds:
            continue
        cls, cfg = kinds[name]
        previous = record.get(name) or {}
        run_id = previous.get("id") if name == "wandb" else previous.get("run_id")
        try:
            tracker = cls(cfg, out_dir, config, run_id)
        except Exception as e:
            for other in started:
                other.finish(None, "failed")
            cause = textwrap.shorten(str(e), 400, placeholder=" ...").rstrip(".")
            raise TrackerError(
                f"the {name} tracker could not start: {type(e).__name__}: {cause}. Nothing was "
                f"trained or changed; fix its settings ({name}: ... in the recipe) or remove "
                f"{name} from trackers."
            ) from None
        record[name] = tracker.record()
        started.append(_Guarded(tracker))
    if started:
        with contextlib.suppress(OSError):  # unrecorded: a resume starts new tracker runs
            (out_dir / TRACKERS_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    if "tensorboard" in names:
        started.insert(0, _TensorBoard(out_dir, resume_after_step))
    return started
