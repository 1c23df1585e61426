"""Rollouts in their own processes: generation by RPC, weights over a :class:`WeightSyncGroup`.

:class:`ProcessRollout` is a :class:`BaseRollout` whose real backend (any registered rollout:
``hf``, ``vllm``, ...) runs in ``replicas`` spawned worker processes, each replica a
:class:`RolloutWorker` in a one-worker :class:`LocalWorkerGroup` of its own (built as
``worker_cls(config, replica=i)``), or with ``executor="ray"`` a one-actor
:class:`RayWorkerGroup` (Ray places it; the weight-sync store then listens on this node's
address, not loopback only). This process only sends work and weights.

- ``generate`` splits the prompts by prompt into ``replicas`` contiguous, near-equal chunks (all
  ``n`` samples of a prompt come from one replica; a replica with no prompt is not called), runs
  the replicas at once and concatenates their results in prompt order, so the rows are ordered
  as a single rollout's: prompt ``i``'s samples at rows ``i*n .. i*n+n-1``. Response-shaped
  fields are right-padded to the longest replica's width (``response_ids`` with the backend's
  pad id, ``response_mask`` and ``rollout_log_probs`` with 0). Each row's ``rollout_replica``
  (:data:`ROLLOUT_REPLICA`) says which replica generated it. With several replicas and
  ``SamplingParams.seed`` set, replica ``i`` samples with its own seed
  ``(seed * 1_000_003 + i) mod 2**63``; a single replica samples with ``seed`` as given.
- ``sync_weights`` streams the trainer's (HF name, tensor) pairs once over one gloo weight-sync
  group: this process at rank 0, replica ``i`` at rank ``i + 1``, every replica receiving into
  its rollout concurrently, verified on both sides (:mod:`engine_core.weight_sync`). A replica
  that refuses the weights or fails verification is named in the :class:`WeightSyncError`
  ("rollout replica 1: ..."); every replica drains the stream whatever happens, so the group is
  in step for the next sync.
- With ``external_sender=True`` the sender is another process (a trainer rank, e.g. the writing
  rank of a :class:`roles.placement.ActorGroup`): :meth:`ProcessRollout.connect_sender` has the
  replicas join the group that sender hosts, and :meth:`ProcessRollout.receive_from` runs one
  sync, the replicas receiving while the sender streams. The weights never pass through this
  process.
- ``release`` / ``resume`` / ``shutdown`` apply to every replica. If a replica fails to start,
  those that started are shut down.
- Each replica runs ``max(1, T // replicas)`` CPU threads, where ``T`` is this process's torch
  thread count (one replica: ``T``).

The training loop does not change: it calls the same ``generate`` / ``sync_weights`` as on a
colocated rollout.

Executed on CPU with gloo, with one and two replicas, as local processes and as Ray actors on
one machine (a cluster of several nodes has not been tried). On a CUDA host the weight-sync group uses
NCCL: that path is written but has never been executed, and it places no replica on a device of
its own (every process uses its current CUDA device).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

import torch
from tensordict import NonTensorStack, TensorDict

from engine_core.dispatch import Worker
from engine_core.errors import BatchError, DispatchError
from engine_core.executors.base import LOOPBACK, WorkerGroup, free_port, meeting_host
from engine_core.executors.local import LocalWorkerGroup
from engine_core.rollout import (
    BUCKET_BYTES,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ROLLOUT_REPLICA,
    BaseRollout,
    RolloutConfig,
    SamplingParams,
    WeightBucket,
)
from engine_core.weight_sync import WeightSyncGroup, receive_weights, send_weights

__all__ = ["RolloutWorker", "ProcessRollout"]

T = TypeVar("T")

_SEED_STRIDE = 1_000_003


class RolloutWorker(Worker):
    """Hosts one rollout backend in a worker process: replica ``replica`` of a ProcessRollout."""

    def __init__(self, config: dict[str, Any], replica: int = 0) -> None:
        from engine_core.plugins import load_plugins
        from engine_core.resolve import resolve_rollout_config

        self.replica = replica
        spec, cfg = resolve_rollout_config(config, load_plugins())
        self.rollout: BaseRollout = spec.load_class()(cfg)
        self.group: WeightSyncGroup | None = None

    def capabilities(self) -> frozenset[Any]:
        return frozenset(self.rollout.capabilities)

    def pad_token_id(self) -> int:
        """The id the backend right-pads ``response_ids`` with (its own, else its config's)."""
        for owner in (self.rollout, self.rollout.config):
            pad = getattr(owner, "pad_token_id", None)
            if isinstance(pad, int) and not isinstance(pad, bool):
                return pad
        return 0

    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        return self.rollout.generate(prompts, params)

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return self.rollout.expected_weights()

    def join_weight_sync(
        self, port: int, rank: int, world_size: int, backend: str, host: str = LOOPBACK
    ) -> None:
        self.group = WeightSyncGroup(
            host=host, port=port, rank=rank, world_size=world_size, backend=backend
        )

    def receive_weights(self, bucket_bytes: int) -> list[WeightBucket]:
        if self.group is None:
            raise RuntimeError("join_weight_sync() first.")
        return receive_weights(self.group, self.rollout, bucket_bytes=bucket_bytes)

    def release(self) -> None:
        self.rollout.release()

    def resume(self) -> None:
        self.rollout.resume()


class _Call(threading.Thread):
    """A worker-group call on a thread, so this process can take part in the same collective
    (or wait for several worker groups at once)."""

    def __init__(self, group: WorkerGroup, method: str, *args: Any) -> None:
        super().__init__(daemon=True)
        self.group, self.method, self.args = group, method, args
        self.result: list[Any] = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.group.call_all(self.method, *self.args)
        except BaseException as e:  # re-raised by the caller after join()
            self.error = e

    def wait(self) -> list[Any]:
        self.join()
        if self.error is not None:
            raise self.error
        return self.result


def _check_replicas(replicas: object) -> int:
    how = (
        "replicas is the number of rollout processes, an int >= 1 (1: one process, as without "
        "replicas; 2: each batch of prompts split between two processes). Pass e.g. replicas=2."
    )
    if not isinstance(replicas, int) or isinstance(replicas, bool):
        raise TypeError(
            f"ProcessRollout got replicas={replicas!r} ({type(replicas).__name__}); {how}"
        )
    if replicas < 1:
        raise ValueError(f"ProcessRollout got replicas={replicas}; {how}")
    return replicas


def _replica_bounds(num_prompts: int, replicas: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each replica's prompts: contiguous chunks, sizes differing by <= 1."""
    base, extra = divmod(num_prompts, replicas)
    bounds, start = [], 0
    for i in range(replicas):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _replica_seed(seed: int | None, replica: int, replicas: int) -> int | None:
    """The sampling seed of ``replica``: ``seed`` itself for a single replica (or no seed)."""
    if seed is None or replicas == 1:
        return seed
    return (seed * _SEED_STRIDE + replica) % (1 << 63)


def _merge_replica_outputs(parts: list[tuple[int, TensorDict]], pad_token_id: int) -> TensorDict:
    """The ``generate`` results of replicas ``(replica, result)``, concatenated in that order.

    ``response_ids`` is right-padded with ``pad_token_id``, ``response_mask`` and
    ``rollout_log_probs`` with 0, to the widest part; :data:`ROLLOUT_REPLICA` (int64, one per
    row) says which replica each row came from. Every part must hold the same fields.
    """
    if not parts:
        raise ValueError("_merge_replica_outputs needs at least one replica's result.")
    replica_col = torch.cat(
        [torch.full((td.batch_size[0],), i, dtype=torch.int64) for i, td in parts]
    )
    if len(parts) == 1:
        out = parts[0][1]
        out[ROLLOUT_REPLICA] = replica_col
        return out
    keys = [str(k) for k in parts[0][1].keys() if k != ROLLOUT_REPLICA]
    for i, td in parts[1:]:
        theirs = {str(k) for k in td.keys() if k != ROLLOUT_REPLICA}
        if theirs != set(keys):
            raise BatchError(
                f"rollout replicas returned different fields: replica {parts[0][0]} "
                f"{sorted(keys)}, replica {i} {sorted(theirs)}; every replica runs the same "
                f"backend and must return the same fields."
            )
    pad_values: dict[str, float] = {
        RESPONSE_IDS: pad_token_id,
        RESPONSE_MASK: 0,
        ROLLOUT_LOG_PROBS: 0.0,
    }
    fields: dict[str, Any] = {}
    listed: dict[str, list[Any]] = {}
    for key in keys:
        values = [td.get(key) for _, td in parts]
        if all(isinstance(v, NonTensorStack) for v in values):
            listed[key] = [x for v in values for x in v.tolist()]
            continue
        if key in pad_values and all(isinstance(v, torch.Tensor) and v.dim() >= 2 for v in values):
            width = max(v.shape[1] for v in values)
            values = [
                v
                if v.shape[1] == width
                else torch.nn.functional.pad(
                    v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1]), value=pad_values[key]
                )
                for v in values
            ]
        try:
            fields[key] = torch.cat(values)
        except (RuntimeError, TypeError) as e:
            shapes = {
                i: tuple(getattr(v, "shape", ())) for (i, _), v in zip(parts, values, strict=True)
            }
            raise BatchError(
                f"cannot concatenate the rollout replicas' {key!r} (shape by replica: {shapes}): "
                f"{e}"
            ) from e
    fields[ROLLOUT_REPLICA] = replica_col
    out = TensorDict(fields, batch_size=[int(replica_col.shape[0])])
    for key, items in listed.items():
        out[key] = NonTensorStack.from_list(items)
    return out


class ProcessRollout(BaseRollout):
    """Run ``config``'s rollout backend in ``replicas`` separate processes; this one sends
    weights and splits the prompts between them."""

    generates_elsewhere = True

    def __init__(
        self,
        config: RolloutConfig,
        *,
        replicas: int = 1,
        worker_cls: type[RolloutWorker] = RolloutWorker,
        timeout_s: float = 600.0,
        executor: Literal["local", "ray"] = "local",
        external_sender: bool = False,
    ) -> None:
        self.replicas = _check_replicas(replicas)
        if executor not in ("local", "ray"):
            raise ValueError(f"executor must be 'local' or 'ray', got {executor!r}.")
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, RolloutWorker)):
            raise TypeError(
                f"worker_cls must be RolloutWorker or a subclass of it, got {worker_cls!r}."
            )
        super().__init__(config)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.weight_sync_backend, self.timeout_s, self.executor = backend, timeout_s, executor
        self.external_sender = external_sender
        threads = torch.get_num_threads()
        per_replica = threads if self.replicas == 1 else max(1, threads // self.replicas)
        self._workers = _start_replicas(
            worker_cls,
            config.model_dump(),
            self.replicas,
            env={"OMP_NUM_THREADS": str(per_replica)},
            timeout_s=timeout_s,
            executor=executor,
        )
        # Ray may place a replica on another node: the sync store then listens on this node's
        # address (every interface) instead of loopback only
        host = meeting_host(any_node=executor == "ray")
        self._group: WeightSyncGroup | None = None
        self._sender_connected = False
        try:
            self.capabilities = self._workers[0].call_all("capabilities")[0]  # type: ignore[misc]
            if not external_sender:
                port, world = free_port(), self.replicas + 1
                self._group = self._join_replicas(
                    host,
                    port,
                    lambda: WeightSyncGroup(
                        host=host,
                        port=port,
                        rank=0,
                        world_size=world,
                        backend=backend,
                        timeout_s=timeout_s,
                    ),
                )
            self._expected: dict[str, tuple[int, ...]] = self._workers[0].call_all(
                "expected_weights"
            )[0]
            self._pad_token_id: int = self._workers[0].call_all("pad_token_id")[0]
        except BaseException:
            self.shutdown()
            raise

    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        if self.replicas == 1 or not prompts.batch_dims:
            out: TensorDict = self._workers[0].call_all("generate", prompts, params)[0]
            return _merge_replica_outputs([(0, out)], self._pad_token_id)
        bounds = _replica_bounds(prompts.batch_size[0], self.replicas)
        calls = {
            i: _Call(
                self._workers[i],
                "generate",
                prompts[start:stop],
                params.model_copy(update={"seed": _replica_seed(params.seed, i, self.replicas)}),
            )
            for i, (start, stop) in enumerate(bounds)
            if stop > start or i == 0  # no prompt at all: replica 0 answers the empty batch
        }
        results = _wait_each(calls, "generate")
        return _merge_replica_outputs(sorted(results.items()), self._pad_token_id)

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return dict(self._expected)

    def load_weight_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> str:
        raise NotImplementedError("ProcessRollout loads weights through sync_weights() only.")

    def _alongside(
        self, method: str, args: Callable[[int], tuple[Any, ...]], run: Callable[[], T]
    ) -> T:
        """Every replica calls ``method`` (replica ``i`` with ``args(i)``) on a thread while
        ``run()``, the other end of the same exchange, runs here; ``run()``'s result. If
        ``run()`` fails, the replicas are waited for (they fail or drain on their own) and its
        error is raised; otherwise a failing replica is raised, named."""
        calls = {i: _Call(w, method, *args(i)) for i, w in enumerate(self._workers)}
        try:
            result = run()
        except BaseException:
            for call in calls.values():
                with contextlib.suppress(Exception):
                    call.wait()
            raise
        _wait_each(calls, method)
        return result

    def _join_replicas(self, host: str, port: int, join_sender: Callable[[], T]) -> T:
        """Every replica joins the weight-sync group at ``host:port`` (ranks 1..N) while
        ``join_sender`` joins it as rank 0 (hosting its store); the sender's result."""
        world, backend = self.replicas + 1, self.weight_sync_backend
        return self._alongside(
            "join_weight_sync", lambda i: (port, i + 1, world, backend, host), join_sender
        )

    def connect_sender(self, host: str, port: int, join_sender: Callable[[], Any]) -> None:
        """With ``external_sender``: the weights come from another process (a trainer rank),
        which hosts the weight-sync group at ``host:port`` as rank 0 when ``join_sender()``
        runs; the replicas join it meanwhile. Then :meth:`receive_from` syncs."""
        if not self.external_sender:
            raise RuntimeError(
                "connect_sender() is for a ProcessRollout built with external_sender=True; this "
                "one sends the weights itself (sync_weights)."
            )
        if self._sender_connected:
            raise RuntimeError("a sender is already connected to this ProcessRollout.")
        self._join_replicas(host, port, join_sender)
        self._sender_connected = True

    @property
    def receiver_names(self) -> list[str]:
        """How a weight sync names each replica in its errors."""
        return [f"rollout replica {i}" for i in range(self.replicas)]

    def receive_from(self, send: Callable[[], T], *, bucket_bytes: int = BUCKET_BYTES) -> T:
        """One sync from the connected sender: every replica receives while ``send()`` (the
        sender streaming with :func:`send_weights`, ``bucket_bytes`` per bucket, naming the
        replicas :attr:`receiver_names`) runs; its result. A replica that fails verification
        fails ``send()`` naming it, and every replica still drains the stream."""
        if not self._sender_connected:
            raise RuntimeError("connect_sender() first: no sender is connected.")
        # a failing send already carries every receiver's verdict
        return self._alongside("receive_weights", lambda i: (bucket_bytes,), send)

    def sync_weights(
        self, named: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int = BUCKET_BYTES
    ) -> list[WeightBucket]:
        if self.external_sender:
            raise RuntimeError(
                "this ProcessRollout receives its weights from an external sender "
                "(external_sender=True): sync through receive_from(), not sync_weights()."
            )
        group = self._group
        if group is None:
            raise RuntimeError("this ProcessRollout has been shut down.")
        return self._alongside(
            "receive_weights",
            lambda i: (bucket_bytes,),
            lambda: send_weights(
                group, named, bucket_bytes=bucket_bytes, receiver_names=self.receiver_names
            ),
        )

    def release(self) -> None:
        _wait_each({i: _Call(w, "release") for i, w in enumerate(self._workers)}, "release")

    def resume(self) -> None:
        _wait_each({i: _Call(w, "resume") for i, w in enumerate(self._workers)}, "resume")

    def shutdown(self) -> None:
        """Stop every rollout process (all at once); safe to call twice."""
        _shutdown_all(self._workers)
        if self._group is not None:
            self._group.close()
            self._group = None


def _wait_each(calls: dict[int, _Call], what: str) -> dict[int, Any]:
    """Each replica's result (its one worker's); every call is waited for before a failure is
    raised, naming each failing replica."""
    results: dict[int, Any] = {}
    failures: list[tuple[int, BaseException]] = []
    for i, call in calls.items():
        try:
            results[i] = call.wait()[0]
        except Exception as e:
            failures.append((i, e))
    if failures:
        raise DispatchError(
            "\n".join(f"rollout replica {r} failed in {what}: {err}" for r, err in failures)
        ) from failures[0][1]
    return results


def _start_replicas(
    worker_cls: type[RolloutWorker],
    config: dict[str, Any],
    replicas: int,
    *,
    env: dict[str, str],
    timeout_s: float,
    executor: str = "local",
) -> list[WorkerGroup]:
    """One one-worker group per replica (a process, or a Ray actor), started at once; if any
    fails, the others are stopped."""
    from engine_core.executors import RayWorkerGroup

    group_cls: type[LocalWorkerGroup] | type[RayWorkerGroup] = (
        RayWorkerGroup if executor == "ray" else LocalWorkerGroup
    )
    started: list[WorkerGroup | None] = [None] * replicas
    errors: dict[int, BaseException] = {}

    def start(i: int) -> None:
        try:
            started[i] = group_cls(
                worker_cls,
                1,
                init_args=(config,),
                init_kwargs={"replica": i},
                env=env,
                call_timeout_s=timeout_s,
            )
        except BaseException as e:  # raised below, after every start has finished
            errors[i] = e

    threads = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        _shutdown_all([g for g in started if g is not None])
        i = min(errors)
        first = errors[i]
        if not isinstance(first, Exception):
            raise first
        raise DispatchError(
            f"rollout replica {i} of {replicas} failed to start (the replicas that had started "
            f"were shut down): {first}"
        ) from first
    return [g for g in started if g is not None]


def _shutdown_all(groups: list[WorkerGroup]) -> None:
    """Shut every group down, each on a thread of its own: the processes exit side by side."""
    threads = [threading.Thread(target=g.shutdown, daemon=True) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
