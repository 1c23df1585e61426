"""Mixtures of experts on megatron-core: a Qwen3-MoE, a Mixtral and a Qwen2-MoE, expert
parallelism.

Three unseen tiny families (8 experts, top-2, odd vocabularies; Qwen3-MoE with per-head q/k
norms and renormalised top-k, Mixtral without either norm, Qwen2-MoE with q/k/v biases, top-k
not renormalised and a gated shared expert of its own width), every weight random, saved with
``save_pretrained``. The megatron engine at TP2 without expert parallelism, at EP2, EP2 with the
experts' own data parallelism (4 ranks), EP2 x TP2 (sequence parallel) and EP2 with PP2, on
real gloo groups and megatron-core's all-to-all token dispatcher, against transformers' own
forward; the same updates as fsdp2's; a checkpoint written at EP2 loaded at EP1 and at TP2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="the megatron plugin's tests need megatron-core")

from engine_core.batch import LOG_PROBS  # noqa: E402
from engine_core.config import ModelConfig  # noqa: E402
from engine_core.errors import ConfigError  # noqa: E402
from engine_core.testing.distributed import run_distributed  # noqa: E402
from engine_core.testing.kit import build, eval_batch, forward, plain_log_probs  # noqa: E402
from engine_core.testing.models import save_with_own_norms, train_steps  # noqa: E402
from engine_core.testing.moe import TINY_MIXTRAL, TINY_QWEN2_MOE, TINY_QWEN3_MOE  # noqa: E402

PRELOAD = (
    "engine_core_megatron.engine",
    "megatron.core",  # imported by the engine only as it builds: seconds of each process
    "engine_core_fsdp.fsdp2",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.qwen2_moe.modeling_qwen2_moe",
)
FAMILIES = {"qwen3_moe": TINY_QWEN3_MOE, "mixtral": TINY_MIXTRAL, "qwen2_moe": TINY_QWEN2_MOE}
OPTIM = {"lr": 1e-2, "clip_grad": 1.0, "warmup_steps": 1}
SP = {"tensor_parallel_size": 2, "sequence_parallel": True}
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "tp2": (2, SP),  # EP 1: every expert whole on both TP ranks, tokens split between them
    "ep2": (2, {"expert_parallel_size": 2}),
    "ep2_dp2": (4, {"expert_parallel_size": 2}),  # DP 4; each expert on 2 ranks
    "ep2_tp2": (4, {"expert_parallel_size": 2, **SP}),
    "ep2_pp2": (4, {"expert_parallel_size": 2, "pipeline_parallel_size": 2}),
}
RESHARDED: dict[str, tuple[int, dict[str, Any]]] = {"ep1": (1, {}), "tp2": (2, SP)}
STEPS = range(3)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for family, config in FAMILIES.items():
        path = tmp_path_factory.mktemp(family)
        save_with_own_norms(config, path)
        out[family] = str(path)
    return out


def _megatron(
    rank: int, world: int, folders: dict[str, str], sizes: dict[str, Any], root: str
) -> Any:
    out: dict[str, Any] = {}
    for family, folder in folders.items():
        engine = build("megatron", model={"path": folder}, optim=OPTIM, **sizes)
        out[family] = {
            "weights": {n: t.clone() for n, t in engine.named_full_params()},
            "log_probs": forward(engine, eval_batch())[LOG_PROBS],
        }
        if family == "qwen3_moe":
            out["steps"] = train_steps(engine, STEPS)
            if root:  # the checkpoint the resharded layouts load
                engine.save_checkpoint(root, step=len(STEPS))
                out["trained_log_probs"] = forward(engine, eval_batch())[LOG_PROBS]
    return out


def _fsdp2(rank: int, world: int, folder: str) -> Any:
    return train_steps(build("fsdp2", model={"path": folder}, optim=OPTIM), STEPS)


def _resharded(rank: int, world: int, folder: str, sizes: dict[str, Any], ckpt: str) -> Any:
    engine = build("megatron", model={"path": folder}, optim=OPTIM, **sizes)
    step = engine.load_checkpoint(str(Path(ckpt) / f"global_step_{len(STEPS)}"))
    return step, forward(engine, eval_batch())[LOG_PROBS]


@pytest.fixture(scope="module")
def runs(folders: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: dict[str, Any] = {}
    (out["fsdp2"],) = run_distributed(_fsdp2, 1, folders["qwen3_moe"], preload=PRELOAD)
    ckpt = str(tmp_path_factory.mktemp("ep2-ckpt"))
    for name, (world, sizes) in LAYOUTS.items():
        root = ckpt if name == "ep2" else ""
        out[name] = run_distributed(_megatron, world, folders, sizes, root, preload=PRELOAD)[0]
    for name, (world, sizes) in RESHARDED.items():
        out[f"resharded_{name}"] = run_distributed(
            _resharded, world, folders["qwen3_moe"], sizes, ckpt, preload=PRELOAD
        )[0]
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_on_megatron_equals_transformers(
    runs: dict[str, Any], folders: dict[str, str], layout: str, family: str
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folders[family], dtype=torch.float32).eval()
    state = hf.state_dict()
    got = runs[layout][family]
    # every expert comes back under transformers' stacked names, bit for bit
    assert sorted(got["weights"]) == sorted(state)
    for name, t in state.items():
        assert torch.equal(got["weights"][name], t), f"{layout}: {name} differs"
    want, _ = plain_log_probs(hf, eval_batch())
    gap = float((got["log_probs"] - want).abs().max())
    assert gap <= 1e-5, f"{layout}/{family}: log-probs {gap:.3g} from transformers'"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_updates_equal_fsdp2(runs: dict[str, Any], layout: str) -> None:
    """Three optimizer steps with the experts spread over ranks: the loss and the gradient norm
    (expert and dense parameters reduced over their own groups) equal fsdp2's."""
    for (loss, norm), (want_loss, want_norm) in zip(
        runs[layout]["steps"], runs["fsdp2"], strict=True
    ):
        assert loss == pytest.approx(want_loss, rel=1e-5), layout
        assert norm == pytest.approx(want_norm, rel=1e-5), layout


@pytest.mark.parametrize("layout", sorted(RESHARDED))
def test_expert_parallel_checkpoint_loads_resharded(runs: dict[str, Any], layout: str) -> None:
    """Saved at EP2 (4 experts a rank), loaded at EP1 (all 8 on one rank) and at TP2 with no
    expert parallelism: the same log-probs as the model that was saved."""
    step, log_probs = runs[f"resharded_{layout}"]
    assert step == len(STEPS)
    want = runs["ep2"]["trained_log_probs"]
    gap = float((log_probs - want).abs().max())
    assert gap <= 1e-5, f"{layout}: {gap:.3g} from the EP2 model saved"
    # the steps changed the model: a checkpoint not loaded would show
    assert float((log_probs - runs["ep2"]["qwen3_moe"]["log_probs"]).abs().max()) > 1e-3


@pytest.mark.parametrize(
    ("family", "change", "tp", "ep", "match"),
    [
        ("qwen3_moe", {"mlp_only_layers": [1]}, 1, 1, "dense layers.*mlp_only_layers"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, 1, 1, "decoder_sparse_step=2"),
        ("qwen3_moe", {}, 1, 3, "expert_parallel_size=3 must divide the number of experts"),
        ("mixtral", {"sliding_window": 16}, 1, 1, "sliding_window=16"),
        ("qwen2_moe", {"use_sliding_window": True}, 1, 1, "use_sliding_window=true"),
        ("qwen2_moe", {"layer_types": ["sliding_attention", "full_attention"]}, 1, 1, "sliding"),
        ("qwen2_moe", {"mlp_only_layers": [0]}, 1, 1, "a Qwen2-MoE with dense layers"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 57}, 2, 1, "divide shared_expert"),
    ],
)
def test_unmappable_moe_is_refused(
    family: str, change: dict[str, Any], tp: int, ep: int, match: str
) -> None:
    from engine_core_megatron.convert import layout_of

    from engine_core.models import build_hf_config

    hf = build_hf_config(ModelConfig(config={**FAMILIES[family], **change}))
    with pytest.raises(ConfigError, match=match):
        layout_of(hf, value_head=False, tp=tp, ep=ep)


def test_expert_parallel_on_a_dense_model_is_refused() -> None:
    from engine_core_megatron.convert import layout_of

    from engine_core.models import build_hf_config
    from engine_core.testing.models import TINY_QWEN3

    hf = build_hf_config(ModelConfig(config=dict(TINY_QWEN3)))
    with pytest.raises(ConfigError, match="expert_parallel_size=2 needs a mixture-of-experts"):
        layout_of(hf, value_head=False, tp=1, ep=2)


def _tp_without_sp(rank: int, world: int) -> str:
    try:
        build("megatron", model={"config": dict(TINY_QWEN3_MOE)}, tensor_parallel_size=2)
    except ConfigError as e:
        return str(e)
    return "built"


def test_moe_with_tensor_parallelism_needs_sequence_parallelism() -> None:
    (message,) = run_distributed(_tp_without_sp, 2, preload=PRELOAD)[:1]
    assert "needs sequence_parallel: true" in message


# -- routing replay, the routers' own choice and the balance loss ---------------------------
REPLAY_LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "ep2": (2, {"expert_parallel_size": 2}),
    "ep2_tp2": (4, {"expert_parallel_size": 2, **SP}),
    "ep2_pp2": (4, {"expert_parallel_size": 2, "pipeline_parallel_size": 2}),
}
PACKINGS: dict[str, dict[str, Any]] = {
    "packed": {},
    "padded": {"use_packing": False, "micro_batch_size": 2},
}


#: the routers' balance loss the engine adds (BatchMeta.moe_aux): a token mean over the loss mask
BALANCE = {"coef": 0.1}


def _policy(mb: Any, out: Any, ctx: Any) -> Any:
    """The policy's NLL, a token mean over the loss mask (the engine adds the balance loss)."""
    from engine_core.batch import LOSS_MASK
    from engine_core.loss import aggregate_loss

    return aggregate_loss(-out[LOG_PROBS], mb[LOSS_MASK], "token-mean", ctx), {}


def _replaying(
    rank: int,
    world: int,
    folder: str,
    backend: str,
    sizes: dict[str, Any],
    batch: Any,
    routes: Any,
    packings: tuple[str, ...] = tuple(PACKINGS),
) -> Any:
    from engine_core.batch import ROUTED_EXPERTS, with_meta

    out: dict[str, Any] = {}
    asked = with_meta(batch, return_routes=True)
    for name in packings:
        packing = PACKINGS[name]
        engine = build(backend, model={"path": folder}, optim=OPTIM, **sizes, **packing)
        given = asked.clone()
        given[ROUTED_EXPERTS] = routes
        replayed = forward(engine, given)
        own = forward(engine, asked.clone())
        out[name] = {
            "replayed": replayed[LOG_PROBS],
            "chosen_under_replay": replayed[ROUTED_EXPERTS],
            "own": own[LOG_PROBS],
            "chosen": own[ROUTED_EXPERTS],
        }
        # the routers' own routes replayed: the same numbers as no replay at all
        again = asked.clone()
        again[ROUTED_EXPERTS] = own[ROUTED_EXPERTS]
        out[name]["own_replayed"] = forward(engine, again)[LOG_PROBS]
        engine.set_loss_fn(_policy)  # an update with the balance loss, on every stage's routers
        update = with_meta(given, moe_aux=BALANCE)
        with engine.train_mode():
            result = engine.forward_backward_step(engine.shard_data(update))
            norm = engine.optimizer_step()
        after = forward(engine, batch.clone())[LOG_PROBS]
        out[name]["update"] = (result.loss, norm, after, result.metrics["moe_aux_loss"])
    return out


def _routed(family: str, folder: str) -> dict[str, Any]:
    """The family's model as saved in ``folder``, a batch with a loss mask after each
    sequence's first three tokens, and routes that are not the model's own."""
    from engine_core.batch import LOSS_MASK, POSITION_IDS
    from engine_core.models import build_model
    from engine_core.testing.moe import routed_batch

    torch.manual_seed(0)
    model: Any = build_model(ModelConfig(config=dict(FAMILIES[family]))).eval()
    model.load_state_dict(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(folder).state_dict()
    )
    batch, routes = routed_batch(model)
    batch[LOSS_MASK] = (batch["attention_mask"].bool() & (batch[POSITION_IDS] >= 3)).long()
    return {"model": model, "batch": batch, "routes": routes}


@pytest.fixture(scope="module")
def replays(folders: dict[str, str]) -> dict[str, Any]:
    folder = folders["qwen3_moe"]
    out = _routed("qwen3_moe", folder)
    batch, routes = out["batch"], out["routes"]
    out["fsdp2"] = run_distributed(
        _replaying, 1, folder, "fsdp2", {}, batch, routes, preload=PRELOAD
    )[0]
    for name, (world, sizes) in REPLAY_LAYOUTS.items():
        out[name] = run_distributed(
            _replaying, world, folder, "megatron", sizes, batch, routes, preload=PRELOAD
        )[0]
    return out


@pytest.mark.parametrize("packing", sorted(PACKINGS))
@pytest.mark.parametrize("layout", sorted(REPLAY_LAYOUTS))
def test_megatron_replays_the_routes_a_batch_carries(
    replays: dict[str, Any], layout: str, packing: str
) -> None:
    """Under expert, tensor (sequence) and pipeline parallelism, packed and padded: the
    engine's log-probs are transformers' with the batch's routes replayed, the routes it returns
    are its routers' own choice (before the replay), and replaying those changes nothing."""
    from engine_core.moe import route_mismatch
    from engine_core.testing.moe import own_routes

    model, batch, routes = replays["model"], replays["batch"], replays["routes"]
    want, _ = plain_log_probs(model, batch, routes)
    own, _ = plain_log_probs(model, batch)
    assert float((want - own).abs().max()) > 1e-3  # the routes given are not the model's
    got = replays[layout][packing]
    assert float((got["replayed"] - want).abs().max()) <= 1e-5
    assert float((got["own"] - own).abs().max()) <= 1e-5
    real = batch["attention_mask"].bool()
    chosen, under_replay = own_routes(model, batch), own_routes(model, batch, routes)
    assert route_mismatch(got["chosen"][real], chosen[real]) == 0.0
    assert route_mismatch(got["chosen_under_replay"][real], under_replay[real]) == 0.0
    assert torch.equal(got["own_replayed"], got["own"])


@pytest.mark.parametrize("packing", sorted(PACKINGS))
@pytest.mark.parametrize("layout", sorted(REPLAY_LAYOUTS))
def test_megatron_update_with_the_balance_loss_equals_fsdp2(
    replays: dict[str, Any], layout: str, packing: str
) -> None:
    """One update under replay with the routers' balance loss added to the policy's, also over
    two pipeline stages (each stage's routers backpropagate their own share): the loss, the
    balance metric, the gradient norm (the routers' gradient included) and the log-probs after
    the step equal fsdp2's, whose balance loss is checked against a hand-written one
    (tests/test_moe.py)."""
    loss, norm, after, aux = replays[layout][packing]["update"]
    want_loss, want_norm, want_after, want_aux = replays["fsdp2"][packing]["update"]
    assert aux == pytest.approx(want_aux, rel=1e-5) and aux > 1.0  # top_k (2) when balanced
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert norm == pytest.approx(want_norm, rel=1e-5)
    # Adam's first step divides each gradient by its own magnitude: rounding-level gradient
    # differences of near-zero entries move the weights by more than that
    assert float((after - want_after).abs().max()) <= 1e-4


def test_a_shared_expert_family_replays_and_updates_as_fsdp2(folders: dict[str, str]) -> None:
    """The Qwen2-MoE (a gated shared expert beside the routed ones, top-k not renormalised) at
    EP2 x TP2, packed: replayed log-probs are transformers' with the routes, the routers' own
    choice is returned, and an update with the balance loss equals fsdp2's."""
    from engine_core.moe import route_mismatch
    from engine_core.testing.moe import own_routes

    given = _routed("qwen2_moe", folders["qwen2_moe"])
    model, batch, routes = given["model"], given["batch"], given["routes"]
    runs = {
        backend: run_distributed(
            _replaying,
            world,
            folders["qwen2_moe"],
            backend,
            sizes,
            batch,
            routes,
            ("packed",),
            preload=PRELOAD,
        )[0]["packed"]
        for backend, world, sizes in (("fsdp2", 1, {}), ("megatron", *REPLAY_LAYOUTS["ep2_tp2"]))
    }
    got, want_update = runs["megatron"], runs["fsdp2"]["update"]
    want, _ = plain_log_probs(model, batch, routes)
    assert float((got["replayed"] - want).abs().max()) <= 1e-5
    real = batch["attention_mask"].bool()
    assert route_mismatch(got["chosen"][real], own_routes(model, batch)[real]) == 0.0
    loss, norm, after, aux = got["update"]
    assert loss == pytest.approx(want_update[0], rel=1e-5)
    assert norm == pytest.approx(want_update[1], rel=1e-5)
    assert aux == pytest.approx(want_update[3], rel=1e-5)
    assert float((after - want_update[2]).abs().max()) <= 1e-4


def _recomputed(rank: int, world: int, folder: str, batch: Any, routes: Any) -> Any:
    from engine_core.batch import ROUTED_EXPERTS, with_meta

    out: dict[str, Any] = {}
    for checkpointing in (False, True):
        engine = build(
            "megatron",
            model={"path": folder, "gradient_checkpointing": checkpointing},
            optim=OPTIM,
            expert_parallel_size=2,
            pipeline_parallel_size=2,
            **PACKINGS["padded"],  # micro-batches of 2 rows through the 1F1B schedule
        )
        engine.set_loss_fn(_policy)
        given = with_meta(batch, moe_aux=BALANCE)
        given[ROUTED_EXPERTS] = routes
        with engine.train_mode():
            result = engine.forward_backward_step(engine.shard_data(given))
            norm = engine.optimizer_step()
        out[checkpointing] = (result.loss, norm, forward(engine, batch.clone())[LOG_PROBS])
    return out


def test_replay_under_megatrons_full_recompute_equals_replay_without(
    replays: dict[str, Any], folders: dict[str, str]
) -> None:
    """``model.gradient_checkpointing`` (megatron-core's full recompute, each layer run again in
    the backward) under replay, EP2 x PP2, micro-batches through the 1F1B schedule: the update's
    loss (the balance loss included), gradient norm and the log-probs after it are those of
    the same update without recompute, bit for bit (each recomputed router takes the experts
    its forward took, and attaches its balance loss again, now with its graph)."""
    out = run_distributed(
        _recomputed,
        4,
        folders["qwen3_moe"],
        replays["batch"],
        replays["routes"],
        preload=PRELOAD,
    )[0]
    plain, recomputed = out[False], out[True]
    assert recomputed[0] == plain[0] and recomputed[1] == plain[1]
    assert torch.equal(recomputed[2], plain[2])


def _misrouted(rank: int, world: int, folder: str, batch: Any, routes: Any) -> list[str]:
    from engine_core.batch import ROUTED_EXPERTS

    engine = build("megatron", model={"path": folder}, expert_parallel_size=2)
    before = {n: t.clone() for n, t in engine.named_full_params()}
    messages = []
    for bad in (
        routes[:, :, :1],  # one layer of two
        routes[..., :1],  # top-1 of top-2
        routes.float(),
        routes + 8,  # expert 8 of 0..7
        torch.zeros_like(routes),  # an expert twice for a token
    ):
        given = batch.clone()
        given[ROUTED_EXPERTS] = bad
        try:
            forward(engine, given)
        except Exception as e:  # noqa: BLE001 - the message is the result
            messages.append(str(e))
    after = dict(engine.named_full_params())
    assert all(torch.equal(before[n], after[n]) for n in before)
    return messages


def test_misshaped_routes_are_refused_before_any_state_changes(
    replays: dict[str, Any], folders: dict[str, str]
) -> None:
    messages = run_distributed(
        _misrouted, 2, folders["qwen3_moe"], replays["batch"], replays["routes"], preload=PRELOAD
    )[0]
    assert len(messages) == 5
    assert "layers=2, top_k=2" in messages[0] and ", 16, 1, 2)" in messages[0]
    assert ", 16, 2, 1)" in messages[1]
    assert "integer expert ids" in messages[2]
    assert "outside 0..7" in messages[3]
    assert "an expert twice" in messages[4]


def _dense_given_routes(rank: int, world: int, routes: Any) -> str:
    from engine_core.batch import ROUTED_EXPERTS
    from engine_core.testing.models import TINY_QWEN3

    engine = build("megatron", model={"config": dict(TINY_QWEN3)})
    batch = eval_batch()
    batch[ROUTED_EXPERTS] = routes
    try:
        forward(engine, batch)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return str(e)
    return "replayed"


def test_routes_given_to_a_dense_model_are_refused() -> None:
    shape = tuple(eval_batch()["input_ids"].shape)
    routes = torch.zeros(*shape, 2, 2, dtype=torch.int64)
    (message,) = run_distributed(_dense_given_routes, 1, routes, preload=PRELOAD)
    assert "this model is dense" in message
