"""Workers in another Python interpreter: another virtual environment, its own torch.

A generation engine often pins versions of its own (torch, transformers, Python itself), so it
lives in an environment of its own, and the trainer in the project's. :class:`InterpreterWorkerGroup`
starts each worker as ``<python> -m engine_core.executors.interpreter`` with two pipes of its
own, and talks to it only in :mod:`engine_core.wire` frames: requests, results, errors and
weights as plain data and raw tensor bytes, never a pickle, so the two sides need not share a
torch, a tensordict or a Python version. The other environment needs engine-core (the same
version: the frames are its own) and the plugin of the backend it hosts.

:func:`probe` asks an interpreter, before anything starts, what it runs (Python, torch,
engine-core, the rollout backends it has); :func:`check_interpreter` turns what is missing or
out of range into one sentence. Calls, timeouts, dead workers and worker errors behave as with
:class:`~engine_core.executors.local.LocalWorkerGroup`, whose call and gather logic this group
shares: only how a worker is started and how a message crosses differ.

Workers here form no torch process group: nothing collective crosses two torch builds.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine_core.errors import ConfigError
from engine_core.executors.base import DEFAULT_CALL_TIMEOUT_S, enter_worker_env, worker_env
from engine_core.executors.local import LocalWorkerGroup
from engine_core.executors.worker_errors import error_payload
from engine_core.wire import decode_frame, read, read_frame, write

__all__ = ["InterpreterWorkerGroup", "check_interpreter", "probe"]

_STOP = "__stop__"
_START = "__start__"

_PROBE = """
import importlib, json, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
    out["torch"] = torch.__version__
    import engine_core
    out["engine_core"] = engine_core.__version__
    from engine_core.plugins import load_plugins
    manager = load_plugins()
    out["rollouts"] = sorted(
        b.name for p in manager.plugins() for b in p.backends if str(b.kind) == "rollout"
    )
    for module in sys.argv[1:]:  # the modules the workers are built from
        try:
            importlib.import_module(module)
        except Exception as e:
            out.setdefault("missing", {})[module] = f"{type(e).__name__}: {e}"
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print("ENGINE_CORE_PROBE " + json.dumps(out))
"""


def probe(python: str, timeout_s: float = 120.0, modules: Sequence[str] = ()) -> dict[str, Any]:
    """What the interpreter ``python`` runs: ``python``, ``torch`` and ``engine_core`` versions
    and the ``rollouts`` its plugins provide, or ``error`` (what failed to import); with
    ``missing`` naming each of ``modules`` it cannot import, and why."""
    path = Path(python)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ConfigError(
            f"rollout_python={python!r} is not an executable file; give the path of the "
            f"Python of the environment the rollout replicas should run in (e.g. "
            f".venv-sglang/bin/python), or leave rollout_python unset to use this one."
        )
    try:
        done = subprocess.run(
            [str(path), "-c", _PROBE, *modules],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"rollout_python={python!r} could not be run ({e}).") from e
    for line in done.stdout.splitlines():
        if line.startswith("ENGINE_CORE_PROBE "):
            info: dict[str, Any] = json.loads(line.removeprefix("ENGINE_CORE_PROBE "))
            return info
    last = (done.stderr.strip().splitlines() or ["(it printed nothing)"])[-1]
    raise ConfigError(
        f"rollout_python={python!r} is not a Python that runs engine-core's check (exit code "
        f"{done.returncode}: {last})."
    )


# the interpreters this process has checked and found able to host a backend's replicas:
# (path, its file's inode and mtime, backend, worker module) -> what the probe said
_PASSED: dict[tuple[str, int, int, str, str | None], dict[str, Any]] = {}


def _passed_key(python: str, backend: str, worker_module: str | None) -> Any:
    try:
        found = os.stat(python)
    except OSError:
        return None
    return (os.path.abspath(python), found.st_ino, found.st_mtime_ns, backend, worker_module)


def check_interpreter(
    python: str, backend: str, worker_module: str | None = None
) -> dict[str, Any]:
    """:func:`probe` ``python`` and refuse, in one sentence, an interpreter without
    engine-core, with another engine-core version than this one, with a torch outside the
    range engine-core supports, without a plugin for rollout ``backend``, or that cannot import
    ``worker_module`` (where the replicas' worker class is defined).

    An interpreter that passed is not probed again by this process for the same backend and
    module (a probe starts that interpreter and imports torch there: seconds); one replaced at
    its path is. One that was refused is probed again each time, so that installing what was
    missing is seen at once."""
    from engine_core import __version__
    from engine_core.doctor import supported_range

    key = _passed_key(python, backend, worker_module)
    if key in _PASSED:
        return dict(_PASSED[key])
    info = probe(python, modules=[worker_module] if worker_module else [])
    where = f"rollout_python={python!r}"
    if "error" in info and "engine_core" not in info:
        raise ConfigError(
            f"{where} cannot import engine-core ({info['error']}); install engine-core and the "
            f"rollout's plugin into that environment (pip install engine-core "
            f"engine-core-{backend}), then run again."
        )
    if info.get("engine_core") != __version__:
        raise ConfigError(
            f"{where} runs engine-core {info.get('engine_core')}, this process {__version__}: "
            f"the replicas and the trainer must run the same version (their messages are "
            f"engine-core's own); install engine-core {__version__} there."
        )
    torch_range = supported_range("torch")
    if torch_range is not None and not torch_range.contains(str(info["torch"]).split("+")[0]):
        raise ConfigError(
            f"{where} has torch {info['torch']}, outside the range engine-core supports "
            f"({torch_range}); install a torch in that range there."
        )
    if "error" in info:
        raise ConfigError(f"{where} failed to load its plugins ({info['error']}).")
    if backend not in info.get("rollouts", []):
        raise ConfigError(
            f"{where} has no plugin for rollout backend {backend!r} (it has "
            f"{info.get('rollouts') or 'none'}); install engine-core-{backend} there."
        )
    for module, error in info.get("missing", {}).items():
        package = module.split(".")[0].replace("_", "-")
        raise ConfigError(
            f"{where} cannot import {module}, which the replicas run ({error}); install "
            f"{package} there (the same version as here)."
        )
    if key is not None:
        _PASSED[key] = dict(info)
    return info


class _Pipe:
    """A worker's two pipe ends, as the executor's gather reads a connection."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd

    def fileno(self) -> int:
        return self.read_fd

    def recv(self) -> Any:
        return read(self.read_fd)

    def send(self, obj: Any) -> None:
        try:
            write(self.write_fd, obj)
        except BrokenPipeError:  # the worker is gone: the gather finds its pipe closed, names it
            pass

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class _Process:
    """A worker's process, as the executor's gather and shutdown use one."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()


class InterpreterWorkerGroup(LocalWorkerGroup):
    """``num_workers`` instances of ``worker_cls``, each in a process of the interpreter
    ``python``. ``worker_cls`` must be importable there by the same module path; its
    constructor's arguments and every call's arguments and results must be what
    :mod:`engine_core.wire` encodes. What the interpreter runs is :func:`probe`'s to ask,
    before the group starts."""

    def __init__(
        self,
        worker_cls: type,
        num_workers: int,
        *,
        python: str,
        init_args: tuple[Any, ...] = (),
        init_kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        self.python = python
        super().__init__(
            worker_cls,
            num_workers,
            init_args=init_args,
            init_kwargs=init_kwargs,
            env=env,
            call_timeout_s=call_timeout_s,
        )

    def _start(
        self,
        worker_cls: type,
        init_args: tuple[Any, ...],
        init_kwargs: dict,
        env: Mapping[str, str] | None,
    ) -> None:
        name = f"{worker_cls.__module__}:{worker_cls.__qualname__}"
        for rank in range(self.num_workers):
            to_child_r, to_child_w = os.pipe()
            from_child_r, from_child_w = os.pipe()
            popen = subprocess.Popen(
                [self.python, "-m", "engine_core.executors.interpreter"]
                + [str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # launch.own_session: the caller handles its signals
            )
            os.close(to_child_r)
            os.close(from_child_w)
            self._procs.append(_Process(popen))
            conn = _Pipe(from_child_r, to_child_w)
            self._conns.append(conn)
            # rank and world size only: a replica joins no torch process group
            rank_env = worker_env(rank, self.num_workers, 0, env)
            start = {"worker": name, "init_args": init_args, "init_kwargs": init_kwargs}
            conn.send((_START, (), {**start, "env": rank_env}))

    def shutdown(self) -> None:
        conns = list(self._conns)
        super().shutdown()
        for conn in conns:
            if isinstance(conn, _Pipe):
                conn.close()


def _worker_class(name: str) -> type:
    from engine_core.dispatch import Worker

    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Worker)):
        raise TypeError(f"{name} is not an engine_core.dispatch.Worker subclass.")
    return obj


def serve(read_fd: int, write_fd: int) -> None:
    """A worker's loop, in the other interpreter: build the worker the first frame names, then
    answer each call until told to stop or the driver's end closes."""
    try:
        method, _, start = read(read_fd)
        assert method == _START, f"the first frame must start the worker, not {method!r}"
        enter_worker_env(start["env"])
        worker = _worker_class(start["worker"])(*start["init_args"], **start["init_kwargs"])
    except BaseException as e:
        write(write_fd, ("error", error_payload(e)))
        return
    write(write_fd, ("ok", None))
    # a driver gone (its end closed: it does not wait for the stop's answer) is told nothing
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        while True:
            try:
                frame = read_frame(read_fd)
            except EOFError:
                return
            try:  # a call whose arguments do not decode is answered, and the worker goes on
                method, args, kwargs = decode_frame(*frame)
            except Exception as e:
                write(write_fd, ("error", error_payload(e)))
                continue
            if method == _STOP:
                write(write_fd, ("ok", None))
                return
            try:
                result = getattr(worker, method)(*args, **kwargs)
                write(write_fd, ("ok", result))
            except BaseException as e:
                write(write_fd, ("error", error_payload(e)))


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
