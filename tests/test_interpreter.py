"""Rollout replicas in another interpreter: the frames that cross, the checks before start-up,
and the failures a trainer must survive.

The replicas here run in this test's own interpreter, started by path as any other would be:
the transport (pipes of engine-core frames, no pickle, weights relayed by this process) is the
one another environment gets. ``ENGINE_CORE_TEST_OTHER_PYTHON`` names an interpreter with
another torch, for the test that runs a job against it.
"""

from __future__ import annotations

import json
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_core_hf.rollout import HFRolloutConfig
from tensordict import NonTensorData, NonTensorStack, TensorDict

from engine_core.batch import BatchMeta
from engine_core.capabilities import Capability
from engine_core.config import ModelConfig
from engine_core.configio import apply_overrides, load_yaml
from engine_core.errors import BatchError, ConfigError, DispatchError, WeightSyncError
from engine_core.executors.interpreter import check_interpreter
from engine_core.models import build_model
from engine_core.plugins import load_plugins
from engine_core.remote_rollout import ProcessRollout
from engine_core.rollout import SamplingParams, WeightBucket, sent_buckets
from engine_core.wire import MAGIC, WireError, decode, encode
from engine_core_roles.jobs.cli import RECIPES
from engine_core_roles.jobs.rl.run import run_rl_job
from tests._models import TINY_QWEN2


def test_every_kind_of_value_crosses_and_comes_back_equal() -> None:
    w = torch.randn(4, 3)
    td = TensorDict(
        {
            "ids": torch.arange(6).view(3, 2),
            "bf": torch.randn(3).bfloat16(),
            "flag": torch.tensor([True, False, True]),
            "inner": TensorDict({"x": torch.zeros(3, 0)}, batch_size=[3]),
        },
        batch_size=[3],
    )
    td["reason"] = NonTensorStack.from_list(["stop", "length", "stop"])
    td["meta"] = NonTensorData(BatchMeta(temperature=0.5), batch_size=[3])
    value = {
        "plain": [None, True, 3, 2.5, "s", float("inf")],
        "tuple": (1, (2, "x")),
        "set": frozenset({Capability.VALUE_HEAD}),
        "tied": [w, w, w.t()],  # views of one storage travel as copies of their own
        "scalar": torch.tensor(7),
        "int_keys": {1: "a", (2, 3): "b"},
        "dollar": {"$t": "not a tensor"},
        "params": SamplingParams(n=2, temperature=0.7, seed=3),
        "bucket": WeightBucket(("a",), ((4, 3),), "abc"),
        "td": td,
    }
    back = decode(encode(value))
    assert back["plain"][:5] == value["plain"][:5] and back["plain"][5] == float("inf")
    assert back["tuple"] == (1, (2, "x")) and back["set"] == frozenset({Capability.VALUE_HEAD})
    assert all(torch.equal(a, b) for a, b in zip(back["tied"], value["tied"], strict=True))
    assert back["scalar"].shape == () and int(back["scalar"]) == 7
    assert back["int_keys"] == {1: "a", (2, 3): "b"} and back["dollar"] == {"$t": "not a tensor"}
    assert back["params"] == value["params"] and back["bucket"] == value["bucket"]
    got = back["td"]
    assert got.batch_size == td.batch_size
    for key in ("ids", "bf", "flag"):
        assert torch.equal(got[key], td[key]) and got[key].dtype == td[key].dtype
    assert got["inner", "x"].shape == (3, 0)
    assert got["reason"].tolist() == ["stop", "length", "stop"]
    assert got.get_non_tensor("meta") == BatchMeta(temperature=0.5)


@pytest.mark.parametrize(
    "value, match",
    [
        (object(), "cannot send a builtins.object"),
        (pickle, "cannot send a builtins.module"),
        ({"cfg": ModelConfig(config=dict(TINY_QWEN2))}, "engine_core.config.ModelConfig"),
    ],
)
def test_what_is_not_plain_data_is_refused_when_sent(value: Any, match: str) -> None:
    with pytest.raises(WireError, match=match):
        encode(value)


def _frame(header: dict[str, Any]) -> bytes:
    body = json.dumps(header).encode()
    return MAGIC + len(body).to_bytes(4, "big") + (0).to_bytes(8, "big") + body


@pytest.mark.parametrize(
    "frame, match",
    [
        (pickle.dumps({"a": 1}), "not an engine-core frame|shorter than"),
        (b"ECW1" + b"\x00" * 3, "shorter than its own prefix"),
        (encode([1, 2, 3])[:-1], "truncated or corrupted"),
        (b"XXXX" + encode([1])[4:], "not an engine-core frame"),
        (_frame({"$model": "os.system", "data": "echo"}), "not on the allow-list"),
        (_frame({"$record": "subprocess.Popen", "fields": {}}), "not on the allow-list"),
        (_frame({"$eval": "1"}), "unknown tag"),
        (_frame({"$t": "0"}), "its blob lacks"),
    ],
    ids=["pickle", "short", "truncated", "magic", "model", "record", "tag", "tensor"],
)
def test_a_frame_that_is_not_ours_is_refused_when_read(frame: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode(frame)


def test_a_flipped_byte_in_the_tensor_header_is_refused() -> None:
    # (a flipped byte of the tensors' own data is what the weight checksums catch, end to end)
    frame = bytearray(encode({"w": torch.arange(8, dtype=torch.float32)}))
    header_len = int.from_bytes(frame[4:8], "big")
    frame[16 + header_len + 2] ^= 0xFF  # inside the safetensors header's length or JSON
    with pytest.raises(WireError, match="corrupted"):
        decode(bytes(frame))


def _fake_python(tmp_path: Path, probe: dict[str, Any]) -> str:
    """An executable that answers the probe with ``probe`` (an environment as it reports
    itself), for the checks that read that answer."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\necho 'ENGINE_CORE_PROBE {json.dumps(probe)}'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_interpreters_that_cannot_host_the_rollout_are_refused_in_one_sentence(
    tmp_path: Path,
) -> None:
    from engine_core import __version__

    ok = {"python": "3.11.7", "torch": "2.13.0", "engine_core": __version__, "rollouts": ["hf"]}
    cases = [
        (str(tmp_path / "missing" / "python"), "is not an executable file"),
        (_fake_python(tmp_path / "a", {**ok, "engine_core": "0.0.1"}), "engine-core 0.0.1"),
        (_fake_python(tmp_path / "b", {**ok, "torch": "2.9.1+cu128"}), "torch 2.9.1.*outside"),
        (_fake_python(tmp_path / "c", {**ok, "rollouts": ["vllm"]}), "no plugin for rollout"),
    ]
    for path, match in cases:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with pytest.raises(ConfigError, match=match):
            check_interpreter(path, "hf")
    passed = Path(_fake_python(tmp_path / "d", ok))
    assert check_interpreter(str(passed), "hf")["torch"] == "2.13.0"
    # one that passed is not probed again (its probe now would refuse it)...
    was = passed.stat()
    passed.write_text(passed.read_text().replace('"hf"', '"vllm"'))
    os.utime(passed, ns=(was.st_atime_ns, was.st_mtime_ns))  # its file's time as it was
    assert check_interpreter(str(passed), "hf")["rollouts"] == ["hf"]
    # ...unless it was replaced at its path (another file there, or the same one changed)
    os.utime(passed, ns=(passed.stat().st_atime_ns, passed.stat().st_mtime_ns + 1_000_000))
    with pytest.raises(ConfigError, match="no plugin for rollout"):
        check_interpreter(str(passed), "hf")
    # one refused is probed again: what was missing, once installed, is seen at once
    fixed = Path(cases[-1][0])
    fixed.write_text(fixed.read_text().replace('"vllm"', '"hf"'))
    assert check_interpreter(str(fixed), "hf")["rollouts"] == ["hf"]
    # a real interpreter (this one) asked for the module the replicas' workers come from
    with pytest.raises(ConfigError, match=r"cannot import no_such_roles\.episodes.*install"):
        check_interpreter(sys.executable, "hf", worker_module="no_such_roles.episodes")
    assert "missing" not in check_interpreter(
        sys.executable, "hf", worker_module="engine_core_roles.episodes.rollout"
    )
    # a real Python without engine-core (nor torch): a bare virtual environment
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True
    )
    with pytest.raises(ConfigError, match=r"cannot import engine-core .*pip install engine-core"):
        check_interpreter(str(tmp_path / "bare" / "bin" / "python"), "hf")
    # and a job names the setting before building anything
    raw = apply_overrides(
        load_yaml(RECIPES / "grpo_tiny.yaml"),
        [f"output_dir={tmp_path / 'run'}", "rollout_python=/nowhere/python"],
    )
    with pytest.raises((ConfigError, ValueError), match="set rollout_placement=process"):
        run_rl_job(raw, load_plugins())
    assert not (tmp_path / "run").exists()


def _hf_config() -> HFRolloutConfig:
    return HFRolloutConfig(backend="hf", model=ModelConfig(config=dict(TINY_QWEN2)), seed=7)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(ModelConfig(config=dict(TINY_QWEN2))).state_dict()


@pytest.fixture(scope="module")
def other() -> Any:
    rollout = ProcessRollout(_hf_config(), replicas=1, timeout_s=120, python=sys.executable)
    yield rollout
    rollout.shutdown()


def test_a_bucket_changed_on_the_way_is_named_and_the_next_sync_goes_through(other: Any) -> None:
    good = list(sent_buckets(_weights(1).items(), 16 << 10))
    bucket, sent = good[1]
    tampered = [*good[:1], (bucket, "0" * len(sent)), *good[2:]]
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        other.load_weights(tampered)
    missing = good[:-1]
    with pytest.raises(WeightSyncError, match="never sent"):
        other.load_weights(missing)
    done = other.load_weights(good)  # the stream after a failed one starts in step
    assert [b.checksum for b in done] == [s for _, s in good]


def test_a_call_whose_arguments_do_not_decode_is_answered_and_the_replica_goes_on(
    other: Any,
) -> None:
    """Params that skipped validation fail to decode in the other interpreter (it rebuilds them
    with model_validate): that call gets the error, the replica stays up for the next one. The
    rollout itself refuses them before sending anything."""
    prompts = TensorDict(
        {
            "prompt_ids": torch.tensor([[5, 9, 13]]),
            "prompt_mask": torch.ones(1, 3, dtype=torch.long),
        },
        batch_size=[1],
    )
    bad = SamplingParams.model_construct(**{**SamplingParams().model_dump(), "max_new_tokens": 0})
    with pytest.raises(DispatchError, match="max_new_tokens"):
        other.worker_group.call_all("generate", prompts, bad)
    with pytest.raises(BatchError, match="max_new_tokens"):
        other.generate(prompts, bad)
    out = other.generate(prompts, SamplingParams(temperature=0, max_new_tokens=3))
    assert out["response_ids"].shape == (1, 3)


def test_a_replica_that_dies_mid_sync_is_named_and_the_sender_keeps_its_weights() -> None:
    rollout = ProcessRollout(_hf_config(), replicas=1, timeout_s=60, python=sys.executable)
    weights = _weights(2)
    before = {k: v.clone() for k, v in weights.items()}
    proc = rollout.worker_group._procs[0]  # type: ignore[attr-defined]

    def buckets() -> Any:
        for i, item in enumerate(sent_buckets(weights.items(), 16 << 10)):
            if i == 2:
                proc.kill()
                proc.join(5)
            yield item

    try:
        with pytest.raises(DispatchError, match=r"worker 0 died during 'weight_bucket'"):
            rollout.load_weights(buckets())
    finally:
        rollout.shutdown()
    assert all(torch.equal(weights[k], before[k]) for k in weights)


@pytest.mark.skipif(
    not os.environ.get("ENGINE_CORE_TEST_OTHER_PYTHON"),
    reason="set ENGINE_CORE_TEST_OTHER_PYTHON to an interpreter with engine-core and another torch",
)
def test_a_job_with_replicas_in_another_torch_learns_as_in_this_one(tmp_path: Path) -> None:
    other_python = os.environ["ENGINE_CORE_TEST_OTHER_PYTHON"]
    runs = {}
    for name, extra in (("here", []), ("other", [f"rollout_python={other_python}"])):
        raw = apply_overrides(
            load_yaml(RECIPES / "grpo_tiny.yaml"),
            [f"output_dir={tmp_path / name}", "steps=20", "rollout_placement=process", *extra],
        )
        runs[name] = run_rl_job(raw, load_plugins())
    assert runs["other"]["reward_last10"] == pytest.approx(runs["here"]["reward_last10"], abs=0.05)
