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
    cfg = {"optim": {"lr": 1e-2, "warmup_steps": 2, "schedule": "cosine", "total_steps": 5}}
    straight = make_engine(**cfg)
    want = [train_step(straight, s) for s in range(5)]

    first = make_engine(**cfg)
    for s in range(3):
        train_step(first, s)
    folder = first.save_checkpoint(ckpt_root, step=3)
    assert folder == f"{ckpt_root}/global_step_3"
    resumed = make_engine(**cfg)
    assert resumed.load_checkpoint(folder) == 3
    got = [train_step(resumed, s) for s in range(3, 5)]
    assert got == want[3:]  # bit-identical on one process


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
