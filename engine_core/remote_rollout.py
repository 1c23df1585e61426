"""Rollouts in their own processes: generation by RPC, weights over a :class:`WeightSyncGroup`.

:class:`ProcessRollout` runs a rollout backend (any registered rollout: ``hf``, ``vllm``, ...)
in ``replicas`` worker processes: one worker group of ``replicas`` :class:`RolloutWorker`
(spawned processes, or Ray actors with ``executor="ray"``), each worker replica ``i`` of the
group's ``rollout`` mesh (its dp rank). This process only sends work; the weights reach the
replicas through a weight-sync group they join (:meth:`ProcessRollout.join_weight_sync`,
:meth:`ProcessRollout.receive_weights`), which the job's weight link
(:class:`engine_core_roles.distributed.weights.WeightLink`) builds with the policy at rank 0,
wherever the policy runs.

It is a :class:`BaseRollout` like any other to the layers above: it declares the replicas'
capabilities and two of its own, ``async_generation`` (:meth:`ProcessRollout.generate_async`)
and, unless its replicas run in another interpreter, ``weight_sync_group`` (the replicas
receive the weights themselves; it loads none in this process). Replicas in another interpreter
take their weights through :meth:`ProcessRollout.load_weights`, relayed from this process.

- ``generate`` splits the prompts by prompt into ``replicas`` contiguous, near-equal chunks (all
  ``n`` samples of a prompt come from one replica; a replica with no prompt generates nothing),
  sends every replica its chunk in one non-blocking call and concatenates their results in
  prompt order, so the rows are ordered as a single rollout's: prompt ``i``'s samples at rows
  ``i*n .. i*n+n-1``. Response-shaped fields are right-padded to the longest replica's width
  (``response_ids`` with the backend's pad id, ``response_mask`` and ``rollout_log_probs`` with
  0). Each row's ``rollout_replica`` (:data:`ROLLOUT_REPLICA`) says which replica generated it.
  With ``SamplingParams.seed`` set, the prompts travel with their ``prompt_seed`` column
  (:func:`engine_core.rollout.prompt_seeds`: each prompt's seed from its index in the whole
  call), so a prompt's samples are those one rollout in this process would draw, however many
  replicas share the call.
- ``generate_async`` is the same call without waiting: a future of the merged result, so a
  trainer can train while the replicas generate.
- ``release`` / ``resume`` / ``shutdown`` apply to every replica. If a replica fails to start,
  the group is shut down.
- Each replica runs ``threads_per_replica`` CPU threads (default: this machine's cores shared
  between the replicas, :func:`engine_core.executors.base.threads_per_process`).

Executed on CPU with gloo, with one and two replicas, as local processes and as Ray actors on
one machine (a cluster of several nodes has not been tried). On a CUDA host the weight-sync group uses
NCCL: that path is written but has never been executed, and it places no replica on a device of
its own (every process uses its current CUDA device).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
from tensordict import NonTensorStack, TensorDict

from engine_core.capabilities import Capability
from engine_core.comm import default_backend
from engine_core.dispatch import Worker
from engine_core.errors import BatchError, ConfigError, DispatchError, WeightSyncError
from engine_core.executors.base import (
    WorkerFuture,
    WorkerGroup,
    threads_per_process,
)
from engine_core.launch import RENDEZVOUS, unset_for_process
from engine_core.rollout import (
    PROMPT_SEED,
    RESPONSE_IDS,
    RESPONSE_LOSS_MASK,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ROLLOUT_REPLICA,
    ROLLOUT_TOP_IDS,
    ROLLOUT_TOP_LOG_PROBS,
    BaseRollout,
    RolloutConfig,
    SamplingParams,
    SentBucket,
    WeightBucket,
    prompt_seeds,
    prompt_tensors,
)
from engine_core.settings import launch_from_env
from engine_core.weight_sync import WeightSyncGroup, receive_weights

__all__ = ["RolloutWorker", "ProcessRollout", "ROLLOUT_MESH", "RELAYED_REPLICAS"]

ROLLOUT_MESH = "rollout"
#: how a weight sync names replicas in another interpreter (this process relays to them)
RELAYED_REPLICAS = "the rollout replicas in another interpreter (through the driver)"


class RolloutWorker(Worker):
    """Hosts one rollout backend in a worker process: replica :attr:`replica` of a
    ProcessRollout, its rank in the worker group (dp rank of the ``rollout`` mesh)."""

    def __init__(self, config: dict[str, Any]) -> None:
        from engine_core.plugins import load_plugins
        from engine_core.resolve import resolve_rollout_config

        # a replica is not a rank of a torch process group: the executor's rendezvous variables
        # are hidden from the backend it hosts (some read RANK / LOCAL_RANK / WORLD_SIZE)
        launch = launch_from_env()
        self.replica, replicas = launch.rank, launch.world_size
        unset_for_process(RENDEZVOUS)
        self.register_mesh(ROLLOUT_MESH, dp_rank=self.replica, dp_size=replicas, is_collect=True)
        spec, cfg = resolve_rollout_config(config, load_plugins())
        self.rollout: BaseRollout = spec.load_class()(cfg)
        self.group: WeightSyncGroup | None = None
        self._stream: _CallStream | None = None

    def describe(self) -> tuple[frozenset[Any], dict[str, tuple[int, ...]], int]:
        """The backend's capabilities, the weights it takes and its pad id, in one call."""
        return frozenset(self.rollout.capabilities), self.rollout.expected_weights(), self.pad_id()

    def pad_id(self) -> int:
        """The id the backend right-pads ``response_ids`` with."""
        return self.rollout.pad_token_id

    def generate(self, prompts: TensorDict | None, params: SamplingParams) -> TensorDict | None:
        """This replica's share of a batch (``None``: no prompt for this replica)."""
        return None if prompts is None else self.rollout.generate(prompts, params)

    def join_weight_sync(
        self, host: str, port: int, first_rank: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        """Join the weight-sync group at ``host:port`` as rank ``first_rank + replica``."""
        self.leave_weight_sync()
        self.group = WeightSyncGroup(
            host=host,
            port=port,
            rank=first_rank + self.replica,
            world_size=world_size,
            backend=backend,
            timeout_s=timeout_s,
        )

    def receive_weights(self) -> list[WeightBucket]:
        if self.group is None:
            raise RuntimeError("join_weight_sync() first: this replica is in no weight-sync group.")
        return receive_weights(self.group, self.rollout)

    def leave_weight_sync(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    # a weight stream whose buckets arrive one call each (a replica in another interpreter)
    def begin_weights(self) -> None:
        """Start loading a weight stream that :meth:`weight_bucket` feeds, bucket by bucket."""
        self.end_weights(abort=True)
        self._stream = _CallStream(self.rollout)

    def weight_bucket(self, bucket: list[tuple[str, torch.Tensor]], sent: str) -> None:
        """The stream's next bucket and the sender's checksum of it; raises at once when the
        loading has already failed (the stream is then over: begin again)."""
        if self._stream is None:
            raise WeightSyncError("weight_bucket() outside a stream: call begin_weights() first.")
        self._stream.put((list(bucket), sent))

    def end_weights(self, abort: bool = False) -> list[WeightBucket]:
        """End the stream: every bucket loaded and verified (names, shapes, checksums, none
        missing), or its error raised; ``abort``: drop it quietly."""
        stream, self._stream = self._stream, None
        if stream is None:
            if abort:
                return []
            raise WeightSyncError("end_weights() outside a stream: call begin_weights() first.")
        return stream.finish(abort=abort)

    def release(self) -> None:
        self.rollout.release()

    def resume(self) -> None:
        self.rollout.resume()


_END = object()


class _CallStream:
    """A backend's ``load_weights`` fed from calls: it runs in a thread of its own that pulls
    buckets from a one-slot queue, so the replica holds at most the bucket being loaded and the
    next one."""

    def __init__(self, rollout: BaseRollout) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._result: list[WeightBucket] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._load, args=(rollout,), daemon=True)
        self._thread.start()

    def _buckets(self) -> Iterator[SentBucket]:
        while (item := self._queue.get()) is not _END:
            yield item

    def _load(self, rollout: BaseRollout) -> None:
        try:
            self._result = rollout.load_weights(self._buckets())
        except BaseException as e:
            self._error = e
            with contextlib.suppress(queue.Empty):  # unblock a put waiting for the slot
                self._queue.get_nowait()

    def _offer(self, item: Any) -> bool:
        """Hand ``item`` to the loading thread; False when it has stopped (done or failed)."""
        while self._thread.is_alive():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def put(self, item: SentBucket) -> None:
        if not self._offer(item):
            self._raise()
            raise WeightSyncError("the replica stopped loading before the stream ended.")

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def finish(self, *, abort: bool) -> list[WeightBucket]:
        self._offer(_END)
        self._thread.join(5.0 if abort else None)
        if abort:
            return []
        self._raise()
        assert self._result is not None  # the thread ended without an error
        return self._result


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
        RESPONSE_LOSS_MASK: 0,
        ROLLOUT_LOG_PROBS: 0.0,
        ROLLOUT_TOP_IDS: 0,
        ROLLOUT_TOP_LOG_PROBS: 0.0,
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
    """Run ``config``'s rollout backend in ``replicas`` separate processes (one worker group);
    this process splits the prompts between them and merges what they generate.

    ``worker_cls`` (a :class:`RolloutWorker`) is built in each process with the config's dict
    and ``worker_args``: a subclass can wrap the backend it hosts (the roles' episode rollout
    does, so an episode's turns all run on one replica). On Ray, each replica is placed with
    ``resources`` by ``strategy`` (:class:`~engine_core.executors.ray.RayWorkerGroup`)."""

    def __init__(
        self,
        config: RolloutConfig,
        *,
        replicas: int = 1,
        worker_cls: type[RolloutWorker] = RolloutWorker,
        timeout_s: float = 600.0,
        executor: Literal["local", "ray"] = "local",
        threads_per_replica: int | None = None,
        worker_args: tuple[Any, ...] = (),
        python: str | None = None,
        resources: Mapping[str, float] | None = None,
        strategy: str = "PACK",
    ) -> None:
        self.replicas = _check_replicas(replicas)
        if executor not in ("local", "ray"):
            raise ValueError(f"executor must be 'local' or 'ray', got {executor!r}.")
        if python is not None and executor != "local":
            raise ConfigError(
                f"rollout replicas in another interpreter (python={python!r}) run as local "
                f"processes; got executor={executor!r}. Use the local executor, or leave python "
                "unset."
            )
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, RolloutWorker)):
            raise TypeError(
                f"worker_cls must be RolloutWorker or a subclass of it, got {worker_cls!r}."
            )
        if threads_per_replica is None:
            threads_per_replica = threads_per_process(self.replicas)
        super().__init__(config)
        self.weight_sync_backend = default_backend()
        self.timeout_s, self.executor = timeout_s, executor
        #: the interpreter the replicas run in (None: this one); see :attr:`streams_weights`
        self.python = python
        #: what that interpreter runs (python, torch, engine_core, rollouts), when it is another
        self.interpreter: dict[str, Any] | None = None
        env = {"OMP_NUM_THREADS": str(threads_per_replica)}
        if python is not None:
            from engine_core.executors.interpreter import InterpreterWorkerGroup, check_interpreter

            self.interpreter = check_interpreter(
                python, config.backend, worker_module=worker_cls.__module__
            )
            self._group: WorkerGroup | None = _named_start_failure(
                self.replicas,
                lambda: InterpreterWorkerGroup(
                    worker_cls,
                    self.replicas,
                    python=python,
                    init_args=(config.model_dump(mode="json"), *worker_args),
                    env=env,
                    call_timeout_s=timeout_s,
                ),
            )
        else:
            self._group = _start_replicas(
                worker_cls,
                (config.model_dump(), *worker_args),
                self.replicas,
                env=env,
                timeout_s=timeout_s,
                executor=executor,
                resources=resources,
                strategy=strategy,
            )
        try:
            caps, expected, pad = self._group.call_all("describe")[0]
        except BaseException:
            self.shutdown()
            raise
        own = {Capability.ASYNC_GENERATION}
        if not self.streams_weights:
            own.add(Capability.WEIGHT_SYNC_GROUP)
        # the replicas' capabilities, which this object knows once they started
        self.capabilities = frozenset(caps) | own  # type: ignore[misc]
        self._expected: dict[str, tuple[int, ...]] = expected
        self.pad_token_id = pad

    @property
    def worker_group(self) -> WorkerGroup:
        """The replicas' worker group (replica ``i`` is worker ``i``)."""
        if self._group is None:
            raise RuntimeError("this ProcessRollout has been shut down.")
        return self._group

    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        out: TensorDict = self.generate_async(prompts, params).result()
        return out

    def generate_async(self, prompts: TensorDict, params: SamplingParams) -> WorkerFuture:
        """:meth:`generate` without waiting: a future of its result. The request is checked
        here first (the prompts' layout, the params), so bad input is refused before any
        replica is sent anything."""
        if prompts.batch_dims and prompts.batch_size[0]:
            images = Capability.VISION in self.capabilities
            prompt_tensors(prompts, "ProcessRollout.generate", images=images)
        self.check_params(params)
        n = prompts.batch_size[0] if prompts.batch_dims else 0
        seeds = prompt_seeds(prompts, params) if prompts.batch_dims else None
        if seeds is not None and PROMPT_SEED not in prompts.keys():
            prompts = prompts.clone(recurse=False)  # the caller's batch keeps its columns
            prompts[PROMPT_SEED] = torch.tensor(seeds, dtype=torch.int64)
        per_replica: list[tuple[Any, ...]] = []
        for i, (start, stop) in enumerate(_replica_bounds(n, self.replicas)):
            if not prompts.batch_dims:  # no batch dimension: replica 0 answers as it is
                per_replica.append((prompts if i == 0 else None, params))
            else:  # no prompt at all: replica 0 answers the empty batch
                part = prompts[start:stop] if stop > start or i == 0 else None
                per_replica.append((part, params))
        future = self.worker_group.call_each_async("generate", per_replica)
        return future.map(self._merge)

    def _merge(self, outputs: list[TensorDict | None]) -> TensorDict:
        parts = [(i, out) for i, out in enumerate(outputs) if out is not None]
        return _merge_replica_outputs(parts, self.pad_token_id)

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return dict(self._expected)

    @property
    def streams_weights(self) -> bool:
        """Whether weights reach the replicas through this process, bucket by bucket over their
        pipes (:meth:`load_weights`): replicas in another interpreter, which share no torch
        process group with the trainer. Otherwise they join a weight-sync group."""
        return self.python is not None

    @property
    def may_span_nodes(self) -> bool:
        return self.worker_group.may_span_nodes

    def load_weights(self, buckets: Iterable[SentBucket]) -> list[WeightBucket]:
        """Every replica loads the stream ``buckets`` (each bucket sent to all of them as raw
        tensor bytes with the sender's checksum) and verifies it as a rollout in this process
        would: names, shapes, none missing, and its checksum of what it loaded against the
        sender's. Replica 0's verified buckets are returned; any replica's failure is raised,
        naming it, after every replica has dropped the stream."""
        group = self.worker_group
        group.call_all("begin_weights")
        try:
            for bucket, sent in buckets:
                group.call_all("weight_bucket", bucket, sent)
        except BaseException:
            with contextlib.suppress(Exception):  # the failure above is the one to report
                group.call_all("end_weights", abort=True)
            raise
        done: list[WeightBucket] = group.call_all("end_weights")[0]
        return done

    @property
    def receiver_names(self) -> list[str]:
        """How a weight sync names each replica in its errors (replicas in another interpreter:
        one receiver, this process, which relays every bucket to them)."""
        if self.streams_weights:
            return [RELAYED_REPLICAS]
        return [f"rollout replica {i}" for i in range(self.replicas)]

    def join_weight_sync(
        self, host: str, port: int, first_rank: int, world_size: int
    ) -> WorkerFuture:
        """Every replica joins the weight-sync group at ``host:port``, replica ``i`` as rank
        ``first_rank + i``; a future of their joining (the group's rank 0 joins meanwhile).
        Replicas in another interpreter join none (their weights come through
        :meth:`load_weights`)."""
        if self.streams_weights:
            raise WeightSyncError(
                "replicas in another interpreter join no weight-sync group: their weights "
                "arrive through load_weights()."
            )
        return self.worker_group.call_all_async(
            "join_weight_sync",
            host,
            port,
            first_rank,
            world_size,
            self.weight_sync_backend,
            self.timeout_s,
        )

    def receive_weights(self) -> WorkerFuture:
        """Every replica receives one weight stream from rank 0 of its group, verified; a
        future of each replica's loaded buckets (the sender streams meanwhile)."""
        return self.worker_group.call_all_async("receive_weights")

    def leave_weight_sync(self) -> None:
        if self._group is not None:
            self._group.call_all("leave_weight_sync")

    def release(self) -> None:
        self.worker_group.call_all("release")

    def resume(self) -> None:
        self.worker_group.call_all("resume")

    def shutdown(self) -> None:
        """Stop every rollout process; safe to call twice."""
        if self._group is not None:
            group, self._group = self._group, None
            group.shutdown()


def _named_start_failure(replicas: int, start: Callable[[], WorkerGroup]) -> WorkerGroup:
    """``start()``, its failure to start named as the rollout replicas'."""
    try:
        group: WorkerGroup = start()
    except DispatchError as e:
        raise DispatchError(
            f"the rollout replicas failed to start ({replicas} of them; every replica was shut "
            f"down): {e}"
        ) from e
    return group


def _start_replicas(
    worker_cls: type[RolloutWorker],
    init_args: tuple[Any, ...],
    replicas: int,
    *,
    env: dict[str, str],
    timeout_s: float,
    executor: str = "local",
    resources: Mapping[str, float] | None = None,
    strategy: str = "PACK",
) -> WorkerGroup:
    """One worker group of ``replicas`` workers (processes, or Ray actors), started at once; a
    replica that fails to start is named and the group is shut down."""
    from engine_core.executors import start_worker_group

    return _named_start_failure(
        replicas,
        lambda: start_worker_group(
            "ray" if executor == "ray" else "local",
            worker_cls,
            replicas,
            init_args=init_args,
            env=env,
            call_timeout_s=timeout_s,
            resources=resources,
            strategy=strategy,
        ),
    )
