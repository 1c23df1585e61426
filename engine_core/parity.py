"""Cross-backend parity: the same model, data and steps through several training engines.

Every backend starts from the same saved Hugging Face folder (a tiny Qwen2 built from a config
with a fixed seed), runs the same ``steps`` optimizer steps on the same batches (AdamW, warm-up,
clipping, token-mean NLL) on ``world_size`` gloo processes, and reports per step the loss and
grad norm, plus the per-token log-probs of a fixed evaluation batch before the first step and
after the last. The first backend is the baseline every other one is compared with.
:func:`print_report` prints a report as tables whose figures stay whole in an 80-column terminal.

The JSON report never replaces an earlier one by accident: :func:`claim_report_path` refuses an
existing file (unless asked to overwrite it) and a place that cannot be written, before any model
is built, and :func:`write_report` writes a temporary file beside the target and renames it, so an
interrupted run leaves either the old report or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from engine_core.errors import ConfigError

__all__ = [
    "ParityReport",
    "claim_report_path",
    "first_divergence",
    "print_report",
    "run_parity",
    "write_report",
]

OPTIM = {"lr": 1e-2, "clip_grad": 1.0, "warmup_steps": 1}


@dataclass
class BackendRun:
    backend: str
    losses: list[float]
    grad_norms: list[float]
    log_probs_before: Any  # torch.Tensor [B, L]
    log_probs_after: Any


@dataclass
class ParityReport:
    backends: list[str]
    steps: int
    world_size: int
    micro_batch_size: int | None
    rtol: float
    atol_log_prob: float
    losses: dict[str, list[float]] = field(default_factory=dict)
    grad_norms: dict[str, list[float]] = field(default_factory=dict)
    max_rel_loss_diff: dict[str, float] = field(default_factory=dict)
    max_rel_grad_norm_diff: dict[str, float] = field(default_factory=dict)
    max_abs_log_prob_diff_before: dict[str, float] = field(default_factory=dict)
    max_abs_log_prob_diff_after: dict[str, float] = field(default_factory=dict)
    # per backend that fails: the first quantity that diverged, and what usually causes that
    first_divergence: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def baseline(self) -> str:
        return self.backends[0]

    @property
    def passed(self) -> bool:
        others = self.backends[1:]
        return all(
            self.max_rel_loss_diff[b] <= self.rtol
            and self.max_rel_grad_norm_diff[b] <= self.rtol
            and self.max_abs_log_prob_diff_before[b] <= self.atol_log_prob
            and self.max_abs_log_prob_diff_after[b] <= self.atol_log_prob
            for b in others
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "baseline": self.baseline, "passed": self.passed}


def _worker(
    rank: int, world: int, backend: str, path: str, steps: int, mbs: int | None
) -> BackendRun | None:
    from engine_core.testing.kit import eval_batch, forward
    from engine_core.testing.models import registered_engine, train_steps

    overrides: dict[str, Any] = {"model": {"path": path}, "optim": OPTIM}
    if mbs is not None:
        overrides["micro_batch_size"] = mbs
    engine = registered_engine(backend, **overrides)
    before = forward(engine, eval_batch())["log_probs"]
    curve = train_steps(engine, range(steps))
    after = forward(engine, eval_batch())["log_probs"]
    if rank:
        return None
    return BackendRun(
        backend, [float(c[0]) for c in curve], [float(c[1]) for c in curve], before, after
    )


def _rel(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)), default=0.0)


def first_divergence(
    run: BackendRun, base: BackendRun, rtol: float, atol: float, world_size: int
) -> dict[str, Any] | None:
    """Where ``run`` first leaves ``base``, in the order the figures are produced (the log-probs
    before any step, then each step's loss and grad norm, then the log-probs after the last),
    with the usual cause of that pattern; None when nothing diverges."""

    def off(x: float, y: float) -> bool:
        return abs(x - y) > rtol * max(abs(y), 1e-12)

    if float((run.log_probs_before - base.log_probs_before).abs().max()) > atol:
        return {
            "step": 0,
            "quantity": "log-probs before training",
            "cause": "the forward pass itself: how the weights are loaded, position ids, padding "
            "or packing boundaries, the attention mask, or the shift that aligns position t with "
            "token t",
        }
    for i, (loss, norm, want_loss, want_norm) in enumerate(
        zip(run.losses, run.grad_norms, base.losses, base.grad_norms, strict=True), start=1
    ):
        if off(loss, want_loss):
            ratio = loss / want_loss
            if i == 1:
                cause = "the reported loss: its normalization (global token count, loss mask) "
                if world_size > 1 and abs(ratio * world_size - 1) < 1e-3:
                    cause = f"the reported loss is 1/{world_size} of the global one: a rank's part "
                cause += "or its sum over micro-batches and ranks"
            else:
                cause = (
                    "the update of the step before: the optimizer step (clipping, the lr schedule, "
                    "AdamW settings, a skipped or doubled step)"
                )
            return {"step": i, "quantity": "loss", "ratio": ratio, "cause": cause}
        if off(norm, want_norm):
            ratio = norm / want_norm
            if world_size > 1 and abs(ratio * world_size - 1) < 1e-3:
                cause = (
                    f"gradients are 1/{world_size} of the sum over ranks: a reduction that "
                    f"averages (DDP, FSDP) needs backward(loss * dp_size)"
                )
            elif world_size > 1 and abs(ratio - world_size) < 1e-3:
                cause = f"gradients are {world_size}x the sum: reduced twice, or scaled twice"
            else:
                cause = (
                    "the gradient with an equal loss: micro-batch accumulation (zero_grad or an "
                    "average between micro-batches), the reduction over ranks, or parameters "
                    "left out of it"
                )
            return {"step": i, "quantity": "grad norm", "ratio": ratio, "cause": cause}
    if float((run.log_probs_after - base.log_probs_after).abs().max()) > atol:
        return {
            "step": len(run.losses),
            "quantity": "log-probs after training",
            "cause": "the last optimizer step (every loss and grad norm agreed): clipping, the "
            "lr of the last step, or the weights the forward reads after an update",
        }
    return None


def run_parity(
    backends: list[str],
    *,
    steps: int = 5,
    world_size: int = 2,
    micro_batch_size: int | None = None,
    rtol: float = 1e-5,
    atol_log_prob: float = 1e-5,
    seed: int = 0,
) -> ParityReport:
    """Run every backend and compare each with the first one."""
    import torch

    from engine_core.plugins import load_plugins
    from engine_core.testing.distributed import run_distributed
    from engine_core.testing.models import TINY_QWEN2

    if len(backends) < 2:
        raise ConfigError(f"parity compares at least two backends; got {backends}.")
    if steps < 1 or world_size < 1:
        raise ConfigError(f"--steps and --world-size must be >= 1; got {steps}, {world_size}.")
    manager = load_plugins()
    # an unknown name fails here, listing the known ones; the ranks start from a fork server
    # that imported each engine's module and the model's class once, not once per rank
    preload: list[str] = []
    for name in backends:
        spec = manager.get_engine(name)
        preload += [spec.target.partition(":")[0], *spec.imports]
    preload.append("transformers.models.qwen2.modeling_qwen2")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_QWEN2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    report = ParityReport(list(backends), steps, world_size, micro_batch_size, rtol, atol_log_prob)
    runs: dict[str, BackendRun] = {}
    with tempfile.TemporaryDirectory(prefix="engine-core-parity-") as folder:
        model.save_pretrained(folder)
        for name in backends:
            results = run_distributed(
                _worker, world_size, name, folder, steps, micro_batch_size, preload=preload
            )
            runs[name] = results[0]
    base = runs[backends[0]]
    for name, run in runs.items():
        report.losses[name] = run.losses
        report.grad_norms[name] = run.grad_norms
        report.max_rel_loss_diff[name] = _rel(run.losses, base.losses)
        report.max_rel_grad_norm_diff[name] = _rel(run.grad_norms, base.grad_norms)
        for when, got, want in (
            ("before", run.log_probs_before, base.log_probs_before),
            ("after", run.log_probs_after, base.log_probs_after),
        ):
            diff = float((got - want).abs().max())
            getattr(report, f"max_abs_log_prob_diff_{when}")[name] = diff
        if name != backends[0]:
            found = first_divergence(run, base, rtol, atol_log_prob, world_size)
            if found is not None:
                report.first_divergence[name] = found
    return report


def claim_report_path(path: str | Path, *, overwrite: bool = False) -> Path:
    """Make sure the JSON report can be written to ``path``; call it before any model is built.

    An existing file is refused unless ``overwrite``; a folder, or a place that cannot be
    created or written, is always refused. Missing parent folders are created.
    """
    target = Path(path)
    if target.is_dir():
        raise ConfigError(
            f"engine-core parity: --json {target} is a folder; give a file path such as "
            f"{target / 'parity.json'}."
        )
    if target.exists() and not overwrite:
        raise ConfigError(
            f"engine-core parity: --json {target} already exists; pass --overwrite to replace "
            "it, or choose another path."
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # the report is renamed into place, so the folder (not the file) must take new files
        fd, probe = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"engine-core parity: cannot write --json {target} ({e.strerror or e}); choose a "
            "path in a writable folder."
        ) from None
    return target


def write_report(report: ParityReport, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write ``report`` as JSON to ``path``: a temporary file beside it, then a rename."""
    # claimed again: another command may have written the path while the backends ran
    target = claim_report_path(path, overwrite=overwrite)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return target


def print_report(report: ParityReport, console: Console) -> None:
    """Print ``report``: per-step figures, the largest differences, and the verdict.

    One row per (step, backend), so the width does not grow with the number of backends. Figure
    columns never wrap and are as wide as their longest figure (headers are split over two
    lines to stay narrow); only backend names fold.
    """
    base = report.baseline
    steps = _table(
        f"parity vs {base} ({report.world_size} process(es) per backend)",
        ("step", "backend"),
        ("loss", "grad norm"),
        [
            (str(i + 1), b, f"{report.losses[b][i]:.8f}", f"{report.grad_norms[b][i]:.8f}")
            for i in range(report.steps)
            for b in report.backends
        ],
        section_every=len(report.backends),
    )
    diffs = _table(
        f"max differences vs {base}",
        ("backend",),
        ("rel\nloss", "rel grad\nnorm", "|Δ log-prob|\nbefore", "|Δ log-prob|\nafter"),
        [
            (
                b,
                f"{report.max_rel_loss_diff[b]:.2e}",
                f"{report.max_rel_grad_norm_diff[b]:.2e}",
                f"{report.max_abs_log_prob_diff_before[b]:.2e}",
                f"{report.max_abs_log_prob_diff_after[b]:.2e}",
            )
            for b in report.backends[1:]
        ],
    )
    console.print(steps)
    console.print(diffs)
    verdict = "PASS" if report.passed else "FAIL"
    console.print(
        f"{verdict}: tolerances rtol={report.rtol:g} (loss, grad norm), "
        f"atol={report.atol_log_prob:g} (log-probs)"
    )
    for name, found in report.first_divergence.items():
        ratio = f" ({found['ratio']:.4g}x {base}'s)" if "ratio" in found else ""
        where = f"step {found['step']}" if found["step"] else "before the first step"
        console.print(
            f"{name}: first diverges in the {found['quantity']} at {where}{ratio}; usually "
            f"{found['cause']}."
        )


def _table(
    title: str,
    labels: tuple[str, ...],
    figures: tuple[str, ...],
    rows: list[tuple[str, ...]],
    section_every: int = 0,
) -> Table:
    table = Table(title=title)
    for name in labels:
        table.add_column(name, overflow="fold")
    for i, name in enumerate(figures, start=len(labels)):
        widest = max((len(row[i]) for row in rows), default=0)
        # no_wrap and min_width: where space is short, rich narrows the label columns instead
        table.add_column(name, justify="right", no_wrap=True, min_width=widest)
    for n, row in enumerate(rows, start=1):
        table.add_row(*row, end_section=bool(section_every) and n % section_every == 0)
    return table
