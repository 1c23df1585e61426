"""`engine-core run rollout.backend=sglang` end to end, on SGLang's CPU engine in its own
environment (``make sglang-env``, or ``ENGINE_CORE_SGLANG_PYTHON``): the text task, the tool
task (the episode loop runs in the replica, on SGLang), asynchronous training with two
replicas, and chat rows with images. Skipped where that environment does not exist (it is not built by ``make test``).
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


@pytest.mark.skipif(PYTHON is None, reason="needs SGLang's CPU environment: make sglang-env")
def test_an_image_job_on_sglang(tmp_path: Path) -> None:
    """The job on chat rows with image files, a tiny Qwen2.5-VL (patches of 14 x 14, the only
    size SGLang's Qwen2.5-VL encodes) sampled by SGLang from the images: the trainer's
    log-probs of the samples, with the images, equal SGLang's at every step."""
    from tests.fixtures.vl_chat import build_vl_chat_folder
    from tests.test_vision import _image_job, _image_rows

    folder = tmp_path / "model"
    folder.mkdir()
    build_vl_chat_folder(folder, patch=14)
    raw = _image_job(str(folder), tmp_path, tmp_path / "run", _image_rows(tmp_path), *SGLANG)
    run_rl_job(raw, load_plugins())
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["weight_sync/bytes"] > 0 for r in rows)
    gaps = [r["rollout/logprob_diff_max"] for r in rows]
    print(f"sglang cpu image job, rollout-vs-trainer log-prob gap per step: {gaps}")
    assert max(gaps) < 1e-5
