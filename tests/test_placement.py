"""``engine-core run`` with its roles placed as worker groups: the actor data-parallel (dp=2) on
local processes and on Ray, with a reward model (dp=2 on local processes), gives the same
metrics, step by step, as the in-process dp=1 run of the same recipe; a resumed grouped run
continues exactly; two rollout replicas take the weights straight from the actor's processes;
bad placements are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine_core.configio import apply_overrides, load_yaml
from engine_core.errors import ConfigError, RunFailed
from engine_core.plugins import load_plugins
from engine_core_roles.jobs.cli import RECIPES
from engine_core_roles.jobs.rl.config import RLJobConfig
from engine_core_roles.jobs.rl.run import run_rl_job
from engine_core_roles.trainer.metrics import TIMING_KEYS

RECIPE = RECIPES / "grpo_tiny.yaml"
# two supervised warm-up steps first: on a worker group each DP rank takes its share of them
SHORT = ["prompts_per_step=8", "trainer.samples_per_prompt=4", "save_every=2", "warmup_sft_steps=2"]


def _run(out: Path, *overrides: str, resume: bool = False) -> dict[str, Any]:
    raw = apply_overrides(load_yaml(RECIPE), [f"output_dir={out}", *SHORT, *overrides])
    return run_rl_job(raw, load_plugins(), resume=resume)


def _rows(out: Path) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
        for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k in w:
            # the DP ranks reduce in another order than one process sums: float rounding only
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), (g["step"], k)


@pytest.fixture(scope="module")
def with_rm(recipe_reward_model: Path) -> list[str]:
    """A reward model's score added to the task's, in every run of this module."""
    return [
        "reward_model.engine.backend=fsdp2",
        f"reward_model.engine.model.path={recipe_reward_model}",
        "trainer.reward_model_weight=0.5",
    ]


@pytest.fixture(scope="module")
def dp1(tmp_path_factory: pytest.TempPathFactory, with_rm: list[str]) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("dp1")
    _run(out, "steps=4", *with_rm)
    return _rows(out)


def test_local_dp2_matches_in_process_dp1_and_resumes_exactly(
    dp1: list[dict[str, Any]], with_rm: list[str], tmp_path: Path
) -> None:
    place = [
        "placement.executor=local",
        "placement.actor.dp=2",
        "placement.reward_model.dp=2",
        *with_rm,
    ]
    _run(tmp_path, "steps=2", *place)
    summary = _run(tmp_path, "steps=4", *place, resume=True)
    rows = _rows(tmp_path)
    _same(rows, dp1)
    # means of float32 rewards: the sum of the means equals the mean of the sums to float32
    # rounding, an absolute 1e-6 however small the reward
    for r in rows:
        assert r["reward"] == pytest.approx(r["reward/fn"] + 0.5 * r["reward/model"], abs=1e-6), r
    # what a sync moved is logged every step: the whole model, once per step
    assert len({r["weight_sync/bytes"] for r in rows}) == 1 and rows[0]["weight_sync/bytes"] > 0
    assert rows[-1]["rollout/logprob_diff_max"] < 1e-4
    # the workers wrote their shards into the job's one checkpoint folder per step
    ckpt = Path(summary["checkpoint"])
    assert ckpt.name == "global_step_4" and (ckpt / "manifest.json").is_file()
    assert sorted(p.name for p in (ckpt / "actor").iterdir() if "rank" in p.name)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(summary["hf_export"]).config.vocab_size == 16


@pytest.mark.ray
def test_ray_dp2_matches_in_process_dp1(
    dp1: list[dict[str, Any]], with_rm: list[str], tmp_path: Path, ray_session: Any
) -> None:
    _run(tmp_path, "steps=3", "placement.executor=ray", "placement.actor.dp=2", *with_rm)
    _same(_rows(tmp_path), dp1[:3])


def test_two_rollout_replicas_follow_the_trainer_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The actor at dp=2 streams its weights from its writing rank straight to two replica
    processes (every sync: the driver only waits); each replica follows it every step."""
    from engine_core_roles.distributed.weights import WeightLink

    synced: list[tuple[str, float]] = []
    sync = WeightLink.sync

    def recording(self: WeightLink) -> dict[str, float]:
        out = sync(self)
        synced.append((self.arrangement, out["weight_sync/bytes"]))
        return out

    monkeypatch.setattr(WeightLink, "sync", recording)
    place = ["placement.executor=local", "placement.actor.dp=2"]
    _run(tmp_path, "steps=2", "rollout_placement=process", "rollout_replicas=2", *place)
    rows = _rows(tmp_path)
    assert len(rows) == 2
    # the first sync (before step 1) and one after each update, each straight from the actor
    assert synced == [("actor group -> rollout replicas", rows[0]["weight_sync/bytes"])] * 3
    assert rows[0]["weight_sync/bytes"] > 0
    for row in rows:
        # each replica's log-probs, after that step's verified sync, against the trainer's
        gaps = [row[f"rollout/replica{i}/logprob_diff_max"] for i in (0, 1)]
        assert max(gaps) <= 1e-5, row


def test_a_replica_given_corrupted_weights_stops_the_job_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica 1 corrupts what it loads (tests/_workers.py): the job's first sync fails naming
    that replica and no other, and the job stops before training on anything."""
    import engine_core_roles.jobs.rl.build
    from engine_core.errors import WeightSyncError
    from engine_core.remote_rollout import ProcessRollout
    from tests._workers import CORRUPTED, CorruptingRolloutWorker

    class Corrupting(ProcessRollout):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, worker_cls=CorruptingRolloutWorker, **kwargs)

    monkeypatch.setattr(engine_core_roles.jobs.rl.build, "ProcessRollout", Corrupting)
    with pytest.raises(RunFailed) as failed:
        _run(tmp_path, "steps=2", "rollout_placement=process", "rollout_replicas=2")
    # one line: what failed, where its traceback went, what is safe; the failure is the cause
    assert "\n" not in str(failed.value) and "WeightSyncError" in str(failed.value)
    assert str(failed.value.log_path) in str(failed.value)
    assert "Traceback" in failed.value.log_path.read_text()
    assert isinstance(failed.value.__cause__, WeightSyncError)
    message = str(failed.value.__cause__)
    assert "rollout replica 1: checksum mismatch" in message and CORRUPTED in message
    assert "replica 0" not in message
    assert not (tmp_path / "metrics.jsonl").exists() or not _rows(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["placement.actor.dp=2"], r"executor=in_process.*actor\.dp=2.*executor=local"),
        (
            ["placement.reward_model.dp=2"],
            r"executor=in_process.*reward_model\.dp=2.*executor=local",
        ),
        (["placement.executor=mpi"], r"placement\.executor"),
        (["placement.actor.dp=0"], r"placement\.actor\.dp"),
        (["rollout_replicas=2"], r"rollout_replicas=2.*rollout_placement=process"),
        (["ray.address=auto"], r"ray\.address is set but placement\.executor=in_process"),
        (
            [
                "placement.executor=local",
                "placement.actor.num_gpus=1",
                "placement.rollout.strategy=SPREAD",
            ],
            r"place Ray actors; placement\.actor, placement\.rollout .* executor=local",
        ),
        (["placement.executor=ray", "placement.actor.strategy=FAR"], r"placement\.actor\.strategy"),
        (
            ["placement.executor=ray", "placement.critic.num_cpus=-1"],
            r"placement\.critic\.num_cpus",
        ),
    ],
)
def test_bad_placements_are_refused_before_anything_starts(
    overrides: list[str], match: str, tmp_path: Path
) -> None:
    raw = apply_overrides(load_yaml(RECIPE), [f"output_dir={tmp_path}", *overrides])
    with pytest.raises((ValueError, ConfigError), match=match):
        RLJobConfig.model_validate(raw)
    with pytest.raises((ValueError, ConfigError), match=match):
        run_rl_job(raw, load_plugins())
    assert not (tmp_path / "metrics.jsonl").exists()
