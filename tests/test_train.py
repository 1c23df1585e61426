"""`engine-core train`: a real, short supervised run through a registered engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from engine_core.checkpoint import list_checkpoints
from engine_core.config import OptimConfig
from engine_core.configio import apply_overrides, load_yaml
from engine_core.optim import lr_lambda
from engine_core.plugins import load_plugins
from engine_core_roles.jobs.cli import RECIPES, main
from engine_core_roles.jobs.sft import run_sft
from engine_core_roles.trainer.metrics import TIMING_KEYS

RECIPE = RECIPES / "sft_tiny.yaml"


def _rows(out: Path) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
        for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


def test_short_run_learns_writes_outputs_and_resumes_exactly(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    overrides = ["steps=30", "log_every=10", "save_every=20", "engine.optim.total_steps=30"]
    raw = apply_overrides(load_yaml(RECIPE), [f"output_dir={straight}", *overrides])
    summary = run_sft(raw, load_plugins())
    rows = _rows(straight)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert summary["final_loss"] < 0.6 * summary["first_loss"]
    assert [s for s, _ in list_checkpoints(straight / "checkpoints")] == [20, 30]
    # one step of the LR schedule a step: "lr" is the rate of the next one
    optim = OptimConfig.model_validate(raw["engine"]["optim"])
    assert [r["lr"] for r in rows] == pytest.approx(
        [3e-3 * lr_lambda(optim, s) for s in range(1, 31)]
    )
    assert {"config.json", "model.safetensors"} <= {
        p.name for p in Path(summary["hf_export"]).iterdir()
    }

    # stopped after step 20's checkpoint, resumed: the digit task's sampler goes on where it was
    shutil.copytree(
        straight / "checkpoints" / "global_step_20", resumed / "checkpoints" / "global_step_20"
    )
    head = (straight / "metrics.jsonl").read_text().splitlines()[:20]
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in head))
    assert main(["train", str(RECIPE), f"output_dir={resumed}", *overrides, "--resume"]) == 0
    assert _rows(resumed) == rows

    # stopped on its wall-time limit after step 1: exit status 3 with a checkpoint of that
    # step, and --resume auto goes on to the straight run's rows
    stopped = tmp_path / "stopped"
    args = ["train", str(RECIPE), f"output_dir={stopped}", *overrides]
    assert main([*args, "max_wall_time=1e-3"]) == 3
    assert [s for s, _ in list_checkpoints(stopped / "checkpoints")] == [1]
    assert main([*args, "--resume", "auto"]) == 0
    assert _rows(stopped) == rows


def test_bad_override_names_the_field(tmp_path: Path) -> None:
    raw = apply_overrides(
        load_yaml(RECIPE), [f"output_dir={tmp_path}", "engine.micro_batch_size=-2"]
    )
    with pytest.raises(ValidationError, match=r"engine\.micro_batch_size"):
        run_sft(raw, load_plugins())


def test_the_rl_warm_up_steps_the_lr_schedule_as_the_sft_job_does() -> None:
    """Both step through :class:`SFTTrainer` (:func:`supervised_step`), one step of the LR
    schedule with each update: after the RL job's warm-up of 3 steps under a 6-step LR
    warm-up, the next update (RL's first) runs at 4/6 of the rate, as the SFT job's step 4
    does (not at 1/6, the first step's)."""
    from engine_core.resolve import resolve_engine_config
    from engine_core_roles.data.tasks.digits import DigitTask
    from engine_core_roles.jobs.rl.config import RLJobConfig
    from engine_core_roles.jobs.rl.warmup import warm_up_on_task

    optim = ["engine.optim.lr=1e-2", "engine.optim.warmup_steps=6"]
    raw = apply_overrides(
        load_yaml(RECIPES / "grpo_tiny.yaml"), ["warmup_sft_steps=3", "warmup_batch_size=4", *optim]
    )
    job = RLJobConfig.model_validate(raw)
    spec, cfg = resolve_engine_config(job.engine, load_plugins(), path=("engine",))
    engine = spec.load_class()(cfg)
    engine.init_model()
    warm_up_on_task(engine, DigitTask(job.task), job)
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 4 / 6)


def test_the_sft_trainer_steps_its_batches_and_validates_where_due(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One batch and one update a step, the row's token counts from that batch, the validation
    loss every ``every`` steps and at the last; ``fit`` stops at ``max_steps`` or on request."""
    import torch
    from tensordict import TensorDict

    from engine_core_roles.trainer import sft

    def batch() -> TensorDict:
        mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
        return TensorDict({"attention_mask": mask, "loss_mask": mask}, batch_size=[2])

    updates: list[TensorDict] = []

    def update(b: TensorDict) -> dict[str, float]:
        updates.append(b)
        return {"loss": float(len(updates)), "grad_norm": 1.0, "lr": 0.1}

    measured: list[int] = []

    def fake_loss(engine: Any, batches: Any) -> dict[str, float]:
        measured.append(len(list(batches)))
        return {"loss": 0.5, "target_prob": 0.25}

    monkeypatch.setattr(sft, "supervised_loss", fake_loss)
    validation = sft.Validation(object(), lambda: [batch()], every=2, last_step=5)  # type: ignore[arg-type]
    trainer = sft.SFTTrainer(update, batch, validation=validation, global_step=0)
    rows = trainer.fit(5)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and trainer.global_step == 5
    assert [r["loss"] for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0] and len(updates) == 5
    assert all(r["loss_tokens"] == 5 and r["tokens_per_s"] > 0 for r in rows)
    assert [r["step"] for r in rows if "val/loss" in r] == [2, 4, 5] and measured == [1] * 3
    assert rows[1]["val/target_prob"] == 0.25
    assert trainer.fit(5) == []  # already at step 5

    resumed = sft.SFTTrainer(update, batch, global_step=3)
    seen: list[int] = []
    rows = resumed.fit(9, callbacks=[lambda t, r: seen.append(r["step"])], should_stop=lambda: 1)
    assert seen == [4] and resumed.global_step == 4 and "val/loss" not in rows[0]
    with pytest.raises(ValueError, match="every=0"):
        sft.Validation(object(), lambda: [], every=0, last_step=5)  # type: ignore[arg-type]


@pytest.mark.parametrize("recipe", ["text_tiny.yaml", "ppo_tiny.yaml", "sft_text_tiny.yaml"])
def test_the_run_seed_is_every_section_seed_unless_a_section_sets_its_own(recipe: str) -> None:
    from engine_core_roles.jobs.cli import load_recipe
    from engine_core_roles.jobs.rl.config import RLJobConfig
    from engine_core_roles.jobs.sft import SFTJobConfig

    job_class = SFTJobConfig if recipe.startswith("sft") else RLJobConfig

    def seeds(*overrides: str) -> dict[str, Any]:
        job = job_class.model_validate(load_recipe(RECIPES / recipe, list(overrides)))
        out = {"engine": job.engine["seed"]}
        out["data"] = job.data.seed if job.data is not None else job.task.seed
        if isinstance(job, RLJobConfig):
            out |= {"rollout": job.rollout["seed"], "trainer": job.trainer.seed}
            if job.critic_engine is not None:
                out["critic"] = job.critic_engine["seed"]
        return out

    assert set(seeds().values()) == {0}
    assert set(seeds("seed=7").values()) == {7}
    mixed = seeds("seed=7", "engine.seed=2")
    assert mixed.pop("engine") == 2 and set(mixed.values()) == {7}
