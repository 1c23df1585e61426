"""A ProcessRollout of several replicas: one weight stream to all, prompts split between them.

Real processes (one worker group) and a real gloo weight-sync group: an HF rollout backend in
each replica process, weights built from the tiny model config (nothing downloaded). The weights
come through the job's one path, a WeightLink from an actor (in this process, or a worker group).
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_core_hf.rollout import HFRollout, HFRolloutConfig
from safetensors.torch import load_file
from tensordict import NonTensorStack, TensorDict

from engine_core.config import ModelConfig
from engine_core.errors import BatchError, DispatchError, WeightSyncError
from engine_core.executors import LocalWorkerGroup, RayWorkerGroup
from engine_core.executors.interpreter import InterpreterWorkerGroup
from engine_core.models import build_model
from engine_core.remote_rollout import (
    ROLLOUT_MESH,
    ProcessRollout,
    RolloutWorker,
    _merge_replica_outputs,
    _replica_bounds,
)
from engine_core.rollout import (
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_SEED,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ROLLOUT_REPLICA,
    TRUNCATED,
    SamplingParams,
    derive_seed,
    prompt_seeds,
)
from engine_core.weight_sync import receive_weights, send_weights
from engine_core_roles.distributed.weights import WeightLink
from engine_core_roles.distributed.workers import build_engine
from engine_core_roles.models.actor import Actor, ActorConfig
from tests._models import TINY_QWEN2, engine_config
from tests._workers import CORRUPTED, CorruptingRolloutWorker, FailingRolloutWorker
from tests.test_weight_sync import _pair

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3)


def _hf_config() -> HFRolloutConfig:
    return HFRolloutConfig(backend="hf", model=ModelConfig(config=dict(TINY_QWEN2)), seed=7)


def _model(seed: int) -> Any:
    """A transformers model of the tiny config, its weights drawn from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(ModelConfig(config=dict(TINY_QWEN2))).eval()


def _prompts(n: int, seed: int = 1) -> TensorDict:
    ids = torch.randint(
        1, TINY_QWEN2["vocab_size"], (n, 5), generator=torch.Generator().manual_seed(seed)
    )
    return TensorDict({PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}, batch_size=[n])


def _gap(model: Any, out: TensorDict) -> float:
    """Largest |rollout log-prob - log-prob a plain forward of ``model`` gives| over ``out``."""
    ids = torch.cat([out[PROMPT_IDS], out[RESPONSE_IDS]], 1)
    with torch.no_grad():
        logits = model(ids).logits[:, out[PROMPT_IDS].shape[1] - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, out[RESPONSE_IDS].unsqueeze(-1))[..., 0]
    return float((lp - out[ROLLOUT_LOG_PROBS]).abs()[out[RESPONSE_MASK].bool()].max())


SENT = 11  # the seed of the weights the shared rollout is synced with


def _actor(seed: int) -> Actor:
    """An in-process actor (reference engine) holding ``_model(seed)``'s weights."""
    actor = Actor(ActorConfig(), build_engine(engine_config()))
    actor.engine.require_module().load_state_dict(_model(seed).state_dict())
    return actor


@pytest.fixture(
    scope="module",
    params=["local", "interpreter", pytest.param("ray", marks=pytest.mark.ray)],
)
def two(request: pytest.FixtureRequest) -> Iterator[ProcessRollout]:
    """Two replicas: spawned processes, processes of an interpreter started by path (plain
    data over pipes, weights relayed by this process), or Ray actors."""
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    other = request.param == "interpreter"
    rollout = ProcessRollout(
        _hf_config(),
        replicas=2,
        timeout_s=300,
        executor="ray" if request.param == "ray" else "local",
        python=sys.executable if other else None,
    )
    kind = {"ray": RayWorkerGroup, "interpreter": InterpreterWorkerGroup}.get(
        request.param, LocalWorkerGroup
    )
    assert type(rollout.worker_group) is kind and rollout.worker_group.num_workers == 2
    assert [r.dp_rank for r in rollout.worker_group.mesh_ranks(ROLLOUT_MESH)] == [0, 1]
    try:
        with WeightLink(_actor(SENT), rollout, bucket_bytes=64 << 10) as link:
            through = "driver rollout" if other else "rollout replicas"
            assert link.arrangement == f"actor in the driver -> {through}"
            assert link.sync()["weight_sync/bytes"] > 0
        yield rollout
    finally:
        rollout.shutdown()
        rollout.shutdown()  # safe twice


def test_every_replica_samples_from_the_sent_weights_in_prompt_order(
    two: ProcessRollout,
) -> None:
    prompts = _prompts(5)
    out = two.generate(prompts, PARAMS)
    n = PARAMS.n
    assert out.batch_size[0] == 5 * n
    # prompt i's n samples at rows i*n .. i*n+n-1; prompts 0-2 on replica 0, 3-4 on replica 1
    assert torch.equal(out[PROMPT_IDS], prompts[PROMPT_IDS].repeat_interleave(n, 0))
    assert out[ROLLOUT_REPLICA].dtype == torch.int64
    assert out[ROLLOUT_REPLICA].tolist() == [0] * 3 * n + [1] * 2 * n
    assert out[TRUNCATED].shape == (5 * n,)
    model = _model(SENT)
    for replica in (0, 1):
        rows = out[ROLLOUT_REPLICA] == replica
        assert _gap(model, out[rows]) <= 1e-5, replica
    # and the rollout was really synced: its own initial weights give other log-probs
    assert _gap(_model(_hf_config().seed), out) > 1e-3


def test_replicas_sample_what_one_rollout_samples_and_repeat_with_the_same_seed(
    two: ProcessRollout,
) -> None:
    prompts = _prompts(4)
    prompts[PROMPT_IDS][2] = prompts[PROMPT_IDS][0]  # the same prompt on replica 0 and replica 1
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=5)
    out = two.generate(prompts, params)
    assert out[ROLLOUT_REPLICA].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert not torch.equal(out[RESPONSE_IDS][0], out[RESPONSE_IDS][4])  # each prompt its seed
    again = two.generate(prompts, params)
    assert torch.equal(again[RESPONSE_IDS], out[RESPONSE_IDS])
    # one rollout in this process with the same weights draws the same samples: a prompt's
    # samples depend on its seed, not on the replica or the batch it shared
    one = HFRollout(_hf_config())
    one.model.load_state_dict(_model(SENT).state_dict())
    alone = one.generate(prompts, params)
    assert torch.equal(alone[RESPONSE_IDS], out[RESPONSE_IDS])
    assert torch.allclose(alone[ROLLOUT_LOG_PROBS], out[ROLLOUT_LOG_PROBS], atol=1e-6)
    assert PROMPT_SEED not in prompts.keys()  # the caller's batch is left as it was


def test_fewer_prompts_than_replicas_and_release_resume(two: ProcessRollout) -> None:
    two.release()
    two.resume()
    out = two.generate(_prompts(1), PARAMS)
    assert out[ROLLOUT_REPLICA].tolist() == [0] * PARAMS.n
    assert _gap(_model(SENT), out) <= 1e-5


def test_generate_async_lets_this_process_work_while_the_replicas_generate(
    two: ProcessRollout,
) -> None:
    prompts = _prompts(3)
    pending = two.generate_async(prompts, PARAMS)
    busy = torch.randn(256, 256) @ torch.randn(256, 256)  # this process is not blocked
    out = pending.result()
    assert busy.shape == (256, 256)
    assert torch.equal(out[RESPONSE_IDS], two.generate(prompts, PARAMS)[RESPONSE_IDS])
    assert pending.result() is out  # the same result when asked again


def test_a_replica_that_corrupts_its_weights_is_named() -> None:
    rollout = ProcessRollout(
        _hf_config(), replicas=2, worker_cls=CorruptingRolloutWorker, timeout_s=300
    )
    try:
        link = WeightLink(_actor(SENT), rollout, bucket_bytes=64 << 10)
        for _ in range(2):  # the group is still in step after a failure: the same verdict again
            with pytest.raises(WeightSyncError) as failed:
                link.sync()
            message = str(failed.value)
            assert "rollout replica 1: checksum mismatch" in message
            assert CORRUPTED in message
            assert "replica 0" not in message
        # replica 0 took the weights all the same
        out = rollout.generate(_prompts(2), PARAMS)
        assert _gap(_model(SENT), out[out[ROLLOUT_REPLICA] == 0]) <= 1e-5
        link.close()
        link.close()  # safe twice
        with pytest.raises(RuntimeError, match="closed"):
            link.sync()
    finally:
        rollout.shutdown()


@pytest.mark.parametrize(
    ("replicas", "error"),
    [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)],
)
def test_bad_replica_counts_are_refused_before_any_process_starts(
    replicas: Any, error: type[Exception], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_process(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a rollout process was started")

    import engine_core.executors as executors

    monkeypatch.setattr(executors, "LocalWorkerGroup", no_process)
    with pytest.raises(error) as refused:
        ProcessRollout(_hf_config(), replicas=replicas)
    message = str(refused.value)
    assert f"replicas={replicas!r}" in message
    assert "int >= 1" in message and "Pass e.g. replicas=2" in message


def test_a_replica_that_fails_to_start_stops_the_others() -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(
        DispatchError,
        match=r"(?s)rollout replicas failed to start \(2 of them; every replica was shut down\)"
        r".*worker 1 raised.*replica 1 cannot start on purpose",
    ):
        ProcessRollout(_hf_config(), replicas=2, worker_cls=FailingRolloutWorker, timeout_s=300)
    assert set(multiprocessing.active_children()) <= before


def test_worker_cls_must_be_a_rollout_worker() -> None:
    with pytest.raises(TypeError, match="RolloutWorker or a subclass"):
        ProcessRollout(_hf_config(), worker_cls=dict)  # type: ignore[arg-type]
    assert issubclass(CorruptingRolloutWorker, RolloutWorker)


# -- splitting, seeds and merging, without processes ----------------------------------------


def test_prompts_are_split_in_contiguous_near_equal_chunks() -> None:
    assert _replica_bounds(5, 2) == [(0, 3), (3, 5)]
    assert _replica_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert _replica_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert _replica_bounds(4, 1) == [(0, 4)]


def test_prompt_seeds_follow_the_prompt_not_the_batch() -> None:
    params = SamplingParams(seed=3)
    prompts = _prompts(5)
    seeds = prompt_seeds(prompts, params)
    assert seeds is not None and len(set(seeds)) == 5
    assert all(0 <= s < 2**63 for s in seeds)
    assert prompt_seeds(prompts, SamplingParams()) is None  # unseeded
    prompts[PROMPT_SEED] = torch.tensor(seeds)
    assert prompt_seeds(prompts[2:], SamplingParams()) == seeds[2:]  # the column wins
    prompts[PROMPT_SEED] = torch.tensor(seeds, dtype=torch.float32)
    with pytest.raises(BatchError, match="one int64 seed per prompt"):
        prompt_seeds(prompts, params)
    for big in (2**63 - 1, -(2**63), 2**80):
        assert 0 <= derive_seed(big, 1) < 2**63


def _part(rows: int, width: int, token: int) -> TensorDict:
    td = TensorDict(
        {
            PROMPT_IDS: torch.full((rows, 2), token),
            PROMPT_MASK: torch.ones(rows, 2, dtype=torch.long),
            RESPONSE_IDS: torch.full((rows, width), token),
            RESPONSE_MASK: torch.ones(rows, width, dtype=torch.long),
            ROLLOUT_LOG_PROBS: torch.full((rows, width), -0.5),
            TRUNCATED: torch.full((rows,), token == 6),
        },
        batch_size=[rows],
    )
    td["note"] = NonTensorStack.from_list([f"r{token}"] * rows)  # rows' records ride along
    return td


def test_replica_results_are_padded_to_the_widest_and_concatenated() -> None:
    out = _merge_replica_outputs([(0, _part(2, 3, 5)), (1, _part(1, 1, 6))], pad_token_id=9)
    assert out.batch_size[0] == 3
    assert out[RESPONSE_IDS].tolist() == [[5, 5, 5], [5, 5, 5], [6, 9, 9]]
    assert out[RESPONSE_MASK].tolist() == [[1, 1, 1], [1, 1, 1], [1, 0, 0]]
    assert out[ROLLOUT_LOG_PROBS].tolist() == [[-0.5] * 3, [-0.5] * 3, [-0.5, 0.0, 0.0]]
    assert out[PROMPT_IDS][:, 0].tolist() == [5, 5, 6]
    assert out["note"].tolist() == ["r5", "r5", "r6"]
    assert out[TRUNCATED].tolist() == [False, False, True]
    assert out[ROLLOUT_REPLICA].tolist() == [0, 0, 1]
    single = _merge_replica_outputs([(0, _part(2, 3, 5))], pad_token_id=9)
    assert single[ROLLOUT_REPLICA].tolist() == [0, 0]


def test_send_weights_labels_receivers_with_the_names_given() -> None:
    """Both ends on threads of this process; a wrong count of names aborts the stream."""
    to_rollout, at_rollout = _pair()
    rollout = HFRollout(_hf_config())
    weights = list(_model(SENT).state_dict().items())

    def send(named: Any, names: Any) -> tuple[BaseException | None, BaseException | None]:
        received: list[BaseException] = []

        def receive() -> None:
            try:
                receive_weights(at_rollout, rollout)
            except Exception as e:  # checked below
                received.append(e)

        receiver = threading.Thread(target=receive)
        receiver.start()
        try:
            send_weights(to_rollout, named, receiver_names=names)
            sent = None
        except Exception as e:  # checked below
            sent = e
        receiver.join()
        return sent, (received[0] if received else None)

    sent, received = send(weights, ["a", "b"])
    assert isinstance(sent, ValueError) and "needs 1 name(s)" in str(sent)
    assert received is not None and "trainer aborted" in str(received)
    wrong = [(n, t[:-1] if n == "lm_head.weight" else t) for n, t in weights]
    sent, _ = send(wrong, ["the rollout"])
    assert isinstance(sent, WeightSyncError)
    assert "the rollout: weight sync refused" in str(sent) and "lm_head.weight" in str(sent)
    assert send(weights, None) == (None, None)  # and the group is still in step
    for group in (to_rollout, at_rollout):
        group.close()


@pytest.mark.parametrize("replicas", [2, 0], ids=["to-replicas", "to-driver-rollout"])
def test_a_data_parallel_actor_streams_from_its_writing_rank(replicas: int, tmp_path: Any) -> None:
    """An actor group at dp=2 (fsdp2, two processes): every rank gathers, the writing rank
    sends. To two replica processes, neither the weights nor the stream pass through this
    process; to a rollout in this process, it receives the stream bucket by bucket. Each rollout
    then samples from the actor's weights; a receiver that corrupts its load fails the sync
    naming it, twice in a row (the group stays in step)."""
    from engine_core_roles.distributed.placement import ActorGroup, PlacementConfig, start_group
    from engine_core_roles.distributed.workers import ActorWorker

    engine = engine_config(backend="fsdp2", seed=SENT)
    group = start_group(PlacementConfig(executor="local"), ActorWorker, 2, (engine, {}))
    rollout: Any = (
        ProcessRollout(_hf_config(), replicas=2, worker_cls=CorruptingRolloutWorker)
        if replicas
        else HFRollout(_hf_config())
    )
    try:
        actor = ActorGroup(group, ActorConfig())
        assert actor.dp_size == 2
        link = WeightLink(actor, rollout, bucket_bytes=16 << 10)
        if replicas:
            assert link.arrangement == "actor group -> rollout replicas"
            assert not link._sender.here and not link._receiver.here  # no end in this process
            for _ in range(2):
                with pytest.raises(DispatchError) as failed:
                    link.sync()
                message = str(failed.value)
                assert "rollout replica 1: checksum mismatch" in message and CORRUPTED in message
                assert "replica 0" not in message
        else:
            assert link.arrangement == "actor group -> driver rollout"
            assert link.sync()["weight_sync/bytes"] > 0
        out = rollout.generate(_prompts(2), PARAMS)
        model = _model(0)
        actor.export_hf(str(tmp_path / "hf"))
        model.load_state_dict(load_file(str(tmp_path / "hf" / "model.safetensors")), strict=False)
        on_0 = out[out[ROLLOUT_REPLICA] == 0] if replicas else out
        assert _gap(model, on_0) <= 1e-5  # the actor's weights
        assert _gap(_model(_hf_config().seed), on_0) > 1e-3
        link.close()
    finally:
        if replicas:
            rollout.shutdown()
        group.shutdown()
