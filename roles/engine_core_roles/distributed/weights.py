"""The one path from a policy to a rollout: :class:`WeightLink`.

A job connects its policy (an in-process :class:`engine_core_roles.Actor`, or an
:class:`engine_core_roles.distributed.placement.ActorGroup` of worker processes) to its rollout (an in-process
:class:`engine_core.rollout.BaseRollout`, or a :class:`engine_core.remote_rollout.ProcessRollout`
of replica processes) once, with ``WeightLink(policy, rollout)``; every :meth:`WeightLink.sync`
then moves the policy's full weights into the rollout the same way:

- **One stream.** The process that holds the policy's full weights (this one for an
  :class:`Actor`; the writing rank of an actor group, while every rank takes part in the
  gathers) iterates ``named_full_params(bucket_bytes)`` and cuts it into buckets of at most
  ``bucket_bytes`` (:func:`engine_core.rollout.sent_buckets`), hashing each once.
- **One connection.** Where the rollout is in that same process, the buckets go straight to its
  :meth:`~engine_core.rollout.BaseRollout.load_weights`. Otherwise the link holds a
  :class:`engine_core.weight_sync.WeightSyncGroup` (built once, in the constructor) with the
  sender at rank 0 and the receivers (this process's rollout, or every replica) at ranks 1..N;
  each bucket is broadcast once and loaded by every receiver.
- **One verification.** Every receiver compares its checksum of what it loaded with the
  sender's, bucket by bucket; a failure names the receiver and the bucket's parameters, and
  every receiver drains the stream, so the next sync starts in step.

The driver never holds more than one bucket: with an actor group and an in-process rollout it
receives the stream bucket by bucket (``benchmarks/weight_sync_memory.py`` measures it). The
calls to worker groups are non-blocking (:class:`engine_core.executors.base.WorkerFuture`), so
this process takes its own part of the exchange without threads.

Executed here on CPU with gloo for all four pairings; the NCCL groups (CUDA hosts) are written
against the same public API and have never run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine_core.config import BUCKET_BYTES
from engine_core.executors.base import free_port, meeting_host
from engine_core.remote_rollout import ProcessRollout
from engine_core.rollout import BaseRollout, sent_buckets
from engine_core.weight_sync import WeightSyncGroup, receive_weights, send_weights
from engine_core_roles.distributed.placement import ActorGroup
from engine_core_roles.roles.actor import Actor

__all__ = ["WeightLink"]

DRIVER_ROLLOUT = "the rollout in the driver"


class WeightLink:
    """Connects ``policy`` to ``rollout``; :meth:`sync` streams the weights, verified.

    ``policy`` is an :class:`engine_core_roles.Actor` or an :class:`engine_core_roles.distributed.placement.ActorGroup`;
    ``rollout`` a :class:`BaseRollout` in this process or a :class:`ProcessRollout`. The
    connection is made here (a weight-sync group joined by both ends when they are in different
    processes) and kept until :meth:`close`.
    """

    def __init__(
        self,
        policy: Actor | ActorGroup,
        rollout: BaseRollout | ProcessRollout,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        timeout_s: float = 600.0,
    ) -> None:
        if not isinstance(policy, Actor | ActorGroup):
            raise TypeError(
                f"WeightLink connects an Actor or an ActorGroup to a rollout; got a policy of "
                f"type {type(policy).__name__}."
            )
        if not isinstance(rollout, BaseRollout | ProcessRollout):
            raise TypeError(
                f"WeightLink connects a policy to a BaseRollout or a ProcessRollout; got a "
                f"rollout of type {type(rollout).__name__}."
            )
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
            raise ValueError(
                f"bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}; the "
                f"default is {BUCKET_BYTES} (256 MiB)."
            )
        self.policy, self.rollout = policy, rollout
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self._group: WeightSyncGroup | None = None  # this process's end, when it has one
        self._policy_joined = False
        self._closed = False
        if isinstance(policy, ActorGroup):
            self._connect_group_policy(policy, rollout)
        elif isinstance(rollout, ProcessRollout):
            self._connect_replicas_to_here(rollout)

    @property
    def arrangement(self) -> str:
        """Where the sender and the receivers run, e.g. 'actor group -> rollout replicas'."""
        sender = "actor group" if isinstance(self.policy, ActorGroup) else "actor in the driver"
        receiver = (
            "rollout replicas" if isinstance(self.rollout, ProcessRollout) else "driver rollout"
        )
        return f"{sender} -> {receiver}"

    # -- connecting --------------------------------------------------------------------------

    def _join(self, host: str, port: int, rank: int, world: int) -> WeightSyncGroup:
        """This process's end of the link's group, as ``rank`` of ``world``."""
        return WeightSyncGroup(
            host=host,
            port=port,
            rank=rank,
            world_size=world,
            backend=self.backend,
            timeout_s=self.timeout_s,
        )

    def _connect_replicas_to_here(self, rollout: ProcessRollout) -> None:
        """This process sends (rank 0, hosting the group's store); the replicas receive."""
        host, port = meeting_host(rollout.worker_group.may_span_nodes), free_port()
        world = rollout.replicas + 1
        joining = rollout.join_weight_sync(host, port, 1, world)
        try:
            self._group = self._join(host, port, 0, world)
        finally:
            joining.result()

    def _connect_group_policy(
        self, actor: ActorGroup, rollout: BaseRollout | ProcessRollout
    ) -> None:
        """The actor group's writing rank sends (rank 0, hosting the store); the replicas, or
        this process for an in-process rollout, receive."""
        any_node = actor.group.may_span_nodes or (
            isinstance(rollout, ProcessRollout) and rollout.worker_group.may_span_nodes
        )
        [(host, port)] = [
            a for a in actor.group.call_all("weight_sync_address", any_node) if a is not None
        ]
        receivers = rollout.replicas if isinstance(rollout, ProcessRollout) else 1
        world = receivers + 1
        sender = actor.group.call_all_async(
            "join_weight_sync", host, port, world, self.backend, self.timeout_s
        )
        try:
            if isinstance(rollout, ProcessRollout):
                rollout.join_weight_sync(host, port, 1, world).result()
            else:
                self._group = self._join(host, port, 1, world)
        finally:
            sender.result()
        self._policy_joined = True

    # -- syncing -----------------------------------------------------------------------------

    def sync(self) -> dict[str, float]:
        """Stream the policy's full weights into the rollout, verified by every receiver; the
        metrics ``weight_sync/time_s`` and ``weight_sync/bytes`` (bytes of weights sent)."""
        if self._closed:
            raise RuntimeError(
                "this WeightLink is closed; connect the policy to the rollout again."
            )
        t0 = time.perf_counter()
        if isinstance(self.policy, ActorGroup):
            sent = self._sync_from_group(self.policy)
        else:
            sent = self._sync_from_here(self.policy)
        return {"weight_sync/time_s": time.perf_counter() - t0, "weight_sync/bytes": float(sent)}

    def _sync_from_here(self, actor: Actor) -> int:
        moved = 0

        def counted(
            named: Iterable[tuple[str, torch.Tensor]],
        ) -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal moved
            for name, t in named:
                moved += t.numel() * t.element_size()
                yield name, t

        named = counted(actor.named_full_params(self.bucket_bytes))
        if isinstance(self.rollout, BaseRollout):
            self.rollout.load_weights(sent_buckets(named, self.bucket_bytes))
            return moved
        assert self._group is not None
        receiving = self.rollout.receive_weights()
        try:
            send_weights(
                self._group,
                named,
                bucket_bytes=self.bucket_bytes,
                receiver_names=self.rollout.receiver_names,
            )
        except BaseException:
            with contextlib.suppress(Exception):  # the replicas fail or drain on their own
                receiving.result()
            raise
        receiving.result()
        return moved

    def _sync_from_group(self, actor: ActorGroup) -> int:
        names = (
            self.rollout.receiver_names
            if isinstance(self.rollout, ProcessRollout)
            else [DRIVER_ROLLOUT]
        )
        sending = actor.group.call_all_async("send_weights", self.bucket_bytes, names)
        if isinstance(self.rollout, ProcessRollout):
            receiving = self.rollout.receive_weights()
            try:
                sent = sending.result()
            except BaseException:
                with contextlib.suppress(Exception):
                    receiving.result()
                raise
            receiving.result()
            return int(sum(sent))
        assert self._group is not None
        try:
            receive_weights(self._group, self.rollout)
        except BaseException:
            with contextlib.suppress(Exception):  # the sender reports this receiver's verdict
                sending.result()
            raise
        return int(sum(sending.result()))

    def close(self) -> None:
        """Leave the weight-sync group on every end; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # an end that already stopped has nothing to leave
            if isinstance(self.rollout, ProcessRollout):
                self.rollout.leave_weight_sync()
        with contextlib.suppress(Exception):
            if self._policy_joined and isinstance(self.policy, ActorGroup):
                self.policy.group.call_all("leave_weight_sync")
        if self._group is not None:
            self._group.close()
            self._group = None

    def __enter__(self) -> WeightLink:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
