"""Checkpoints: a resume equal to an uninterrupted run (model, sharded optimizer, schedule,
RNG, skipped steps) on one and two DP ranks, rotation, and the checkpoint sequence's promises
(the folder and job state committed, preflight first, an interrupted save commits nothing, a
damaged file refused on every rank, a resharded load keeps each rank's RNG).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_core.testing.checks.registry import Check, Context, Layout
from engine_core.testing.checks.verdict import described, is_, result
from engine_core.testing.drive import (
    build,
    fingerprint,
    first_step,
    raised_by,
    rng_draws,
    skip_a_step,
    train_lrs,
)
from engine_core.testing.models import TINY_QWEN2
from engine_core.testing.oracle import train_batch

__all__ = [
    "CHECKS",
    "test_a_damaged_checkpoint_is_refused_on_every_rank",
    "test_a_refused_or_interrupted_save_commits_nothing",
    "test_a_resharded_load_keeps_each_ranks_rng",
    "test_checkpoint_resume_and_rotation",
    "test_checkpoint_with_two_dp_ranks",
    "test_load_shards_refuses_a_folder_without_its_files",
    "test_save_checkpoint_commits_the_step_folder_and_job_state",
]

# a schedule that moves on every step compared (warm-up over 6), and a model that draws random
# numbers in training (attention dropout), so a checkpoint that drops the schedule or the RNG
# state resumes differently
CKPT_OPTIM = {"lr": 1e-2, "clip_grad": 1.0, "warmup_steps": 6}


def _ckpt_model(policy: dict[str, Any]) -> dict[str, Any]:
    return {"config": {**TINY_QWEN2, "attention_dropout": 0.1}} if "path" in policy else policy


def _checkpoint(c: Context) -> dict[str, Any]:
    """Save after 2 steps; 2 more steps straight on, and the same 2 steps after loading the
    checkpoint into a fresh engine: losses, grad norms, learning rates, random draws and final
    weights must agree. Then rotation keeps the newest ``max_ckpt_to_keep``."""
    from engine_core.checkpoint import list_checkpoints

    model, root = _ckpt_model(c.policy), c.root
    engine = build(c.backend, model=model, optim=CKPT_OPTIM)
    train_lrs(engine, range(2))
    skip_a_step(engine)  # the skipped-step counter is part of what a resume restores
    skipped_before = getattr(engine, "skipped_steps", None)
    folder = engine.save_checkpoint(root, step=2, max_ckpt_to_keep=2)
    straight_rng = rng_draws()
    straight = train_lrs(engine, range(2, 4))
    straight_weights = fingerprint(engine)
    resumed = build(c.backend, model=model, optim=CKPT_OPTIM)
    step = resumed.load_checkpoint(folder)
    again_rng = rng_draws()
    again = train_lrs(resumed, range(2, 4))
    again_weights = fingerprint(resumed)
    skipped_after = getattr(resumed, "skipped_steps", None)
    for s in (3, 4):
        engine.save_checkpoint(root, step=s, max_ckpt_to_keep=2)
    kept = [s for s, _ in list_checkpoints(root)]
    return {
        "step": step,
        "straight": straight,
        "again": again,
        "straight_rng": straight_rng,
        "again_rng": again_rng,
        "weights": (straight_weights, again_weights),
        "skipped": (skipped_before, skipped_after),
        "kept": kept,
    }


def _saving(c: Context) -> dict[str, Any]:
    """The checkpoint sequence's promises on one rank: the folder save_checkpoint returns and
    the job state committed with it; a second save of a step, a refusing
    ``checkpoint_preflight`` and a save interrupted after ``save_shards`` (each must commit
    nothing); ``load_shards`` of an empty folder; a checkpoint read as one written by two
    ranks (each rank's RNG streams stay its own)."""
    from engine_core.checkpoint import is_dir, list_checkpoints, load_torch, save_torch
    from engine_core.engine import CHECKPOINT_STATE_FILE
    from engine_core.errors import CheckpointError

    root = str(Path(c.root) / "saving")
    engine = build(c.backend, model=c.policy, optim={"lr": 1e-2, "clip_grad": None})
    first_step(engine, train_batch(0))  # megatron has no optimizer state to save before a step
    folder = engine.save_checkpoint(root, step=1, job_state={"data_position": 7})
    first_step(engine, train_batch(1))  # so that a checkpoint read would change the weights
    moved = fingerprint(engine)
    out: dict[str, Any] = {
        "root": root,
        "folder": folder,
        "job_state": type(engine).load_job_state(folder),
        "again": raised_by(lambda: engine.save_checkpoint(root, step=1)),
    }
    out["kept_after_again"] = [s for s, _ in list_checkpoints(root)]

    def refuse(path: str, *, saving: bool) -> None:
        raise CheckpointError(
            f"kit: checkpoint_preflight refuses to {'save' if saving else 'load'}"
        )

    engine.checkpoint_preflight = refuse  # type: ignore[method-assign]
    out["preflight_save"] = raised_by(lambda: engine.save_checkpoint(root, step=2))
    out["preflight_load"] = raised_by(lambda: engine.load_checkpoint(folder))
    del engine.checkpoint_preflight  # the class's own again
    out["preflight_wrote"] = is_dir(f"{root}/global_step_2") or is_dir(f"{root}/global_step_2.tmp")
    out["preflight_read"] = fingerprint(engine) != moved

    shards = engine.save_shards

    def interrupted(folder: str) -> None:
        shards(folder)
        raise RuntimeError("kit: the save was interrupted after save_shards")

    engine.save_shards = interrupted  # type: ignore[method-assign]
    out["interrupted"] = raised_by(lambda: engine.save_checkpoint(root, step=3))
    del engine.save_shards
    out["listed_after_interrupt"] = [s for s, _ in list_checkpoints(root)]
    out["committed_interrupted"] = is_dir(f"{root}/global_step_3")

    empty = Path(root) / "empty"
    empty.mkdir()
    out["empty"] = (str(empty), raised_by(lambda: engine.load_shards(str(empty))))

    # a checkpoint written by two ranks, read by one: rank 0's core state file says world 2
    # (the folder no longer matches its manifest: read it as read_checkpoint_files does,
    # unverified); this rank's streams must go on as they were, not restart from the file's
    state_file = str(Path(folder) / CHECKPOINT_STATE_FILE.format(rank=0))
    core = load_torch(state_file)
    save_torch({**core, "world_size": 2}, state_file)
    rng_draws()  # the streams move on from the saved ones
    streams = engine.rng_state()
    engine.read_checkpoint_files(folder)
    read = rng_draws()
    engine.set_rng_state(streams)
    out["resharded_rng"] = (read, rng_draws())
    return out


def _damaged(c: Context) -> dict[str, Any]:
    """A checkpoint saved without a job state, then with one byte flipped in its biggest file,
    loaded on every rank: what each rank raised, and whether its weights (moved on since the
    save) changed."""
    import torch.distributed as dist

    from engine_core.checkpoint import MANIFEST_FILE

    root = str(Path(c.root) / "damaged")
    engine = build(c.backend, model=c.policy, optim={"lr": 1e-2, "clip_grad": None})
    first_step(engine, train_batch(0))
    folder = engine.save_checkpoint(root, step=1)
    first_step(engine, train_batch(1))  # so that a checkpoint read would change the weights
    moved = fingerprint(engine)
    files = [p for p in Path(folder).rglob("*") if p.is_file() and p.name != MANIFEST_FILE]
    victim = max(files, key=lambda p: (p.stat().st_size, str(p)))
    dist.barrier()  # every rank has chosen before the file changes
    if dist.get_rank() == 0:
        with victim.open("r+b") as f:  # one bit, in place: the size stays
            f.seek(victim.stat().st_size // 2)
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ 0x01]))
    dist.barrier()
    return {
        "job_state": type(engine).load_job_state(folder),
        "file": victim.relative_to(folder).as_posix(),
        "refused": raised_by(lambda: engine.load_checkpoint(folder)),
        "weights_moved": fingerprint(engine) != moved,
    }


CHECKPOINT_SINGLE = Check("checkpoint", Layout.SINGLE, _checkpoint)
# optimizer state sharded (or replicated) over two ranks: saved and restored by every rank
CHECKPOINT_TWO = Check("checkpoint", Layout.TWO, _checkpoint)
SAVING = Check("saving", Layout.SINGLE, _saving)
DAMAGED = Check("damaged", Layout.TWO, _damaged)

CHECKS = (CHECKPOINT_SINGLE, SAVING, CHECKPOINT_TWO, DAMAGED)


def _check_checkpoint(ck: dict[str, Any], where: str) -> None:
    assert ck["step"] == 2, (
        f"[checkpoint] {where}: load_checkpoint returned step {ck['step']}, want 2"
    )
    lrs = ([r[2] for r in ck["straight"]], [r[2] for r in ck["again"]])
    if lrs[0] != lrs[1]:
        pytest.fail(
            f"[checkpoint: LR schedule] {where}: after resuming, lr_scheduler_step() returned "
            f"{lrs[1]}, an uninterrupted run {lrs[0]}. Save the scheduler's position "
            f"(checkpoint_extra_state(); SingleOptimizerMixin does) and restore it on load."
        )
    if ck["again_rng"] != ck["straight_rng"]:
        pytest.fail(
            f"[checkpoint: RNG] {where}: random draws right after load_checkpoint() differ from "
            f"those right after save_checkpoint() ({ck['again_rng'][:2]} vs "
            f"{ck['straight_rng'][:2]}): dropout and sampling diverge after a resume. Let "
            f"BaseEngine.load_checkpoint restore the RNG streams (rng_state / set_rng_state), "
            f"and do not reseed after loading."
        )
    if ck["again"] != ck["straight"] or ck["weights"][0] != ck["weights"][1]:
        pytest.fail(
            f"[checkpoint: model and optimizer] {where}: (loss, grad norm, lr) of the 2 steps "
            f"after resume {ck['again']} differ from an uninterrupted run {ck['straight']} "
            f"(final weights sum {ck['weights'][1]!r} vs {ck['weights'][0]!r}). save_shards() "
            f"must write every rank's model and optimizer state (sharded optimizer state "
            f"included) and load_shards() must restore each rank's own part."
        )
    before, after = ck["skipped"]
    if before is not None and after != before:
        pytest.fail(
            f"[checkpoint: skipped steps] {where}: skipped_steps was {before} when saved and "
            f"{after} after loading. Save the counter with the schedule "
            f"(checkpoint_extra_state(); SingleOptimizerMixin does) and restore it on load."
        )
    assert ck["kept"] == [3, 4], (
        f"[checkpoint: rotation] {where}: max_ckpt_to_keep=2 left steps {ck['kept']}, want [3, 4]"
    )


def test_checkpoint_resume_and_rotation(single: dict) -> None:
    _check_checkpoint(result(single, CHECKPOINT_SINGLE, "checkpoint"), "1 rank")


def test_checkpoint_with_two_dp_ranks(double: list) -> None:
    for rank, r in enumerate(double):
        _check_checkpoint(result(r, CHECKPOINT_TWO, "checkpoint, dp=2"), f"dp=2 rank {rank}")


def test_save_checkpoint_commits_the_step_folder_and_job_state(single: dict) -> None:
    got = result(single, SAVING, "checkpoint: sequence")
    want = f"{got['root']}/global_step_1"
    if got["folder"].rstrip("/") != want:
        pytest.fail(
            f"[checkpoint: sequence] save_checkpoint returned {got['folder']!r}, want {want!r}"
        )
    if got["job_state"] != {"data_position": 7}:
        pytest.fail(
            f"[checkpoint: sequence] load_job_state() of a checkpoint saved with job_state="
            f"{{'data_position': 7}} gave {got['job_state']!r}: commit job_state with the "
            f"checkpoint (BaseEngine.save_checkpoint does)."
        )
    if not is_(got["again"], "CheckpointError") or got["kept_after_again"] != [1]:
        pytest.fail(
            f"[checkpoint: sequence] saving step 1 again raised {described(got['again'])} and left "
            f"steps {got['kept_after_again']}; want a CheckpointError and step 1 as it was (an "
            f"existing checkpoint is never overwritten)."
        )


def test_a_refused_or_interrupted_save_commits_nothing(single: dict) -> None:
    got = result(single, SAVING, "checkpoint: sequence")
    for what in ("save", "load"):
        raised = got[f"preflight_{what}"]
        if not is_(raised, "CheckpointError", f"kit: checkpoint_preflight refuses to {what}"):
            pytest.fail(
                f"[checkpoint: sequence] with a checkpoint_preflight() that refuses, "
                f"{what}_checkpoint raised {described(raised)}; want its CheckpointError "
                f"(call checkpoint_preflight first, as BaseEngine.{what}_checkpoint does)."
            )
    if got["preflight_wrote"] or got["preflight_read"]:
        done = "wrote a folder" if got["preflight_wrote"] else "loaded the checkpoint"
        pytest.fail(
            f"[checkpoint: sequence] checkpoint_preflight() refused, yet the engine {done}: "
            f"nothing may be written or read before it passes."
        )
    if not is_(got["interrupted"], "RuntimeError", "kit: the save was interrupted"):
        pytest.fail(
            f"[checkpoint: sequence] a save whose save_shards() raised after writing raised "
            f"{described(got['interrupted'])}; want that RuntimeError, as raised."
        )
    if got["committed_interrupted"] or got["listed_after_interrupt"] != [1]:
        pytest.fail(
            f"[checkpoint: sequence] after a save interrupted in save_shards(), "
            f"list_checkpoints() gives steps {got['listed_after_interrupt']}, want [1]: an "
            f"interrupted save must leave only its .tmp staging folder (stage, then commit)."
        )


def test_load_shards_refuses_a_folder_without_its_files(single: dict) -> None:
    folder, raised = result(single, SAVING, "checkpoint: sequence")["empty"]
    if not is_(raised, "CheckpointError", folder):
        pytest.fail(
            f"[checkpoint: sequence] load_shards() of an empty folder raised {described(raised)}; "
            f"want a CheckpointError naming the folder and what it lacks."
        )


def test_a_resharded_load_keeps_each_ranks_rng(single: dict) -> None:
    read, kept = result(single, SAVING, "checkpoint: RNG")["resharded_rng"]
    if read != kept:
        pytest.fail(
            f"[checkpoint: RNG] reading a checkpoint saved by another number of ranks changed "
            f"this rank's random streams (draws {read[:2]}, not {kept[:2]}): streams belong to "
            f"ranks, so a resharded load keeps its own (BaseEngine.read_checkpoint_files "
            f"restores them only when the world sizes match)."
        )


def test_a_damaged_checkpoint_is_refused_on_every_rank(double: list) -> None:
    for rank, r in enumerate(double):
        got = result(r, DAMAGED, "checkpoint: damaged")
        if got["job_state"] is not None:
            pytest.fail(
                f"[checkpoint: sequence] load_job_state() of a checkpoint saved without "
                f"job_state gave {got['job_state']!r}; want None."
            )
        if not is_(got["refused"], "CheckpointError", got["file"]):
            pytest.fail(
                f"[checkpoint: damaged] rank {rank}: load_checkpoint() of a checkpoint with one "
                f"byte flipped in {got['file']} raised {described(got['refused'])}; want a "
                f"CheckpointError naming the file on every rank (BaseEngine.load_checkpoint "
                f"verifies every file against the manifest first)."
            )
        if got["weights_moved"]:
            pytest.fail(
                f"[checkpoint: damaged] rank {rank}: the refused load changed the weights: "
                f"verify the files before load_shards() reads any."
            )
