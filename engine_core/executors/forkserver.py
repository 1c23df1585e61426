"""Worker processes forked from a fork server that has imported their modules once.

A spawned worker starts a fresh interpreter and imports torch, transformers and the engine again:
seconds of CPU per worker. ``multiprocessing``'s ``forkserver`` start method starts one fresh
interpreter (the server), which imports the modules named here once and runs nothing else; each
worker is then forked from it with those imports done. The server is started with this
process's environment, working folder and ``sys.path``, and a new one is started when any of
them changed since (modules may read them on import) or when a module to import is new (not
when only the workers' own module is: a child imports that one itself); the old one ends with
its last worker. A worker gets the caller's environment as a spawned one would
(:func:`engine_core.launch.adopt_environment`).

The local executor spawns its workers unless ``ENGINE_CORE_WORKER_START=forkserver``
(:func:`worker_context`). A forked worker can use CUDA only if the server never initialized it;
nothing here asks torch about devices, but a preloaded module could. Forked workers have run on
CPU hosts only (gloo); on GPU hosts they have never run.
"""

from __future__ import annotations

import multiprocessing.forkserver as forkserver
import os
import sys
import threading
from collections.abc import Sequence
from multiprocessing import util
from typing import Any

from engine_core.launch import caller_environment as current_environment
from engine_core.launch import with_variable

__all__ = ["fork_server", "worker_context"]

# what the running server was started with: (environment, working folder, sys.path) and the
# modules it imported
_LOCK = threading.Lock()
_key: tuple[Any, ...] | None = None
_modules: frozenset[str] = frozenset()
# set as a process runs, by pytest for each test and by tensorboardX as a job's tracker imports
# it (for the crc32c package, which nothing the server imports reads); each child gets the
# caller's value, and a server is not started anew for them
_VOLATILE = ("PYTEST_CURRENT_TEST", "CRC32C_SW_MODE")


def fork_server(modules: Sequence[str], target: str = "") -> Any:
    """The ``forkserver`` context, its server (re)started as the module docstring says, having
    imported ``modules`` (and those it imported before, while nothing else changed).

    ``target``: the module of what the children run (a worker's class, a function). A new
    server imports it too, but it alone starts no new one: a child of a running server that
    lacks it imports it as it unpickles its target, once the heavy ``modules`` are there a
    fraction of what a new server's imports cost."""
    global _key, _modules
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    wanted = frozenset(m for m in modules if m and m != "__main__")
    own = frozenset(m for m in [target] if m and m != "__main__")
    env = current_environment(exclude=_VOLATILE)
    key = (tuple(sorted(env.items())), os.getcwd(), tuple(sys.path))
    with _LOCK:
        server = forkserver._forkserver
        if key != _key or not wanted <= _modules:
            _leave(server)
            _modules = wanted | own | (_modules if key == _key else frozenset())
            _key = key
            ctx.set_forkserver_preload(sorted(_modules))
            # the server imports with this process's sys.path (a test module's folder, say)
            with with_variable("PYTHONPATH", os.pathsep.join(p for p in sys.path if p)):
                server.ensure_running()
    return ctx


_left: list[int] = []  # servers left to end with their last worker, reaped when they have


def _leave(server: Any) -> None:
    """Let the running server go, without waiting for it: it ends when its last worker does
    (each worker holds the server's "alive" pipe, so stopping it and waiting, as
    ``multiprocessing`` does, would wait for every worker it forked). The next
    ``ensure_running`` starts a new one."""
    with server._lock:
        if server._forkserver_pid is not None:
            os.close(server._forkserver_alive_fd)
            _left.append(server._forkserver_pid)
            server._forkserver_alive_fd = server._forkserver_pid = None
            address, server._forkserver_address = server._forkserver_address, None
            if address and not util.is_abstract_socket_namespace(address):
                os.unlink(address)  # a socket file (Linux's abstract namespace leaves none)
    for pid in list(_left):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            _left.remove(pid)


def worker_context(modules: Sequence[str], target: str = "") -> Any:
    """The multiprocessing context the local executor starts workers with, as
    ``ENGINE_CORE_WORKER_START`` says (:class:`~engine_core.settings.Settings`; unset: spawn);
    a fork server imports ``modules`` (and ``target``, the workers' class's module, as
    :func:`fork_server` says)."""
    from engine_core.settings import Settings

    if Settings.from_env().worker_start == "forkserver":
        return fork_server(modules, target)
    import torch.multiprocessing as mp  # tensors then pass through shared memory

    return mp.get_context("spawn")
