"""Checkpoints are verified when loaded: every file against the manifest written last.

A flipped byte, a truncated, missing or extra file, or a damaged manifest is refused with an
error naming the checkpoint, its step and the file, before any state of the engine changes;
``engine-core run --resume`` then falls back to the newest checkpoint that verifies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import engine_core.checkpoint as checkpoint_module
from engine_core.checkpoint import MANIFEST_FILE, is_dir, list_checkpoints, verify_checkpoint
from engine_core.errors import CheckpointError
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from engine_core.testing.models import engine_config, nll_loss, train_steps
from engine_core_roles.jobs.cli import RECIPES
from engine_core_roles.trainer.metrics import TIMING_KEYS
from tests._dist import run_distributed


def _engine() -> ReferenceEngine:
    engine = ReferenceEngine(ReferenceEngineConfig(**engine_config()))
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    return engine


def _weights(engine: ReferenceEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.require_module().state_dict().items()}


def _files(folder: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(folder)
    return sorted(p[len(path) :].lstrip("/") for p in fs.find(path))


def _damage(kind: str, data: bytes) -> bytes:
    if kind == "flipped":
        out = bytearray(data)
        out[len(out) // 2] ^= 0x01  # one bit
        return bytes(out)
    return data[: len(data) // 2]


@pytest.mark.parametrize("kind", ["flipped", "truncated"])
def test_every_damaged_file_is_named_before_any_state_changes(root: str, kind: str) -> None:
    engine = _engine()
    train_steps(engine, range(1), 4)
    folder = engine.save_checkpoint(root, step=3)
    names = [n for n in _files(folder) if n != MANIFEST_FILE]
    assert {"model.safetensors", "optim_rank0.pt", "engine_state_rank0.pt"} <= set(names)
    train_steps(engine, range(1, 2), 4)  # move on, so a load would change the weights
    before = _weights(engine)
    for name in names:
        location = f"{folder}/{name}"
        with fsspec.open(location, "rb") as f:
            original = f.read()
        with fsspec.open(location, "wb") as f:
            f.write(_damage(kind, original))
        with pytest.raises(CheckpointError) as refused:
            engine.load_checkpoint(folder)
        message = str(refused.value)
        assert name in message and "(step 3)" in message and folder in message, message
        assert "damaged or was changed" in message, message
        with fsspec.open(location, "wb") as f:
            f.write(original)
        after = _weights(engine)
        assert all(torch.equal(before[k], after[k]) for k in before), name
    assert engine.load_checkpoint(folder) == 3  # intact again


def test_missing_extra_and_manifest_damage_are_refused(root: str) -> None:
    engine = _engine()
    folder = engine.save_checkpoint(root, step=1)
    fs, path = fsspec.core.url_to_fs(folder)
    fs.pipe_file(f"{path}/planted.pt", b"not saved by the engine")
    with pytest.raises(CheckpointError, match=r"not in the manifest \['planted.pt'\]"):
        engine.load_checkpoint(folder)
    fs.rm(f"{path}/planted.pt")
    optim = fs.cat_file(f"{path}/optim_rank0.pt")
    fs.rm(f"{path}/optim_rank0.pt")
    with pytest.raises(CheckpointError, match=r"missing \['optim_rank0.pt'\]"):
        engine.load_checkpoint(folder)
    fs.pipe_file(f"{path}/optim_rank0.pt", optim)
    manifest = fs.cat_file(f"{path}/{MANIFEST_FILE}")
    for bad in (manifest[:20], b"[]", json.dumps({"format": 99, "step": 1, "files": {}}).encode()):
        fs.pipe_file(f"{path}/{MANIFEST_FILE}", bad)
        with pytest.raises(CheckpointError, match=f"{MANIFEST_FILE} is damaged"):
            engine.load_checkpoint(folder)
    fs.rm(f"{path}/{MANIFEST_FILE}")
    with pytest.raises(CheckpointError, match=f"has no {MANIFEST_FILE}"):
        engine.load_checkpoint(folder)
    fs.pipe_file(f"{path}/{MANIFEST_FILE}", manifest)
    assert verify_checkpoint(folder) == 1 and engine.load_checkpoint(folder) == 1


def test_bad_save_arguments_write_nothing(tmp_path: Path) -> None:
    engine = _engine()
    root = tmp_path / "ckpt"
    for kwargs, match in (
        ({"step": -1}, "step must be an int >= 0"),
        ({"step": 1, "max_ckpt_to_keep": 0}, "max_ckpt_to_keep must be >= 1"),
        ({"step": 1, "job_state": {"f": lambda: 0}}, r"job_state\['f'\].*is not plain data"),
    ):
        with pytest.raises(CheckpointError, match=match):
            engine.save_checkpoint(str(root), **kwargs)  # type: ignore[arg-type]
    assert not root.exists()
    engine.save_checkpoint(str(root), step=1)
    with pytest.raises(CheckpointError, match="already exists; refusing to overwrite"):
        engine.save_checkpoint(str(root), step=1)
    assert [s for s, _ in list_checkpoints(root)] == [1]


def _fsdp2_shard_worker(rank: int, world: int, tmp: str) -> dict[str, str]:
    from engine_core.testing.models import registered_engine

    engine = registered_engine("fsdp2")
    train_steps(engine, range(1), 4)
    folder = engine.save_checkpoint(f"{tmp}/ckpt", step=1)
    shards = sorted(n for n in _files(folder) if n.endswith(".distcp"))
    assert shards, _files(folder)
    location = f"{folder}/{shards[0]}"
    data = Path(location).read_bytes()
    Path(location).write_bytes(_damage("flipped", data))
    try:
        engine.load_checkpoint(folder)
    except CheckpointError as e:
        return {"shard": shards[0], "error": str(e)}
    return {"shard": shards[0], "error": "<loaded>"}


def test_a_flipped_byte_in_a_dcp_shard_is_refused(tmp_path: Path) -> None:
    (got,) = run_distributed(_fsdp2_shard_worker, 1, str(tmp_path))
    assert got["shard"] in got["error"] and "damaged or was changed" in got["error"], got


def _run(out: Path, steps: int, *extra: str, resume: bool = False) -> tuple[dict, str]:
    import io

    from rich.console import Console

    from engine_core.configio import apply_overrides, load_yaml
    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.rl.run import run_rl_job

    recipe = RECIPES / "grpo_tiny.yaml"
    overrides = [
        f"output_dir={out}",
        f"steps={steps}",
        "engine.backend=reference",
        "prompts_per_step=2",
        "trainer.samples_per_prompt=2",
        "save_every=1",
        "log_every=1",
        *extra,
    ]
    raw = apply_overrides(load_yaml(recipe), overrides)
    buf = io.StringIO()
    summary = run_rl_job(raw, load_plugins(), resume=resume, console=Console(file=buf, width=200))
    return summary, buf.getvalue()


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_resume_skips_a_damaged_checkpoint_and_says_so(tmp_path: Path, algorithm: str) -> None:
    extra = [f"trainer.algorithm={algorithm}"]
    if algorithm == "ppo":
        extra.append("trainer.samples_per_prompt=1")
    straight = tmp_path / "straight"
    _run(straight, 3, *extra)
    out = tmp_path / "run"
    _run(out, 2, *extra)
    damaged = out / "checkpoints"
    part = "critic" if algorithm == "ppo" else "actor"
    shard = damaged / "global_step_2" / part / "engine_state_rank0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    hashed: list[str] = []
    digest = checkpoint_module._digest

    def counting(fs: Any, path: str) -> tuple[int, str]:
        hashed.append(path)
        return digest(fs, path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint_module, "_digest", counting)
        summary, log = _run(out, 3, *extra, resume=True)
    # the checkpoint resumed from is hashed once, file by file (not again when it is loaded)
    step_1 = [p for p in hashed if "global_step_1/" in p]
    assert step_1 and len(step_1) == len(set(step_1)), step_1
    assert "skipped step 2" in log and f"{part}/engine_state_rank0.pt is damaged" in log, log
    assert "global_step_1 (next step 2)" in log, log
    assert summary["checkpoint"].endswith("global_step_3")
    # steps 2-3 after falling back to step 1 equal the uninterrupted run's
    assert _metrics(out)[-2:] == _metrics(straight)[-2:]
    assert os.path.isdir(damaged / "global_step_3")


def test_no_command_overwrites_a_run_or_writes_where_it_cannot(tmp_path: Path) -> None:
    from engine_core.configio import apply_overrides, load_yaml
    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.sft import run_sft

    recipe = RECIPES / "sft_tiny.yaml"
    out = tmp_path / "sft"
    raw = apply_overrides(load_yaml(recipe), [f"output_dir={out}", "steps=2", "log_every=1"])
    from rich.console import Console

    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    run_sft(raw, load_plugins(), console=quiet)
    metrics = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError, match="already holds a run.*refusing to overwrite"):
        run_sft(raw, load_plugins(), console=quiet)
    assert (out / "metrics.jsonl").read_bytes() == metrics  # untouched
    blocked = tmp_path / "file"
    blocked.write_text("a file, not a folder")
    bad = apply_overrides(raw, [f"output_dir={blocked}/run"])
    with pytest.raises(CheckpointError, match=f"cannot write to output_dir {blocked}/run"):
        run_sft(bad, load_plugins(), console=quiet)
    with pytest.raises(CheckpointError, match="Pass --resume to continue it"):
        _run(tmp_path / "grpo", 1)
        _run(tmp_path / "grpo", 1)


def test_resuming_with_another_model_shape_is_one_sentence(tmp_path: Path) -> None:
    engine = _engine()
    folder = engine.save_checkpoint(str(tmp_path / "ckpt"), step=1)
    from engine_core.testing.models import TINY_QWEN2

    wider = {"config": {**TINY_QWEN2, "hidden_size": 64, "intermediate_size": 128}}
    other = ReferenceEngine(ReferenceEngineConfig(**engine_config(model=wider)))
    other.init_model()
    with pytest.raises(
        CheckpointError,
        match=r"\(step 1\) does not fit this ReferenceEngine's model \(RuntimeError: Error\(s\) in loading state_dict",
    ):
        other.load_checkpoint(folder)


def _fsdp2_reshape_worker(rank: int, world: int, tmp: str) -> str:
    from engine_core.testing.models import TINY_QWEN2, registered_engine

    folder = registered_engine("fsdp2").save_checkpoint(f"{tmp}/ckpt", step=1)
    wider = {"config": {**TINY_QWEN2, "hidden_size": 64, "intermediate_size": 128}}
    try:
        registered_engine("fsdp2", model=wider).load_checkpoint(folder)
    except CheckpointError as e:
        return str(e)
    return "<loaded>"


def test_dcp_size_mismatch_is_one_sentence(tmp_path: Path) -> None:
    (message,) = run_distributed(_fsdp2_reshape_worker, 1, str(tmp_path))
    assert "(step 1) does not fit this FSDP2Engine's model (ValueError: Size mismatch" in message
    assert "\n" not in message, message


# -- one checkpoint for the whole job ---------------------------------------------------------


def test_a_job_checkpoint_is_committed_whole_or_not_at_all(root: str) -> None:
    from engine_core.checkpoint import JOB_STATE_FILE, JobCheckpoints, join

    actor, critic = _engine(), _engine()
    train_steps(actor, range(1))
    checkpoints = JobCheckpoints(root, max_ckpt_to_keep=1)
    folder = checkpoints.save(1, {"actor": actor, "critic": critic}, {"step": 1})
    assert _files(folder)[-2:] == [JOB_STATE_FILE, MANIFEST_FILE]
    assert verify_checkpoint(folder) == 1  # one manifest over every part

    def broken(folder: str) -> None:
        raise OSError("disk full")

    critic.save_shards = broken  # type: ignore[method-assign]
    with pytest.raises(OSError, match="disk full"):
        checkpoints.save(2, {"actor": actor, "critic": critic}, {"step": 2})
    # the actor's part of step 2 was written, but step 2 was never committed nor step 1 rotated
    assert [s for s, _ in list_checkpoints(root)] == [1]
    del critic.save_shards
    want = _weights(actor)
    train_steps(actor, range(1))
    fresh = {"actor": _engine(), "critic": _engine()}
    assert checkpoints.load(folder, fresh) == {"step": 1}
    assert all(torch.equal(v, want[k]) for k, v in _weights(fresh["actor"]).items())
    with pytest.raises(CheckpointError, match=r"holds no extra/: it was not saved by this job"):
        checkpoints.load(folder, {**fresh, "extra": _engine()})
    for bad in ({}, {"Actor": actor}, {"../x": actor}):
        with pytest.raises(CheckpointError, match="part names must be lowercase identifiers"):
            checkpoints.save(3, bad, {"step": 3})
    with pytest.raises(CheckpointError, match=r"job_state\['f'\] \(builtins.object\)"):
        checkpoints.save(3, {"actor": actor}, {"f": object()})
    assert [s for s, _ in list_checkpoints(root)] == [1] and not is_dir(
        join(root, "global_step_3.tmp")
    )


def _verify_split(rank: int, world: int, folder: str) -> tuple[int, str]:
    """Each rank hashes its share of the files; the damage one of them finds reaches both."""
    from engine_core.checkpoint import _share, verify_on_every_rank
    from engine_core.errors import CheckpointError

    sizes = {p.name: p.stat().st_size for p in Path(folder).iterdir() if p.name != MANIFEST_FILE}
    mine = sorted(_share(sizes, rank, world))
    try:
        verify_on_every_rank(folder)
    except CheckpointError as e:
        return len(mine), str(e)
    return len(mine), ""


def test_verification_is_split_between_the_ranks(tmp_path: Path) -> None:
    from engine_core.checkpoint import _share, write_manifest
    from tests._dist import run_distributed

    folder = tmp_path / "global_step_4"
    folder.mkdir()
    sizes = {"a.bin": 9000, "b.bin": 5000, "c.bin": 4000, "d.bin": 100}
    for name, size in sizes.items():
        (folder / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    write_manifest(str(folder), step=4)
    # largest first to the least loaded rank: 9000 + 100 | 5000 + 4000
    assert _share(sizes, 0, 2) == {"a.bin", "d.bin"} and _share(sizes, 1, 2) == {"b.bin", "c.bin"}
    assert set().union(*(_share(sizes, r, 3) for r in range(3))) == set(sizes)
    assert run_distributed(_verify_split, 2, str(folder)) == [(2, ""), (2, "")]
    data = bytearray((folder / "c.bin").read_bytes())
    data[7] ^= 0x10  # on rank 1's share: rank 0 hashes nothing of it and still refuses
    (folder / "c.bin").write_bytes(bytes(data))
    for _, problem in run_distributed(_verify_split, 2, str(folder)):
        assert "c.bin is damaged" in problem and "step 4" in problem, problem
