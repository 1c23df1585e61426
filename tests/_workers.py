"""Worker classes for executor tests; importable by module path for spawn and Ray."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_core.dispatch import DispatchMode, Worker, register
from engine_core.executors import join_process_group
from engine_core.remote_rollout import RolloutWorker
from engine_core.rollout import tensor_checksum


class MeshWorker(Worker):
    """Registers the "actor" mesh as dp_rank = rank // tp, collector = first tp replica, and
    two meshes registered wrongly, each with a method of its own: "two_collectors" (two
    collectors in dp rank 0) and "missing_dp" (dp rank 1 registered as 0)."""

    def __init__(self, tp: int = 1, world: int = 1) -> None:
        self.tp, self.world = tp, world
        self.rank = int(os.environ.get("RANK", "-1"))

    @register(DispatchMode.ALL_TO_ALL)
    def setup(self, rank: int) -> None:
        self.rank = rank
        dp_size = self.world // self.tp
        dp_rank, tp_rank = divmod(rank, self.tp)
        self.register_mesh("actor", dp_rank=dp_rank, dp_size=dp_size, is_collect=tp_rank == 0)
        self.register_mesh(
            "two_collectors",
            dp_rank=dp_rank,
            dp_size=dp_size,
            is_collect=tp_rank == 0 or not dp_rank,
        )
        self.register_mesh(
            "missing_dp",
            dp_rank=0 if dp_rank == 1 else dp_rank,
            dp_size=dp_size,
            is_collect=tp_rank == 0,
        )

    @register(DispatchMode.ND_COMPUTE, mesh="two_collectors")
    def square_on_two_collectors(self, batch: TensorDict) -> TensorDict:
        return self.square(batch)

    @register(DispatchMode.ND_COMPUTE, mesh="missing_dp")
    def square_on_missing_dp(self, batch: TensorDict) -> TensorDict:
        return self.square(batch)

    @register(DispatchMode.ND_COMPUTE, mesh="actor")
    def square(self, batch: TensorDict) -> TensorDict:
        """A per-sample function, so the collected result is checkable; x stays on every replica."""
        return TensorDict(
            {"y": batch["x"].float() ** 2, "rank": torch.full((batch.batch_size[0],), self.rank)},
            batch_size=batch.batch_size,
        )

    @register(DispatchMode.ND_COMPUTE, mesh="actor")
    def digest(self, batch: TensorDict) -> list[int]:
        return [int(batch["x"].sum()), batch.batch_size[0]]

    @register(DispatchMode.ALL_TO_ALL)
    def echo(self, value: int) -> int:
        return value * 10 + self.rank

    def whoami(self) -> int:
        return self.rank

    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)

    def fail(self) -> None:
        raise ValueError(f"worker {self.rank} fails on purpose")

    def die_in_a_collective(self, victim: int) -> float:
        """Worker ``victim`` exits; the others wait for it in an all-reduce."""
        if self.rank == victim:
            os._exit(3)
        return self.all_reduce_rank()

    def nap(self, sleeper: int, seconds: float) -> int:
        """Worker ``sleeper`` answers after ``seconds``; the others at once."""
        if self.rank == sleeper:
            time.sleep(seconds)
        return self.rank

    def skip_a_collective(self, absent: int) -> float:
        """Worker ``absent`` never joins the all-reduce the others wait in."""
        if self.rank == absent:
            return -1.0
        return self.all_reduce_rank()

    def raise_or_wait(self, raiser: int) -> float:
        """Worker ``raiser`` raises; the others wait for it in an all-reduce it never joins."""
        if self.rank == raiser:
            raise ValueError(f"worker {self.rank} fails before the collective")
        return self.all_reduce_rank()

    def raise_or_nap(self, raiser: int, seconds: float, peer_lost: bool = False) -> int:
        """Worker ``raiser`` raises at once (with ``peer_lost``, the error gloo raises when a
        collective's peer went away); the others answer after ``seconds``."""
        if self.rank == raiser and peer_lost:
            raise RuntimeError("[gloo/transport/tcp/pair.cc] Read error: Connection reset by peer")
        if self.rank == raiser:
            raise ValueError(f"worker {self.rank} fails on purpose")
        time.sleep(seconds)
        return self.rank

    def all_reduce_rank(self) -> float:
        join_process_group("gloo")  # with the executor's collective timeout
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        return float(t)


CORRUPTED = "model.norm.weight"


class CorruptingRolloutWorker(RolloutWorker):
    """A rollout replica whose replica 1 corrupts what it loads: after the real load of the
    bucket holding :data:`CORRUPTED`, that weight is shifted, so the rollout's checksum of its
    loaded weights no longer matches what the trainer sent. Other replicas load faithfully."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        if self.replica == 1:
            rollout: Any = self.rollout
            load = rollout.load_weight_bucket

            @torch.no_grad()
            def corrupting_load(bucket: list[tuple[str, torch.Tensor]]) -> str:
                load(bucket)
                state = rollout.model.state_dict()
                if CORRUPTED in state and any(name == CORRUPTED for name, _ in bucket):
                    state[CORRUPTED].add_(1.0)
                return tensor_checksum((name, state[name]) for name, _ in bucket)

            rollout.load_weight_bucket = corrupting_load


class FailingRolloutWorker(RolloutWorker):
    """Replica 1 fails to start; the others start as usual."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        if self.replica == 1:
            raise RuntimeError(f"replica {self.replica} cannot start on purpose")
