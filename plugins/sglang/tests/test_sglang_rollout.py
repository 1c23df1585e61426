"""The SGLang rollout.

On CPU hosts (everywhere this has run) these tests execute the rollout's pure pieces without
SGLang: the sampling-parameter mapping, request building, parsing of outputs shaped like SGLang
0.5.23's ``Engine.generate`` answers, the weight-bucket checks on a real tiny model's weights,
the plugin's registration, and the constructor's error when SGLang is missing. They do not run
SGLang: nothing here shows that the engine generates, loads weights or releases memory.

The tests marked ``gpu`` drive a real ``sglang.Engine`` and are skipped unless SGLang imports
and a CUDA device is visible: they have never run.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_core_sglang.rollout import (
    SGLangRollout,
    SGLangRolloutConfig,
    build_requests,
    check_result,
    parse_outputs,
    to_sglang_sampling_params,
)
from tensordict import TensorDict

from engine_core.capabilities import Capability
from engine_core.config import ModelConfig
from engine_core.errors import BatchError, ConfigError, WeightSyncError
from engine_core.rollout import (
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_SEED,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TRUNCATED,
    RolloutConfig,
    SamplingParams,
    confirm_bucket,
    model_weight_shapes,
    prompt_seeds,
    sent_buckets,
    tensor_checksum,
    verified_buckets,
)
from engine_core.testing.models import TINY_QWEN2

# Field names of sglang.srt.sampling.sampling_params.SamplingParams (0.5.23) that the mapping may
# use; a key outside them would be rejected by SGLang.
SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "stop_token_ids", "temperature", "top_p", "top_k", "n",
    "no_stop_trim", "skip_special_tokens", "sampling_seed", "ignore_eos",
}  # fmt: skip
SGLANG_AVAILABLE = importlib.util.find_spec("sglang") is not None


def prompts(rows: list[list[int]] | None = None) -> TensorDict:
    rows = rows or [[5, 9, 13, 2], [7, 3], [11, 12, 40]]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):  # left padding
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return TensorDict({PROMPT_IDS: ids, PROMPT_MASK: mask}, batch_size=[len(rows)])


def sglang_output(
    tokens: list[int], logps: list[float], finish: dict[str, Any] | None, prompt_tokens: int
) -> dict[str, Any]:
    """One item of ``Engine.generate``'s answer with ``skip_tokenizer_init=True`` and
    ``return_logprob=True``, as SGLang 0.5.23's tokenizer manager builds it."""
    return {
        "output_ids": list(tokens),
        "meta_info": {
            "id": "0f3c",
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "weight_version": "default",
            "num_retractions": 0,
            "input_token_logprobs": [],
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(logps, tokens, strict=True)],
            "output_token_logprobs_length": len(tokens),
            "reasoning_tokens": 0,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
        },
    }


def stop(token: int) -> dict[str, Any]:
    return {"type": "stop", "matched": token}


def length(n: int) -> dict[str, Any]:
    return {"type": "length", "length": n}


# -- sampling parameters --------------------------------------------------------------------
def test_sampling_params_mapping() -> None:
    params = SamplingParams(
        temperature=0.5, top_p=0.9, top_k=-1, max_new_tokens=7, n=3, stop_token_ids=[2]
    )
    sp = to_sglang_sampling_params(params)
    assert set(sp) <= SGLANG_SAMPLING_KEYS
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["max_new_tokens"]) == (0.5, 0.9, -1, 7)
    assert sp["n"] == 1  # n is expanded into separate requests
    assert sp["stop_token_ids"] == [2] and sp["no_stop_trim"] is True
    assert "sampling_seed" not in sp
    greedy = to_sglang_sampling_params(SamplingParams(temperature=0, top_k=5))
    assert (greedy["temperature"], greedy["top_k"]) == (0, 5)


def test_refuses_what_sglang_would_silently_change() -> None:
    with pytest.raises(ConfigError, match="deterministic_inference: true"):
        to_sglang_sampling_params(SamplingParams(seed=3))
    assert "sampling_seed" not in to_sglang_sampling_params(
        SamplingParams(seed=3), deterministic=True
    )  # seeds are per sample, set by build_requests
    with pytest.raises(ConfigError, match="temperature=0 for greedy"):
        to_sglang_sampling_params(SamplingParams(temperature=1e-7))


# -- requests -------------------------------------------------------------------------------
def test_requests_strip_left_padding_and_keep_a_prompts_samples_adjacent() -> None:
    req = build_requests(prompts(), SamplingParams(n=2, max_new_tokens=4))
    assert req.input_ids == [[5, 9, 13, 2]] * 2 + [[7, 3]] * 2 + [[11, 12, 40]] * 2
    assert len(req.sampling_params) == 6
    assert all(sp["n"] == 1 and sp["max_new_tokens"] == 4 for sp in req.sampling_params)
    assert req.sampling_params[0] is not req.sampling_params[1]


def test_requests_name_a_missing_key_and_refuse_an_empty_prompt() -> None:
    p = prompts()
    with pytest.raises(BatchError, match="needs 'prompt_mask'"):
        build_requests(TensorDict({PROMPT_IDS: p[PROMPT_IDS]}, batch_size=[3]), SamplingParams())
    with pytest.raises(BatchError, match="needs 'prompt_ids'"):
        build_requests(TensorDict({PROMPT_MASK: p[PROMPT_MASK]}, batch_size=[3]), SamplingParams())
    p[PROMPT_MASK][1] = 0
    with pytest.raises(BatchError, match=r"prompt\(s\) \[1\] are empty"):
        build_requests(p, SamplingParams())


def test_requests_refuse_a_token_id_outside_the_vocabulary() -> None:
    """An id at or past the vocabulary size kills SGLang's scheduler (found by the rollout
    kit on its CPU engine): the rollout refuses it before the engine sees it."""
    p = prompts()
    top = int(p[PROMPT_IDS].max())
    build_requests(p, SamplingParams(), vocab_size=top + 1)
    with pytest.raises(BatchError, match=str(top)):
        build_requests(p, SamplingParams(), vocab_size=top)


def test_deterministic_requests_get_distinct_reproducible_seeds() -> None:
    def seeds(params: SamplingParams) -> list[int]:
        req = build_requests(prompts(), params, deterministic=True)
        return [sp["sampling_seed"] for sp in req.sampling_params]

    a = seeds(SamplingParams(n=4, seed=7))
    assert a == seeds(SamplingParams(n=4, seed=7))  # reproducible
    assert len(set(a)) == 12  # one seed per sample: equal seeds would give equal samples
    assert all(0 <= s < 2**63 for s in a)  # SGLang accepts int64 seeds
    assert seeds(SamplingParams(n=4, seed=8)) != a
    assert len(set(seeds(SamplingParams(n=4)))) == 12
    # a share of the prompts carrying their seeds (as a replica gets it) seeds as the whole did
    whole = prompts()
    whole[PROMPT_SEED] = torch.tensor(prompt_seeds(whole, SamplingParams(seed=7)))
    part = build_requests(whole[1:], SamplingParams(n=4, seed=7), deterministic=True)
    assert [sp["sampling_seed"] for sp in part.sampling_params] == a[4:]


# -- responses ------------------------------------------------------------------------------
def test_outputs_become_the_contract_batch() -> None:
    p = prompts()
    outputs = [
        sglang_output([3, 8, 2], [-0.5, -1.0, -0.25], stop(2), 4),
        sglang_output([4, 4, 4, 4], [-0.1, -0.2, -0.3, -0.4], length(4), 4),
        sglang_output([2], [-2.0], stop(2), 2),
        sglang_output([9, 9, 1, 1], [-1.0, -1.0, -1.0, -1.0], length(4), 2),
        sglang_output([6, 2], [-0.75, -0.125], stop(2), 3),
        sglang_output([6, 7, 8, 9], [-0.5, -0.5, -0.5, -0.5], length(4), 3),
    ]
    out = parse_outputs(outputs, p, 2, pad_token_id=0)
    assert out.batch_size == torch.Size([6])
    assert torch.equal(out[PROMPT_IDS], p[PROMPT_IDS].repeat_interleave(2, 0))
    assert torch.equal(out[PROMPT_MASK], p[PROMPT_MASK].repeat_interleave(2, 0))
    assert out[RESPONSE_IDS].tolist() == [
        [3, 8, 2, 0], [4, 4, 4, 4], [2, 0, 0, 0], [9, 9, 1, 1], [6, 2, 0, 0], [6, 7, 8, 9],
    ]  # fmt: skip
    assert out[RESPONSE_MASK].sum(-1).tolist() == [3, 4, 1, 4, 2, 4]
    assert out[RESPONSE_IDS].dtype == torch.long and out[ROLLOUT_LOG_PROBS].dtype == torch.float32
    assert out[ROLLOUT_LOG_PROBS][0].tolist() == [-0.5, -1.0, -0.25, 0.0]
    assert out[ROLLOUT_LOG_PROBS][2].tolist() == [-2.0, 0.0, 0.0, 0.0]
    assert out[TRUNCATED].tolist() == [False, True] * 3


def test_a_stop_string_cuts_a_response_after_the_token_that_completes_it() -> None:
    """SGLang, started without its tokenizer, answers to the budget or a stop id; the rollout
    cuts each response at the first prefix whose text holds a string (token kept, log-probs
    with it, not truncated); a response that holds none is left as SGLang answered it."""
    from engine_core.stop_strings import stop_string_end

    texts = {3: "a", 8: "bc", 2: "d", 4: "x", 6: "b", 7: "c", 9: "cd"}

    def decode(ids: list[int]) -> str:
        return "".join(texts[t] for t in ids)

    outputs = [
        sglang_output([3, 8, 2], [-0.5, -1.0, -0.25], stop(2), 4),  # "abcd": "b" ends in 8
        sglang_output([4, 4, 4, 4], [-0.1, -0.2, -0.3, -0.4], length(4), 4),  # none
        sglang_output([6, 7, 9, 2], [-1.0, -2.0, -3.0, -4.0], length(4), 2),  # "b" at once
        sglang_output([4, 9, 2, 2], [-1.0, -2.0, -3.0, -4.0], length(4), 2),  # "cd" in one
        sglang_output([4, 7, 2], [-1.0, -2.0, -3.0], length(3), 3),  # "cd" over two tokens
        sglang_output([4, 4, 2], [-1.0, -1.0, -1.0], length(3), 3),  # "xxd": none
    ]
    out = parse_outputs(
        outputs,
        prompts(),
        2,
        stop_at=lambda ids: stop_string_end(decode, ids, ["b", "cd"]),
    )
    assert out[RESPONSE_MASK].sum(-1).tolist() == [2, 4, 1, 2, 3, 3]
    assert out[RESPONSE_IDS][0].tolist() == [3, 8, 0, 0]
    assert out[ROLLOUT_LOG_PROBS][3].tolist() == [-1.0, -2.0, 0.0, 0.0]
    assert out[TRUNCATED].tolist() == [False, True, False, False, False, True]


@pytest.mark.parametrize(
    ("finish", "match"),
    [
        ({"type": "abort", "message": "too long", "status_code": None}, "sample 1: too long"),
        ({"type": "cancelled"}, "unknown finish_reason"),
        (None, "unknown finish_reason"),
    ],
)  # fmt: skip
def test_aborted_or_unknown_finishes_are_refused(finish: Any, match: str) -> None:
    outputs = [sglang_output([1], [-1.0], length(1), n) for n in (4, 2, 3)]
    outputs[1] = sglang_output([1], [-1.0], finish, 2)
    with pytest.raises(BatchError, match=match):
        parse_outputs(outputs, prompts(), 1)


def test_outputs_that_do_not_line_up_are_refused() -> None:
    good = [sglang_output([1, 2], [-1.0, -2.0], length(2), n) for n in (4, 2, 3)]
    with pytest.raises(BatchError, match="returned 3 outputs for 3 prompts x n=2"):
        parse_outputs(good, prompts(), 2)
    swapped = [good[1], good[0], good[2]]  # a 2-token prompt's answer in prompt 0's slot
    with pytest.raises(BatchError, match="not in request order"):
        parse_outputs(swapped, prompts(), 1)
    short = [dict(o, meta_info=dict(o["meta_info"])) for o in good]
    short[2]["meta_info"]["output_token_logprobs"] = [(-1.0, 1, None)]
    with pytest.raises(BatchError, match="output 2: 2 tokens but 1 log-probs"):
        parse_outputs(short, prompts(), 1)
    wrong = [dict(o, meta_info=dict(o["meta_info"])) for o in good]
    wrong[0]["meta_info"]["output_token_logprobs"] = [(-1.0, 1, None), (-2.0, 7, None)]
    with pytest.raises(BatchError, match="output 0, token 1.*sampled token 2"):
        parse_outputs(wrong, prompts(), 1)
    bare = [
        dict(o, meta_info={k: v for k, v in o["meta_info"].items() if "logprob" not in k})
        for o in good
    ]
    with pytest.raises(BatchError, match="return_logprob=True"):
        parse_outputs(bare, prompts(), 1)


# -- weights --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from engine_core.models import build_model

    cfg = ModelConfig(config=dict(TINY_QWEN2))
    torch.manual_seed(0)
    return cfg, dict(build_model(cfg).state_dict())


def expected_of(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return model_weight_shapes(cfg)


def test_expected_weights_are_the_models_hf_names_and_shapes(tiny: Any) -> None:
    cfg, state = tiny
    assert expected_of(cfg) == {n: tuple(t.shape) for n, t in state.items()}


def test_buckets_of_a_real_model_are_verified_and_complete(tiny: Any) -> None:
    cfg, state = tiny
    expected = expected_of(cfg)
    done = []
    for handed, sent in verified_buckets(state.items(), expected, bucket_bytes=16 << 10):
        assert sent == tensor_checksum([(n, state[n]) for n, _ in handed])
        assert all(t.is_contiguous() and not t.requires_grad for _, t in handed)
        done.append(confirm_bucket(handed, sent))
    assert len(done) > 1
    assert [n for b in done for n in b.names] == list(state)
    assert all(len(b.names) == len(b.shapes) for b in done)


def test_broken_syncs_name_the_parameter(tiny: Any) -> None:
    cfg, state = tiny
    expected = expected_of(cfg)
    dropped = "model.layers.1.mlp.down_proj.weight"
    partial = [(n, t) for n, t in state.items() if n != dropped]
    buckets = verified_buckets(partial, expected, bucket_bytes=16 << 10)
    with pytest.raises(WeightSyncError, match=f"never sent: \\['{dropped}'\\]"):
        for _ in buckets:  # every bucket is handed over; the gap shows after the last one
            pass
    wrong = [(n, t.T if n == dropped else t) for n, t in state.items()]
    loaded: list[str] = []
    with pytest.raises(WeightSyncError, match=f"{dropped}: got \\(64, 32\\), expected \\(32, 64"):
        for handed, _ in verified_buckets(wrong, expected, bucket_bytes=16 << 10):
            loaded.extend(n for n, _ in handed)
    assert dropped not in loaded  # refused before being handed over
    with pytest.raises(WeightSyncError, match="lm_head.bias: got \\(64,\\), expected no such"):
        list(verified_buckets([("lm_head.bias", torch.zeros(64))], expected, 1 << 20))


def test_a_tensor_changed_after_sending_fails_its_checksum(tiny: Any) -> None:
    cfg, state = tiny
    buffer = {n: t.clone() for n, t in state.items()}  # a sender that reuses its buffers
    handed, sent = next(verified_buckets(buffer.items(), expected_of(cfg), bucket_bytes=1 << 30))
    buffer["model.norm.weight"].add_(1.0)  # overwritten before SGLang read it
    with pytest.raises(WeightSyncError, match="checksum mismatch in bucket .*model.norm.weight"):
        confirm_bucket(handed, sent)


class _FlushCacheReqOutput:  # the shape of SGLang's flush_cache() answer
    def __init__(self, success: bool, message: str = "") -> None:
        self.success, self.message = success, message


def test_sglang_results_are_checked() -> None:
    check_result("update_weights_from_tensor", (True, "Success"))
    check_result("flush_cache", _FlushCacheReqOutput(True))
    with pytest.raises(WeightSyncError, match="begin_weight_update failed: a weight-update"):
        check_result("begin_weight_update", (False, "a weight-update session is already open"))
    with pytest.raises(WeightSyncError, match="flush_cache failed: running requests"):
        check_result("flush_cache", _FlushCacheReqOutput(False, "running requests"))
    with pytest.raises(WeightSyncError, match="end_weight_update failed: None"):
        check_result("end_weight_update", None)


def test_routed_experts_are_read_per_moe_layer() -> None:
    """SGLang returns base64 int32 ``[tokens, every decoder layer, top_k]``; the rollout keeps
    the MoE layers (those with an ``mlp.gate``) and refuses what does not split."""
    import base64

    import numpy as np
    from engine_core_sglang.rollout import moe_layers, sglang_routes

    expected = {
        "model.layers.0.mlp.gate_proj.weight": (4, 4),  # a dense layer
        "model.layers.1.mlp.gate.weight": (8, 4),
        "model.layers.2.mlp.gate.weight": (8, 4),
    }
    assert moe_layers(expected) == [1, 2]
    with pytest.raises(ConfigError, match="no mixture-of-experts layer"):
        moe_layers({"model.layers.0.mlp.gate_proj.weight": (4, 4)})
    rows = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2)
    out = {"meta_info": {"routed_experts": base64.b64encode(rows.tobytes()).decode()}}
    got = sglang_routes(0, out, 3, 2, [1, 2])
    assert got.dtype == torch.int64 and torch.equal(got, torch.from_numpy(rows[:, 1:]).long())
    with pytest.raises(BatchError, match="do not split into rows of 3 layers x top_k=4"):
        sglang_routes(0, out, 3, 4, [1, 2])
    with pytest.raises(BatchError, match="has no 'routed_experts'"):
        sglang_routes(3, {"meta_info": {}}, 3, 2, [1, 2])


# -- plugin and constructor -----------------------------------------------------------------
def test_registered_with_its_capabilities() -> None:
    from engine_core.plugins import load_plugins

    manager = load_plugins()
    spec = manager.get_rollout("sglang")
    assert spec.capabilities == frozenset(
        {
            Capability.LOGPROBS,
            Capability.SLEEP,
            Capability.ROUTING_REPLAY,
            Capability.LORA,
            Capability.STOP_STRINGS,
            Capability.VISION,
            Capability.TOP_LOGPROBS,
        }
    )
    assert Capability.CPU not in spec.capabilities
    assert spec.distribution == "engine-core-sglang"
    assert spec.load_class() is SGLangRollout
    assert spec.load_config_class() is SGLangRolloutConfig
    info = {p.name: p for p in manager.plugins()}["sglang"]
    assert info.status == "ok" and [b.name for b in info.backends] == ["sglang"]


def test_plugin_module_imports_neither_sglang_nor_torch() -> None:
    code = (
        "import sys, engine_core_sglang.plugin as p; p.SGLANG_CAPABILITIES; "
        "print(sorted(m for m in ('sglang', 'torch') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_config_is_checked_before_anything_is_built() -> None:
    with pytest.raises(TypeError, match="SGLangRolloutConfig"):
        SGLangRollout(RolloutConfig(backend="sglang", model={"config": dict(TINY_QWEN2)}))


@pytest.mark.skipif(SGLANG_AVAILABLE, reason="SGLang is installed here")
def test_without_sglang_the_constructor_says_how_to_install_it() -> None:
    cfg = SGLangRolloutConfig(backend="sglang", model={"config": dict(TINY_QWEN2)})
    with pytest.raises(ImportError, match=r"pip install 'engine-core-sglang\[gpu\]'") as err:
        SGLangRollout(cfg)
    assert "make sglang-env" in str(err.value)


# -- the real engine: on a GPU (never run), or on CPU in SGLang's own environment ----------
# On CPU the rollout is a replica started in that environment's interpreter (`make sglang-env`,
# or ENGINE_CORE_SGLANG_PYTHON), reached as the trainer reaches it: through rollout_python, with
# everything crossing as plain data (engine_core.wire). This process keeps its own torch.
def _sglang_python() -> str | None:
    import os
    from pathlib import Path

    default = Path(__file__).resolve().parents[3] / ".venv-sglang" / "bin" / "python"
    return os.environ.get("ENGINE_CORE_SGLANG_PYTHON") or (
        str(default) if default.is_file() else None
    )


SGLANG_PYTHON = _sglang_python()
LIVE = [
    pytest.param(
        "gpu",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not (SGLANG_AVAILABLE and torch.cuda.is_available()),
                reason="needs SGLang and a CUDA device",
            ),
        ],
    ),
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            SGLANG_PYTHON is None,
            reason="needs SGLang's CPU environment: make sglang-env (or ENGINE_CORE_SGLANG_PYTHON)",
        ),
    ),
]
# head size 64 (128 hidden / 2 heads): supported by SGLang's attention kernels
GPU_QWEN2: dict[str, Any] = {**TINY_QWEN2, "hidden_size": 128, "intermediate_size": 256,
                             "num_attention_heads": 2, "num_key_value_heads": 1,
                             "max_position_embeddings": 256}  # fmt: skip
TEMPERATURE = 0.8
# fp32 on both sides: GPU kernels reduce in another order; on CPU SGLang's torch_native path
ATOL = {"gpu": 2e-3, "cpu": 1e-4}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine_core.models import build_model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("sglang-model")
    model: Any = build_model(ModelConfig(config=dict(GPU_QWEN2)))
    model.save_pretrained(path)
    return str(path)


def _live(where: str, folder: str, **settings: Any) -> Any:
    """A live SGLang rollout: in this process on a GPU, or a replica in SGLang's environment."""
    from engine_core.remote_rollout import ProcessRollout

    dtype = settings.pop("dtype", "float32")
    model = {"path": folder, **settings.pop("model", {})}
    common: dict[str, Any] = {"backend": "sglang", "model": model, "dtype": dtype}
    if where == "gpu":
        return SGLangRollout(
            SGLangRolloutConfig(
                **common,
                attention_backend="triton",
                disable_cuda_graph=True,
                mem_fraction_static=0.3,
                **settings,
            )
        )
    config = SGLangRolloutConfig(
        **common,
        device="cpu",
        mem_fraction_static=0.05,
        max_total_tokens=4096,
        context_length=256,
        **settings,
    )
    assert SGLANG_PYTHON is not None
    return ProcessRollout(config, replicas=1, timeout_s=600, python=SGLANG_PYTHON)


@pytest.fixture(scope="module", params=LIVE)
def live(request: pytest.FixtureRequest, folder: str) -> Iterator[tuple[str, Any]]:
    rollout = _live(request.param, folder)
    yield request.param, rollout
    rollout.shutdown()


def trainer(folder: str) -> Any:
    from engine_core.testing.models import registered_engine

    optim = {"lr": 5e-2, "clip_grad": None}
    return registered_engine("reference", model={"path": folder}, optim=optim)


def trainer_log_probs(engine: Any, out: TensorDict, temperature: float) -> torch.Tensor:
    from engine_core.batch import BatchMeta, make_batch, set_meta
    from engine_core.testing.kit import forward

    ids = torch.cat([out[PROMPT_IDS], out[RESPONSE_IDS]], 1)
    mask = torch.cat([out[PROMPT_MASK], out[RESPONSE_MASK]], 1)
    batch = make_batch(ids * mask, mask)
    set_meta(batch, BatchMeta(temperature=temperature))
    lp = forward(engine, batch)["log_probs"]
    return lp[:, out[PROMPT_IDS].shape[1] :] * out[RESPONSE_MASK]


def test_greedy_equals_transformers_generate(live: tuple[str, Any], folder: str) -> None:
    from transformers import AutoModelForCausalLM

    _, rollout = live
    out = rollout.generate(prompts(), SamplingParams(temperature=0, max_new_tokens=6))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    p = prompts()
    for i in range(3):
        real = p[PROMPT_IDS][i][p[PROMPT_MASK][i].bool()].unsqueeze(0)
        with torch.no_grad():
            seq = model.generate(real, max_new_tokens=6, do_sample=False, pad_token_id=0)
        n = int(out[RESPONSE_MASK][i].sum())
        assert out[RESPONSE_IDS][i, :n].tolist() == seq[0, real.shape[1] :].tolist()


def test_sampled_log_probs_match_a_trainer_forward(live: tuple[str, Any], folder: str) -> None:
    where, rollout = live
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=8, n=2, stop_token_ids=[3])
    out = rollout.generate(prompts(), params)
    assert out.batch_size[0] == 6
    got = out[ROLLOUT_LOG_PROBS]
    want = trainer_log_probs(trainer(folder), out, TEMPERATURE)
    assert (got[out[RESPONSE_MASK].bool()] < 0).all()
    gap = float((got - want).abs().max())
    print(f"sglang {where} fp32 log-prob gap to the trainer: {gap:.3g}")
    assert gap <= ATOL[where]
    for row, mask in zip(out[RESPONSE_IDS], out[RESPONSE_MASK], strict=True):  # stops kept
        assert 3 not in row[mask.bool()].tolist()[:-1]


# the largest |SGLang - fsdp2 actor| log-prob of a sampled token, same weights, both sides in
# the dtype: fp32 is rounding; bf16 is two different bf16 computations (measured on CPU:
# 7.2e-7 and 2.8e-3 on this model)
DTYPE_ATOL = {"float32": 1e-4, "bfloat16": 0.05}


@pytest.mark.parametrize("dtype", sorted(DTYPE_ATOL))
@pytest.mark.parametrize("where", LIVE)
def test_log_probs_against_an_fsdp2_actor(where: str, dtype: str, folder: str) -> None:
    """Per-sample seeded samples from SGLang, scored by an fsdp2 actor holding the same weights
    in the same dtype: the gap stated in fp32 and bf16."""
    from engine_core.testing.models import registered_engine

    rollout = _live(where, folder, dtype=dtype, deterministic_inference=True)
    try:
        params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=8, n=2, seed=5)
        out = rollout.generate(prompts(), params)
    finally:
        rollout.shutdown()
    actor = registered_engine("fsdp2", model={"path": folder, "dtype": dtype})
    want = trainer_log_probs(actor, out, TEMPERATURE).float()
    mask = out[RESPONSE_MASK].bool()
    gap = float((out[ROLLOUT_LOG_PROBS].float() - want).abs()[mask].max())
    print(f"sglang {where} {dtype} log-prob gap to an fsdp2 actor: {gap:.3g}")
    assert gap <= DTYPE_ATOL[dtype]


def test_sync_after_a_training_step_is_verified_and_followed(
    live: tuple[str, Any], folder: str
) -> None:
    """After one optimizer step a skipped sync shows in the log-probs, a verified sync removes
    the difference, and a broken sync blocks generation until a full one."""
    from engine_core.batch import make_batch

    where, rollout = live
    engine = trainer(folder)
    with engine.train_mode():
        engine.forward_backward_step(make_batch(torch.randint(1, 64, (4, 12))))
        engine.optimizer_step()
        engine.optimizer_zero_grad()
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    stale = rollout.generate(prompts(), params)
    skipped = (stale[ROLLOUT_LOG_PROBS] - trainer_log_probs(engine, stale, 1.0)).abs().max()
    assert skipped > 1e-2
    buckets = rollout.load_weights(sent_buckets(engine.named_full_params(), 64 << 10))
    assert len(buckets) > 1
    fresh = rollout.generate(prompts(), params)
    synced = (fresh[ROLLOUT_LOG_PROBS] - trainer_log_probs(engine, fresh, 1.0)).abs().max()
    assert synced <= ATOL[where]
    full = dict(engine.named_full_params())
    partial = [(n, t) for n, t in full.items() if n != "model.norm.weight"]
    with pytest.raises(WeightSyncError, match="never sent"):
        rollout.load_weights(sent_buckets(partial))
    with pytest.raises(WeightSyncError, match="load the full weights again"):
        rollout.generate(prompts(), params)
    rollout.load_weights(sent_buckets(full.items()))
    assert rollout.generate(prompts(), params).batch_size[0] == 3


def test_release_and_resume(live: tuple[str, Any], folder: str) -> None:
    """On a GPU release() frees memory and, without a CPU backup, blocks generation until
    resume() and a full sync; on CPU (no memory saver) both leave the weights in place."""
    where, rollout = live
    rollout.release()
    if where == "gpu":
        with pytest.raises(WeightSyncError, match="release\\(\\) discarded"):
            rollout.generate(prompts(), SamplingParams(max_new_tokens=2))
    rollout.resume()
    if where == "gpu":
        rollout.load_weights(sent_buckets(trainer(folder).named_full_params()))
    assert rollout.generate(prompts(), SamplingParams(max_new_tokens=2)).batch_size[0] == 3


@pytest.mark.parametrize("where", LIVE)
def test_seeded_samples_repeat_per_prompt(where: str, folder: str) -> None:
    rollout = _live(where, folder, deterministic_inference=True)
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=11)
        a, b = rollout.generate(prompts(), params), rollout.generate(prompts(), params)
        assert torch.equal(a[RESPONSE_IDS], b[RESPONSE_IDS])
        other = rollout.generate(prompts(), params.model_copy(update={"seed": 12}))
        assert not torch.equal(a[RESPONSE_IDS], other[RESPONSE_IDS])
        # a prompt's samples follow its seed, not the batch: the last prompt alone, seeded as
        # it was in the batch, draws the same
        p = prompts()
        p["prompt_seed"] = torch.tensor(prompt_seeds(p, params), dtype=torch.int64)
        alone = rollout.generate(p[2:], params)
        width = alone[RESPONSE_IDS].shape[1]
        assert torch.equal(alone[RESPONSE_IDS], a[RESPONSE_IDS][4:, :width])
    finally:
        rollout.shutdown()


LORA = {"rank": 4, "alpha": 8.0}


@pytest.mark.parametrize("where", LIVE)
def test_a_lora_policy_is_served_as_adapters(where: str, folder: str) -> None:
    """With ``model.lora`` SGLang serves the policy's adapters itself: the peft tensors once (the
    base through the weight update, the adapters as SGLang's LoRA), then the adapters alone,
    each version followed exactly; a broken adapter stream blocks generation until a good one."""
    from engine_core.batch import make_batch
    from engine_core.models import is_adapter_name
    from engine_core.testing.models import nll_loss, registered_engine

    actor = registered_engine(
        "fsdp2", model={"path": folder, "lora": LORA}, optim={"lr": 5e-2, "clip_grad": None}
    )
    with torch.no_grad():  # lora_B starts at zero: move the adapters so they matter
        for name, p in actor.require_module().named_parameters():
            if is_adapter_name(name):
                p.add_(torch.randn_like(p) * 0.2)
    rollout = _live(where, folder, model={"lora": LORA})
    try:
        expected = rollout.expected_weights()
        adapters = {n for n in expected if is_adapter_name(n)}
        assert adapters and len(adapters) < len(expected)
        params = SamplingParams(temperature=1.0, max_new_tokens=8)
        base = rollout.generate(prompts(), params)  # no adapter served yet: the base model
        assert (base[ROLLOUT_LOG_PROBS] - trainer_log_probs(actor, base, 1.0)).abs().max() > 1e-2

        first = rollout.load_weights(sent_buckets(actor.named_weights("peft"), 64 << 10))
        assert {n for b in first for n in b.names} == set(expected)
        out = rollout.generate(prompts(), params)
        assert (out[ROLLOUT_LOG_PROBS] - trainer_log_probs(actor, out, 1.0)).abs().max() < ATOL[
            where
        ]

        with actor.train_mode():  # a training step moves the adapters alone
            actor.set_loss_fn(nll_loss)
            actor.forward_backward_step(make_batch(torch.randint(1, 64, (4, 12))))
            actor.optimizer_step()
            actor.optimizer_zero_grad()
        stale = rollout.generate(prompts(), params)
        assert (stale[ROLLOUT_LOG_PROBS] - trainer_log_probs(actor, stale, 1.0)).abs().max() > 1e-3
        sent = list(actor.named_weights("adapters"))
        assert {n for n, _ in sent} == adapters
        second = rollout.load_weights(sent_buckets(sent))
        assert {n for b in second for n in b.names} == adapters
        out = rollout.generate(prompts(), params)
        gap = float((out[ROLLOUT_LOG_PROBS] - trainer_log_probs(actor, out, 1.0)).abs().max())
        print(f"log-prob gap after an adapters-only sync: {gap:.3g}")
        assert (out[ROLLOUT_LOG_PROBS] - trainer_log_probs(actor, out, 1.0)).abs().max() < ATOL[
            where
        ]

        left_out = sorted(adapters)[0]
        with pytest.raises(WeightSyncError, match="never sent"):
            rollout.load_weights(sent_buckets([(n, t) for n, t in sent if n != left_out]))
        with pytest.raises(WeightSyncError, match="load the full weights again"):
            rollout.generate(prompts(), params)
        rollout.load_weights(sent_buckets(sent))
        assert rollout.generate(prompts(), params).batch_size[0] == 3
    finally:
        rollout.shutdown()


# head size 64 as above; an expert intermediate size SGLang's CPU MoE takes as it is
SGLANG_QWEN3_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 71,
    "hidden_size": 128,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("where", LIVE)
def test_a_mixture_of_experts_returns_the_experts_it_routed_to(where: str, tmp_path: Any) -> None:
    """Started with rollout.return_routes (enable_return_routed_experts), SGLang returns per
    sampled sequence the experts every token went to in every MoE layer: placed under their
    tokens, they are transformers' own choice on the same weights (fp32), and an fsdp2 engine
    replaying them scores every sampled token as SGLang did."""
    from engine_core.batch import ROUTED_EXPERTS, BatchMeta, make_batch, set_meta
    from engine_core.models import build_model
    from engine_core.moe import RouteRecorder, route_mismatch
    from engine_core.testing.kit import forward
    from engine_core.testing.models import registered_engine

    torch.manual_seed(0)
    model: Any = build_model(ModelConfig(config=dict(SGLANG_QWEN3_MOE))).eval()
    model.save_pretrained(tmp_path)
    rollout = _live(where, str(tmp_path), return_routes=True)
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, return_routes=True)
        out = rollout.generate(prompts(), params)
    finally:
        rollout.shutdown()
    routes, width = out[ROUTED_EXPERTS], out[PROMPT_IDS].shape[1]
    assert routes.shape == (6, width + out[RESPONSE_IDS].shape[1], 2, 2)
    for i in range(6):
        p, r = out[PROMPT_MASK][i].bool(), out[RESPONSE_MASK][i].bool()
        seq = torch.cat([out[PROMPT_IDS][i][p], out[RESPONSE_IDS][i][r]])
        with torch.no_grad(), RouteRecorder(model) as own:
            model(seq[None])
        sampled = torch.cat([routes[i, :width][p], routes[i, width:][r]])
        # the last sampled token is never fed back: SGLang has no route for it
        assert route_mismatch(own.routes().transpose(0, 1)[:-1], sampled[:-1]) == 0.0
    engine = registered_engine("fsdp2", model={"path": str(tmp_path)})
    ids = torch.cat([out[PROMPT_IDS], out[RESPONSE_IDS]], 1)
    mask = torch.cat([out[PROMPT_MASK], out[RESPONSE_MASK]], 1)
    batch = make_batch(ids * mask, mask)
    set_meta(batch, BatchMeta())
    batch[ROUTED_EXPERTS] = routes
    got = forward(engine, batch)["log_probs"][:, width:]
    gap = (got - out[ROLLOUT_LOG_PROBS]).abs()[out[RESPONSE_MASK].bool()].max()
    assert float(gap) <= 1e-4
