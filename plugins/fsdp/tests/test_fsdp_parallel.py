"""FSDP2 meshes (HSDP 1×2 and 2×1, TP 1×2, CP 1×2 on Qwen2 and Llama shapes with GQA; on four
processes CP 2 × TP 2 and HSDP 2 × CP 2), and for both FSDP engines mixed precision, LoRA and
rank-0 / meta init, on real gloo processes (two unless named) against the single-process
reference engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from engine_core_fsdp._common import full_tensors
from engine_core_fsdp.fsdp2 import FSDP2Engine, FSDP2EngineConfig

from engine_core.batch import BatchMeta, set_meta
from engine_core.errors import ConfigError
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from tests._dist import run_distributed
from tests._models import (
    TINY_QWEN2,
    engine_config,
    nll_loss,
    random_batch,
    registered_engine,
    train_steps,
)

STEPS = 5
N = 8
OPTIM = {"lr": 1e-2, "clip_grad": 1.0, "warmup_steps": 1}
LORA = {"rank": 4, "alpha": 8.0}
BACKENDS = ["fsdp", "fsdp2"]


def _fsdp2(**overrides: object) -> FSDP2Engine:
    return registered_engine("fsdp2", optim=OPTIM, **overrides)


def _engine(backend: str, **overrides: object):  # type: ignore[no-untyped-def]
    return registered_engine(backend, optim=OPTIM, **overrides)


def _log_probs(engine) -> torch.Tensor:  # type: ignore[no-untyped-def]
    batch = random_batch(N, seed=11, left_pad=True)
    set_meta(batch, BatchMeta(compute_entropy=True))
    engine.set_loss_fn(None)
    with engine.eval_mode():
        out = engine.forward_backward_step(engine.shard_data(batch), forward_only=True).outputs
    engine.set_loss_fn(nll_loss)
    return engine.unshard_data(out)["log_probs"]


@pytest.fixture(scope="module")
def reference() -> dict:
    e = ReferenceEngine(ReferenceEngineConfig(**engine_config(optim=OPTIM)))
    e.init_model()
    e.set_loss_fn(nll_loss)
    return {"lp": _log_probs(e), "curve": train_steps(e, range(STEPS), N)}


def _mesh_worker(rank: int, world: int, overrides: dict) -> dict:
    engine = _fsdp2(**overrides)
    return {
        "mesh": (engine.mesh.mesh_dim_names, tuple(engine.mesh.shape)),
        "dp": (engine.dp_rank, engine.dp_size, engine.is_collect_rank),
        "lp": _log_probs(engine),
        "curve": train_steps(engine, range(STEPS), N),
    }


@pytest.mark.parametrize(
    ("overrides", "mesh", "dp"),
    [
        ({"data_parallel_replicate_size": 1}, (("dp_replicate", "dp_shard"), (1, 2)), 2),
        ({"data_parallel_replicate_size": 2}, (("dp_replicate", "dp_shard"), (2, 1)), 2),
        ({"tensor_parallel_size": 2, "micro_batch_size": 3}, (("dp_shard", "tp"), (1, 2)), 1),
    ],
    ids=["hsdp_1x2", "hsdp_2x1", "tp_1x2"],
)
def test_meshes_match_single_process(
    overrides: dict, mesh: tuple, dp: int, reference: dict
) -> None:
    ranks = run_distributed(_mesh_worker, 2, overrides)
    for rank, r in enumerate(ranks):
        assert r["mesh"] == mesh
        assert r["dp"][1] == dp
        assert r["dp"][0] == (rank if dp == 2 else 0)
        assert r["dp"][2] == (dp == 2 or rank == 0)  # one collect rank per DP rank
        assert torch.allclose(r["lp"], reference["lp"], atol=1e-5)
        for (loss, norm), (want_loss, want_norm) in zip(
            r["curve"], reference["curve"], strict=True
        ):
            assert loss == pytest.approx(want_loss, rel=1e-5)
            assert norm == pytest.approx(want_norm, rel=1e-5)


def _bf16_worker(rank: int, world: int, backend: str) -> dict:
    bf16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    engine = _engine(backend, mixed_precision=bf16)
    curve = train_steps(engine, range(3), N)
    dtypes = {str(p.dtype) for p in engine.module.parameters()}
    return {"curve": curve, "lp": _log_probs(engine), "dtypes": dtypes}


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_mixed_precision_keeps_fp32_master_weights(backend: str, reference: dict) -> None:
    for r in run_distributed(_bf16_worker, 2, backend):
        assert r["dtypes"] == {"torch.float32"}  # sharded master weights stay fp32
        for (loss, norm), (want_loss, _) in zip(r["curve"], reference["curve"], strict=False):
            assert loss == pytest.approx(want_loss, rel=2e-3)  # bf16 compute: close, not equal
            assert norm == norm and norm > 0


def _precision_worker(rank: int, world: int, backend: str, precision: dict) -> dict:
    engine = _engine(backend, **precision)
    return {
        "wrapped": engine.sharded if backend == "fsdp2" else engine.wrapped,
        "dtypes": {str(p.dtype) for p in engine.module.parameters()},
        "lp": _log_probs(engine),
        "curve": train_steps(engine, range(3), N),
        "export": {str(t.dtype) for _, t in engine.named_full_params()},
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_compute_dtype_is_their_mixed_precision_on_one_process(
    backend: str, reference: dict
) -> None:
    # compute_dtype alone runs as mixed_precision {param_dtype: bfloat16, reduce_dtype: float32};
    # on one process too, where a plain module would compute in float32, the model is wrapped
    (core,) = run_distributed(_precision_worker, 1, backend, {"compute_dtype": "bfloat16"})
    bf16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    (own,) = run_distributed(_precision_worker, 1, backend, {"mixed_precision": bf16})
    assert core["wrapped"] and own["wrapped"]
    assert core["dtypes"] == core["export"] == {"torch.float32"}  # float32 master weights
    assert torch.equal(core["lp"], own["lp"]) and core["curve"] == own["curve"]
    diff = float((core["lp"] - reference["lp"]).abs().max())
    assert 1e-5 < diff < 1e-2  # bfloat16 compute: close to float32, not equal


def test_compute_dtype_and_mixed_precision_must_agree() -> None:
    from engine_core_fsdp.fsdp1 import FSDPEngineConfig

    both = {"compute_dtype": "bfloat16", "mixed_precision": {"param_dtype": "float16"}}
    for cls, backend in ((FSDP2EngineConfig, "fsdp2"), (FSDPEngineConfig, "fsdp")):
        with pytest.raises(ValueError, match=r"compute_dtype='bfloat16' and mixed_precision\."):
            cls(**engine_config(backend=backend, **both))
        agree = cls(**engine_config(backend=backend, compute_dtype="bfloat16"))
        policy = agree.precision_policy
        assert policy is not None and (policy.param_dtype, policy.reduce_dtype) == (
            "bfloat16",
            "float32",
        )
        own = {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}
        kept = cls(**engine_config(backend=backend, compute_dtype="bfloat16", mixed_precision=own))
        assert kept.precision_policy == kept.mixed_precision  # the engine's own field wins
        assert cls(**engine_config(backend=backend)).precision_policy is None


def _lora_worker(rank: int, world: int, backend: str, base_dir: str) -> dict:
    engine = _engine(backend, model={"path": base_dir, "lora": LORA})
    module = engine.module
    before = {n: t.clone() for n, t in full_tensors(engine.sharded_state_dict())}
    trainable = sorted(n for n, p in module.named_parameters() if p.requires_grad)
    train_steps(engine, range(2), N)
    after = dict(full_tensors(engine.sharded_state_dict()))
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    with module.disable_adapter():
        base_lp = _log_probs(engine)
    adapted_lp = _log_probs(engine)
    merged = dict(engine.named_full_params())
    unmerged = {n: t.clone() for n, t in full_tensors(engine.sharded_state_dict())}
    return {
        "trainable": trainable,
        "changed": changed,
        "base_lp": base_lp,
        "adapted_lp": adapted_lp,
        "merged": merged,
        "unmerged": unmerged,
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_trains_adapters_only_and_exports_merged_weights(backend: str, tmp_path: Path) -> None:
    from engine_core.config import ModelConfig
    from engine_core.models import build_model

    torch.manual_seed(0)
    build_model(ModelConfig(config=dict(TINY_QWEN2))).save_pretrained(tmp_path / "base")
    ranks = run_distributed(_lora_worker, 2, backend, str(tmp_path / "base"))
    base_ref = ReferenceEngine(
        ReferenceEngineConfig(**engine_config(model={"path": str(tmp_path / "base")}))
    )
    base_ref.init_model()
    want_base_lp = _log_probs(base_ref)
    # peft's own merge of the same trained adapters, in one process
    peft_model = build_model(ModelConfig(path=str(tmp_path / "base"), lora=LORA))
    for r in ranks:
        assert r["trainable"] and all("lora_" in n for n in r["trainable"])
        assert r["changed"] and all("lora_" in n for n in r["changed"])
        assert torch.allclose(r["base_lp"], want_base_lp, atol=1e-5)
        assert not torch.allclose(r["adapted_lp"], want_base_lp, atol=1e-4)
    peft_model.load_state_dict(ranks[0]["unmerged"])
    want = peft_model.merge_and_unload().state_dict()
    merged = ranks[0]["merged"]
    assert merged.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.allclose(merged[name], tensor, atol=1e-6), name


def _init_worker(rank: int, world: int, backend: str, path: str, init: str) -> dict:
    engine = _engine(backend, model={"path": path}, init=init)
    return {"params": dict(engine.named_full_params()), "lp": _log_probs(engine)}


@pytest.mark.parametrize(
    ("backend", "init"),
    [("fsdp2", "rank0_broadcast"), ("fsdp2", "meta"), ("fsdp", "rank0_broadcast")],
)
def test_rank0_and_meta_init_equal_a_plain_load(backend: str, init: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ref = ReferenceEngine(ReferenceEngineConfig(**engine_config(seed=3)))
    ref.init_model()
    ref.module.save_pretrained(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    want = loaded.state_dict()
    for r in run_distributed(_init_worker, 2, backend, str(tmp_path / "hf"), init):
        assert r["params"].keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(r["params"][name], tensor), name
        assert torch.allclose(r["lp"], _log_probs(ref), atol=1e-5)  # buffers (rotary) intact


TINY_LLAMA = {
    **TINY_QWEN2,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


# eight heads over four key/value heads (GQA): two heads and one key/value head per rank once
# tensor parallelism (2) and context parallelism (2) have split them
WIDE_QWEN2 = {**TINY_QWEN2, "num_attention_heads": 8, "num_key_value_heads": 4}
# Final weights are compared at 1e-5. Adam's update lr * m / (sqrt(v) + eps) turns the last
# bits of a gradient that nearly cancels (|g| ~ eps), which another reduction order (tensor-
# parallel partial sums) changes by ~1e-10, into weight differences of ~lr * 3e-3 (2.7e-5 at
# lr 1e-2, eps 1e-8, already with tensor parallelism alone); lr 1e-3 and eps 1e-6 keep that
# rounding ~30x below 1e-5 while five steps still move each weight by up to 5e-3.
CP_OPTIM = {**OPTIM, "lr": 1e-3, "eps": 1e-6}


def _grads(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Every parameter's full gradient after one batch's backward, then cleared (no step)."""
    with engine.train_mode():
        engine.forward_backward_step(engine.shard_data(random_batch(N, seed=21)))
    grads = {}
    for name, param in engine.module.named_parameters():  # collective for sharded gradients
        grad = param.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
    engine.optimizer_zero_grad()
    return grads


def _run(engine) -> dict:  # type: ignore[no-untyped-def]
    """Log-probs, one batch's gradients, five clipped training steps, the final weights."""
    return {
        "lp": _log_probs(engine),
        "grads": _grads(engine),
        "curve": train_steps(engine, range(STEPS), N),
        "params": dict(engine.named_full_params()),
    }


def _reference_run(model: dict) -> dict:
    e = ReferenceEngine(
        ReferenceEngineConfig(**engine_config(optim=CP_OPTIM, model={"config": model}))
    )
    e.init_model()
    e.set_loss_fn(nll_loss)
    return _run(e)


def _assert_same_run(got: dict, want: dict) -> None:
    """:func:`_run`'s results equal the reference's within 1e-5."""
    torch.testing.assert_close(got["lp"], want["lp"], rtol=0, atol=1e-5)
    for key in ("grads", "params"):
        assert got[key].keys() == want[key].keys()
        for name, tensor in want[key].items():
            torch.testing.assert_close(
                got[key][name], tensor, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
    for (loss, norm), (want_loss, want_norm) in zip(got["curve"], want["curve"], strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-5)


def _cp_worker(rank: int, world: int, model: dict, packing: bool, overrides: dict) -> dict:
    engine = registered_engine(
        "fsdp2",
        optim=CP_OPTIM,
        model={"config": model},
        use_packing=packing,
        micro_batch_size=3,
        **overrides,
    )
    cp = engine.context_parallel_group
    tp = engine.mesh["tp"].get_group() if engine.config.tensor_parallel_size > 1 else None
    shard_mesh = next(engine.module.parameters()).device_mesh  # the embedding: FSDP's mesh only
    return {
        "mesh": (engine.mesh.mesh_dim_names, tuple(engine.mesh.shape)),
        "dp": (engine.dp_rank, engine.dp_size, engine.is_collect_rank),
        "groups": tuple(None if g is None else dist.get_process_group_ranks(g) for g in (cp, tp)),
        "fsdp": (shard_mesh.mesh_dim_names, shard_mesh.mesh.tolist()),
        **_run(engine),
    }


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("model", [TINY_QWEN2, TINY_LLAMA], ids=["qwen2", "llama"])
def test_context_parallel_matches_one_rank(model: dict, packing: bool) -> None:
    # each row split over two ranks (Ulysses attention): the log-probs, gradients, five clipped
    # training steps and final weights of the single-process reference engine on the same model
    want = _reference_run(model)
    ranks = run_distributed(_cp_worker, 2, model, packing, {"context_parallel_size": 2})
    for rank, r in enumerate(ranks):
        assert r["mesh"] == (("dp_shard", "cp"), (1, 2))
        assert r["dp"] == (0, 1, rank == 0)  # one DP rank; its first cp rank is collected
        _assert_same_run(r, want)


@pytest.mark.parametrize(
    ("model", "overrides", "layout"),
    [
        (
            WIDE_QWEN2,
            {"context_parallel_size": 2, "tensor_parallel_size": 2},
            {
                "mesh": (("dp_shard", "cp", "tp"), (1, 2, 2)),
                # one DP rank of four: every rank sees the whole batch, rank 0 is collected
                "dp": [(0, 1, True), (0, 1, False), (0, 1, False), (0, 1, False)],
                # (cp group, tp group): orthogonal, every rank in one of each
                "groups": [([0, 2], [0, 1]), ([1, 3], [0, 1]), ([0, 2], [2, 3]), ([1, 3], [2, 3])],
                # FSDP shards over dp_shard x cp (here the cp group), never over tp
                "fsdp": [(("dp_shard_cp",), r) for r in ([0, 2], [1, 3], [0, 2], [1, 3])],
            },
        ),
        (
            TINY_LLAMA,
            {"context_parallel_size": 2, "data_parallel_replicate_size": 2},
            {
                "mesh": (("dp_replicate", "dp_shard", "cp"), (2, 1, 2)),
                # two DP ranks (the replicas), each split over a cp pair; one collect rank each
                "dp": [(0, 2, True), (0, 2, False), (1, 2, True), (1, 2, False)],
                "groups": [([0, 1], None), ([0, 1], None), ([2, 3], None), ([2, 3], None)],
                # HSDP: replicated over dp_replicate, sharded over dp_shard x cp
                "fsdp": [(("dp_replicate", "dp_shard_cp"), [[0, 1], [2, 3]])] * 4,
            },
        ),
    ],
    ids=["qwen2-cp2xtp2", "llama-hsdp2xcp2"],
)
def test_context_parallel_composes_on_four_ranks(
    model: dict, overrides: dict, layout: dict
) -> None:
    # packed rows split over a cp pair beside tensor parallelism or HSDP replicas: the same
    # log-probs, gradients, training steps and final weights as the single-process reference
    want = _reference_run(model)
    ranks = run_distributed(_cp_worker, 4, model, True, overrides)
    for rank, r in enumerate(ranks):
        assert r["mesh"] == layout["mesh"]
        for key in ("dp", "groups", "fsdp"):
            assert r[key] == layout[key][rank], key
        _assert_same_run(r, want)


def _values(engine, at_token: bool) -> torch.Tensor:  # type: ignore[no-untyped-def]
    batch = random_batch(N, seed=12)
    set_meta(batch, BatchMeta(values_at_token=at_token))
    engine.set_loss_fn(None)
    with engine.eval_mode():
        out = engine.forward_backward_step(engine.shard_data(batch), forward_only=True).outputs
    return engine.unshard_data(out)["values"]


def _cp_values_worker(rank: int, world: int, cp: int) -> list[torch.Tensor]:
    critic = {"config": dict(TINY_QWEN2), "value_head": True}
    engine = _fsdp2(model=critic, context_parallel_size=cp, micro_batch_size=3)
    return [_values(engine, at_token) for at_token in (False, True)]


def test_context_parallel_value_head_matches_one_rank() -> None:
    (want,) = run_distributed(_cp_values_worker, 1, 1)
    for got in run_distributed(_cp_values_worker, 2, 2):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def test_config_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="init='meta' reads weights from a saved"):
        FSDP2EngineConfig(**engine_config(backend="fsdp2", init="meta"))
    for both in ({"tensor_parallel_size": 2}, {"data_parallel_replicate_size": 2}):
        FSDP2EngineConfig(**engine_config(backend="fsdp2", context_parallel_size=2, **both))
    eager = {"config": dict(TINY_QWEN2), "attn_implementation": "eager"}
    with pytest.raises(ValueError, match="needs model.attn_implementation sdpa_varlen"):
        FSDP2EngineConfig(**engine_config(backend="fsdp2", context_parallel_size=2, model=eager))
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 with model.lora"):
        FSDP2EngineConfig(
            **engine_config(
                backend="fsdp2",
                tensor_parallel_size=2,
                model={"config": dict(TINY_QWEN2), "lora": LORA},
            )
        )


def _bad_mesh_worker(rank: int, world: int, overrides: dict) -> str:
    engine = FSDP2Engine(FSDP2EngineConfig(**engine_config(backend="fsdp2", **overrides)))
    try:
        engine.init_model()
    except ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    ("world", "overrides", "message"),
    [
        (2, {"tensor_parallel_size": 2, "data_parallel_replicate_size": 2}, "does not divide"),
        (
            2,
            {
                "tensor_parallel_size": 2,
                "model": {"config": {**TINY_QWEN2, "num_key_value_heads": 1}},
            },
            "tensor_parallel_size=2 must divide num_attention_heads",
        ),
        (
            2,
            {
                "context_parallel_size": 2,
                "model": {"config": {**TINY_QWEN2, "num_key_value_heads": 1}},
            },
            "context_parallel_size=2 must divide num_attention_heads (4) and "
            "num_key_value_heads (1)",
        ),
        (2, {"context_parallel_size": 4}, "does not divide"),
        (
            4,  # each divides the 2 key/value heads, their product does not
            {"context_parallel_size": 2, "tensor_parallel_size": 2},
            "tensor_parallel_size=2 x context_parallel_size=2 = 4 must divide "
            "num_attention_heads (4) and num_key_value_heads (2)",
        ),
    ],
)
def test_mesh_errors_before_any_state(world: int, overrides: dict, message: str) -> None:
    for text in run_distributed(_bad_mesh_worker, world, overrides):
        assert message in text
