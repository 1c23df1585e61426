"""The bad-input catalogue: each input a user can get wrong gives an error naming the argument,
what was expected and how to fix it, before any state changes (the engine's weights are
compared before and after every case).

``CATALOGUE`` is also the source of the table in ``docs/errors.md``
(``python docs/hooks/generate.py`` writes it; ``tests/test_docs.py`` fails while it is stale).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from engine_core import BatchError, ConfigError, EngineCoreError, make_batch
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from engine_core.testing.models import TINY_QWEN2, engine_config, nll_loss, random_batch


@dataclass(frozen=True)
class Case:
    """One bad input: what it is, the call that gets it, and a phrase its error contains."""

    name: str
    where: str
    error: type[Exception]
    phrase: str
    call: Callable[[Any], Any]  # takes the fixture's state (engine, actor)


def _batch(**fields: torch.Tensor) -> TensorDict:
    b = random_batch(4, seq_len=8, seed=3)
    for k, v in fields.items():
        b[k] = v
    return b


def _train(state: Any, batch: TensorDict) -> Any:
    engine = state["engine"]
    with engine.train_mode():
        return engine.forward_backward_step(batch)


def _update(state: Any, **fields: Any) -> Any:
    from engine_core_roles import ADVANTAGES, OLD_LOG_PROBS

    batch = random_batch(4, seq_len=8, seed=4)
    batch["loss_mask"] = batch["attention_mask"]
    batch[OLD_LOG_PROBS] = torch.zeros(4, 8)
    batch[ADVANTAGES] = torch.ones(4, 8)
    for k, v in fields.items():
        batch[k] = v(batch) if callable(v) else v
    return state["actor"].update_actor(batch)


def _empty_update(state: Any) -> Any:
    from engine_core_roles import ADVANTAGES, OLD_LOG_PROBS

    batch = random_batch(4, seq_len=8)[:0]
    batch["loss_mask"] = batch["attention_mask"]
    batch[OLD_LOG_PROBS] = torch.zeros(0, 8)
    batch[ADVANTAGES] = torch.zeros(0, 8)
    return state["actor"].update_actor(batch)


def _long_prompts(state: Any) -> Any:
    from engine_core_hf.rollout import HFRollout, HFRolloutConfig

    from engine_core_roles import RLTrainer, TrainerConfig

    rollout = HFRollout(HFRolloutConfig(backend="hf", model={"config": dict(TINY_QWEN2)}))
    trainer = RLTrainer(
        TrainerConfig(samples_per_prompt=2, max_new_tokens=8),
        actor=state["actor"],
        rollout=rollout,  # never generates: the length is refused first
        reward_fn=lambda p, r, m: torch.zeros(p.shape[0]),
        prompts=[torch.ones(2, TINY_QWEN2["max_position_embeddings"], dtype=torch.long)],
    )
    return trainer.step()


def _model_path(state: Any) -> Any:
    from engine_core.models import build_model

    cfg = ReferenceEngineConfig(**engine_config(model={"path": "/no/such/model"}))
    return build_model(cfg.model)


def _parity_report_at(state: Any, taken: str) -> Any:
    """``engine-core parity --json`` to a path that is a file already, or under a file."""
    from engine_core.parity import claim_report_path

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "taken").write_text("an earlier report")
        return claim_report_path(Path(folder) / taken)


V = TINY_QWEN2["vocab_size"]
CATALOGUE = [
    Case("empty batch", "forward_backward_step", BatchError, "the batch is empty",
         lambda s: _train(s, make_batch(torch.zeros(0, 4, dtype=torch.long)))),
    Case("float token ids", "forward_backward_step", BatchError,
         "must hold integer token ids, got dtype torch.float32",
         lambda s: _train(s, _batch(input_ids=torch.ones(4, 8)))),
    Case("negative token ids", "forward_backward_step", BatchError, "negative token id (-1)",
         lambda s: _train(s, _batch(input_ids=torch.full((4, 8), -1)))),
    Case("token ids outside the vocabulary", "forward_backward_step", BatchError,
         f"token id {V}, outside the model's vocabulary of {V}",
         lambda s: _train(s, _batch(input_ids=torch.full((4, 8), V)))),
    Case("mismatched shapes between input fields", "forward_backward_step", BatchError,
         "attention_mask shape (4, 7) differs from input_ids (4, 8)",
         lambda s: _train(s, TensorDict(
             {"input_ids": torch.ones(4, 8, dtype=torch.long),
              "attention_mask": torch.ones(4, 7, dtype=torch.long)}, batch_size=[4]))),
    Case("attention mask that is not 0/1", "forward_backward_step", BatchError,
         "attention_mask must hold 0 (padding) and 1 (token)",
         lambda s: _train(s, _batch(attention_mask=torch.full((4, 8), 2)))),
    Case("a fully masked sample", "forward_backward_step", BatchError,
         "samples [1] have no token",
         lambda s: _train(s, _batch(attention_mask=torch.ones(4, 8, dtype=torch.long).index_fill(0, torch.tensor([1]), 0)))),
    Case("a sequence longer than the model's positions", "forward_backward_step", BatchError,
         "more than the model's max_position_embeddings",
         lambda s: _train(s, make_batch(torch.ones(2, TINY_QWEN2["max_position_embeddings"] + 1, dtype=torch.long)))),
    Case("per-sequence advantages ([B] instead of [B, L])", "Actor.update_actor", BatchError,
         "advantages has shape (4,), want [batch, seq_len]",
         lambda s: _update(s, advantages=torch.ones(4))),
    Case("an empty update batch", "Actor.update_actor", BatchError, "the batch is empty",
         lambda s: _empty_update(s)),
    Case("a mini-batch size that does not divide the batch", "Actor.update_actor", ValueError,
         "ppo_mini_batch_size=3 does not divide this update's 4 samples (4 on each of 1 DP "
         "ranks): the last mini-batch would be smaller, and its samples weigh more. Sizes that "
         "work: [1, 2, 4]", lambda s: _update_with(s, ppo_mini_batch_size=3)),
    Case("prompts longer than the model's positions", "RLTrainer.step", ValueError,
         "exceeds the model's max_position_embeddings", _long_prompts),
    Case("a model.path that does not exist", "engine init_model / build_model", ConfigError,
         "model.path '/no/such/model' does not exist", _model_path),
    Case("a parity report that exists already", "engine-core parity --json", ConfigError,
         "already exists; pass --overwrite to replace it, or choose another path",
         lambda s: _parity_report_at(s, "taken")),
    Case("a parity report where nothing can be written", "engine-core parity --json",
         ConfigError, "choose a path in a writable folder",
         lambda s: _parity_report_at(s, "taken/parity.json")),
]  # fmt: skip


def _update_with(state: Any, **actor_config: Any) -> Any:
    from engine_core_roles import Actor, ActorConfig

    state = {**state, "actor": Actor(ActorConfig(**actor_config), state["engine"])}
    return _update(state)


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    from engine_core_roles import Actor, ActorConfig

    engine = ReferenceEngine(ReferenceEngineConfig(**engine_config()))
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    return {"engine": engine, "actor": Actor(ActorConfig(), engine)}


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.name for c in CATALOGUE])
def test_bad_input_is_refused_before_any_state_changes(case: Case, state: dict[str, Any]) -> None:
    engine = state["engine"]
    before = {k: v.clone() for k, v in engine.require_module().state_dict().items()}
    engine.optimizer_zero_grad()
    with pytest.raises(case.error) as refused:
        case.call(state)
    assert case.phrase in str(refused.value), str(refused.value)
    assert isinstance(refused.value, (EngineCoreError, ValueError))
    after = engine.require_module().state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the weights changed"
    grads = [p.grad for p in engine.require_module().parameters() if p.grad is not None]
    assert all(not bool(g.any()) for g in grads), "gradients were accumulated"


def catalogue_table() -> str:
    """The Markdown table of ``docs/errors.md``."""
    rows = ["| bad input | refused by | error | its message says |", "| --- | --- | --- | --- |"]
    for case in CATALOGUE:
        phrase = case.phrase.replace("|", "\\|")
        rows.append(f"| {case.name} | `{case.where}` | `{case.error.__name__}` | “{phrase}…” |")
    return "\n".join(rows)
