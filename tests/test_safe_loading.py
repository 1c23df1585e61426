"""Files and messages engine-core reads are parsed, never executed (issue 15).

Every kind of state file the project writes (reference and fsdp2 engine state, the GRPO job's
trainer state; on a local path and an fsspec ``memory://`` URL) is replaced by a pickle whose
unpickling would create a marker folder: loading must raise a :class:`CheckpointError` naming the
file and leave no marker. Damaged files fail the same way. The weight-sync wire format is JSON
with a fixed schema: malformed or pickled bytes are refused with a clear error.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import pickle
import re
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

from engine_core.checkpoint import load_torch, save_torch
from engine_core.errors import CheckpointError, RunFailed, WeightSyncError
from engine_core.executors.base import free_port
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from engine_core.weight_sync import (
    PROTOCOL_VERSION,
    WeightSyncGroup,
    _Abort,
    _End,
    _header,
    _Verdict,
    decode_message,
    encode_message,
    receive_weights,
    send_weights,
)
from engine_core_roles.jobs.cli import RECIPES
from tests._dist import run_distributed
from tests._models import engine_config, nll_loss, registered_engine, train_steps


class _Planted:
    """Unpickling this creates the folder ``marker``: proof that a file ran instead of parsing."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (self.marker,))


def _planted_bytes(kind: str, marker: str) -> bytes:
    payload = {"step": 3, "rng": _Planted(marker)}
    if kind == "pickle":  # protocol 2: torch's own; the refusal is then at the GLOBAL itself
        return pickle.dumps(payload, protocol=2)
    buf = io.BytesIO()
    torch.save(payload, buf)  # a torch zip archive whose data.pkl holds the payload
    return buf.getvalue()


def _write(location: str, data: bytes) -> None:
    with fsspec.open(location, "wb") as f:
        f.write(data)


def _read(location: str) -> bytes:
    with fsspec.open(location, "rb") as f:
        return bytes(f.read())


def _damaged(data: bytes) -> dict[str, bytes]:
    flipped = bytearray(data)
    for i in range(0, len(flipped), 7):
        flipped[i] ^= 0xFF
    return {"truncated": data[: len(data) // 2], "flipped": bytes(flipped), "empty": b""}


def _reseal(state_file: str) -> None:
    """Rewrite the checkpoint's manifest over its current files, as an attacker who can write
    the folder would: the manifest catches damage, the state-file parser what gets past it."""
    from engine_core.checkpoint import MANIFEST_FILE, write_manifest

    parent = state_file.rsplit("/", 1)[0]
    for folder in (parent, parent.rsplit("/", 1)[0]):  # an engine's folder, or a job's part
        fs, path = fsspec.core.url_to_fs(f"{folder}/{MANIFEST_FILE}")
        if fs.exists(path):  # a checkpoint folder, not a lone state file
            step = json.loads(_read(f"{folder}/{MANIFEST_FILE}"))["step"]
            write_manifest(folder, step=step)
            return


def _refusals(state_file: str, load: Any, marker: str) -> list[str]:
    """Plant each malicious and damaged variant of ``state_file`` (manifest resealed); the
    messages of the refusals."""
    original = _read(state_file)
    variants = {kind: _planted_bytes(kind, marker) for kind in ("pickle", "torch")}
    variants.update(_damaged(original))
    messages = []
    for data in variants.values():
        _write(state_file, data)
        _reseal(state_file)
        try:
            load()
        except CheckpointError as e:
            messages.append(str(e))
        except RunFailed as e:  # a job's resume: the refusal is the cause of the run's failure
            assert isinstance(e.__cause__, CheckpointError), e
            messages.append(str(e.__cause__))
        else:
            messages.append("<loaded>")
    _write(state_file, original)
    _reseal(state_file)
    return messages


def _assert_refused(messages: list[str], state_file: str, marker: str) -> None:
    assert len(messages) == 5
    for msg in messages:
        assert state_file in msg and "not a valid engine-core state file" in msg, msg
    assert not os.path.exists(marker)


# -- the I/O helpers --------------------------------------------------------------------------


def test_the_planted_files_are_live(tmp_path: Path) -> None:
    """Control: unpickled the ordinary way, each planted file does run its code."""
    for kind in ("pickle", "torch"):
        marker = tmp_path / f"marker-{kind}"
        data = _planted_bytes(kind, str(marker))
        # what load_torch used to do (a bare pickle runs, then fails torch's magic-number check)
        with contextlib.suppress(RuntimeError):
            torch.load(io.BytesIO(data), weights_only=False)
        assert marker.is_dir()


def test_load_torch_refuses_planted_and_damaged_files(root: str, tmp_path: Path) -> None:
    marker = str(tmp_path / "marker")
    location = f"{root}/state.pt"
    state = {"step": 1, "t": torch.arange(4), "nested": [(1, 2.0, None, True, "x")]}
    save_torch(state, location)
    _assert_refused(_refusals(location, lambda: load_torch(location), marker), location, marker)
    loaded = load_torch(location)  # the original is back and loads
    assert loaded["step"] == 1 and torch.equal(loaded["t"], state["t"])


def test_save_torch_refuses_what_would_not_load_back(tmp_path: Path) -> None:
    location = str(tmp_path / "state.pt")
    with pytest.raises(CheckpointError, match=r"state\['rng'\]\[1\] \(numpy\.ndarray\)"):
        save_torch({"rng": ("MT19937", np.zeros(3))}, location)
    with pytest.raises(CheckpointError, match="a key of state"):
        save_torch({("a", "tuple"): 1}, location)
    assert not os.path.exists(location)


# -- engine state -----------------------------------------------------------------------------


def _reference() -> ReferenceEngine:
    optim = {"lr": 1e-2, "warmup_steps": 1, "schedule": "cosine", "total_steps": 4}
    engine = ReferenceEngine(ReferenceEngineConfig(**engine_config(optim=optim)))
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    return engine


@pytest.mark.parametrize("name", ["engine_state_rank0.pt", "optim_rank0.pt"])
def test_reference_engine_state(root: str, tmp_path: Path, name: str) -> None:
    """The core's state file (step, RNG, schedule) and the engine's own optimizer file."""
    engine = _reference()
    train_steps(engine, range(2), 4)
    folder = engine.save_checkpoint(root, step=2)
    state_file = f"{folder}/{name}"
    marker = str(tmp_path / "marker")
    messages = _refusals(state_file, lambda: engine.load_checkpoint(folder), marker)
    _assert_refused(messages, state_file, marker)
    assert engine.load_checkpoint(folder) == 2


def _fsdp2_worker(rank: int, world: int, tmp: str) -> list[tuple[str, list[str]]]:
    engine = registered_engine("fsdp2")
    train_steps(engine, range(1), 4)
    out = []
    for root in (f"{tmp}/ckpt", "memory://safe-loading-fsdp2"):
        folder = engine.save_checkpoint(root, step=1)
        state_file = f"{folder}/engine_state_rank0.pt"
        load = functools.partial(engine.load_checkpoint, folder)
        messages = _refusals(state_file, load, f"{tmp}/marker")
        assert engine.load_checkpoint(folder) == 1
        out.append((state_file, messages))
    return out


def test_fsdp2_engine_state(tmp_path: Path) -> None:
    (results,) = run_distributed(_fsdp2_worker, 1, str(tmp_path))
    assert [f for f, _ in results] == [
        f"{tmp_path}/ckpt/global_step_1/engine_state_rank0.pt",
        "memory://safe-loading-fsdp2/global_step_1/engine_state_rank0.pt",
    ]
    for state_file, messages in results:
        _assert_refused(messages, state_file, str(tmp_path / "marker"))


def test_rng_state_round_trips_bit_for_bit_through_a_state_file(tmp_path: Path) -> None:
    import random

    from engine_core.optim import capture_rng, restore_rng

    np.random.seed(5)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    random.seed(3)
    random.gauss(0, 1)  # and in Python's
    save_torch(capture_rng(), tmp_path / "rng.pt")
    draws = (random.random(), random.gauss(0, 1), np.random.randn(4).tolist(), torch.rand(3))
    restore_rng(load_torch(tmp_path / "rng.pt"))
    again = (random.random(), random.gauss(0, 1), np.random.randn(4).tolist(), torch.rand(3))
    assert draws[:3] == again[:3] and torch.equal(draws[3], again[3])


# -- the GRPO job's trainer state -------------------------------------------------------------


def test_grpo_trainer_state(tmp_path: Path) -> None:
    from engine_core.configio import apply_overrides, load_yaml
    from engine_core.engine import CHECKPOINT_STATE_FILE, JOB_STATE_FILE
    from engine_core.plugins import load_plugins
    from engine_core_roles.jobs.rl.run import run_rl_job

    recipe = RECIPES / "grpo_tiny.yaml"
    out = tmp_path / "run"
    overrides = ["engine.backend=reference", "prompts_per_step=2", "trainer.samples_per_prompt=2"]
    manager = load_plugins()
    raw = apply_overrides(load_yaml(recipe), [f"output_dir={out}", "steps=1", *overrides])
    with open(os.devnull, "w") as sink:
        from rich.console import Console

        console = Console(file=sink)
        run_rl_job(raw, manager, console=console)
        resume = apply_overrides(raw, ["steps=2"])
        folder = out / "checkpoints" / "global_step_1"
        for state_file in (
            str(folder / JOB_STATE_FILE),
            str(folder / "actor" / CHECKPOINT_STATE_FILE.format(rank=0)),
        ):
            marker = str(tmp_path / "marker")
            messages = _refusals(
                state_file,
                lambda: run_rl_job(resume, manager, resume=True, console=console),
                marker,
            )
            _assert_refused(messages, state_file, marker)


# -- the weight-sync wire format --------------------------------------------------------------


def _params() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 4, generator=g)),
        ("b.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
    ]


def test_messages_round_trip() -> None:
    for msg in (
        _header(_params(), "0" * 32),
        _End(),
        _Abort("boom"),
        _Verdict(""),
        _Verdict("bad"),
    ):
        assert decode_message(encode_message(msg)) == msg


def _bucket_body(**changes: Any) -> bytes:
    body = json.loads(encode_message(_header(_params(), "0" * 32)))
    body.update(changes)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x80\x04\x95", "not UTF-8 JSON"),
        (b"{not json", "not UTF-8 JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"v": 1, "kind": "end", "x": NaN}', "not UTF-8 JSON"),
        (json.dumps({"v": 99, "kind": "end"}).encode(), "protocol version 99"),
        (json.dumps({"v": 1, "kind": "exec"}).encode(), "unknown kind 'exec'; allowed: bucket"),
        (
            json.dumps({"v": 1, "kind": "end", "cmd": "x"}).encode(),
            r"the 'end' message has exactly the fields \[\], got \['cmd'\]",
        ),
        (json.dumps({"v": 1, "kind": "abort", "reason": 3}).encode(), "'reason' must be"),
        (_bucket_body(dtypes=["float32", "load"]), r"unknown dtypes \['load'\]; allowed: float64"),
        (_bucket_body(names=["a.weight", 7]), "'names' must be a list of strings"),
        (_bucket_body(shapes=[[3, -4], [5]]), "'shapes' must be lists of non-negative"),
        (_bucket_body(shapes=[[True, 4], [5]]), "'shapes' must be lists of non-negative"),
        (_bucket_body(shapes=[[3, 4]]), "'names', 'shapes' and 'dtypes' differ in length"),
        (_bucket_body(nbytes=1 << 40), r"'nbytes' is 1099511627776, the shapes and dtypes make 58"),
        (_bucket_body(checksum=None), "'checksum' must be a string"),
    ],
)
def test_malformed_messages_are_refused(data: bytes, reason: str) -> None:
    with pytest.raises(WeightSyncError, match="malformed weight-sync message: " + reason):
        decode_message(data)


def test_a_pickled_header_is_refused_not_run(tmp_path: Path) -> None:
    marker = str(tmp_path / "marker")
    with pytest.raises(WeightSyncError, match=f"not UTF-8 JSON.*protocol v{PROTOCOL_VERSION}"):
        decode_message(pickle.dumps(_Planted(marker)))
    assert not os.path.exists(marker)


def _pair(host: str = "127.0.0.1") -> tuple[WeightSyncGroup, WeightSyncGroup, int]:
    port = free_port()
    out: dict[int, WeightSyncGroup] = {}

    def make(rank: int) -> None:
        out[rank] = WeightSyncGroup(host=host, port=port, rank=rank, world_size=2, timeout_s=60)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out[0], out[1], port


def _rollout() -> Any:
    from engine_core_hf.rollout import HFRollout, HFRolloutConfig

    from engine_core.config import ModelConfig
    from tests._models import TINY_QWEN2

    return HFRollout(HFRolloutConfig(backend="hf", model=ModelConfig(config=dict(TINY_QWEN2))))


def _receive_on_thread(group: WeightSyncGroup, rollout: Any) -> dict[str, Any]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["buckets"] = receive_weights(group, rollout)
        except Exception as e:  # checked by the test
            box["error"] = e

    box["thread"] = threading.Thread(target=run)
    box["thread"].start()
    return box


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of the sockets listening on ``port`` (Linux /proc/net)."""
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                if width == 8:
                    found.append(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:  # four little-endian 32-bit words
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.append(socket.inet_ntop(socket.AF_INET6, words))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net")
def test_a_loopback_group_listens_on_loopback_only_and_syncs() -> None:
    sender, receiver, port = _pair()
    try:
        assert _listening_addresses(port) == ["127.0.0.1"]
        rollout = _rollout()
        torch.manual_seed(21)
        params = [(n, torch.randn_like(t)) for n, t in rollout.model.state_dict().items()]
        box = _receive_on_thread(receiver, rollout)
        sent = send_weights(sender, params, bucket_bytes=32 << 10)
        box["thread"].join()
        assert "error" not in box and len(sent) > 1
        held = rollout.model.state_dict()
        assert all(torch.equal(held[n], t) for n, t in params)
    finally:
        sender.close()
        receiver.close()


def test_a_malformed_header_on_the_wire_is_a_clear_error(tmp_path: Path) -> None:
    sender, receiver, _ = _pair()
    marker = str(tmp_path / "marker")
    try:
        box = _receive_on_thread(receiver, _rollout())
        sender.broadcast_bytes(pickle.dumps(_Planted(marker)), 0)
        box["thread"].join(timeout=60)
        assert not box["thread"].is_alive()  # refused at once: no verdict awaited
        assert isinstance(box["error"], WeightSyncError)
        assert re.search("malformed weight-sync message: not UTF-8 JSON", str(box["error"]))
        assert "create a new one" in str(box["error"])
        assert not os.path.exists(marker)
    finally:
        sender.close()
        receiver.close()
