"""A rollout in its own process: generation by RPC, weights over a :class:`WeightSyncGroup`.

:class:`ProcessRollout` is a :class:`BaseRollout` whose real backend (any registered rollout:
``hf``, ``vllm``, ...) lives in a spawned worker process (:class:`RolloutWorker` under a
:class:`LocalWorkerGroup`). ``generate`` is a call into that process; ``sync_weights`` streams
the trainer's (HF name, tensor) pairs over a gloo weight-sync group while the worker receives
them into its rollout, verified on both sides (:mod:`engine_core.weight_sync`).

The training loop does not change: it calls the same ``generate`` / ``sync_weights`` as on a
colocated rollout.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from typing import Any

import torch
from tensordict import TensorDict

from engine_core.dispatch import Worker
from engine_core.executors.base import free_port
from engine_core.executors.local import LocalWorkerGroup
from engine_core.rollout import BaseRollout, RolloutConfig, SamplingParams, WeightBucket
from engine_core.weight_sync import WeightSyncGroup, receive_weights, send_weights

__all__ = ["RolloutWorker", "ProcessRollout"]

_HOST = "127.0.0.1"  # both ends on this machine: the sync store listens on loopback only


class RolloutWorker(Worker):
    """Hosts one rollout backend in a worker process."""

    def __init__(self, config: dict[str, Any]) -> None:
        from engine_core.plugins import load_plugins
        from engine_core.resolve import resolve_rollout_config

        spec, cfg = resolve_rollout_config(config, load_plugins())
        self.rollout: BaseRollout = spec.load_class()(cfg)
        self.group: WeightSyncGroup | None = None

    def capabilities(self) -> frozenset[Any]:
        return frozenset(self.rollout.capabilities)

    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        return self.rollout.generate(prompts, params)

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return self.rollout.expected_weights()

    def join_weight_sync(self, port: int, rank: int, world_size: int, backend: str) -> None:
        self.group = WeightSyncGroup(
            host=_HOST, port=port, rank=rank, world_size=world_size, backend=backend
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
    """A worker-group call on a thread, so this process can take part in the same collective."""

    def __init__(self, group: LocalWorkerGroup, method: str, *args: Any) -> None:
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


class ProcessRollout(BaseRollout):
    """Run ``config``'s rollout backend in a separate process; this process sends weights."""

    generates_elsewhere = True

    def __init__(self, config: RolloutConfig, *, timeout_s: float = 600.0) -> None:
        super().__init__(config)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self._workers = LocalWorkerGroup(
            RolloutWorker,
            1,
            init_args=(config.model_dump(),),
            env={"OMP_NUM_THREADS": str(torch.get_num_threads())},
            call_timeout_s=timeout_s,
        )
        try:
            self.capabilities = self._workers.call_all("capabilities")[0]  # type: ignore[misc]
            port = free_port()
            joining = _Call(self._workers, "join_weight_sync", port, 1, 2, backend)
            self._group = WeightSyncGroup(
                host=_HOST, port=port, rank=0, world_size=2, backend=backend, timeout_s=timeout_s
            )
            joining.wait()
            self._expected: dict[str, tuple[int, ...]] = self._workers.call_all("expected_weights")[
                0
            ]
        except BaseException:
            self._workers.shutdown()
            raise

    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        out: TensorDict = self._workers.call_all("generate", prompts, params)[0]
        return out

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return dict(self._expected)

    def load_weight_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> str:
        raise NotImplementedError("ProcessRollout loads weights through sync_weights() only.")

    def sync_weights(
        self, named: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int = 256 << 20
    ) -> list[WeightBucket]:
        receiving = _Call(self._workers, "receive_weights", bucket_bytes)
        try:
            sent = send_weights(self._group, named, bucket_bytes=bucket_bytes)
        except BaseException:
            # the sender's error already carries the receiver's verdict
            with contextlib.suppress(Exception):
                receiving.wait()
            raise
        receiving.wait()
        return sent

    def release(self) -> None:
        self._workers.call_all("release")

    def resume(self) -> None:
        self._workers.call_all("resume")

    def shutdown(self) -> None:
        """Stop the rollout process; safe to call twice."""
        self._workers.shutdown()
        self._group.close()
