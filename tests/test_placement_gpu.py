"""``engine-core run`` with the actor at dp=2 over NCCL, one GPU per rank (the worker group's
process group is NCCL wherever CUDA is visible), against the in-process run of the same recipe.

Marked ``gpu``: skipped unless two CUDA devices are visible (NCCL puts one rank on each). Written
against the same code paths the CPU tests run with gloo; never executed yet.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_placement import _rows, _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def test_actor_dp2_over_nccl_matches_the_in_process_run(tmp_path: Path) -> None:
    _run(tmp_path / "dp1", "steps=3")  # in this process: one rank, gloo, on the CPU
    _run(tmp_path / "dp2", "steps=3", "placement.executor=local", "placement.actor.dp=2")
    want, got = _rows(tmp_path / "dp1"), _rows(tmp_path / "dp2")
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k in w:
            # GPU kernels against the CPU: float rounding only
            assert g[k] == pytest.approx(w[k], rel=1e-3, abs=1e-5), (g["step"], k)
