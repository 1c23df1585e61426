"""``RLTrainer`` on real engines and the HF rollout: metrics, PPO with a critic, KL, its inputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict

from engine_core import (
    BaseEngine,
    BaseRollout,
    BatchError,
    EngineCoreError,
    SamplingParams,
    get_meta,
    load_plugins,
    resolve_engine_config,
    resolve_rollout_config,
)
from engine_core_roles import (
    ROLLOUT_LOG_PROBS,
    Actor,
    ActorConfig,
    Critic,
    CriticConfig,
    Reference,
    RLTrainer,
    TrainerConfig,
    plot_keys,
    prompt_batch,
    training_batch,
)
from tests._models import TINY_QWEN2

TARGET = 7  # the custom reward: the fraction of response tokens equal to this id
MODEL = {"config": dict(TINY_QWEN2)}
ROW_KEYS = {
    "step",
    "reward",
    "reward/zero_variance_groups",  # the share of prompts whose samples all scored the same
    "response_length",
    "rollout/logprob_diff_max",
    "rollout/logprob_diff_mean",
    "actor/pg_loss",
    "actor/clipfrac",
    "actor/dual_clipfrac",
    "actor/approx_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/loss",
    "actor/lr",
    "actor/num_optimizer_steps",
    "actor/num_skipped_steps",
    "weight_sync/time_s",
    "weight_sync/bytes",
    "time_s",
    "tokens_per_s",
}


def build_engine(
    backend: str = "fsdp2", value_head: bool = False, model: dict[str, Any] | None = None
) -> BaseEngine:
    raw = {
        "backend": backend,
        "model": {**(model or MODEL), "value_head": value_head},
        "optim": {"lr": 1e-3, "clip_grad": 1.0},
    }
    spec, cfg = resolve_engine_config(raw, load_plugins())
    engine: BaseEngine = spec.load_class()(cfg)
    engine.init_model()
    return engine


def build_rollout() -> BaseRollout:
    spec, cfg = resolve_rollout_config({"backend": "hf", "model": MODEL}, load_plugins())
    rollout: BaseRollout = spec.load_class()(cfg)
    return rollout


class TargetReward:
    """Counts its calls and remembers its scores, so a test can see the trainer used them."""

    def __init__(self) -> None:
        self.scores: list[torch.Tensor] = []

    def __call__(
        self, prompt_ids: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
    ) -> torch.Tensor:
        hits = (response_ids == TARGET) & response_mask.bool()
        self.scores.append(hits.sum(-1) / response_mask.sum(-1).clamp_min(1))
        return self.scores[-1]


def random_prompts(n: int = 4) -> Any:
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randint(8, TINY_QWEN2["vocab_size"], (n, 5), generator=g)


def trainer(config: TrainerConfig, actor_config: ActorConfig | None = None, **kw: Any) -> RLTrainer:
    kw.setdefault("reward_fn", TargetReward())
    kw.setdefault("prompts", random_prompts())
    return RLTrainer(
        config,
        actor=Actor(
            actor_config or ActorConfig(),
            build_engine(kw.pop("backend", "fsdp2")),
            config.algorithm,
        ),
        rollout=build_rollout(),
        **kw,
    )


def test_grpo_steps_use_the_reward_function_and_log_every_metric() -> None:
    reward = TargetReward()
    t = trainer(TrainerConfig(samples_per_prompt=4, max_new_tokens=6), reward_fn=reward)
    seen: list[int] = []
    rows = t.fit(3, callbacks=[lambda tr, row: seen.append(row["step"])])
    assert seen == [r["step"] for r in rows] == [1, 2, 3] and t.global_step == 3
    assert len(reward.scores) == 3
    for row, scores in zip(rows, reward.scores, strict=True):
        assert set(row) == ROW_KEYS
        assert scores.shape == (16,)  # 4 prompts x 4 samples
        assert row["reward"] == pytest.approx(float(scores.mean()))
        assert row["actor/approx_kl"] >= 0.0
        assert row["actor/num_optimizer_steps"] == 1.0
        # the weights are synced after each update: the rollout samples from the actor
        assert row["rollout/logprob_diff_max"] < 1e-4
    assert t.fit(3) == []  # already at step 3
    keys = plot_keys(rows)
    assert "actor/grad_norm" in keys and "tokens_per_s" in keys and "response_length" in keys
    assert "actor/clipfrac" not in keys and "actor/approx_kl" not in keys  # exactly 0 here


def test_ppo_with_a_critic_and_several_optimizer_steps() -> None:
    t = trainer(
        TrainerConfig(algorithm="ppo", samples_per_prompt=2, max_new_tokens=4),
        ActorConfig(ppo_epochs=2, ppo_mini_batch_size=4),
        backend="reference",
        critic=Critic(CriticConfig(), build_engine("reference", value_head=True)),
    )
    rows = t.fit(2)
    for row in rows:
        assert ROW_KEYS <= set(row) and "critic/vf_loss" in row
        assert row["actor/num_optimizer_steps"] == 4.0  # 2 epochs x 8 samples / 4
        assert row["actor/approx_kl"] > 0.0  # later mini-batches are off-policy
    assert rows[0]["critic/vf_loss"] != rows[1]["critic/vf_loss"]
    keys = plot_keys(rows)
    assert {"actor/clipfrac", "actor/approx_kl", "critic/vf_loss"} <= set(keys)


def test_a_step_calls_its_stages_once_each_in_the_algorithms_order() -> None:
    """generate, score, old log-probs, reference, values, advantages, critic update, actor
    update, sync: each role's call once a step, in that order (PPO with a critic and a KL loss,
    where every stage does something)."""
    from engine_core_roles.distributed.weights import WeightLink

    calls: list[str] = []

    def recorded(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    config = TrainerConfig(algorithm="ppo", samples_per_prompt=2, max_new_tokens=3)
    actor = Actor(
        ActorConfig(use_kl_loss=True, ppo_epochs=2, ppo_mini_batch_size=4),
        build_engine("reference"),
        algorithm=config.algorithm,
    )
    reference = Reference(build_engine("reference"))
    critic = Critic(CriticConfig(), build_engine("reference", value_head=True))
    rollout = build_rollout()
    weights = WeightLink(actor, rollout)
    reward = TargetReward()
    for obj, name, label in (
        (rollout, "generate", "generate"),
        (actor, "compute_log_prob", "old log-probs"),
        (reference, "compute_ref_log_prob", "reference"),
        (critic, "compute_values", "values"),
        (critic, "update_critic", "critic update"),
        (actor, "update_actor", "actor update"),
        (weights, "sync", "sync"),
    ):
        setattr(obj, name, recorded(label, getattr(obj, name)))
    t = RLTrainer(
        config,
        actor=actor,
        rollout=rollout,
        reward_fn=recorded("score", reward),
        prompts=random_prompts(),
        reference=reference,
        critic=critic,
        weights=weights,
    )
    rows = t.fit(2)
    step = [
        "generate",
        "score",
        "old log-probs",
        "reference",
        "values",
        "critic update",
        "actor update",
        "sync",
    ]
    assert calls == ["sync", *step, *step]  # the first sync before the first generation
    assert all("critic/vf_loss" in row and "actor/kl_loss" in row for row in rows)


def test_kl_loss_against_a_reference_and_a_prompt_callable() -> None:
    calls: list[int] = []

    def prompts(step: int) -> torch.Tensor:
        calls.append(step)
        return torch.full((2, 3), 9)

    t = trainer(
        TrainerConfig(samples_per_prompt=2, max_new_tokens=3, seed=5),
        ActorConfig(use_kl_loss=True, kl_loss_coef=0.1),
        prompts=prompts,
        reference=Reference(build_engine()),
    )
    rows = t.fit(2)
    assert calls == [1, 2]
    assert rows[0]["actor/kl_loss"] == 0.0  # policy == reference on the first step
    assert rows[1]["actor/kl_loss"] > 0.0
    assert "actor/kl_loss" in plot_keys(rows)


def test_the_trainer_refuses_inconsistent_pieces() -> None:
    actor = Actor(ActorConfig(), build_engine("reference"))
    rollout = build_rollout()
    parts: dict[str, Any] = {"reward_fn": TargetReward(), "prompts": random_prompts()}
    with pytest.raises(ValueError, match="pass critic="):
        RLTrainer(TrainerConfig(algorithm="ppo"), actor=actor, rollout=rollout, **parts)
    critic = Critic(CriticConfig(), build_engine("reference", value_head=True))
    with pytest.raises(ValueError, match="drop the critic"):
        RLTrainer(TrainerConfig(), actor=actor, rollout=rollout, critic=critic, **parts)
    kl_actor = Actor(ActorConfig(use_kl_loss=True), actor.engine)
    with pytest.raises(ValueError, match="reference="):
        RLTrainer(TrainerConfig(), actor=kl_actor, rollout=rollout, **parts)
    # the actor computes the policy loss of the algorithm it was built with: the trainer's
    with pytest.raises(ValueError, match=r"built with 'grpo'.*algorithm=trainer_config\.algo"):
        RLTrainer(TrainerConfig(algorithm="gspo"), actor=actor, rollout=rollout, **parts)
    with pytest.raises(ValueError, match="samples_per_prompt must be >= 2"):
        TrainerConfig(samples_per_prompt=1)
    with pytest.raises(
        ValueError, match="declares async_generation.*HFRollout does not. Use a ProcessRollout"
    ):
        RLTrainer(TrainerConfig(max_staleness=1), actor=actor, rollout=rollout, **parts)

    cfg = TrainerConfig(samples_per_prompt=2, max_new_tokens=2)
    bad_reward = RLTrainer(
        cfg,
        actor=actor,
        rollout=rollout,
        reward_fn=lambda p, r, m: torch.zeros(3),
        prompts=random_prompts(),
    )
    with pytest.raises(ValueError, match=r"one score per sample, shape \(8,\); got \(3,\)"):
        bad_reward.step()
    short = RLTrainer(
        cfg, actor=actor, rollout=rollout, reward_fn=TargetReward(), prompts=[torch.ones(2, 3)]
    )
    with pytest.raises(BatchError, match="integer tensor"):
        short.step()  # float prompt ids
    short = RLTrainer(
        cfg,
        actor=actor,
        rollout=rollout,
        reward_fn=TargetReward(),
        prompts=[torch.ones(2, 3, dtype=torch.long)],
    )
    short.step()
    with pytest.raises(RuntimeError, match="prompt source ran out before step 2"):
        short.step()


def test_prompt_batch_left_pads_and_training_batch_masks_the_response() -> None:
    prompts = prompt_batch([[5, 6, 7], [8]])
    assert prompts["prompt_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert prompts["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    ids = torch.tensor([[5, 6, 7]])
    assert prompt_batch(ids)["prompt_mask"].tolist() == [[1, 1, 1]]
    with pytest.raises(BatchError, match="left-padded"):
        prompt_batch(ids, torch.tensor([[1, 1, 0]]))
    with pytest.raises(BatchError, match="shape"):
        prompt_batch(ids, torch.ones(1, 2))

    out = TensorDict(
        {
            **prompts,
            "response_ids": torch.tensor([[9, 3], [9, 0]]),
            "response_mask": torch.tensor([[1, 1], [1, 0]]),
        },
        batch_size=[2],
    )
    batch = training_batch(out, SamplingParams(temperature=0.6))
    assert batch["input_ids"].tolist() == [[5, 6, 7, 9, 3], [0, 0, 8, 9, 0]]
    # the roles compute log-probs at the temperature the samples were drawn at (1 if greedy)
    assert get_meta(batch).temperature == 0.6
    assert get_meta(training_batch(out, SamplingParams(temperature=0))).temperature == 1.0
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0]]
    assert batch["position_ids"][1].tolist()[2:4] == [0, 1]
    with pytest.raises(BatchError, match="response_ids"):
        training_batch(prompts, SamplingParams())


def test_training_batch_aligns_the_rollout_log_probs_to_input_ids() -> None:
    out = TensorDict(
        {
            **prompt_batch([[5, 6, 7], [8]]),
            "response_ids": torch.tensor([[9, 3], [9, 0]]),
            "response_mask": torch.tensor([[1, 1], [1, 0]]),
            "rollout_log_probs": torch.tensor([[-0.5, -1.5], [-0.25, 0.0]]),
        },
        batch_size=[2],
    )
    batch = training_batch(out, SamplingParams())
    assert batch[ROLLOUT_LOG_PROBS].tolist() == [[0, 0, 0, -0.5, -1.5], [0, 0, 0, -0.25, 0]]
    out["rollout_log_probs"] = torch.zeros(2, 3)
    with pytest.raises(BatchError, match="rollout_log_probs has shape"):
        training_batch(out, SamplingParams())


def test_non_finite_updates_are_counted_warned_and_stop_the_run() -> None:
    """A reward that is NaN makes every advantage NaN: each update is skipped, counted, warned
    with its cause, and the second such step in a row stops the run."""

    def nan_reward(prompt_ids: torch.Tensor, response_ids: torch.Tensor, mask: torch.Tensor) -> Any:
        return torch.full((prompt_ids.shape[0],), float("nan"))

    config = TrainerConfig(
        samples_per_prompt=2, max_new_tokens=3, max_consecutive_skipped_updates=2
    )
    t = trainer(config, reward_fn=nan_reward)
    before = {k: v.clone() for k, v in t.actor.engine.named_full_params()}
    with pytest.warns(
        RuntimeWarning,
        match=r"1 of 1 optimizer steps skipped.*non-finite values in \['advantages'\]",
    ):
        row = t.step()
    assert row["actor/num_optimizer_steps"] == 0.0 and row["actor/num_skipped_steps"] == 1.0
    after = dict(t.actor.engine.named_full_params())
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was applied
    with pytest.raises(
        EngineCoreError, match=r"step 2: 2 steps in a row applied no actor update.*'advantages'"
    ):
        t.step()
