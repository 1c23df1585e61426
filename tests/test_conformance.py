"""The conformance kit itself: each deliberately broken example engine fails the kit, exactly
the contract tests of the clause it breaks, with a message naming the fix. (The kit's passing
runs over every engine in the repository are part of ``make test``:
``--engine-core-backend=reference,fsdp,fsdp2,megatron,example``.)

The broken engines run in one pytest subprocess, grouped by the clauses they break, each
group on the contract tests around its clauses (``-k``), each engine with only the kit checks
its group needs (``--engine-core-kit-only=ENGINE:CHECK``); the JUnit report gives each test's
outcome and failure message.
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

OUTPUTS = {
    "test_log_probs_and_entropy_match_transformers",
    "test_outputs_with_two_dp_ranks_match_transformers",
}
GRADIENTS = {"test_gradient_invariance_single_process", "test_gradient_invariance_two_dp_ranks"}
METRICS = "test_metrics_reduce_over_micro_batches_and_ranks"
COLLECT = "test_one_collect_rank_per_dp_rank"
CHECKPOINTS = {"test_checkpoint_resume_and_rotation", "test_checkpoint_with_two_dp_ranks"}
MODES = "test_train_and_eval_modes"
RESTORED = "test_modes_restore_the_module_and_autograd_on_exit"
OFFLOADED = "test_offload_loads_on_entering_a_mode_and_offloads_on_exit"
OPTIMIZER = "test_optimizer_step_semantics"
EXPORT = "test_weight_export_matches_hf_state_dict"
REGISTERED = "test_registered_class_declares_the_registered_capabilities"
INPUTS = "test_inputs_left_unmodified"
NO_GROUP = "test_runs_without_a_process_group"
TO = "test_to_moves_what_its_flags_say"
BF16 = "test_bf16_model_keeps_its_dtype_and_gives_float32_log_probs"
MIXED_PRECISION = "test_mixed_precision_computes_in_bf16_on_float32_master_weights"
TIED = "test_tied_embeddings_export_and_checkpoint"
CHECKPOINTING = "test_gradient_checkpointing_recomputes_the_blocks"
ROUTING = "test_routing_replay_follows_the_given_routes"
VISION = "test_log_probs_with_images_match_transformers"
UPDATE = {
    "test_update_matches_a_plain_adamw_loop_single_process",
    "test_update_matches_a_plain_adamw_loop_two_dp_ranks",
}

# The broken engines in groups, each on the contract tests around some clauses (-k) and only the
# kit checks those tests need (--engine-core-kit-only):
# group -> (contract tests, kit checks)
GROUPS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "numerics": (
        frozenset({*OUTPUTS, *GRADIENTS, METRICS, COLLECT, *UPDATE, OPTIMIZER, TO}),
        ("outputs", "step_", "layout", "update", "optimizer", "to_meta"),
    ),
    "checkpoints": (frozenset(CHECKPOINTS), ("checkpoint",)),
    "lifecycle": (
        frozenset(
            {
                *(MODES, RESTORED, OFFLOADED, OPTIMIZER, EXPORT, REGISTERED, INPUTS),
                *(BF16, MIXED_PRECISION, TIED, CHECKPOINTING, ROUTING, VISION),
            }
        ),
        (
            *("modes", "optimizer", "export", "inputs", "bf16", "mixed_precision", "tied"),
            *("recompute", "routing", "vision"),
        ),
    ),
    "process": (frozenset({NO_GROUP, MODES}), ("lifecycle", "modes")),
}
# The groups in one pytest subprocess (an interpreter, the kit's collection, baseline and
# worker fork server each cost ~10 s of a two-core machine): each group's tests run on that
# group's engines only (-k), and each engine runs only its group's kit checks
# (--engine-core-kit-only=ENGINE:CHECK), so no engine runs another group's heaviest checks.


@dataclass(frozen=True)
class Broken:
    """A broken engine: its group, the contract tests that must fail (all others of the group
    pass) and a phrase their failure messages contain (each names its clause in brackets)."""

    group: str
    must_fail: frozenset[str]
    phrase: str


BROKEN = {
    "example-bad-order": Broken(
        "numerics",
        frozenset({*OUTPUTS, *GRADIENTS, METRICS, *UPDATE}),
        "outputs are not in input order",
    ),
    "example-bad-scaling": Broken(
        "numerics",
        frozenset({"test_gradient_invariance_two_dp_ranks"}),
        "must scale the loss by dp_size",
    ),
    "example-bad-loss-report": Broken(
        "numerics", frozenset(GRADIENTS), "the micro-batch losses are averaged"
    ),
    "example-bad-metrics": Broken("numerics", frozenset({METRICS}), "[metric reduction]"),
    "example-no-collect": Broken(
        "numerics",
        frozenset({COLLECT}),
        "is_collect_rank must be True on exactly one rank per DP rank",
    ),
    "example-bad-scheduler": Broken(
        "checkpoints", frozenset(CHECKPOINTS), "[checkpoint: LR schedule]"
    ),
    "example-bad-rng": Broken("checkpoints", frozenset(CHECKPOINTS), "[checkpoint: RNG]"),
    "example-forgets-skipped-steps": Broken(
        "checkpoints", frozenset(CHECKPOINTS), "[checkpoint: skipped steps]"
    ),
    "example-bad-sharded-optimizer": Broken(
        "checkpoints", frozenset({"test_checkpoint_with_two_dp_ranks"}), "own part"
    ),
    "example-bad-modes": Broken("lifecycle", frozenset({MODES}), "[modes]"),
    "example-bad-optimizer": Broken(
        "lifecycle", frozenset({OPTIMIZER}), "a non-finite grad norm must skip the update"
    ),
    # the mixed-precision clause exports too, and sees the same fault
    "example-bad-export": Broken("lifecycle", frozenset({EXPORT, MIXED_PRECISION}), "[export]"),
    "example-drops-tied-head": Broken("lifecycle", frozenset({TIED}), "'lm_head.weight'"),
    "example-upcasts-export": Broken(
        "lifecycle", frozenset({BF16}), "export the weights in the model's dtype"
    ),
    "example-bad-capabilities": Broken("lifecycle", frozenset({REGISTERED}), "[capabilities]"),
    "example-modifies-inputs": Broken("lifecycle", frozenset({INPUTS}), "[inputs unmodified]"),
    "example-ignores-checkpointing": Broken(
        "lifecycle", frozenset({CHECKPOINTING}), "nothing is recomputed in the backward"
    ),
    "example-needs-process-group": Broken(
        "process", frozenset({NO_GROUP}), "create a one-rank group in init_model"
    ),
    "example-ignores-loss-mask": Broken(
        "numerics", frozenset(UPDATE), "it trains on every predicted token"
    ),
    "example-no-clip": Broken("numerics", frozenset(UPDATE), "gradients are not clipped"),
    "example-double-step": Broken("numerics", frozenset(UPDATE), "applies the update twice"),
    "example-forgets-optimizer": Broken("numerics", frozenset({TO}), "optimizer on ['cpu'], want"),
    "example-ignores-routes": Broken(
        "lifecycle", frozenset({ROUTING}), "it routed on its own (its log-probs are the model's"
    ),
    "example-drops-images": Broken(
        "lifecycle", frozenset({VISION}), "the model was called without the images"
    ),
    "example-bf16-master-weights": Broken(
        "lifecycle", frozenset({MIXED_PRECISION}), "The master weights are not float32"
    ),
    "example-modes-stick": Broken("lifecycle", frozenset({RESTORED}), "[modes: restored]"),
    "example-offload-stays": Broken(
        "lifecycle", frozenset({OFFLOADED}), "offloaded to the CPU again"
    ),
}

_REPORT: dict[tuple[str, str], str | None] = {}


def _engines(group: str) -> list[str]:
    return sorted(b for b, broken in BROKEN.items() if broken.group == group)


def run_groups(report: Path) -> dict[tuple[str, str], str | None]:
    """Run the one subprocess of every group: each group's contract tests on that group's
    broken engines, each engine with its group's kit checks. {(backend, test): failure or
    None}."""
    if _REPORT:
        return _REPORT
    backends = [b for g in GROUPS for b in _engines(g)]
    checks = [f"{b}:{c}" for g in GROUPS for b in _engines(g) for c in GROUPS[g][1]]
    selected = " or ".join(
        f"(({' or '.join(sorted(GROUPS[g][0]))}) and ({' or '.join(_engines(g))}))" for g in GROUPS
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(CONTRACT),
            *(f"--engine-core-backend={b}" for b in backends),
            *(f"--engine-core-kit-only={c}" for c in checks),
            "-k",
            selected,
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
        timeout=1500,
        cwd=Path(__file__).parents[1],
    )
    assert report.exists(), (proc.stdout + proc.stderr)[-3000:]
    outcomes: dict[tuple[str, str], str | None] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name, _, backend = case.attrib["name"].partition("[")
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        outcomes[(backend.rstrip("]"), name)] = (
            None if failure is None else failure.attrib.get("message", "") + (failure.text or "")
        )
    _REPORT.update(outcomes)
    return outcomes


@pytest.mark.parametrize("backend", sorted(BROKEN))
def test_broken_engine_fails_the_kit_for_the_right_reason(backend: str, tmp_path: Path) -> None:
    broken = BROKEN[backend]
    tests, _ = GROUPS[broken.group]
    outcomes = run_groups(tmp_path / "report.xml")
    results = {test: message for (b, test), message in outcomes.items() if b == backend}
    assert set(results) == tests, f"ran {sorted(results)}, want {sorted(tests)}"
    failed = {name for name, message in results.items() if message is not None}
    assert failed == broken.must_fail, {n: (m or "")[:800] for n, m in results.items() if m}
    messages = [results[name] or "" for name in sorted(broken.must_fail)]
    assert any(broken.phrase in m for m in messages), "\n---\n".join(m[:1500] for m in messages)


def test_every_broken_engine_is_registered_and_checked() -> None:
    """Each engine the example plugin registers as broken is checked here, and vice versa."""
    from engine_core.plugins import load_plugins

    (example,) = [p for p in load_plugins().plugins() if p.name == "example"]
    broken = {b.name for b in example.backends if b.kind == "engine" and b.name != "example"}
    assert broken == set(BROKEN)


def test_the_checks_an_engine_gets_follow_its_declared_capabilities() -> None:
    """The registry picks each check by what it needs and what the engine declares; a prefix
    selection (--engine-core-kit-only) keeps the checks that always run."""
    from engine_core.capabilities import Capability
    from engine_core.testing.checks import REGISTRY, Layout

    caps = frozenset({Capability.CPU, Capability.DATA_PARALLEL})
    for layout in Layout:
        picked = REGISTRY.select(layout, caps)
        assert all(c.needs <= caps and not c.unless & caps for c in picked)
        left_out = [c for c in REGISTRY if c.layout is layout and c not in picked]
        assert all(not c.needs <= caps or c.unless & caps for c in left_out)
    with_lora = REGISTRY.select(Layout.SINGLE, caps | {Capability.LORA})
    assert "lora" in {c.name for c in with_lora} - {
        c.name for c in REGISTRY.select(Layout.SINGLE, caps)
    }
    only = REGISTRY.select(Layout.PLAIN, caps, ("lifecycle",))
    assert [c.name for c in only] == ["had_group", "lifecycle"]


def test_the_registry_refuses_two_checks_of_one_name_in_a_layout() -> None:
    from engine_core.testing.checks import Check, Layout, Registry

    Registry([Check("a", Layout.SINGLE, len), Check("a", Layout.TWO, len)])  # one per layout
    with pytest.raises(ValueError, match="give each its own name"):
        Registry([Check("a", Layout.SINGLE, len), Check("a", Layout.SINGLE, len)])


def test_a_kit_only_prefix_naming_an_engine_limits_that_engine_alone() -> None:
    from engine_core.testing.contract import _only

    given = ["step_", "a:checkpoint", "b:outputs", "a:modes"]
    assert _only(given, "a") == ["step_", "checkpoint", "modes"]
    assert _only(given, "c") == ["step_"]
    assert _only(["b:outputs"], "a") == []  # none limits a: it runs every check
