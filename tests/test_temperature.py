"""The sampling temperature is set once and every log-prob follows it.

A rollout sampling at temperature T reports log-probs of the tempered distribution; the actor's
old log-probs and the reference's must be computed at the same T, or the PPO ratio, TIS and the
KL term compare different distributions. The trainer's temperature is the one source: the
rollout samples at it, :func:`engine_core_roles.training_batch` stamps it on the batch, and the actor and
the reference read it from there. The gap guard stops a run whose rollout and trainer disagree.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from engine_core import BaseRollout, SamplingParams, load_plugins, resolve_rollout_config
from engine_core.configio import load_yaml
from engine_core_roles import (
    REF_LOG_PROBS,
    Actor,
    ActorConfig,
    Reference,
    RLTrainer,
    TrainerConfig,
)
from engine_core_roles.jobs.cli import RECIPES
from engine_core_roles.trainer.guards import LogProbGapError
from tests.test_trainer import build_engine

RECIPE = RECIPES / "grpo_tiny.yaml"
# the recipe's model: head size 32, which vLLM's CPU attention needs
MODEL = load_yaml(RECIPE)["engine"]["model"]
PROMPT_LEN, RESPONSE_LEN = 4, 5


def _rollout(backend: str) -> BaseRollout:
    if backend == "vllm":
        pytest.importorskip("vllm", reason="make setup installs the vllm plugin")
    raw: dict[str, Any] = {"backend": backend, "model": MODEL}
    if backend == "vllm":
        raw["max_model_len"] = 64
    spec, cfg = resolve_rollout_config(raw, load_plugins())
    rollout: BaseRollout = spec.load_class()(cfg)
    return rollout


@pytest.fixture(scope="module", params=["hf", "vllm"])
def rollout(request: pytest.FixtureRequest) -> Iterator[BaseRollout]:
    """One rollout per backend for the module: each trainer syncs its actor's weights first.
    Shut down at the module's end: a vLLM engine left to the garbage collector resets vLLM's
    process-wide state whenever it is collected, under a later test's engine."""
    made = _rollout(request.param)
    yield made
    made.shutdown()


class RecordingReference(Reference):
    """The real reference role; keeps what it returned so the test can compare it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outputs: list[torch.Tensor] = []

    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        out = super().compute_ref_log_prob(batch)
        self.outputs.append(out[REF_LOG_PROBS].clone())
        return out


class RecordingRollout:
    """Wraps a rollout's generate to keep each step's samples (their rollout log-probs)."""

    def __init__(self, rollout: BaseRollout) -> None:
        self.rollout, self.samples = rollout, []
        self._generate = rollout.generate

    def __enter__(self) -> RecordingRollout:
        def generate(prompts: TensorDict, params: SamplingParams) -> TensorDict:
            out = self._generate(prompts, params)
            self.samples.append(out)
            return out

        self.rollout.generate = generate  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.rollout.generate  # back to the class's method


def _prompts(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(4, 14, (4, PROMPT_LEN), generator=g)


def _trainer(config: TrainerConfig, rollout: BaseRollout, reference: Reference) -> RLTrainer:
    actor = Actor(
        ActorConfig(use_kl_loss=True, kl_loss_coef=0.1, old_log_probs="recompute"),
        build_engine(model=MODEL),
    )
    return RLTrainer(
        config,
        actor=actor,
        rollout=rollout,
        reward_fn=lambda p, r, m: (r[:, 0] == 7).float(),
        prompts=_prompts,
        reference=reference,
    )


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_rollout_actor_and_reference_share_the_sampling_temperature(
    rollout: BaseRollout, temperature: float
) -> None:
    config = TrainerConfig(
        samples_per_prompt=4, temperature=temperature, max_new_tokens=RESPONSE_LEN, seed=1
    )
    reference = RecordingReference(build_engine(model=MODEL))  # the initial policy
    trainer = _trainer(config, rollout, reference)
    with RecordingRollout(rollout) as recorded:
        rows = trainer.fit(2)
    for row in rows:  # the actor's old log-probs: the sampled distribution's, up to fp32 noise
        assert row["rollout/logprob_diff_max"] <= 1e-5, row
    # step 1: the reference is the policy that sampled, so its log-probs are the rollout's,
    # which holds only at the sampling temperature
    gen = recorded.samples[0]
    mask = gen["response_mask"].bool()
    ref = reference.outputs[0][:, PROMPT_LEN:]
    assert (ref - gen["rollout_log_probs"]).abs()[mask].max() <= 1e-5
    assert rows[0]["actor/kl_loss"] <= 1e-10
    # and not by accident: at temperature 1 the same log-probs would be far apart
    at_one = Reference(build_engine(model=MODEL)).compute_ref_log_prob(
        _retempered(gen, 1.0, config)
    )[REF_LOG_PROBS][:, PROMPT_LEN:]
    assert (at_one - gen["rollout_log_probs"]).abs()[mask].mean() > 1e-2


def _retempered(gen: TensorDict, temperature: float, config: TrainerConfig) -> TensorDict:
    from engine_core_roles import training_batch

    params = config.sampling_params(1).model_copy(update={"temperature": temperature})
    return training_batch(gen, params)


def test_the_gap_guard_stops_a_rollout_sampling_at_another_temperature() -> None:
    """The rollout is handed temperature 1 while the trainer samples (and scores) at 0.7."""
    rollout = _rollout("hf")
    real_generate = rollout.generate

    def off_temperature(prompts: TensorDict, params: SamplingParams) -> TensorDict:
        return real_generate(prompts, params.model_copy(update={"temperature": 1.0}))

    rollout.generate = off_temperature  # type: ignore[method-assign]
    config = TrainerConfig(samples_per_prompt=4, temperature=0.7, max_new_tokens=RESPONSE_LEN)
    trainer = _trainer(config, rollout, Reference(build_engine(model=MODEL)))
    before = [t.clone() for _, t in trainer.actor.named_full_params()]
    with pytest.raises(LogProbGapError, match=r"step 1: .*mean gap .*temperature=0\.7") as err:
        trainer.step()
    assert "tokenizer" in str(err.value) and "logprob_gap_limit" in str(err.value)
    # with the recomputed old log-probs the guard runs before the update: nothing was trained
    after = [t for _, t in trainer.actor.named_full_params()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # the guard can be turned off; the gap is then only logged
    unguarded = config.model_copy(update={"logprob_gap_limit": None})
    row = _trainer(unguarded, rollout, Reference(build_engine(model=MODEL))).step()
    assert (
        row["rollout/logprob_diff_mean"] > TrainerConfig.model_fields["logprob_gap_limit"].default
    )


def test_the_actor_refuses_a_temperature_of_its_own() -> None:
    with pytest.raises(ValueError, match="trainer.temperature"):
        ActorConfig.model_validate({"temperature": 0.7})


def test_the_sampling_settings_are_declared_once() -> None:
    """temperature, max_new_tokens, stop_token_ids and stop_strings are SamplingSettings'
    fields, inherited by the trainer's config and each step's SamplingParams alike: the same
    field, the same checks, and the step's params carry the trainer's values."""
    from engine_core.rollout import SamplingSettings

    shared = set(SamplingSettings.model_fields)
    assert shared == {"temperature", "max_new_tokens", "stop_token_ids", "stop_strings"}
    for cls in (TrainerConfig, SamplingParams):
        assert issubclass(cls, SamplingSettings)
        for name in shared:
            own, base = cls.model_fields[name], SamplingSettings.model_fields[name]
            assert repr(own) == repr(base), (cls, name)
    config = TrainerConfig(
        temperature=0.7, max_new_tokens=5, stop_token_ids=[2], stop_strings=["\n\n"]
    )
    params = config.sampling_params(1)
    assert {k: getattr(params, k) for k in shared} == {k: getattr(config, k) for k in shared}
    with pytest.raises(ValueError, match=r"trainer\.temperature=0 samples greedily"):
        TrainerConfig(temperature=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        TrainerConfig(max_new_tokens=0)
