"""Starting the endpoint: a rollout built from its config (:func:`served_rollout`), served in
the foreground (:func:`serve`, what ``engine-core serve`` runs) or on a thread of this process
(:class:`BackgroundServer`, for a job or a test that calls it)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from engine_core.errors import ConfigError
from engine_core.plugins import PluginManager
from engine_core.resolve import resolve_rollout_config
from engine_core.rollout import BaseRollout, RolloutConfig
from engine_core_roles.data.datasets.tokenizer import load_tokenizer
from engine_core_roles.serving.app import Endpoint, build_app
from engine_core_roles.serving.config import ServeConfig
from engine_core_roles.serving.sampler import ServedRollout

__all__ = ["served_rollout", "serve", "BackgroundServer"]


def served_rollout(raw: Mapping[str, Any], manager: PluginManager) -> ServedRollout:
    """The rollout ``raw`` configures (``{"backend": ..., "model": {...}, ...}``, as a recipe's
    ``rollout`` section with its model), built, with the model's tokenizer."""
    spec, cfg = resolve_rollout_config(raw, manager, path=("rollout",))
    if not isinstance(cfg, RolloutConfig):
        raise ConfigError(
            f"rollout.backend={spec.name!r} has the config class {type(cfg).__name__}, which "
            f"does not subclass engine_core.RolloutConfig; fix the plugin's config class."
        )
    vocab = cfg.model.raw_config().get("vocab_size")
    tokenizer = load_tokenizer(cfg.model, None if vocab is None else int(vocab))
    rollout: BaseRollout = spec.load_class()(cfg)
    return ServedRollout(rollout, tokenizer)


def _bound_socket(config: ServeConfig) -> socket.socket:
    """A socket bound to the config's address (port 0: a free one), before uvicorn starts, so
    the port is known and a taken one is refused in one sentence."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host.strip("[]"), config.port))
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


def serve(config: ServeConfig, served: ServedRollout) -> None:
    """Serve until interrupted (SIGINT or SIGTERM), in this thread."""
    sock = _bound_socket(config)
    host, port = sock.getsockname()[:2]
    print(f"engine-core serve: {config.model_name!r} at http://{host}:{port}/v1", flush=True)
    try:
        _server(Endpoint(config, served)).run(sockets=[sock])
    finally:
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
