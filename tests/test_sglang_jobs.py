"""`engine-core run rollout.backend=sglang` end to end, on SGLang's CPU engine in its own
environment (``make sglang-env``, or ``ENGINE_CORE_SGLANG_PYTHON``): the text task, the tool
task (the episode loop runs in the replica, on SGLang) and asynchronous training with two
replicas. Skipped where that environment does not exist (it is not built by ``make test``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine_core.plugins import load_plugins
from engine_core_roles.jobs.cli import RECIPES, load_recipe
from engine_core_roles.jobs.rl.run import run_rl_job

_BUILT = Path(__file__).resolve().parents[1] / ".venv-sglang" / "bin" / "python"
PYTHON = os.environ.get("ENGINE_CORE_SGLANG_PYTHON") or (str(_BUILT) if _BUILT.is_file() else None)
SGLANG = [
    "rollout_placement=process",
    f"rollout_python={PYTHON}",
    "rollout.backend=sglang",
    "rollout.device=cpu",
    "rollout.max_total_tokens=4096",
    "rollout.mem_fraction_static=0.05",
    "rollout.deterministic_inference=true",
]
JOBS = {
    "text": ("text_tiny.yaml", []),
    "tools": ("agent_tiny.yaml", ["warmup_sft_steps=0"]),
    "async-replicas": ("text_tiny.yaml", ["rollout_replicas=2", "trainer.max_staleness=1"]),
    # a mixture of experts: SGLang returns its routes (replayed by the actor) and takes the
    # actor's stacked experts under its per-expert names at every sync
    "moe": ("moe_tiny.yaml", ["warmup_sft_steps=0", "eval.every=0"]),
}


@pytest.mark.skipif(PYTHON is None, reason="needs SGLang's CPU environment: make sglang-env")
@pytest.mark.parametrize("job", sorted(JOBS))
def test_a_job_on_sglang(job: str, tmp_path: Path) -> None:
    recipe, extra = JOBS[job]
    overrides = [f"output_dir={tmp_path}", "steps=3", "log_every=1", *SGLANG, *extra]
    summary = run_rl_job(load_recipe(RECIPES / recipe, overrides), load_plugins())
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and summary["steps"] == 3
    assert all(r["weight_sync/bytes"] > 0 for r in rows)
    if job == "async-replicas":
        # one step behind from the second step on: the gap is the policy's own step
        assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
        assert rows[0]["rollout/logprob_diff_max"] < 1e-4
    else:
        assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4
    if job == "moe":  # fp32 on both sides: the trainer's routers agree with SGLang's
        assert [r["rollout/route_mismatch"] for r in rows] == [0.0, 0.0, 0.0]
