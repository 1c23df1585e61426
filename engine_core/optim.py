"""Optimizer, LR schedule and gradient-step semantics shared by engines."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch.optim.lr_scheduler import LambdaLR

from engine_core.config import EngineConfig, OptimConfig
from engine_core.errors import CheckpointError

__all__ = [
    "build_optimizer",
    "build_lr_scheduler",
    "lr_lambda",
    "clip_and_step",
    "total_grad_norm",
    "SingleOptimizerMixin",
    "capture_rng",
    "restore_rng",
    "scheduler_state",
]


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable ``params``."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters; check model.lora / freezing.")
    # one fused kernel updates every parameter (DTensor shards included), on CUDA and on the
    # CPU: the default per-parameter loop dispatches each elementwise op of each parameter on
    # its own (through DTensor, for sharded engines)
    fused = all(p.is_floating_point() for p in trainable) or None
    return torch.optim.AdamW(
        trainable,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=fused,
    )


def lr_lambda(cfg: OptimConfig, step: int) -> float:
    """Multiplier of the base lr at ``step``: the prelude's rate for its steps, then linear
    warmup, then constant or cosine decay (counted from the prelude's end)."""
    if step < cfg.prelude_steps:
        assert cfg.prelude_lr is not None  # enforced by OptimConfig
        return cfg.prelude_lr / cfg.lr
    step -= cfg.prelude_steps
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    assert cfg.total_steps is not None  # enforced by OptimConfig
    span = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> LambdaLR:
    """The warmup + constant/cosine schedule as a ``LambdaLR``."""
    return LambdaLR(optimizer, lambda step: lr_lambda(cfg, step))


def clip_and_step(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float | None
) -> tuple[float, bool]:
    """Clip to ``max_norm`` (None: measure only) and step; skip the step on a non-finite norm.

    Returns (global grad norm, whether the update was skipped). The norm is materialised as a
    plain float on every rank (see :func:`total_grad_norm`).
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = total_grad_norm(grads)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return norm, True
    if max_norm is not None:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:  # one multiply per mesh, not one per gradient (a DTensor op each)
            for group in _by_mesh(grads).values():
                torch._foreach_mul_(group, coef)
    optimizer.step()
    return norm, False


def _by_mesh(grads: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """``grads`` grouped by their DTensor device mesh (None: plain tensors)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(getattr(g, "device_mesh", None), []).append(g)
    return groups


def total_grad_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm of all gradients together, as a float on every rank.

    Sharded (DTensor) gradients may live on different meshes (e.g. 2-D for tensor-parallel
    weights, 1-D for replicated norms); each mesh's group is reduced on its own mesh, then the
    group norms are combined.
    """
    squares = 0.0
    for group in _by_mesh(grads).values():
        norm_t = torch.nn.utils.get_total_norm(group, 2.0)
        if hasattr(norm_t, "full_tensor"):
            norm_t = norm_t.full_tensor()
        squares += float(norm_t) ** 2
    return math.sqrt(squares)


class SingleOptimizerMixin:
    """``optimizer_zero_grad`` / ``optimizer_step`` / ``lr_scheduler_step`` for engines holding one
    optimizer and one LR scheduler. List it before ``BaseEngine`` among the bases.
    """

    config: EngineConfig
    module: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    scheduler: LambdaLR | None
    skipped_steps: int

    def init_optimizer(self, module: torch.nn.Module) -> None:
        """Build AdamW over ``module``'s trainable parameters and the LR schedule."""
        self.optimizer = build_optimizer(module.parameters(), self.config.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, self.config.optim)
        self.skipped_steps = 0

    def optimizer_zero_grad(self) -> None:
        assert self.optimizer is not None, "call init_model() first"
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        assert self.optimizer is not None and self.module is not None, "call init_model() first"
        params = [p for p in self.module.parameters() if p.requires_grad]
        norm, skipped = clip_and_step(params, self.optimizer, self.config.optim.clip_grad)
        self.skipped_steps += int(skipped)
        return norm

    def lr_scheduler_step(self) -> float:
        assert self.scheduler is not None, "call init_model() first"
        self.scheduler.step()
        return float(self.scheduler.get_last_lr()[0])

    def checkpoint_extra_state(self) -> dict[str, Any]:
        """What a checkpoint needs beyond model and optimizer: the LR schedule's position and
        the skipped-step count (``BaseEngine.save_checkpoint`` stores it)."""
        assert self.scheduler is not None, "call init_model() first"
        return {"scheduler": scheduler_state(self.scheduler), "skipped_steps": self.skipped_steps}

    def load_checkpoint_extra_state(self, state: dict[str, Any]) -> None:
        assert self.scheduler is not None, "call init_model() first"
        try:
            self.scheduler.load_state_dict(state["scheduler"])
            self.skipped_steps = int(state["skipped_steps"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"the checkpoint's LR-schedule state is missing or malformed ({type(e).__name__}: "
                f"{e}); it was not written by save_checkpoint() of this engine. Resume from "
                f"another checkpoint."
            ) from e


def scheduler_state(scheduler: LambdaLR) -> dict[str, Any]:
    """The schedule's position as plain data.

    ``LambdaLR.state_dict()`` carries each lambda's ``__dict__`` when it is a callable object; the
    schedule is rebuilt from the config, so only its counters and lrs are kept (None entries, which
    ``load_state_dict`` skips).
    """
    state = scheduler.state_dict()
    state["lr_lambdas"] = [None] * len(scheduler.lr_lambdas)
    return state


def capture_rng() -> dict[str, Any]:
    """torch (CPU, and the current CUDA device once CUDA is in use), numpy and Python RNG
    states as tensors and plain values, for exact resume.

    numpy's and Python's own state objects (a tuple holding an ndarray, a tuple of ints) would
    need arbitrary unpickling; they are stored as int64 tensors and restored bit for bit.
    """
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    extra: dict[str, Any] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        extra["cuda"] = torch.cuda.get_rng_state()  # the current device's stream
    return {
        **extra,
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": None if gauss_next is None else float(gauss_next),
        },
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Set the RNGs to what :func:`capture_rng` recorded."""
    try:
        npy, py = state["numpy"], state["python"]
        numpy_state = (
            npy["bit_generator"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
        python_state = (
            py["version"],
            tuple(int(v) for v in py["internal"].tolist()),
            py["gauss_next"],
        )
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise CheckpointError(
            f"the RNG state in this checkpoint is malformed ({type(e).__name__}: {e}); it was not "
            f"written by capture_rng() of this engine-core version. Resume from another checkpoint."
        ) from e
