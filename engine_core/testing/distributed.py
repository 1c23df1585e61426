"""Run a function on several real processes (gloo on CPU, NCCL with one GPU per rank) and fail
the test if any rank fails.

Usage from a test module (the worker must be a module-level function, so spawn can import it)::

    def _worker(rank: int, world_size: int, scale: float) -> float:
        t = torch.tensor([rank * scale])
        dist.all_reduce(t)  # the default group is initialized for you
        return float(t)

    def test_sum() -> None:
        assert run_distributed(_worker, 2, 1.5) == [1.5, 1.5]

Each child gets ``MASTER_ADDR=127.0.0.1``, the port of a rendezvous store this process hosts
(so no other process can take it first), ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
and one intra-op thread (``OMP_NUM_THREADS=1``), so two ranks do not oversubscribe a small host.
Return values must be picklable; a child's traceback becomes the test failure.

The children are forked from a fork server (``multiprocessing``'s ``forkserver``): a fresh
interpreter, started with this process's environment, working folder and ``sys.path``, that has
imported ``fn``'s module and the modules named in ``preload`` once (and run nothing else); each
child then starts with those imports done instead of importing torch, transformers and the
engine again. The child gets this process's environment and ``sys.path`` as a spawned one
would. The server is started again when the environment, the working folder or ``sys.path``
changed since it started (modules may read them on import), or when a module to preload is new
(``fn``'s module alone starts none: a child of a running server imports it as it unpickles
``fn``, a fraction of a new server's imports).
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from engine_core.executors.base import free_port, host_rendezvous, worker_env
from engine_core.executors.forkserver import fork_server
from engine_core.launch import (
    adopt_environment,
    caller_environment,
    set_for_process,
    unset_for_process,
)

__all__ = ["free_port", "run_distributed"]


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    queue: Any,
    pg_backend: str | None,
    env: dict[str, str],
) -> None:
    adopt_environment(env)  # the caller's environment, as a spawned child has it
    # the rendezvous variables every executor's worker gets (worker_env), the caller hosting the
    # store; a plain process, as `engine-core run` starts, has none of them
    rendezvous = worker_env(rank, world_size, port, hosted=True)
    if pg_backend is not None:
        set_for_process(rendezvous)
    else:
        unset_for_process(rendezvous)
    set_for_process({"OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)  # torch is imported already, so the env var alone is too late
    try:
        if pg_backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank
        if pg_backend is not None:
            dist.init_process_group(pg_backend, rank=rank, world_size=world_size)
            # every rank through gloo's full-mesh connect before any goes on: a rank whose
            # function fails at once (a config refused) would otherwise tear its sockets down
            # while a slower peer still reads the handshake ("Connection closed by peer")
            dist.barrier()
        result = fn(rank, world_size, *args)
        queue.put(
            (rank, "ok", pickle.dumps(result))
        )  # bytes: outlives the child, unlike shared-memory tensors
    except BaseException:  # report every failure to the parent, then exit non-zero
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300,
    pg_backend: str | None = "gloo",
    preload: Sequence[str] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes (a ``pg_backend`` process
    group: gloo on CPU, nccl with one GPU per rank; ``None``: one plain process with no process
    group and no rendezvous variables, as a script or ``engine-core run`` starts); return
    results by rank.

    ``fn`` must be importable (module level). A failure on any rank raises with its traceback.
    ``preload``: modules the processes need besides ``fn``'s (an engine's module, say), imported
    once by the fork server they start from.
    """
    if pg_backend is None and world_size != 1:
        raise ValueError(f"pg_backend=None runs one process; got world_size={world_size}")
    # a fork server that imported a module asking torch.cuda anything (a skip mark's
    # is_available()) forks children that cannot use CUDA: NCCL ranks start fresh (spawn)
    ctx: Any = (
        multiprocessing.get_context("spawn")
        if pg_backend == "nccl"
        else fork_server(preload, fn.__module__)
    )
    queue = ctx.Queue()
    # this process hosts the rendezvous on a port it keeps: no other process can take the port
    # before the ranks meet (the store lives until every rank has been joined or killed)
    store, port = host_rendezvous(world_size) if pg_backend is not None else (None, 0)
    procs = [
        ctx.Process(
            # not daemonic: the function may start processes (megatron-core's checkpoint
            # writers do); every child is joined or killed below
            target=_entry,
            args=(r, world_size, port, fn, args, queue, pg_backend, caller_environment()),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) < world_size and not errors:
        try:
            rank, status, payload = queue.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                errors.append(
                    f"rank(s) {dead} died without a report (exit codes "
                    f"{[procs[i].exitcode for i in dead]})"
                )
            elif time.monotonic() > deadline:
                errors.append(f"timed out after {timeout} s")
            continue
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors.append(f"rank {rank} failed:\n{payload}")
    for p in procs:
        p.join(timeout=5 if errors else timeout)
        if p.is_alive():
            p.kill()
    del store
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
