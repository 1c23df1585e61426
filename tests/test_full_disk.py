"""A full disk during a save: one sentence, every committed step intact, no staging folder left,
and with ``on_save_failure=continue`` a run that trains on.

The run's output folder is a real tmpfs mount sized for one checkpoint and the run's other
files, not two checkpoints: the save of step 2 fails with ENOSPC (the rotation of step 1 comes
only after a commit).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_core.checkpoint import JobCheckpoints, list_checkpoints
from engine_core_roles.jobs.cli import RECIPES, main

# one checkpoint of this run is about 0.97 MB, its export and plot about 0.45 MB
SIZE = "1600k"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"this machine does not let the tests mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        # lazily: a writer abandoned on the full disk may still hold its file open
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _args(out: Path, *extra: str) -> list[str]:
    return [
        "run",
        str(RECIPES / "grpo_tiny.yaml"),
        f"output_dir={out}",
        "steps=3",
        "save_every=1",
        "max_ckpt_to_keep=1",
        "engine.backend=reference",
        "prompts_per_step=2",
        "trainer.samples_per_prompt=2",
        "log_every=1",
        *extra,
    ]


@pytest.mark.parametrize("on_failure", ["stop", "continue"])
def test_a_full_disk_is_one_sentence_and_keeps_what_was_committed(
    small_disk: Path, on_failure: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = small_disk / "run"
    code = main(_args(out, f"on_save_failure={on_failure}"))
    err = capsys.readouterr()
    root = out / "checkpoints"
    # step 1 is committed and whole; the failed saves left no staging folder
    assert [s for s, _ in list_checkpoints(root)] == [1]
    assert JobCheckpoints(root).verify(str(root / "global_step_1"), ["actor"]) == 1
    assert not list(root.glob("*.tmp"))
    said = f"saving the checkpoint of step 2 under {root} failed: No space left on device"
    if on_failure == "stop":
        assert code == 1
        lines = [line for line in err.err.splitlines() if line.strip()]
        assert len(lines) == 1, err.err
        assert said in lines[0] and "the last safe one is" in lines[0], lines[0]
        assert str(root / "global_step_1") in lines[0] and "--resume auto" in lines[0]
        assert "GB" in lines[0]  # the space the save needs, and what is free
    else:  # the run trains to its end; each failed save is said, the next one tries again
        assert code == 0, err.err
        printed = " ".join(err.out.split())
        assert printed.count("No space left on device") == 2, printed  # steps 2 and 3
        assert "training goes on" in printed
        assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
