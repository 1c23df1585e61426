"""The reference engine's state handling: checkpoints, rotation, export, device moves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine_core.checkpoint import list_checkpoints, staging_dir
from engine_core.errors import CheckpointError
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from tests._models import engine_config, nll_loss, random_batch


def make_engine(**overrides: object) -> ReferenceEngine:
    engine = ReferenceEngine(ReferenceEngineConfig(**engine_config(**overrides)))
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    return engine


def train_step(engine: ReferenceEngine, seed: int) -> tuple[float, float]:
    with engine.train_mode():
        out = engine.forward_backward_step(random_batch(6, seed=seed))
        norm = engine.optimizer_step()
        engine.lr_scheduler_step()
        engine.optimizer_zero_grad()
    assert out.loss is not None
    return out.loss, norm


def _lr(engine: ReferenceEngine) -> float:
    """The rate of the engine's next step."""
    assert engine.optimizer is not None
    return float(engine.optimizer.param_groups[0]["lr"])


@pytest.fixture(params=["local", "memory"])
def ckpt_root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A checkpoint root as a local path and as an fsspec URL (in-memory filesystem)."""
    if request.param == "local":
        yield str(tmp_path)
        return
    import fsspec

    root = f"memory://ckpt-{request.node.originalname}"  # no [param] (glob characters)
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_checkpoint_resume_is_exact(ckpt_root: str) -> None:
    """Saved after the prelude's last step and the schedule's first: the resumed engine steps
    on exactly as the straight one, its rates included."""
    cfg = {
        "optim": {
            "lr": 1e-2,
            "prelude_steps": 2,
            "prelude_lr": 3e-2,
            "warmup_steps": 2,
            "schedule": "cosine",
            "total_steps": 4,
        }
    }
    straight = make_engine(**cfg)
    want = [(train_step(straight, s), _lr(straight)) for s in range(7)]
    assert [lr for _, lr in want][:3] == pytest.approx([3e-2, 1e-2 / 2, 1e-2])

    first = make_engine(**cfg)
    for s in range(3):
        train_step(first, s)
    folder = first.save_checkpoint(ckpt_root, step=3)
    assert folder == f"{ckpt_root}/global_step_3"
    resumed = make_engine(**cfg)
    assert resumed.load_checkpoint(folder) == 3
    got = [(train_step(resumed, s), _lr(resumed)) for s in range(3, 7)]
    assert got == want[3:]  # bit-identical on one process


def test_the_prelude_runs_at_its_own_rate_then_the_schedule_starts() -> None:
    """prelude_steps at prelude_lr, then the schedule as if it began there: its warm-up ramp,
    its cosine over total_steps; the two fields go together."""
    from engine_core.config import OptimConfig
    from engine_core.optim import lr_lambda

    cfg = OptimConfig(
        lr=1e-4,
        prelude_steps=3,
        prelude_lr=5e-4,
        warmup_steps=2,
        schedule="cosine",
        total_steps=4,
    )
    rates = [cfg.lr * lr_lambda(cfg, s) for s in range(8)]
    assert rates == pytest.approx([5e-4, 5e-4, 5e-4, 5e-5, 1e-4, 1e-4, 5e-5, 0.0])
    plain = OptimConfig(lr=1e-4, warmup_steps=2, schedule="cosine", total_steps=4)
    assert rates[3:] == pytest.approx([plain.lr * lr_lambda(plain, s) for s in range(5)])
    for alone in ({"prelude_steps": 3}, {"prelude_lr": 5e-4}):
        with pytest.raises(ValueError, match="go together: set both"):
            OptimConfig(**alone)


def test_rotation_keeps_max_ckpt_to_keep(ckpt_root: str) -> None:
    engine = make_engine()
    for step in range(1, 6):
        engine.save_checkpoint(ckpt_root, step=step, max_ckpt_to_keep=2)
    assert [s for s, _ in list_checkpoints(ckpt_root)] == [4, 5]


def test_existing_checkpoint_is_never_overwritten(tmp_path: Path) -> None:
    engine = make_engine()
    folder = Path(engine.save_checkpoint(str(tmp_path), step=1))
    before = (folder / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="already exists"):
        engine.save_checkpoint(str(tmp_path), step=1)
    assert (folder / "model.safetensors").read_bytes() == before


def test_interrupted_save_is_not_a_checkpoint(ckpt_root: str) -> None:
    staging_dir(ckpt_root, 7)  # as if a save died before committing
    assert list_checkpoints(ckpt_root) == []
    engine = make_engine()
    engine.save_checkpoint(ckpt_root, step=7)  # the leftover is cleared, not an error
    assert [s for s, _ in list_checkpoints(ckpt_root)] == [7]


def test_load_rejects_an_incomplete_folder(tmp_path: Path) -> None:
    engine = make_engine()
    with pytest.raises(
        CheckpointError, match="has no manifest.json: it was not completely written"
    ):
        engine.load_checkpoint(str(tmp_path))


def test_exported_weights_equal_the_state_dict() -> None:
    engine = make_engine()
    exported = dict(engine.named_full_params())
    state = engine.module.state_dict()
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name


def test_to_round_trip_keeps_values() -> None:
    engine = make_engine()
    train_step(engine, 0)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.to("cpu")
    engine.to("cpu", model=False)
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, before[k])
