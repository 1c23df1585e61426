"""The one path from a policy to a rollout: :class:`WeightLink`.

A job connects its policy (an in-process :class:`engine_core_roles.Actor`, or an
:class:`engine_core_roles.distributed.placement.ActorGroup` of worker processes) to its rollout
(any :class:`engine_core.rollout.BaseRollout`; the link reads the rollout's declared
capabilities, never its class) once, with ``WeightLink(policy, rollout)``; every :meth:`WeightLink.sync`
then moves the policy's full weights into the rollout the same way:

- **One stream.** The process that holds the policy's full weights (this one for an
  :class:`Actor`; the writing rank of an actor group, while every rank takes part in the
  gathers) takes its engine's ``weight_buckets(part, bucket_bytes)``, buckets of at most
  ``bucket_bytes`` as the engine gathers them, and hashes each once
  (:func:`engine_core.rollout.sent_buckets`).
- **One connection.** Where the rollout is in that same process, the buckets go straight to its
  :meth:`~engine_core.rollout.BaseRollout.load_weights`. Otherwise the link holds a
  :class:`engine_core.weight_sync.WeightSyncGroup` (built once, in the constructor) with the
  sender at rank 0 and the receivers (this process's rollout, or every replica) at ranks 1..N;
  each bucket is broadcast once and loaded by every receiver.
- **One verification.** Every receiver compares its checksum of what it loaded with the
  sender's, bucket by bucket; a failure names the receiver and the bucket's parameters, and
  every receiver drains the stream, so the next sync starts in step.

**LoRA.** A rollout that serves LoRA adapters (built with the policy's ``model.lora``, its
weights name the adapter tensors: the hf, vllm and sglang rollouts) is sent the policy's peft
tensors unmerged: all of them at the first sync, then the adapters alone
(:attr:`WeightLink.next_part`), since the base does not train. A rollout whose weights are the
base model's takes the merged weights under those names.

Replicas in another interpreter (``ProcessRollout(python=...)``) share no torch process group
with the trainer: this process is their receiving end, as for a rollout of its own, and relays
each bucket to every replica over its pipe as raw tensor bytes with the sender's checksum
(:meth:`engine_core.remote_rollout.ProcessRollout.load_weights`); each replica verifies what it
loaded against that checksum.

Each end knows its own transport: the policy is a :class:`_DriverSender` (an :class:`Actor` here)
or a :class:`_GroupSender` (an actor group's writing rank), the rollout a :class:`_DriverReceiver`
(a rollout that loads its weights in this process) or a :class:`_ReplicaReceiver` (a rollout
that declares ``weight_sync_group``: every replica of a
:class:`engine_core.remote_rollout.ProcessRollout`). An end in this process does its part of an exchange when asked; an end
in worker processes starts its part at once (a non-blocking call) and is waited for after, so
one process takes part without threads.

No end holds more than about one bucket, whatever the model's size: the sender and the
receivers each let go of a bucket before the next one is gathered or received
(``benchmarks/weight_sync_scaling.py`` measures the sender, the other ranks and the driver at
three model sizes; ``benchmarks/weight_sync_memory.py`` the driver at two bucket sizes).

Executed here on CPU with gloo for all four pairings; the NCCL groups (CUDA hosts) are written
against the same public API and have never run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from engine_core.capabilities import Capability
from engine_core.comm import default_backend
from engine_core.config import BUCKET_BYTES
from engine_core.engine import WeightPart
from engine_core.executors.base import free_port, meeting_host
from engine_core.models import is_adapter_name
from engine_core.rollout import DRIVER_ROLLOUT, BaseRollout, sent_buckets
from engine_core.weight_sync import WeightSyncGroup, receive_weights, send_weights
from engine_core_roles.distributed.placement import ActorGroup
from engine_core_roles.models.actor import Actor

__all__ = ["DRIVER_ROLLOUT", "WeightLink"]


class _Part:
    """One end's part of an exchange: ``here`` runs in this process when waited for (blocking);
    otherwise it is already running in worker processes, and waiting collects it."""

    def __init__(self, wait: Callable[[], Any], *, here: bool) -> None:
        self.wait, self.here = wait, here


def _together(*parts: _Part) -> list[Any]:
    """Every part done, this process's first (the others are already under way and wait for
    it), then the others in order; when one fails, the others are still waited for (their
    errors follow from it) and the first failure is raised."""
    order = sorted(range(len(parts)), key=lambda i: not parts[i].here)
    results: list[Any] = [None] * len(parts)
    for n, i in enumerate(order):
        try:
            results[i] = parts[i].wait()
        except BaseException:
            for j in order[n + 1 :]:
                with contextlib.suppress(Exception):  # they fail or drain on their own
                    parts[j].wait()
            raise
    return results


class _Sender:
    """The end that holds the policy's full weights: rank 0 of the link's group."""

    here: bool
    spans_nodes: bool

    def address(self, any_node: bool) -> tuple[str, int]:
        raise NotImplementedError

    def join(self, host: str, port: int, world: int, backend: str, timeout_s: float) -> _Part:
        raise NotImplementedError

    def send(self, bucket_bytes: int, receivers: list[str], part: WeightPart) -> _Part:
        """Stream ``part`` of the weights to ``receivers`` (one name per receiving rank); the
        part's result is the bytes of weights sent."""
        raise NotImplementedError

    def leave(self) -> None:
        raise NotImplementedError


class _DriverSender(_Sender):
    """An :class:`Actor` in this process."""

    here, spans_nodes = True, False

    def __init__(self, actor: Actor) -> None:
        self.actor = actor
        self.group: WeightSyncGroup | None = None

    def address(self, any_node: bool) -> tuple[str, int]:
        return meeting_host(any_node), free_port()

    def join(self, host: str, port: int, world: int, backend: str, timeout_s: float) -> _Part:
        def joined() -> None:
            self.group = WeightSyncGroup(
                host=host, port=port, rank=0, world_size=world, backend=backend, timeout_s=timeout_s
            )

        return _Part(joined, here=True)

    def send(self, bucket_bytes: int, receivers: list[str], part: WeightPart) -> _Part:
        def sent() -> int:
            assert self.group is not None  # joined when the link was made
            buckets = self.actor.engine.weight_buckets(part, bucket_bytes)
            send_weights(self.group, buckets, bucket_bytes=bucket_bytes, receiver_names=receivers)
            return buckets.bytes

        return _Part(sent, here=True)

    def direct(self, rollout: BaseRollout, bucket_bytes: int, part: WeightPart) -> int:
        """The weights straight into a rollout in this process (no group)."""
        buckets = self.actor.engine.weight_buckets(part, bucket_bytes)
        rollout.load_weights(sent_buckets(buckets))
        return buckets.bytes

    def leave(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class _GroupSender(_Sender):
    """An :class:`ActorGroup`: every rank takes part in the gathers, the writing rank sends."""

    here = False

    def __init__(self, actor: ActorGroup) -> None:
        self.actor = actor
        self.spans_nodes = actor.group.may_span_nodes
        self._joined = False

    def address(self, any_node: bool) -> tuple[str, int]:
        [(host, port)] = [
            a for a in self.actor.group.call_all("weight_sync_address", any_node) if a is not None
        ]
        return host, port

    def join(self, host: str, port: int, world: int, backend: str, timeout_s: float) -> _Part:
        joining = self.actor.group.call_all_async(
            "join_weight_sync", host, port, world, backend, timeout_s
        )
        self._joined = True
        return _Part(joining.result, here=False)

    def send(self, bucket_bytes: int, receivers: list[str], part: WeightPart) -> _Part:
        sending = self.actor.group.call_all_async("send_weights", bucket_bytes, receivers, part)
        return _Part(lambda: int(sum(sending.result())), here=False)

    def leave(self) -> None:
        if self._joined:
            self.actor.group.call_all("leave_weight_sync")


class _Receiver:
    """The end that loads the weights: ranks 1..N of the link's group, one per name."""

    here: bool
    spans_nodes: bool
    names: list[str]

    def join(self, host: str, port: int, world: int, backend: str, timeout_s: float) -> _Part:
        raise NotImplementedError

    def receive(self) -> _Part:
        raise NotImplementedError

    def leave(self) -> None:
        raise NotImplementedError


class _DriverReceiver(_Receiver):
    """A rollout that loads its weights through ``load_weights`` in this process (replicas in
    another interpreter too: this process relays every bucket to them over their pipes)."""

    here, spans_nodes = True, False

    def __init__(self, rollout: BaseRollout) -> None:
        self.rollout = rollout
        self.names = list(rollout.receiver_names)
        self.group: WeightSyncGroup | None = None

    def join(self, host: str, port: int, world: int, backend: str, timeout_s: float) -> _Part:
        def joined() -> None:
            self.group = WeightSyncGroup(
                host=host, port=port, rank=1, world_size=world, backend=backend, timeout_s=timeout_s
            )

        return _Part(joined, here=True)

    def receive(self) -> _Part:
        def received() -> None:
            assert self.group is not None  # joined when the link was made
            receive_weights(self.group, self.rollout)

        return _Part(received, here=True)

    def leave(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class _ReplicaReceiver(_Receiver):
    """The processes of a rollout that declares ``weight_sync_group`` (every replica of a
    :class:`ProcessRollout`), receiver ``i`` as rank ``1 + i``."""

    here = False

    def __init__(self, rollout: BaseRollout) -> None:
        self.rollout = rollout
        self.spans_nodes = rollout.may_span_nodes
        self.names = rollout.receiver_names

    def join(self, host: str, port: int, world: int, backend: str, timeout_s: float) -> _Part:
        del backend, timeout_s  # the replicas use their rollout's own
        return _Part(self.rollout.join_weight_sync(host, port, 1, world).result, here=False)

    def receive(self) -> _Part:
        return _Part(self.rollout.receive_weights().result, here=False)

    def leave(self) -> None:
        self.rollout.leave_weight_sync()


def _sender(policy: Actor | ActorGroup) -> _Sender:
    if isinstance(policy, ActorGroup):
        return _GroupSender(policy)
    if isinstance(policy, Actor):
        return _DriverSender(policy)
    raise TypeError(
        f"WeightLink connects an Actor or an ActorGroup to a rollout; got a policy of "
        f"type {type(policy).__name__}."
    )


def _receiver(rollout: BaseRollout) -> _Receiver:
    capabilities = getattr(rollout, "capabilities", None)
    if not isinstance(capabilities, frozenset):
        raise TypeError(
            f"WeightLink connects a policy to a rollout (an engine_core.rollout.BaseRollout); "
            f"got {type(rollout).__name__}, which declares no capabilities."
        )
    if Capability.WEIGHT_SYNC_GROUP in capabilities:
        return _ReplicaReceiver(rollout)
    return _DriverReceiver(rollout)


class WeightLink:
    """Connects ``policy`` to ``rollout``; :meth:`sync` streams the weights, verified.

    ``policy`` is an :class:`engine_core_roles.Actor` or an
    :class:`engine_core_roles.distributed.placement.ActorGroup`; ``rollout`` any
    :class:`BaseRollout` (its replicas join the link's group where it declares
    ``weight_sync_group``). The connection is made
    here (a weight-sync group joined by both ends when they are in different processes) and
    kept until :meth:`close`.
    """

    def __init__(
        self,
        policy: Actor | ActorGroup,
        rollout: BaseRollout,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        timeout_s: float = 600.0,
    ) -> None:
        sender, receiver = _sender(policy), _receiver(rollout)
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
            raise ValueError(
                f"bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}; the "
                f"default is {BUCKET_BYTES} (256 MiB)."
            )
        self.policy, self.rollout = policy, rollout
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.backend = default_backend()
        self._sender, self._receiver = sender, receiver
        self._closed = False
        # a rollout that serves LoRA adapters (its weights name them) takes the policy's peft
        # tensors unmerged: all of them once, then the adapters alone (the base is frozen)
        self.serves_adapters = any(is_adapter_name(n) for n in rollout.expected_weights())
        self._base_sent = False
        # both ends in this process: the buckets go straight to the rollout, no group
        self._direct = sender.here and receiver.here
        if not self._direct:
            host, port = sender.address(sender.spans_nodes or receiver.spans_nodes)
            world = len(receiver.names) + 1
            args = (host, port, world, self.backend, timeout_s)
            _together(sender.join(*args), receiver.join(*args))

    @property
    def arrangement(self) -> str:
        """Where the sender and the receivers run, e.g. 'actor group -> rollout replicas'."""
        sender = "actor in the driver" if self._sender.here else "actor group"
        receiver = "driver rollout" if self._receiver.here else "rollout replicas"
        return f"{sender} -> {receiver}"

    def sync(self) -> dict[str, float]:
        """Stream the policy's weights (:attr:`next_part` of them) into the rollout, verified by
        every receiver; the metrics ``weight_sync/time_s`` and ``weight_sync/bytes`` (bytes of
        weights sent)."""
        if self._closed:
            raise RuntimeError(
                "this WeightLink is closed; connect the policy to the rollout again."
            )
        t0 = time.perf_counter()
        part = self.next_part
        if self._direct:
            assert isinstance(self._sender, _DriverSender)
            assert isinstance(self._receiver, _DriverReceiver)
            sent = self._sender.direct(self._receiver.rollout, self.bucket_bytes, part)
        else:
            sending = self._sender.send(self.bucket_bytes, self._receiver.names, part)
            sent, _ = _together(sending, self._receiver.receive())
        self._base_sent = self.serves_adapters  # only once every receiver verified it all
        return {"weight_sync/time_s": time.perf_counter() - t0, "weight_sync/bytes": float(sent)}

    @property
    def next_part(self) -> WeightPart:
        """What the next :meth:`sync` sends: the full weights ("model"); for a rollout that
        serves LoRA adapters, the policy's peft tensors until one sync of them all succeeded
        ("peft"), then the adapters alone ("adapters")."""
        if not self.serves_adapters:
            return "model"
        return "adapters" if self._base_sent else "peft"

    def close(self) -> None:
        """Leave the weight-sync group on every end; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # an end that already stopped has nothing to leave
            self._receiver.leave()
        with contextlib.suppress(Exception):
            self._sender.leave()

    def __enter__(self) -> WeightLink:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
