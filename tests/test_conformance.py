"""The conformance kit itself: each deliberately broken example engine fails the kit, and for
the right reason. (The kit's passing runs over every engine in the repository are part of
``make test``: ``--engine-core-backend=reference,fsdp,fsdp2,example``.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine_core.testing.plugin import CONTRACT

# backend -> (the contract tests that must fail, a phrase their message must contain)
BROKEN = {
    "example-bad-scaling": (
        {"test_gradient_invariance_two_dp_ranks"},
        "must scale the loss by dp_size",
    ),
    "example-bad-order": (
        {
            "test_log_probs_and_entropy_match_transformers",
            "test_outputs_with_two_dp_ranks_match_transformers",
            "test_gradient_invariance_single_process",
            "test_gradient_invariance_two_dp_ranks",
        },
        "outputs are not in input order",
    ),
    "example-no-collect": (
        {"test_one_collect_rank_per_dp_rank"},
        "is_collect_rank must be True on exactly one rank per DP rank",
    ),
}


def run_kit(backend: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(CONTRACT),
            f"--engine-core-backend={backend}",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-rf",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        timeout=600,
    )


@pytest.mark.parametrize("backend", sorted(BROKEN))
def test_broken_engine_fails_the_kit_for_the_right_reason(backend: str) -> None:
    must_fail, phrase = BROKEN[backend]
    proc = run_kit(backend)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    failed = {
        line.split("::")[1].split("[")[0]
        for line in proc.stdout.splitlines()
        if line.startswith("FAILED ")
    }
    assert failed == must_fail, out[-3000:]
    assert phrase in out, out[-3000:]
