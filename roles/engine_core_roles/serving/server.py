"""Starting the endpoint: a rollout built from its config (:func:`served_rollout`), served in
the foreground (:func:`serve`, what ``engine-core serve`` runs) or on a thread of this process
(:class:`BackgroundServer`, for a job or a test that calls it)."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from engine_core.errors import ConfigError
from engine_core.plugins import PluginManager
from engine_core.remote_rollout import ProcessRollout
from engine_core.resolve import resolve_rollout_config
from engine_core.rollout import BaseRollout, RolloutConfig
from engine_core_roles.data.datasets.tokenizer import load_tokenizer
from engine_core_roles.serving.app import Endpoint, build_app
from engine_core_roles.serving.config import ServeConfig
from engine_core_roles.serving.sampler import ServedRollout

__all__ = ["served_rollout", "serve", "BackgroundServer"]


def served_rollout(
    raw: Mapping[str, Any],
    manager: PluginManager,
    *,
    replicas: int | None = None,
    python: str | None = None,
) -> ServedRollout:
    """The rollout ``raw`` configures (``{"backend": ..., "model": {...}, ...}``, as a recipe's
    ``rollout`` section with its model), built, with the model's tokenizer: in this process, or
    with ``replicas`` (or ``python``: one replica unless told) as replicas in processes of their
    own, started by ``python`` (an interpreter with its own environment, e.g. SGLang's) where
    given, this one otherwise; the endpoint feeds them as it feeds one rollout."""
    if replicas is not None and replicas < 1:
        raise ConfigError(f"--replicas {replicas}; serve with 1 or more, or leave it out.")
    spec, cfg = resolve_rollout_config(raw, manager, path=("rollout",))
    if not isinstance(cfg, RolloutConfig):
        raise ConfigError(
            f"rollout.backend={spec.name!r} has the config class {type(cfg).__name__}, which "
            f"does not subclass engine_core.RolloutConfig; fix the plugin's config class."
        )
    vocab = cfg.model.raw_config().get("vocab_size")
    tokenizer = load_tokenizer(cfg.model, None if vocab is None else int(vocab))
    rollout: BaseRollout
    if replicas is None and python is None:
        rollout = spec.load_class()(cfg)
    else:  # the interpreter is checked (engine-core, the backend's plugin) before any starts
        rollout = ProcessRollout(cfg, replicas=replicas or 1, python=python)
    return ServedRollout(rollout, tokenizer)


def _bound_socket(config: ServeConfig) -> socket.socket:
    """A socket bound to the config's address (port 0: a free one) and listening, before
    uvicorn starts, so the port is known and a taken one is refused in one sentence."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host.strip("[]"), config.port))
        # listening from now: a client that connects as soon as the address is printed waits
        # in the backlog for the server to start, instead of being refused
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ConfigError(
            f"cannot listen on {config.host}:{config.port} ({e.strerror}); pick another "
            f"--port (0: any free one) or stop what holds it."
        ) from None
    return sock


def _server(endpoint: Endpoint) -> Any:
    app = build_app(endpoint)
    try:
        import uvicorn
    except ImportError as e:
        raise ConfigError(
            f"the endpoint needs the serve extra ({e}); pip install 'engine-core-roles[serve]'."
        ) from e
    # the endpoint bounds request bodies itself; lifespan off: nothing starts with the app
    return uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
    )


class _Stopped(Exception):
    """SIGTERM, once uvicorn has shut down gracefully and raised it again."""


def _stopped(signum: int, frame: Any) -> None:
    raise _Stopped


def serve(config: ServeConfig, served: ServedRollout) -> None:
    """Serve until interrupted (SIGINT or SIGTERM), in this thread; then stop the rollout and
    the processes it started (an engine's, replicas). uvicorn handles either signal with a
    graceful shutdown and then raises it again under the handler it found: for SIGTERM that is
    this function's, so the process is not ended by the signal before its rollout is stopped."""
    sock = _bound_socket(config)
    host, port = sock.getsockname()[:2]
    previous = signal.signal(signal.SIGTERM, _stopped)
    print(f"engine-core serve: {config.model_name!r} at http://{host}:{port}/v1", flush=True)
    try:
        _server(Endpoint(config, served)).run(sockets=[sock])
    except _Stopped:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        served.close()
        served.rollout.shutdown()  # an engine's own processes (vllm, sglang, replicas)


class BackgroundServer:
    """The endpoint on a thread of this process, while the ``with`` block runs.

    ``url`` is its OpenAI base URL (``http://HOST:PORT/v1``); :meth:`session_url` a session's
    own base URL; ``endpoint`` holds the sessions. Closing stops the server; the rollout stays
    the caller's."""

    def __init__(
        self, config: ServeConfig, served: ServedRollout, start_timeout_s: float = 30
    ) -> None:
        self.endpoint = Endpoint(config, served)
        self._sock = _bound_socket(config)
        host, self.port = self._sock.getsockname()[:2]
        self.root = f"http://{host}:{self.port}"
        self.url = f"{self.root}/v1"
        self._server = _server(self.endpoint)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            daemon=True,
            name="engine-core-serve-http",
        )
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the endpoint did not start within {start_timeout_s} s.")
            time.sleep(0.01)

    def session_url(self, session_id: str) -> str:
        return f"{self.root}/sessions/{session_id}/v1"

    def close(self, timeout_s: float = 10) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
