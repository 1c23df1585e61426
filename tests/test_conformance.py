"""The conformance kit itself: each deliberately broken example engine fails the kit, exactly
the contract tests of the clause it breaks, with a message naming the fix. (The kit's passing
runs over every engine in the repository are part of ``make test``:
``--engine-core-backend=reference,fsdp,fsdp2,megatron,example``.)

Each broken engine runs in a pytest subprocess of its own, on the contract tests around the
clause it breaks (``-k``) and only the kit checks they need (``--engine-core-kit-only``); the
JUnit report gives each test's outcome and failure message.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine_core.testing.plugin import CONTRACT

GRADIENTS = {"test_gradient_invariance_single_process", "test_gradient_invariance_two_dp_ranks"}
CHECKPOINTS = {"test_checkpoint_resume_and_rotation", "test_checkpoint_with_two_dp_ranks"}


@dataclass(frozen=True)
class Broken:
    """A broken engine, the contract tests run on it (with the kit checks they need), the ones
    that must fail, and a phrase the failure messages contain (each names its clause in brackets)."""

    tests: frozenset[str]
    checks: tuple[str, ...]
    must_fail: frozenset[str]
    phrase: str


BROKEN = {
    "example-bad-scaling": Broken(
        frozenset(GRADIENTS),
        ("step_",),
        frozenset({"test_gradient_invariance_two_dp_ranks"}),
        "must scale the loss by dp_size",
    ),
    "example-bad-order": Broken(
        frozenset(
            {
                "test_log_probs_and_entropy_match_transformers",
                "test_outputs_with_two_dp_ranks_match_transformers",
                *GRADIENTS,
            }
        ),
        ("outputs", "step_"),
        frozenset(
            {
                "test_log_probs_and_entropy_match_transformers",
                "test_outputs_with_two_dp_ranks_match_transformers",
                *GRADIENTS,
            }
        ),
        "outputs are not in input order",
    ),
    "example-no-collect": Broken(
        frozenset({"test_one_collect_rank_per_dp_rank"}),
        ("layout",),
        frozenset({"test_one_collect_rank_per_dp_rank"}),
        "is_collect_rank must be True on exactly one rank per DP rank",
    ),
    "example-bad-scheduler": Broken(
        frozenset(CHECKPOINTS), ("checkpoint",), frozenset(CHECKPOINTS), "[checkpoint: LR schedule]"
    ),
    "example-bad-rng": Broken(
        frozenset(CHECKPOINTS), ("checkpoint",), frozenset(CHECKPOINTS), "[checkpoint: RNG]"
    ),
    "example-bad-sharded-optimizer": Broken(
        frozenset(CHECKPOINTS),
        ("checkpoint",),
        frozenset({"test_checkpoint_with_two_dp_ranks"}),
        "own part",
    ),
    "example-needs-process-group": Broken(
        frozenset({"test_runs_without_a_process_group", "test_train_and_eval_modes"}),
        ("lifecycle", "modes"),
        frozenset({"test_runs_without_a_process_group"}),
        "create a one-rank group in init_model",
    ),
    "example-modifies-inputs": Broken(
        frozenset({"test_inputs_left_unmodified", "test_log_probs_and_entropy_match_transformers"}),
        ("inputs", "outputs_packing"),
        frozenset({"test_inputs_left_unmodified"}),
        "[inputs unmodified]",
    ),
}


def run_kit(backend: str, broken: Broken, report: Path) -> dict[str, str | None]:
    """Run the selected contract tests on ``backend``; {test: failure message or None}."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(CONTRACT),
            f"--engine-core-backend={backend}",
            *(f"--engine-core-kit-only={c}" for c in broken.checks),
            "-k",
            " or ".join(sorted(broken.tests)),
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            f"--junitxml={report}",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        timeout=900,
        cwd=Path(__file__).parents[1],
    )
    assert report.exists(), (proc.stdout + proc.stderr)[-3000:]
    outcomes: dict[str, str | None] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.attrib["name"].partition("[")[0]
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        outcomes[name] = (
            None if failure is None else failure.attrib.get("message", "") + (failure.text or "")
        )
    return outcomes


@pytest.mark.parametrize("backend", sorted(BROKEN))
def test_broken_engine_fails_the_kit_for_the_right_reason(backend: str, tmp_path: Path) -> None:
    broken = BROKEN[backend]
    results = run_kit(backend, broken, tmp_path / "report.xml")
    assert set(results) == broken.tests, f"ran {sorted(results)}, want {sorted(broken.tests)}"
    failed = {name for name, message in results.items() if message is not None}
    assert failed == broken.must_fail, {n: (m or "")[:800] for n, m in results.items() if m}
    messages = [results[name] or "" for name in sorted(broken.must_fail)]
    assert any(broken.phrase in m for m in messages), "\n---\n".join(m[:1500] for m in messages)
