"""The Ray executor: one Ray actor per worker, same dispatch/collect as the local executor.

Needs the optional extra: ``pip install 'engine-core[ray]'``. Ray is imported only when a
``RayWorkerGroup`` is created. Ray writes an auth token under the home directory unless
``RAY_AUTH_MODE=disabled`` is set before ``ray.init``; set it where that matters (tests do).
Each worker is one bundle of a Ray placement group: ``resources`` per worker (default
``{"CPU": 0.01}``, so small hosts can place several; ``GPU`` and custom resources as Ray names
them), the bundles placed by ``strategy`` (``PACK``: as few nodes as fit, ``SPREAD``,
``STRICT_PACK``, ``STRICT_SPREAD``). A group the cluster has no room for is refused, naming what
each node has free. The workers meet at this node's address, so a group may span nodes; a worker
whose node leaves the cluster is named with that node. The timeouts are the local executor's:
``call_timeout_s`` per call (and for the group to be placed and its actors to start),
``collective_timeout_s`` for the workers' process group. A worker's errors are raised as the
local executor raises them (:mod:`engine_core.executors.worker_errors`).

Run here on one machine, with several raylets as separate nodes (Ray's test cluster); never on
separate machines.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine_core.errors import DispatchError
from engine_core.executors.base import (
    DEFAULT_CALL_TIMEOUT_S,
    FAILURE_GRACE_S,
    Calls,
    WorkerFuture,
    WorkerGroup,
    enter_worker_env,
    host_rendezvous,
    meeting_host,
    no_answer,
    worker_env,
)
from engine_core.executors.worker_errors import WorkerErrorInfo, error_payload, worker_failure

__all__ = ["RayWorkerGroup", "STRATEGIES"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# how long a failed call waits for the cluster to say whether an unreachable worker's node left
NODE_LOSS_WAIT_S = 60.0
# what a worker's error says when a collective's peer went away (gloo, NCCL)
PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited",
)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "RayWorkerGroup needs Ray, which is not installed. Install it with: "
            "pip install 'engine-core[ray]'"
        ) from e
    return ray


class _Host:
    """Holds one worker inside a Ray actor; the environment is set before it is built.

    The worker's errors come back as plain data (:func:`error_payload`), as from the local
    executor's processes, so both raise the same types; what Ray itself raises (an actor
    that died, an interrupt) stays Ray's.
    """

    def __init__(self, cls: type, init_args: tuple, init_kwargs: dict, env: dict[str, str]) -> None:
        self.failed: dict[str, Any] | None = None
        try:
            enter_worker_env(env)
            self.worker = cls(*init_args, **init_kwargs)
        except Exception as e:
            self.failed = error_payload(e)

    def ready(self) -> dict[str, Any] | None:
        """None once the worker is built; else the error its construction raised."""
        return self.failed

    def node(self) -> tuple[str, str]:
        """The Ray node this worker runs on: its id and address."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def call(self, method: str, args: tuple, kwargs: dict) -> tuple[str, Any]:
        try:
            return ("ok", getattr(self.worker, method)(*args, **kwargs))
        except Exception as e:
            return ("error", error_payload(e))


class RayWorkerGroup(WorkerGroup):
    """``num_workers`` Ray actors, each holding one ``worker_cls`` instance."""

    may_span_nodes = True

    def __init__(
        self,
        worker_cls: type,
        num_workers: int,
        *,
        init_args: tuple[Any, ...] = (),
        init_kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        num_cpus: float = 0.01,
        resources: Mapping[str, float] | None = None,
        strategy: str = "PACK",
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        collective_timeout_s: float | None = None,
    ) -> None:
        super().__init__(
            worker_cls,
            num_workers,
            call_timeout_s=call_timeout_s,
            collective_timeout_s=collective_timeout_s,
        )
        ray = _import_ray()
        if not ray.is_initialized():
            raise DispatchError(
                "Ray is not initialized; call ray.init(...) (e.g. ray.init(num_cpus=2)) before "
                "creating a RayWorkerGroup."
            )
        self._ray = ray
        self._placement: Any = None
        #: (node id, address) of each worker, in worker order
        self.nodes: list[tuple[str, str]] = []
        bundle = _bundle(num_cpus, resources)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}.")
        self._placement = _placed(ray, bundle, num_workers, strategy, self.call_timeout_s)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        host = ray.remote(_Host)
        self._store, port = host_rendezvous(num_workers)
        # the group's members meet at this node's address: Ray may place them on other nodes
        meet = {**(env or {}), "MASTER_ADDR": meeting_host(True)}
        self._actors = [
            host.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=r
                ),
            ).remote(
                worker_cls,
                init_args,
                dict(init_kwargs or {}),
                worker_env(
                    r,
                    num_workers,
                    port,
                    meet,
                    collective_timeout_s=self.collective_timeout_s,
                    hosted=True,
                ),
            )
            for r in range(num_workers)
        ]
        try:  # surfaces a constructor failure here, with the worker index
            for i, actor in enumerate(self._actors):
                try:
                    failed = ray.get(actor.ready.remote(), timeout=self.call_timeout_s)
                except ray.exceptions.RayError as e:
                    raise DispatchError(f"worker {i} failed to start:\n{e}") from None
                if failed is not None:
                    described = WorkerErrorInfo.parse(failed).describe()
                    summary = f"worker {i} failed to start: {described}"
                    raise worker_failure(summary, {i: failed}, method="__init__")
            self.nodes = [tuple(n) for n in ray.get([a.node.remote() for a in self._actors])]
        except BaseException:
            self.shutdown()
            raise

    def where(self) -> str:
        """Where the workers run: each node's address and id, with how many workers."""
        counts: dict[tuple[str, str], int] = {}
        for node in self.nodes:
            counts[node] = counts.get(node, 0) + 1
        return ", ".join(f"{n} on node {ip} ({nid[:8]})" for (nid, ip), n in counts.items())

    def _gone_nodes(self, wait_for: Sequence[int] = (), any_node: bool = False) -> set[str] | None:
        """The ids of this group's nodes that are no longer in the cluster (None: unknown).

        With ``wait_for`` (workers Ray could not reach), up to :data:`NODE_LOSS_WAIT_S` for
        the cluster to tell whether their nodes left: it marks a node dead only after missed
        health checks. With ``any_node``, as long for any of the group's nodes to leave."""
        waiting = bool(wait_for) or any_node
        deadline = time.monotonic() + (NODE_LOSS_WAIT_S if waiting else 0.0)
        while True:
            try:
                alive = {n["NodeID"] for n in self._ray.nodes() if n.get("Alive")}
            except Exception:
                return None
            gone = {node_id for node_id, _ in self.nodes if node_id not in alive}
            if (
                not waiting
                or (wait_for and all(self._on(i, gone) for i in wait_for))
                or (any_node and gone)
                or time.monotonic() > deadline
            ):
                return gone
            time.sleep(0.5)

    def _on(self, worker: int, nodes: set[str] | None) -> bool:
        return nodes is not None and worker < len(self.nodes) and self.nodes[worker][0] in nodes

    def _node_of(self, worker: int, gone: set[str] | None) -> str:
        """The node of ``worker``, and whether it left the cluster."""
        if worker >= len(self.nodes):
            return ""
        node_id, ip = self.nodes[worker]
        left = ", which left the cluster" if self._on(worker, gone) else ""
        return f" on node {ip} ({node_id[:8]}{left})"

    def _submit(self, method: str, calls: Calls) -> WorkerFuture:
        if not self._actors:
            raise DispatchError("this worker group has been shut down.")
        refs = [
            a.call.remote(method, args, kwargs)
            for a, (args, kwargs) in zip(self._actors, calls, strict=True)
        ]
        deadline = time.monotonic() + self.call_timeout_s
        return WorkerFuture(lambda: self._wait(method, refs, deadline), method)

    def _wait(self, method: str, refs: list[Any], deadline: float) -> list[Any]:
        ray = self._ray
        index = {ref: i for i, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}  # what Ray raised
        raised: dict[int, object] = {}  # what the worker raised: its payload, first first
        pending = list(refs)
        while pending:
            # after a first failure, give the other workers a moment to report theirs: a dead
            # worker's peers fail (or hang) in collectives, and the dead one must be named
            failed = errors or raised
            wait = max(deadline - time.monotonic(), 0.0) if not failed else FAILURE_GRACE_S
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait)
            if not ready:
                break
            for ref in ready:
                try:
                    status, payload = ray.get(ref)
                except ray.exceptions.RayError as e:
                    errors[index[ref]] = e
                    continue
                if status == "ok":
                    results[index[ref]] = payload
                else:
                    raised[index[ref]] = payload
        if not (errors or raised) and pending:
            raise DispatchError(
                "\n".join(
                    no_answer(i, method, after_failure=False, call_timeout_s=self.call_timeout_s)
                    for i in sorted(index[r] for r in pending)
                )
            )
        if errors or raised:
            silent = sorted(index[r] for r in pending)  # no answer within the grace period
            # a worker whose node was cut off says nothing (or that it is unreachable) until
            # the cluster misses enough of the node's health checks, which takes longer than
            # the grace period: when the group spans nodes, wait for those workers' nodes too,
            # so that the lost node is named rather than the errors it caused on the others
            spans = len({node_id for node_id, _ in self.nodes}) > 1
            if spans:
                wait_for = sorted(errors) + silent
            else:  # one node: only an unreachable worker may be on a node that left
                wait_for = [
                    i
                    for i, e in errors.items()
                    if isinstance(e, ray.exceptions.ActorUnavailableError)
                ]
            # a collective's peer lost (a connection error) while the rest of this group answered:
            # the peer may be another group's, on one of this group's nodes that is leaving
            described = {i: WorkerErrorInfo.parse(p).describe() for i, p in raised.items()}
            peer_lost = spans and any(
                sign in text for text in described.values() for sign in PEER_LOST
            )
            gone = self._gone_nodes(wait_for=wait_for, any_node=peer_lost)
            died = sorted(
                i
                for i, e in [*errors.items(), *((i, None) for i in silent)]
                if isinstance(e, ray.exceptions.ActorDiedError) or self._on(i, gone)
            )
            lines = [f"worker {i} died during {method!r}{self._node_of(i, gone)}" for i in died]
            # workers that answered (or raised) before their node went: its other processes
            # (another group's) were the peers the call lost
            lines += [
                f"worker {i} was{self._node_of(i, gone)} during {method!r}"
                for i in sorted({*results, *raised})
                if self._on(i, gone)
            ]
            head = [f"{'; '.join(lines)}; the other failures follow from it:"] if lines else []
            failures = {i: f"worker {i} raised in {method!r}:\n{e}" for i, e in errors.items()}
            for i, text in described.items():
                failures[i] = f"worker {i} raised in {method!r}: {text}"
            for i in silent:
                failures[i] = no_answer(
                    i, method, after_failure=True, call_timeout_s=self.call_timeout_s
                )
            rest = [failures[i] for i in sorted(failures) if i not in died]
            summary = "\n".join(head + rest)
            # as the local executor: the first error raised keeps its type (when allowed)
            raise worker_failure(summary, raised, method=method, typed=not lines)
        return [results[i] for i in range(len(refs))]

    def shutdown(self) -> None:
        for actor in getattr(self, "_actors", []):
            self._ray.kill(actor)
        self._actors = []
        self._store = None
        placement, self._placement = getattr(self, "_placement", None), None
        if placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(placement)


def _bundle(num_cpus: float, resources: Mapping[str, float] | None) -> dict[str, float]:
    """One worker's resources: ``resources`` (Ray's names: ``CPU``, ``GPU``, custom ones), its
    ``CPU`` defaulting to ``num_cpus``."""
    bundle = {"CPU": float(num_cpus), **{k: float(v) for k, v in (resources or {}).items()}}
    bad = {k: v for k, v in bundle.items() if not v >= 0}
    if bad:
        raise ValueError(f"resources must be numbers >= 0; got {bad}.")
    return {k: v for k, v in bundle.items() if v > 0}


def _placed(ray: Any, bundle: dict[str, float], workers: int, strategy: str, timeout: float) -> Any:
    """A placement group of ``workers`` bundles, ready; refused with what each node has free
    when the cluster cannot place it within ``timeout`` seconds."""
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([dict(bundle) for _ in range(workers)], strategy=strategy)
    if group.wait(timeout_seconds=timeout):
        return group
    remove_placement_group(group)
    free = []
    for node in ray.nodes():
        if node.get("Alive"):
            have = {
                k: v
                for k, v in node.get("Resources", {}).items()
                if k in ("CPU", "GPU") or k in bundle
            }
            free.append(f"{node.get('NodeManagerAddress')} ({node['NodeID'][:8]}): {have}")
    raise DispatchError(
        f"the Ray cluster has no room for {workers} workers of {bundle} each placed {strategy} "
        f"(waited {timeout:g} s); its nodes have (in all, not free): {'; '.join(free) or 'none'}. "
        f"Add nodes with those resources, ask for less per worker, or place them another way "
        f"(strategy PACK fills nodes one after another)."
    )
