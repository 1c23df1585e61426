"""Weight sync across processes: a trainer streams verified buckets to a rollout process.

Real processes and real gloo groups throughout: the rollout runs in a spawned process
(``ProcessRollout``) or, for the error paths, both ends of a sync group run on two threads of
this process with a real HF rollout receiving.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_core_hf.rollout import HFRollout, HFRolloutConfig
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from engine_core.batch import BatchMeta, make_batch
from engine_core.config import ModelConfig
from engine_core.errors import WeightSyncError
from engine_core.executors.base import free_port
from engine_core.executors.local import LocalWorkerGroup
from engine_core.models import build_model
from engine_core.remote_rollout import ProcessRollout, RolloutWorker
from engine_core.rollout import SamplingParams, confirm_bucket
from engine_core.weight_sync import (
    STAGE_BYTES,
    WeightSyncGroup,
    pieces,
    receive_weights,
    send_weights,
)
from engine_core_roles.distributed.weights import WeightLink
from engine_core_roles.models.actor import Actor, ActorConfig
from tests._dist import run_distributed
from tests._models import TINY_QWEN2, random_batch, registered_engine

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3)


def _prompts(n: int = 3) -> TensorDict:
    ids = torch.randint(
        1, TINY_QWEN2["vocab_size"], (n, 5), generator=torch.Generator().manual_seed(1)
    )
    return TensorDict({"prompt_ids": ids, "prompt_mask": torch.ones_like(ids)}, batch_size=[n])


def _trainer_log_probs(engine: Any, out: TensorDict) -> torch.Tensor:
    ids = torch.cat([out["prompt_ids"], out["response_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["response_mask"]], 1)
    with engine.eval_mode():
        lp = engine.forward_backward_step(
            make_batch(ids, mask, meta=BatchMeta(temperature=PARAMS.temperature)), forward_only=True
        ).outputs["log_probs"]
    return lp[:, out["prompt_ids"].shape[1] :]


def _mismatch(engine: Any, out: TensorDict) -> float:
    diff = (_trainer_log_probs(engine, out) - out["rollout_log_probs"]).abs()
    return float(diff[out["response_mask"].bool()].max())


def _hf_config(**model: Any) -> HFRolloutConfig:
    return HFRolloutConfig(backend="hf", model=ModelConfig(config={**TINY_QWEN2, **model}), seed=7)


def test_a_rollout_process_follows_the_trainer_and_a_skipped_sync_shows() -> None:
    engine = registered_engine("fsdp2", optim={"lr": 5e-2, "clip_grad": None})
    rollout = ProcessRollout(_hf_config())
    try:
        link = WeightLink(Actor(ActorConfig(), engine), rollout, bucket_bytes=64 << 10)
        assert link.sync()["weight_sync/bytes"] == sum(
            t.numel() * t.element_size() for _, t in engine.named_full_params()
        )
        assert _mismatch(engine, rollout.generate(_prompts(), PARAMS)) < 1e-5

        with engine.train_mode():
            engine.forward_backward_step(random_batch(8))
            engine.optimizer_step()
            engine.optimizer_zero_grad()
        stale = _mismatch(engine, rollout.generate(_prompts(), PARAMS))
        assert stale > 1e-3  # no sync yet: the rollout still samples from the old weights

        link.sync()
        assert _mismatch(engine, rollout.generate(_prompts(), PARAMS)) < 1e-5
    finally:
        rollout.shutdown()


def test_a_refused_sync_names_the_parameter_on_the_trainer_side() -> None:
    """The core's pieces of a sync to replicas, driven by hand: the replicas join a group this
    process hosts, receive while it sends; a wrong shape is refused before it is loaded."""
    engine = registered_engine("fsdp2")
    rollout = ProcessRollout(_hf_config())
    try:
        port = free_port()
        joining = rollout.join_weight_sync("127.0.0.1", port, 1, 2)
        group = WeightSyncGroup(host="127.0.0.1", port=port, rank=0, world_size=2)
        joining.result()

        def wrong() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in engine.named_full_params():
                yield name, (t[:-1] if name == "lm_head.weight" else t)

        def sync(named: Any) -> list[Any]:
            receiving = rollout.receive_weights()
            try:
                return send_weights(group, named, receiver_names=rollout.receiver_names)
            finally:
                with contextlib.suppress(Exception):
                    receiving.result()

        with pytest.raises(WeightSyncError, match=r"rollout replica 0: .*lm_head\.weight"):
            sync(wrong())
        # both ends stayed in step: the next sync goes through and is followed
        buckets = sync(engine.named_full_params())
        assert {n for b in buckets for n in b.names} == set(rollout.expected_weights())
        assert _mismatch(engine, rollout.generate(_prompts(), PARAMS)) < 1e-5
        group.close()
    finally:
        rollout.shutdown()


# -- both ends on threads of this process ---------------------------------------------------


def _pair() -> tuple[WeightSyncGroup, WeightSyncGroup]:
    port = free_port()
    out: dict[int, WeightSyncGroup] = {}

    def make(rank: int) -> None:
        out[rank] = WeightSyncGroup(
            host="127.0.0.1", port=port, rank=rank, world_size=2, timeout_s=60
        )

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out[0], out[1]


def _receive_on_thread(group: WeightSyncGroup, rollout: HFRollout) -> dict[str, Any]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["buckets"] = receive_weights(group, rollout)
        except Exception as e:  # checked by the test
            box["error"] = e

    box["thread"] = threading.Thread(target=run)
    box["thread"].start()
    return box


@pytest.fixture(scope="module")
def pair() -> tuple[WeightSyncGroup, WeightSyncGroup]:
    return _pair()


@pytest.fixture(scope="module")
def hf_rollout() -> HFRollout:
    return HFRollout(_hf_config())


def _model_params(seed: int) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(seed)
    return list(build_model(ModelConfig(config=dict(TINY_QWEN2))).state_dict().items())


def test_the_rollout_holds_exactly_what_was_sent(pair: Any, hf_rollout: HFRollout) -> None:
    sender, receiver = pair
    params = _model_params(11)
    box = _receive_on_thread(receiver, hf_rollout)
    sent = send_weights(sender, params, bucket_bytes=32 << 10)
    box["thread"].join()
    assert "error" not in box
    assert len(sent) > 1
    assert {n for b in sent for n in b.names} == {n for b in box["buckets"] for n in b.names}
    held = hf_rollout.model.state_dict()
    for name, t in params:
        assert torch.equal(held[name], t), name


def test_pieces_cover_the_bucket_in_order_big_tensors_alone() -> None:
    big, small = STAGE_BYTES, 1000
    sizes = [small, small, big, small, STAGE_BYTES - 1, 3, 2 * big, small]
    got = pieces(sizes)
    assert [i for piece in got for i in piece] == list(range(len(sizes)))
    for piece in got:
        if any(sizes[i] >= STAGE_BYTES for i in piece):
            assert len(piece) == 1
        else:
            assert sum(sizes[i] for i in piece) <= STAGE_BYTES
    expected = [range(0, 2), range(2, 3), range(3, 4), range(4, 5), range(5, 6), range(6, 7)]
    assert got == [*expected, range(7, 8)]
    assert pieces([]) == []


class _Keeper:
    """A receiving end that keeps copies of what arrives (verified against the checksums)."""

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}

    def load_weights(self, buckets: Any) -> list[Any]:
        done = []
        for bucket, sent in buckets:
            self.held.update((name, t.clone()) for name, t in bucket)
            done.append(confirm_bucket(bucket, sent))
        return done


def test_big_and_small_tensors_arrive_whole(pair: Any) -> None:
    """Tensors of a megabyte and more go from their own memory, smaller ones staged together:
    what arrives is every tensor, bit for bit, in buckets of any mix."""
    sender, receiver = pair
    g = torch.Generator().manual_seed(5)
    named = [
        ("a", torch.randn(7, generator=g)),
        ("big", torch.randn(600, 1000, generator=g)),  # 2.4 MB: alone
        ("b", torch.randint(0, 9, (5, 3), generator=g)),
        ("half", torch.randn(300, 1000, generator=g).to(torch.bfloat16)),
        ("flag", torch.tensor([True, False])),
        ("strided", torch.randn(400, 900, generator=g).t()),  # 1.4 MB, not contiguous
    ]
    keeper = _Keeper()
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(got=receive_weights(receiver, keeper)))
    thread.start()
    send_weights(sender, named, bucket_bytes=3 << 20)
    thread.join()
    assert len(box["got"]) > 1
    assert set(keeper.held) == {n for n, _ in named}
    for name, t in named:
        assert keeper.held[name].dtype == t.dtype and torch.equal(keeper.held[name], t), name


def test_a_corrupted_transfer_is_caught_by_the_checksum(pair: Any, hf_rollout: HFRollout) -> None:
    """The sender's header carries a checksum the received bytes do not have."""
    sender, receiver = pair
    params = _model_params(12)[:2]
    box = _receive_on_thread(receiver, hf_rollout)
    from engine_core.weight_sync import _broadcast_bucket, _End, _header, _Verdict

    header = _header(params, "0" * 32)  # not the checksum of these bytes
    sender.broadcast_message(header, 0)
    _broadcast_bucket(sender, params)
    sender.broadcast_message(_End(), 0)
    reply = sender.broadcast_message(None, 1)
    assert isinstance(reply, _Verdict)
    verdict = reply.error
    box["thread"].join()
    assert isinstance(box["error"], WeightSyncError)
    for name, _ in params:
        assert name in verdict and name in str(box["error"])
    assert "checksum mismatch" in verdict


def test_a_trainer_failure_mid_stream_reaches_the_rollout(pair: Any, hf_rollout: HFRollout) -> None:
    sender, receiver = pair
    params = _model_params(13)

    def failing() -> Iterator[tuple[str, torch.Tensor]]:
        yield from params[:3]
        raise RuntimeError("trainer died while gathering a shard")

    box = _receive_on_thread(receiver, hf_rollout)
    with pytest.raises(RuntimeError, match="gathering a shard"):
        send_weights(sender, failing(), bucket_bytes=1 << 10)
    box["thread"].join()
    assert "trainer aborted" in str(box["error"]) and "gathering a shard" in str(box["error"])
    # and the group is still usable
    box = _receive_on_thread(receiver, hf_rollout)
    send_weights(sender, params)
    box["thread"].join()
    assert "error" not in box


def test_an_incomplete_sync_names_what_was_never_sent(pair: Any, hf_rollout: HFRollout) -> None:
    sender, receiver = pair
    params = _model_params(14)
    box = _receive_on_thread(receiver, hf_rollout)
    with pytest.raises(WeightSyncError, match=r"never sent.*model\.norm\.weight"):
        send_weights(sender, [p for p in params if p[0] != "model.norm.weight"])
    box["thread"].join()
    assert isinstance(box["error"], WeightSyncError)


def test_group_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="world_size=1"):
        WeightSyncGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        WeightSyncGroup(host="127.0.0.1", port=free_port(), rank=2, world_size=2)


# -- two trainer ranks (fsdp2, dp=2) and a rollout process ----------------------------------


def _fsdp2_trainer(rank: int, world_size: int, port: int, folder: str) -> None:
    engine = registered_engine("fsdp2", optim={"lr": 5e-2, "clip_grad": None})
    with engine.train_mode():
        engine.forward_backward_step(random_batch(8, seed=rank))
        engine.optimizer_step()
    group = (
        WeightSyncGroup(host="127.0.0.1", port=port, rank=0, world_size=2) if rank == 0 else None
    )
    send_weights(group, engine.named_full_params(), bucket_bytes=64 << 10)
    engine.export_hf(folder)


def test_two_sharded_trainer_ranks_sync_a_rollout_process(tmp_path: Path) -> None:
    workers = LocalWorkerGroup(
        RolloutWorker, 1, init_args=(_hf_config().model_dump(),), env={"OMP_NUM_THREADS": "1"}
    )
    try:
        port = free_port()
        errors: list[BaseException] = []

        def train() -> None:
            try:
                run_distributed(_fsdp2_trainer, 2, port, str(tmp_path / "hf"))
            except BaseException as e:  # re-raised below
                errors.append(e)

        trainer = threading.Thread(target=train)
        trainer.start()
        workers.call_all("join_weight_sync", "127.0.0.1", port, 1, 2, "gloo", 600.0)
        workers.call_all("receive_weights")
        trainer.join()
        assert not errors, errors
        out = workers.call_all("generate", _prompts(), PARAMS)[0]
    finally:
        workers.shutdown()
    # the rollout holds the trainers' post-step weights: its log-probs equal a plain forward
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.cat([out["prompt_ids"], out["response_ids"]], 1)
    with torch.no_grad():
        logits = model(ids).logits[:, out["prompt_ids"].shape[1] - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, out["response_ids"].unsqueeze(-1))[..., 0]
    mask = out["response_mask"].bool()
    assert float((lp - out["rollout_log_probs"]).abs()[mask].max()) < 1e-5
