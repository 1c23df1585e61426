"""FSDP2 on two real gloo processes against the single-process reference engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_core_fsdp.fsdp2 import FSDP2Engine, FSDP2EngineConfig

from engine_core.batch import BatchMeta, set_meta
from engine_core.checkpoint import list_checkpoints
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from tests._dist import run_distributed
from tests._models import engine_config, nll_loss, random_batch

STEPS = 5
N = 8
OPTIM = {"lr": 1e-2, "clip_grad": 1.0, "warmup_steps": 1}


def _train(engine, steps: range) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    out = []
    for s in steps:
        with engine.train_mode():
            result = engine.forward_backward_step(engine.shard_data(random_batch(N, seed=s)))
            norm = engine.optimizer_step()
            engine.lr_scheduler_step()
            engine.optimizer_zero_grad()
        out.append((result.loss, norm))
    return out


def _fsdp2(**overrides: object) -> FSDP2Engine:
    e = FSDP2Engine(FSDP2EngineConfig(**engine_config(optim=OPTIM, **overrides)))
    e.init_model()
    e.set_loss_fn(nll_loss)
    return e


def _reference() -> list[tuple[float, float]]:
    e = ReferenceEngine(ReferenceEngineConfig(**engine_config(optim=OPTIM)))
    e.init_model()
    e.set_loss_fn(nll_loss)
    return _train(e, range(STEPS))


def _parity_worker(rank: int, world: int, batching: dict) -> list[tuple[float, float]]:
    return _train(_fsdp2(**batching), range(STEPS))


@pytest.fixture(scope="module")
def reference_curve() -> list[tuple[float, float]]:
    return _reference()


@pytest.mark.parametrize(
    "batching",
    [
        {},
        {"micro_batch_size": 1},
        {"max_tokens_per_micro_batch": 40, "use_packing": True},
        {"micro_batch_size": 3, "use_packing": False},
    ],
    ids=["one_mb", "mbs1", "budget40", "padded_mbs3"],
)
def test_dp2_training_matches_single_process(batching: dict, reference_curve: list) -> None:
    for rank_curve in run_distributed(_parity_worker, 2, batching):
        for (loss, norm), (want_loss, want_norm) in zip(rank_curve, reference_curve, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5)
            assert norm == pytest.approx(want_norm, rel=1e-5)


def _outputs_worker(rank: int, world: int, tmp: str) -> dict:
    engine = _fsdp2(micro_batch_size=3)
    batch = random_batch(N, seed=11, left_pad=True)
    set_meta(batch, BatchMeta(compute_entropy=True))
    with engine.eval_mode():
        lp = engine.unshard_data(
            engine.forward_backward_step(engine.shard_data(batch), forward_only=True).outputs
        )
    critic = _fsdp2(model={"config": engine_config()["model"]["config"], "value_head": True})
    critic.set_loss_fn(None)
    with critic.eval_mode():
        values = critic.unshard_data(
            critic.forward_backward_step(critic.shard_data(batch), forward_only=True).outputs
        )
    exported = {k: v.clone() for k, v in engine.named_full_params()}
    engine.export_hf(str(Path(tmp) / "hf"))  # collective; rank 0 writes
    # checkpoint round trip: save after 3 steps, resume in a fresh engine, compare steps 4-5
    first = _train(engine, range(3))
    folder = engine.save_checkpoint(tmp, step=3, max_ckpt_to_keep=2)
    straight = _train(engine, range(3, 5))
    resumed = _fsdp2(micro_batch_size=3)
    step = resumed.load_checkpoint(folder)
    again = _train(resumed, range(3, 5))
    for s in (4, 5):
        engine.save_checkpoint(tmp, step=s, max_ckpt_to_keep=2)
    return {
        "lp": lp["log_probs"],
        "ent": lp["entropy"],
        "values": values["values"],
        "exported": exported,
        "first": first,
        "straight": straight,
        "again": again,
        "step": step,
    }


def test_outputs_export_and_checkpoint_resume(tmp_path: Path) -> None:
    ranks = run_distributed(_outputs_worker, 2, str(tmp_path))
    ref = ReferenceEngine(ReferenceEngineConfig(**engine_config(optim=OPTIM)))
    ref.init_model()
    batch = random_batch(N, seed=11, left_pad=True)
    set_meta(batch, BatchMeta(compute_entropy=True))
    with ref.eval_mode():
        want = ref.forward_backward_step(batch, forward_only=True).outputs
    critic = ReferenceEngine(
        ReferenceEngineConfig(
            **engine_config(
                model={"config": engine_config()["model"]["config"], "value_head": True}
            )
        )
    )
    critic.init_model()
    with critic.eval_mode():
        want_values = critic.forward_backward_step(batch, forward_only=True).outputs["values"]
    for r in ranks:
        assert torch.allclose(r["lp"], want["log_probs"], atol=1e-5)
        assert torch.allclose(r["ent"], want["entropy"], atol=1e-5)
        assert torch.allclose(r["values"], want_values, atol=1e-5)
        state = ref.module.state_dict()
        assert r["exported"].keys() == state.keys()
        for k, v in state.items():
            assert r["exported"][k].shape == v.shape and torch.equal(r["exported"][k], v), k
        assert r["step"] == 3
        assert r["again"] == r["straight"]  # bit-identical resume
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    # the HF export (taken before training) reloads with the initial weights
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = random_batch(3)["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ref.module.eval()(input_ids=ids).logits)
