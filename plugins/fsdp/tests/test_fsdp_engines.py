"""Both FSDP engines (``fsdp``: FullyShardedDataParallel, ``fsdp2``: fully_shard) on real gloo
processes against the single-process reference engine: outputs, training, export, checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_core_fsdp._common import full_tensors

from engine_core.batch import BatchMeta, set_meta
from engine_core.checkpoint import list_checkpoints
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from tests._dist import run_distributed
from tests._models import (
    engine_config,
    nll_loss,
    random_batch,
    registered_engine,
    train_steps,
)

STEPS = 5
N = 8
OPTIM = {"lr": 1e-2, "clip_grad": 1.0, "warmup_steps": 1}
BACKENDS = ["fsdp", "fsdp2"]
CRITIC_MODEL = {"config": engine_config()["model"]["config"], "value_head": True}


def _engine(backend: str, **overrides: object):  # type: ignore[no-untyped-def]
    return registered_engine(backend, optim=OPTIM, **overrides)


def _reference(**overrides: object) -> ReferenceEngine:
    e = ReferenceEngine(ReferenceEngineConfig(**engine_config(optim=OPTIM, **overrides)))
    e.init_model()
    e.set_loss_fn(nll_loss)
    return e


def _eval_batch():  # type: ignore[no-untyped-def]
    batch = random_batch(N, seed=11, left_pad=True)
    set_meta(batch, BatchMeta(compute_entropy=True))
    return batch


def _forward(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    engine.set_loss_fn(None)
    with engine.eval_mode():
        out = engine.forward_backward_step(engine.shard_data(_eval_batch()), forward_only=True)
    return dict(engine.unshard_data(out.outputs).items())


@pytest.fixture(scope="module")
def reference_curve() -> list[tuple[float, float]]:
    return train_steps(_reference(), range(STEPS), N)


def _parity_worker(rank: int, world: int, backend: str, batching: dict) -> list:
    return train_steps(_engine(backend, **batching), range(STEPS), N)


@pytest.mark.parametrize("backend", BACKENDS)
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
def test_dp2_training_matches_single_process(
    backend: str, batching: dict, reference_curve: list
) -> None:
    # same losses and grad norms for any micro-batching, token budget and DP size 2 vs 1
    for rank_curve in run_distributed(_parity_worker, 2, backend, batching):
        for (loss, norm), (want_loss, want_norm) in zip(rank_curve, reference_curve, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5)
            assert norm == pytest.approx(want_norm, rel=1e-5)


def _compiled_worker(rank: int, world: int) -> dict:
    engine = _engine("fsdp2", compile=True, max_tokens_per_micro_batch=40, use_packing=True)
    compiled = sum(
        getattr(m, "_compiled_call_impl", None) is not None for m in engine.module.modules()
    )
    out = _forward(engine)
    engine.set_loss_fn(nll_loss)
    return {"curve": train_steps(engine, range(STEPS), N), "compiled": compiled, **out}


def test_fsdp2_compiled_blocks_match_eager(reference_curve: list) -> None:
    # torch.compile per block (inductor) changes kernels, not results: packed micro-batches
    # through sdpa_varlen (eager between the compiled parts) give the reference's outputs and
    # training curve at DP size 2
    want = _forward(_reference())
    for r in run_distributed(_compiled_worker, 2):
        assert r["compiled"] == engine_config()["model"]["config"]["num_hidden_layers"]
        assert torch.allclose(r["log_probs"], want["log_probs"], atol=1e-5)
        assert torch.allclose(r["entropy"], want["entropy"], atol=1e-5)
        for (loss, norm), (want_loss, want_norm) in zip(r["curve"], reference_curve, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5)
            assert norm == pytest.approx(want_norm, rel=1e-5)


def _outputs_worker(rank: int, world: int, backend: str) -> dict:
    out = {}
    for packing in (True, False):
        actor = _engine(backend, micro_batch_size=3, use_packing=packing)
        critic = _engine(backend, micro_batch_size=3, use_packing=packing, model=CRITIC_MODEL)
        out[packing] = {**_forward(actor), "values": _forward(critic)["values"]}
    # a non-finite gradient norm skips the update and is counted
    actor.set_loss_fn(lambda mb, o, ctx: ((o["log_probs"] * float("nan")).sum(), {}))
    before = {k: v.clone() for k, v in full_tensors(actor.sharded_state_dict())}
    with actor.train_mode():
        actor.forward_backward_step(actor.shard_data(random_batch(N)))
        norm = actor.optimizer_step()
    after = dict(full_tensors(actor.sharded_state_dict()))
    out["skip"] = (norm, actor.skipped_steps, all(torch.equal(before[k], after[k]) for k in after))
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_log_probs_entropy_values_match_transformers(backend: str, world: int) -> None:
    want = _forward(_reference())
    want_values = _forward(_reference(model=CRITIC_MODEL))["values"]
    for r in run_distributed(_outputs_worker, world, backend):
        for packing in (True, False):
            got = r[packing]
            assert torch.allclose(got["log_probs"], want["log_probs"], atol=1e-5), packing
            assert torch.allclose(got["entropy"], want["entropy"], atol=1e-5), packing
            assert torch.allclose(got["values"], want_values, atol=1e-5), packing
        norm, skipped, unchanged = r["skip"]
        assert norm != norm and skipped == 1 and unchanged


def _checkpoint_worker(rank: int, world: int, backend: str, tmp: str) -> dict:
    engine = _engine(backend, micro_batch_size=3)
    exported = {k: v.clone() for k, v in engine.named_full_params()}
    engine.export_hf(str(Path(tmp) / "hf"))  # collective; rank 0 writes
    # checkpoint round trip: save after 3 steps, resume in a fresh engine, compare steps 4-5
    train_steps(engine, range(3), N)
    folder = engine.save_checkpoint(tmp, step=3, max_ckpt_to_keep=2)
    straight = train_steps(engine, range(3, 5), N)
    resumed = _engine(backend, micro_batch_size=3)
    step = resumed.load_checkpoint(folder)
    again = train_steps(resumed, range(3, 5), N)
    for s in (4, 5):
        engine.save_checkpoint(tmp, step=s, max_ckpt_to_keep=2)
    return {"exported": exported, "straight": straight, "again": again, "step": step}


@pytest.mark.parametrize("backend", BACKENDS)
def test_export_and_checkpoint_resume(backend: str, tmp_path: Path) -> None:
    ranks = run_distributed(_checkpoint_worker, 2, backend, str(tmp_path))
    ref = _reference()
    state = ref.module.state_dict()
    for r in ranks:
        assert r["exported"].keys() == state.keys()
        for k, v in state.items():
            assert r["exported"][k].shape == v.shape and torch.equal(r["exported"][k], v), k
        assert r["step"] == 3
        assert r["again"] == r["straight"]  # bit-identical resume
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]  # rotation kept exactly 2
    # the HF export (taken before training) reloads with the initial weights
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = random_batch(3)["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ref.module.eval()(input_ids=ids).logits)


def _cross_world_worker(rank: int, world: int, tmp: str, save: bool) -> dict:
    """fsdp2 at this world size: train 3 steps and save, or load what the other size saved;
    then 2 more steps. A one-rank engine holds plain tensors, a two-rank one DTensor shards."""
    engine = _engine("fsdp2", micro_batch_size=2)
    if save:
        train_steps(engine, range(3), N)
        engine.save_checkpoint(tmp, step=3)
    else:
        assert engine.load_checkpoint(str(Path(tmp) / "global_step_3")) == 3
    loaded = {k: v.clone() for k, v in engine.named_full_params()}
    curve = train_steps(engine, range(3, 5), N)
    return {"sharded": engine.sharded, "loaded": loaded, "curve": curve}


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(1, 2), (2, 1)])
def test_fsdp2_checkpoint_loads_at_another_world_size(
    saved_by: int, loaded_by: int, tmp_path: Path
) -> None:
    """A checkpoint of the unsharded one-rank engine resumes on two ranks, and back."""
    first = run_distributed(_cross_world_worker, saved_by, str(tmp_path), True)[0]
    then = run_distributed(_cross_world_worker, loaded_by, str(tmp_path), False)
    assert first["sharded"] is (saved_by > 1) and then[0]["sharded"] is (loaded_by > 1)
    for r in then:
        for name, tensor in first["loaded"].items():  # weights as saved, bit for bit
            assert torch.equal(r["loaded"][name], tensor), name
        # optimizer state, schedule and counters came along: the same next steps (the DP
        # gradient is summed in another order: float tolerance)
        for (loss, norm), (want_loss, want_norm) in zip(r["curve"], first["curve"], strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5)
            assert norm == pytest.approx(want_norm, rel=1e-4)


def test_fsdp1_config_errors_name_the_fix() -> None:
    from engine_core_fsdp.fsdp1 import FSDPEngineConfig

    with pytest.raises(ValueError, match="init='meta' .* is implemented by the fsdp2 engine"):
        FSDPEngineConfig(**engine_config(backend="fsdp", init="meta", model={"path": "/x"}))
    with pytest.raises(ValueError, match="Use backend='fsdp2' for tensor parallelism"):
        FSDPEngineConfig(**engine_config(backend="fsdp", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="sharding_strategy"):
        FSDPEngineConfig(**engine_config(backend="fsdp", sharding_strategy="no_shard"))


def _fsspec_worker(rank: int, world: int, backend: str) -> dict:
    import fsspec

    root = f"memory://ckpt-{backend}"  # in-process filesystem: DCP's fsspec writer and reader
    engine = _engine(backend)
    train_steps(engine, range(2), N)
    for step in (1, 2):
        folder = engine.save_checkpoint(root, step=step, max_ckpt_to_keep=1)
    straight = train_steps(engine, range(2, 4), N)
    resumed = _engine(backend)
    step = resumed.load_checkpoint(folder)
    again = train_steps(resumed, range(2, 4), N)
    kept = [s for s, _ in list_checkpoints(root)]
    fsspec.filesystem("memory").rm(f"/ckpt-{backend}", recursive=True)
    return {"folder": folder, "step": step, "kept": kept, "same": again == straight}


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_to_an_fsspec_url(backend: str) -> None:
    (r,) = run_distributed(_fsspec_worker, 1, backend)
    assert r == {
        "folder": f"memory://ckpt-{backend}/global_step_2",
        "step": 2,
        "kept": [2],
        "same": True,
    }
