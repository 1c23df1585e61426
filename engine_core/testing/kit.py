"""The conformance kit's checks: what runs inside the engine's processes, and the baselines.

Every check drives a registered engine through its public API only (``BaseEngine``) on a tiny
Qwen2 model, and compares with plain transformers on the same weights. One process run per
layout gathers the raw results of every check (an exception in one check is recorded, not
fatal), so the contract tests in :mod:`engine_core.testing.contract` stay cheap and each fails
with its own message.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from tensordict import TensorDict

from engine_core.batch import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOG_PROBS,
    LOSS_MASK,
    BatchMeta,
    set_meta,
    with_meta,
)
from engine_core.capabilities import Capability
from engine_core.engine import BaseEngine, loss_mask_of, predicted_mask
from engine_core.moe import replaying
from engine_core.plugins import load_plugins
from engine_core.resolve import resolve_engine_config
from engine_core.testing.models import TINY_QWEN2, engine_config, nll_loss, random_batch

__all__ = [
    "Baseline",
    "CAPABILITY_TRIGGERS",
    "build",
    "declared_capabilities",
    "make_baseline",
    "plain_log_probs",
    "plain_values",
    "plain_loss_and_grad_norm",
    "plain_update",
    "masked_batch",
    "UPDATE_OPTIM",
    "UPDATE_STEPS",
    "UPDATE_CAUSES",
    "MIXED_PRECISION_OPTIM",
    "no_process_group_checks",
    "single_process_checks",
    "two_process_checks",
]

N = 8  # samples per batch (divisible by DP size 2)
LORA = {"rank": 4, "alpha": 8.0}

# the config that asks a backend for a capability (refused at resolution when undeclared)
CAPABILITY_TRIGGERS: dict[Capability, dict[str, Any]] = {
    Capability.VALUE_HEAD: {"model": {"config": dict(TINY_QWEN2), "value_head": True}},
    Capability.LORA: {"model": {"config": dict(TINY_QWEN2), "lora": LORA}},
    Capability.GRADIENT_CHECKPOINTING: {
        "model": {"config": dict(TINY_QWEN2), "gradient_checkpointing": True}
    },
    Capability.TENSOR_PARALLEL: {"tensor_parallel_size": 2},
    Capability.PIPELINE_PARALLEL: {"pipeline_parallel_size": 2},
    Capability.CONTEXT_PARALLEL: {"context_parallel_size": 2},
    Capability.PACKING: {"use_packing": True},
    Capability.DYNAMIC_BATCH: {"max_tokens_per_micro_batch": 64},
    Capability.OFFLOAD: {"offload": True},
    Capability.BF16: {"model": {"config": dict(TINY_QWEN2), "dtype": "bfloat16"}},
    Capability.MIXED_PRECISION: {"compute_dtype": "bfloat16"},
    Capability.ACTIVATION_OFFLOAD: {"activation_offload": True},
}


def declared_capabilities(backend: str) -> frozenset[Capability]:
    return frozenset(load_plugins().get_engine(backend).capabilities)


def _packing(backend: str) -> bool:
    return Capability.PACKING in declared_capabilities(backend)


def build(backend: str, **overrides: Any) -> BaseEngine:
    """Resolve (capability checks included), construct and initialise ``backend``'s engine."""
    overrides.setdefault("use_packing", _packing(backend))
    raw = engine_config(backend=backend, **overrides)
    spec, cfg = resolve_engine_config(raw, load_plugins())
    engine: BaseEngine = spec.load_class()(cfg)
    engine.init_model()
    engine.set_loss_fn(nll_loss)
    return engine


# ---------------------------------------------------------------------------- baselines
@dataclass
class Baseline:
    """Saved HF folders the engines load, and plain transformers figures on those weights."""

    root: str
    policy_dir: str
    critic_dir: str
    log_probs: torch.Tensor
    entropy: torch.Tensor
    values: torch.Tensor
    values_at_token: torch.Tensor
    loss: float
    grad_norm: float
    state_dict: dict[str, torch.Tensor]


def eval_batch() -> TensorDict:
    batch = random_batch(N, seed=11, left_pad=True)
    set_meta(batch, BatchMeta(compute_entropy=True))
    return batch


def train_batch(seed: int = 0) -> TensorDict:
    return random_batch(N, seed=seed)


def _hf_config(**extra: Any) -> Any:
    from transformers import AutoConfig

    cfg = dict(TINY_QWEN2)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg, **extra)


def plain_log_probs(
    model: torch.nn.Module, batch: TensorDict, routes: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence alone through the model: log-probs and entropy aligned to ``input_ids``.
    With ``routes`` (``[B, L, layers, top_k]``, a mixture of experts), each sequence's routes
    are replayed (:func:`engine_core.moe.replaying`)."""
    ids, mask = batch[INPUT_IDS], batch[ATTENTION_MASK]
    lp, ent = torch.zeros(ids.shape), torch.zeros(ids.shape)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            real = mask[i].bool()
            seq = ids[i][real].unsqueeze(0)
            replay = (
                contextlib.nullcontext()
                if routes is None
                else replaying(model, routes[i, real].transpose(0, 1))
            )
            with replay:
                logits = model(input_ids=seq).logits
            logp = torch.log_softmax(logits.float()[0, :-1], -1)
            idx = real.nonzero().squeeze(-1)
            lp[i, idx[1:]] = logp.gather(-1, seq[0, 1:, None]).squeeze(-1)
            ent[i, idx[1:]] = -(logp.exp() * logp).sum(-1)
    return lp, ent


def plain_values(
    model: torch.nn.Module, batch: TensorDict, *, at_token: bool = False
) -> torch.Tensor:
    """A value head's outputs aligned like log-probs (position t: the prefix before t), or with
    ``at_token`` the head's output at each token itself (``BatchMeta.values_at_token``)."""
    ids, mask = batch[INPUT_IDS], batch[ATTENTION_MASK]
    out = torch.zeros(ids.shape)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            real = mask[i].bool()
            head = model(input_ids=ids[i][real].unsqueeze(0)).logits.float()[0, :, 0]
            where = real.nonzero().squeeze(-1)
            if at_token:
                out[i, where] = head
            else:
                out[i, where[1:]] = head[:-1]
    return out


def plain_loss_and_grad_norm(model: torch.nn.Module, batch: TensorDict) -> tuple[float, float]:
    """Token-mean NLL over the whole batch (each sequence alone) and its gradient norm."""
    model.zero_grad(set_to_none=True)
    ids, mask = batch[INPUT_IDS], batch[ATTENTION_MASK]
    loss_mask = loss_mask_of(batch)
    total = loss_mask.sum()
    loss = torch.zeros(())
    for i in range(ids.shape[0]):
        real = mask[i].bool()
        seq = ids[i][real].unsqueeze(0)
        logp = torch.log_softmax(model(input_ids=seq).logits.float()[0, :-1], -1)
        lp = logp.gather(-1, seq[0, 1:, None]).squeeze(-1)
        weight = loss_mask[i][real][1:].float()
        loss = loss + (-(lp * weight).sum()) / total
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), norm


# The update oracle's optimizer: a moving warm-up, clipping that bites, and eps large enough that
# AdamW's step is close to lr * (momentum of the gradient), so the gradient's scale shows in the
# weights (with eps 1e-8 Adam cancels it) and float noise in tiny gradients cannot flip a step.
UPDATE_OPTIM: dict[str, Any] = {
    "lr": 1.0,
    "eps": 1.0,
    "weight_decay": 0.0,
    "warmup_steps": 2,
    "clip_grad": 0.05,
}
UPDATE_STEPS = 3
# what an engine's update matches instead of the oracle's, and what that usually means
UPDATE_CAUSES: dict[str, str] = {
    "no_loss_mask": "it trains on every predicted token: the batch's loss_mask is dropped or "
    "ignored before the loss (prompt tokens and fully masked samples train)",
    "no_clip": "gradients are not clipped to optim.clip_grad before the step "
    "(SingleOptimizerMixin.optimizer_step and clip_and_step do it)",
    "twice": "each optimizer_step() applies the update twice",
    "no_schedule": "the learning rate ignores the schedule (the warm-up): the scheduler is not "
    "built from optim, or lr_scheduler_step() does not advance it",
}


def masked_batch(seed: int) -> TensorDict:
    """A training batch with a ``loss_mask`` as RL batches carry one: the first half of each
    sequence's tokens is its prompt (no loss), the rest its response, and one sample trains on
    nothing at all. Lengths are uneven."""
    batch = random_batch(N, seed=100 + seed)
    real = batch[ATTENTION_MASK].bool()
    response = real.long().cumsum(-1) > real.sum(-1, keepdim=True) // 2
    mask = predicted_mask(batch[ATTENTION_MASK]) & response
    mask[seed % N] = False
    batch[LOSS_MASK] = mask.long()
    return batch


# The mixed-precision clause's optimizer: plain AdamW (eps 1e-8, so each step moves a weight by
# about lr whatever its gradient's scale) with an lr below a bfloat16 weight's rounding step
# (2**-8 to 2**-7 of its magnitude: 1.2e-4 at 0.02, the model's init scale; 7.8e-3 at a norm's
# 1.0), far above a float32 one's (2**-16 of that): float32 master weights take the update,
# weights held in bfloat16 round most of it away.
MIXED_PRECISION_OPTIM: dict[str, Any] = {"lr": 1e-5, "clip_grad": None}


def plain_update(
    policy_dir: str,
    *,
    cause: str | None = None,
    steps: int = UPDATE_STEPS,
    optim: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` training steps on :func:`masked_batch` written as a plain
    float32 PyTorch loop (torch's AdamW, ``clip_grad_norm_``, ``LambdaLR``), from
    ``policy_dir``'s weights: what an engine's update must give. ``cause`` (a key of
    :data:`UPDATE_CAUSES`) makes the loop commit that bug instead, so a failing engine's weights
    can be matched to one. ``optim``: the optimizer config (default :data:`UPDATE_OPTIM`)."""
    from transformers import AutoModelForCausalLM

    from engine_core.config import OptimConfig
    from engine_core.optim import lr_lambda

    cfg = OptimConfig(**(UPDATE_OPTIM if optim is None else optim))
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=False,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 1.0 if cause == "no_schedule" else lr_lambda(cfg, s)
    )
    for step in range(steps):
        batch = masked_batch(step)
        if cause == "no_loss_mask":
            batch = batch.exclude(LOSS_MASK)
        ids, mask, loss_mask = batch[INPUT_IDS], batch[ATTENTION_MASK], loss_mask_of(batch)
        total = loss_mask.sum()
        for i in range(ids.shape[0]):  # each sequence alone: no padding, no packing
            real = mask[i].bool()
            seq = ids[i][real].unsqueeze(0)
            logp = torch.log_softmax(model(input_ids=seq).logits.float()[0, :-1], -1)
            lp = logp.gather(-1, seq[0, 1:, None]).squeeze(-1)
            (-(lp * loss_mask[i][real][1:].float()).sum() / total).backward()
        if cfg.clip_grad is not None and cause != "no_clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        for _ in range(2 if cause == "twice" else 1):
            opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _oracle_steps(engine: BaseEngine) -> None:
    """The update oracle's :data:`UPDATE_STEPS` training steps, on the engine: the same
    batches, each sharded over its DP ranks."""
    for step in range(UPDATE_STEPS):
        with engine.train_mode():
            engine.forward_backward_step(engine.shard_data(masked_batch(step)))
            engine.optimizer_step()
            engine.lr_scheduler_step()
            engine.optimizer_zero_grad()


def _update(backend: str, policy: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """The engine's weights (and log-probs) after the oracle's steps on the same batches."""
    engine = build(backend, model=policy, optim=dict(UPDATE_OPTIM), **overrides)
    _oracle_steps(engine)
    export = Capability.WEIGHT_EXPORT in declared_capabilities(backend)
    return {
        "params": _params(engine) if export else None,
        "log_probs": forward(engine, eval_batch())[LOG_PROBS],
    }


def make_baseline(root: str | None = None) -> Baseline:
    """Save a seeded policy and a seeded value model, and compute the plain figures on them."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    root = root or tempfile.mkdtemp(prefix="engine-core-kit-")
    policy_dir, critic_dir = str(Path(root) / "policy"), str(Path(root) / "critic")
    torch.manual_seed(1234)
    policy = AutoModelForCausalLM.from_config(_hf_config()).eval()
    policy.save_pretrained(policy_dir)
    torch.manual_seed(4321)
    critic_cfg = _hf_config(num_labels=1, classifier_dropout=0.0)
    critic = AutoModelForTokenClassification.from_config(critic_cfg).eval()
    critic.save_pretrained(critic_dir)
    batch = eval_batch()
    lp, ent = plain_log_probs(policy, batch)
    loss, norm = plain_loss_and_grad_norm(policy, train_batch())
    return Baseline(
        root=root,
        policy_dir=policy_dir,
        critic_dir=critic_dir,
        log_probs=lp,
        entropy=ent,
        values=plain_values(critic, batch),
        values_at_token=plain_values(critic, batch, at_token=True),
        loss=loss,
        grad_norm=norm,
        state_dict={k: v.clone() for k, v in policy.state_dict().items()},
    )


# ---------------------------------------------------------------------------- in-process checks
# check-name prefixes to run (empty: every check); set from the kit's --engine-core-kit-only
_ONLY: tuple[str, ...] = ()


def _select(baseline: dict[str, str]) -> None:
    global _ONLY
    _ONLY = tuple(p for p in baseline.get("only", "").split(",") if p)


def _record(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    if _ONLY and not name.startswith(_ONLY):
        return
    try:
        results[name] = fn()
    except Exception:  # one broken check must not hide the others
        results[name] = {"error": traceback.format_exc()}


def forward(engine: BaseEngine, batch: TensorDict) -> dict[str, torch.Tensor]:
    """Forward-only outputs of the global ``batch`` (sharded over DP, gathered back)."""
    engine.set_loss_fn(None)
    with engine.eval_mode():
        out = engine.forward_backward_step(engine.shard_data(batch), forward_only=True).outputs
    engine.set_loss_fn(nll_loss)
    gathered = engine.unshard_data(out)
    return {str(k): cast(torch.Tensor, gathered[k]) for k in gathered.keys()}


def first_step(engine: BaseEngine, batch: TensorDict) -> dict[str, Any]:
    """Loss, grad norm and micro-batch count of one optimizer step (no clipping)."""
    calls: list[int] = []

    def counting_loss(mb: TensorDict, out: TensorDict, ctx: Any) -> Any:
        calls.append(ctx.num_micro_batches)
        return nll_loss(mb, out, ctx)

    engine.set_loss_fn(counting_loss)
    with engine.train_mode():
        result = engine.forward_backward_step(engine.shard_data(batch))
        norm = engine.optimizer_step()
        engine.lr_scheduler_step()
        engine.optimizer_zero_grad()
    engine.set_loss_fn(nll_loss)
    return {
        "loss": result.loss,
        "norm": norm,
        "calls": len(calls),
        "declared": calls[:1],
        "metrics": dict(result.metrics),
    }


def _outputs(backend: str, **overrides: Any) -> dict[str, torch.Tensor]:
    return forward(build(backend, **overrides), eval_batch())


def _step(
    backend: str, overrides: dict[str, Any], batch: TensorDict | None = None
) -> dict[str, Any]:
    return first_step(build(backend, **overrides), train_batch() if batch is None else batch)


def _train(engine: BaseEngine, seeds: range) -> list[tuple[float | None, float]]:
    return [(loss, norm) for loss, norm, _ in _train_lrs(engine, seeds)]


def _params(engine: BaseEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.named_full_params()}


def _modes(backend: str, policy: dict[str, Any]) -> dict[str, Any]:
    engine = build(backend, model=policy)
    module = engine.module
    assert module is not None
    seen: dict[str, Any] = {}
    with engine.train_mode():
        seen["train"] = (module.training, torch.is_grad_enabled())
    with engine.eval_mode():
        seen["eval"] = (module.training, torch.is_grad_enabled())
    before = forward(engine, eval_batch())[LOG_PROBS]
    engine.to("cpu")
    engine.to(engine.device)
    seen["to_round_trip"] = float((forward(engine, eval_batch())[LOG_PROBS] - before).abs().max())
    return seen


def _block_calls(backend: str, policy: dict[str, Any], checkpointing: bool) -> int:
    """Forward calls of the model's decoder blocks (modules whose class name ends in
    ``DecoderLayer`` or ``TransformerLayer``) during one training step: activation
    checkpointing runs each block's forward again in the backward."""
    engine = build(backend, model={**policy, "gradient_checkpointing": checkpointing})
    module = engine.module
    assert module is not None
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    hooks = [
        # a pre-hook: a recomputation may stop early, before a forward hook would run
        m.register_forward_pre_hook(count)
        for m in module.modules()
        if type(m).__name__.endswith(("DecoderLayer", "TransformerLayer"))
    ]
    first_step(engine, train_batch())
    for h in hooks:
        h.remove()
    return calls[0] if hooks else -1


def _state_devices(engine: BaseEngine) -> dict[str, list[str]]:
    """Device types of the engine's parameters, their gradients and its optimizer state."""

    def types(tensors: Any) -> list[str]:
        return sorted({t.device.type for t in tensors})

    module = engine.module
    assert module is not None
    params = list(module.parameters())
    optimizer: Any = getattr(engine, "optimizer", None)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps its own
    state = [
        v
        for per_param in (getattr(inner, "state", {}) or {}).values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    ]
    return {
        "model": types(params),
        "grads": types(p.grad for p in params if p.grad is not None),
        "optimizer": types(state),
    }


def _to(backend: str, policy: dict[str, Any]) -> dict[str, Any]:
    """``to("meta", ...)`` with each pair of flags, after a step and a backward (so optimizer
    state and gradients exist): where model, gradients and optimizer state went. The meta device
    makes a forgotten tensor visible on a host with one device; an engine may refuse a device
    (an EngineCoreError), which the contract allows only without ``offload``."""
    from engine_core.errors import EngineCoreError

    seen: dict[str, Any] = {}
    for model, optimizer in ((True, True), (True, False), (False, True)):
        engine = build(backend, model=policy, optim={"lr": 1e-3})
        with engine.train_mode():
            engine.forward_backward_step(engine.shard_data(train_batch(0)))
            engine.optimizer_step()
            engine.forward_backward_step(engine.shard_data(train_batch(1)))
        try:
            engine.to("meta", model=model, optimizer=optimizer)
        except EngineCoreError as e:
            seen[f"model={model},optimizer={optimizer}"] = {"refused": str(e)}
            continue
        seen[f"model={model},optimizer={optimizer}"] = _state_devices(engine)
    return seen


def _bf16(backend: str, policy: dict[str, Any]) -> dict[str, Any]:
    """A model held in bfloat16: its log-probs (their dtype), its export before and after a
    step, and the step's loss."""
    engine = build(backend, model={**policy, "dtype": "bfloat16"}, optim={"lr": 1e-3})
    export = Capability.WEIGHT_EXPORT in declared_capabilities(backend)
    before = _params(engine) if export else None
    log_probs = forward(engine, eval_batch())[LOG_PROBS]
    step = first_step(engine, train_batch())
    return {
        "log_probs": log_probs,
        "export": before,
        "export_dtypes_after": sorted({str(v.dtype) for v in _params(engine).values()})
        if export
        else None,
        "loss": step["loss"],
    }


def _mixed_precision(backend: str, policy: dict[str, Any]) -> dict[str, Any]:
    """A float32 model computing in bfloat16 (``compute_dtype``): its log-probs, then its
    exported weights after the update oracle's steps at :data:`MIXED_PRECISION_OPTIM`'s lr,
    on micro-batches (gradients accumulate over them)."""
    engine = build(
        backend,
        model=policy,
        compute_dtype="bfloat16",
        optim=dict(MIXED_PRECISION_OPTIM),
        micro_batch_size=3,
    )
    log_probs = forward(engine, eval_batch())[LOG_PROBS]
    _oracle_steps(engine)
    export = Capability.WEIGHT_EXPORT in declared_capabilities(backend)
    return {"log_probs": log_probs, "params": _params(engine) if export else None}


def _tied(backend: str, root: str) -> dict[str, Any]:
    """A model whose input embedding and output head are one tensor: the names its export
    gives (and whether the two are equal), and its weights after a step, a save and a load
    into a fresh engine against before the save."""
    model = {"config": {**TINY_QWEN2, "tie_word_embeddings": True}}
    engine = build(backend, model=model, optim={"lr": 1e-2})
    first_step(engine, train_batch())
    exported = _params(engine)
    folder = engine.save_checkpoint(str(Path(root) / "tied"), step=1)
    resumed = build(backend, model=model, optim={"lr": 1e-2})
    resumed.load_checkpoint(folder)
    again = _params(resumed)
    head, embed = exported.get("lm_head.weight"), exported.get("model.embed_tokens.weight")
    changed = [k for k in exported if k not in again or not torch.equal(exported[k], again[k])]
    return {
        "names": sorted(exported),
        "head_is_embedding": head is not None and embed is not None and torch.equal(head, embed),
        "round_trip": sorted(changed),
        "names_after": sorted(again),
    }


def _optimizer(backend: str, policy: dict[str, Any]) -> dict[str, Any]:
    optim = {"lr": 1e-2, "warmup_steps": 4, "clip_grad": None}
    engine = build(backend, model=policy, optim=optim)
    start = _params(engine)
    lrs = []
    for s in range(2):
        with engine.train_mode():
            engine.forward_backward_step(engine.shard_data(train_batch(s)))
            engine.optimizer_step()
            lrs.append(engine.lr_scheduler_step())
            engine.optimizer_zero_grad()
    moved = any(not torch.equal(v, start[k]) for k, v in _params(engine).items())
    # a non-finite gradient norm must skip the update
    before = _params(engine)
    nan_norm = _skip_a_step(engine, seed=7)
    unchanged = all(torch.equal(v, before[k]) for k, v in _params(engine).items())
    return {"moved": moved, "lrs": lrs, "nan_norm": nan_norm, "unchanged_after_nan": unchanged}


def _rng_draws() -> list[float]:
    """A few values from every stream a resume must continue (torch, numpy, Python)."""
    import random

    import numpy as np

    return [*torch.rand(3).tolist(), *np.random.rand(2).tolist(), random.random()]


def _fingerprint(engine: BaseEngine) -> float:
    return float(sum(float(t.double().abs().sum()) for _, t in engine.named_full_params()))


# a schedule that moves on every step compared (warm-up over 6), and a model that draws random
# numbers in training (attention dropout), so a checkpoint that drops the schedule or the RNG
# state resumes differently
CKPT_OPTIM = {"lr": 1e-2, "clip_grad": 1.0, "warmup_steps": 6}


def _ckpt_model(policy: dict[str, Any]) -> dict[str, Any]:
    return {"config": {**TINY_QWEN2, "attention_dropout": 0.1}} if "path" in policy else policy


def _train_lrs(engine: BaseEngine, seeds: range) -> list[tuple[float | None, float, float]]:
    out = []
    for s in seeds:
        with engine.train_mode():
            result = engine.forward_backward_step(engine.shard_data(train_batch(s)))
            norm = engine.optimizer_step()
            lr = engine.lr_scheduler_step()
            engine.optimizer_zero_grad()
        out.append((result.loss, norm, lr))
    return out


def _checkpoint(backend: str, policy: dict[str, Any], root: str) -> dict[str, Any]:
    """Save after 2 steps; 2 more steps straight on, and the same 2 steps after loading the
    checkpoint into a fresh engine: losses, grad norms, learning rates, random draws and final
    weights must agree. Then rotation keeps the newest ``max_ckpt_to_keep``."""
    from engine_core.checkpoint import list_checkpoints

    model = _ckpt_model(policy)
    engine = build(backend, model=model, optim=CKPT_OPTIM)
    _train_lrs(engine, range(2))
    _skip_a_step(engine)  # the skipped-step counter is part of what a resume restores
    skipped_before = getattr(engine, "skipped_steps", None)
    folder = engine.save_checkpoint(root, step=2, max_ckpt_to_keep=2)
    straight_rng = _rng_draws()
    straight = _train_lrs(engine, range(2, 4))
    straight_weights = _fingerprint(engine)
    resumed = build(backend, model=model, optim=CKPT_OPTIM)
    step = resumed.load_checkpoint(folder)
    again_rng = _rng_draws()
    again = _train_lrs(resumed, range(2, 4))
    again_weights = _fingerprint(resumed)
    skipped_after = getattr(resumed, "skipped_steps", None)
    for s in (3, 4):
        engine.save_checkpoint(root, step=s, max_ckpt_to_keep=2)
    kept = [s for s, _ in list_checkpoints(root)]
    return {
        "step": step,
        "straight": straight,
        "again": again,
        "straight_rng": straight_rng,
        "again_rng": again_rng,
        "weights": (straight_weights, again_weights),
        "skipped": (skipped_before, skipped_after),
        "kept": kept,
    }


def _skip_a_step(engine: BaseEngine, seed: int = 9) -> float:
    """One step whose gradient norm is NaN (which the optimizer must skip, and count); the
    norm ``optimizer_step()`` returned."""
    engine.set_loss_fn(lambda mb, out, ctx: ((out[LOG_PROBS] * math.nan).sum(), {}))
    with engine.train_mode():
        engine.forward_backward_step(engine.shard_data(train_batch(seed)))
        norm = engine.optimizer_step()
        engine.optimizer_zero_grad()
    engine.set_loss_fn(nll_loss)
    return norm


def _inputs_unmodified(backend: str, policy: dict[str, Any]) -> dict[str, Any]:
    """A training step and a forward pass must leave the caller's batch as it was."""
    engine = build(backend, model=policy, micro_batch_size=3)
    batch = eval_batch()  # one rank: the whole batch is this rank's
    before = batch.clone()
    keys = sorted(str(k) for k in batch.keys())
    with engine.train_mode():
        engine.forward_backward_step(batch)
        engine.optimizer_zero_grad()
    engine.set_loss_fn(None)
    with engine.eval_mode():
        engine.forward_backward_step(batch, forward_only=True)
    after_keys = sorted(str(k) for k in batch.keys())
    changed = [k for k in keys if k in after_keys and not _same(batch, before, k)]
    return {
        "added": sorted(set(after_keys) - set(keys)),
        "removed": sorted(set(keys) - set(after_keys)),
        "changed": changed,
    }


def _same(a: TensorDict, b: TensorDict, key: str) -> bool:
    x, y = a.get(key), b.get(key)
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and not key == "meta":
        return x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
    return bool(a.get_non_tensor(key) == b.get_non_tensor(key))


# ---------------------------------------------------------------------------- promises
# what the engine does when something goes wrong, and BaseEngine's smaller promises
# (docs/conformance.md, "Promises and the clauses that check them")

# an lr too small to move any weight: a probe step (first_step on train_batch(), whose loss and
# grad norm the baseline holds) then runs on the weights the engine was built with, however
# many came before it, and shows what an earlier call left behind (a gradient, say)
PROBE_OPTIM: dict[str, Any] = {"lr": 1e-30, "clip_grad": None}


def _raised(call: Callable[[], Any]) -> dict[str, Any] | None:
    """What ``call`` raised: the names of the exception's class and its bases, and its
    message; None when it returned."""
    try:
        call()
    except Exception as e:  # the clause says which exception it wanted
        return {"types": [c.__name__ for c in type(e).__mro__], "message": str(e)}
    return None


def _refused_batches(caps: frozenset[Capability]) -> dict[str, tuple[str, TensorDict]]:
    """Training batches a step must refuse before anything runs: {case: (error, batch)}."""
    from engine_core.batch import ROUTED_EXPERTS

    wrong_mask = train_batch()
    wrong_mask[ATTENTION_MASK] = wrong_mask[ATTENTION_MASK][:, :-1]
    outside = train_batch()
    outside[INPUT_IDS][0, 0] = TINY_QWEN2["vocab_size"]  # a real token: batches pad on the right
    longest = TINY_QWEN2["max_position_embeddings"] + 1
    cases = {
        "attention_mask of another shape than input_ids": ("BatchError", wrong_mask),
        "a token id outside the model's vocabulary": ("BatchError", outside),
        "a sample longer than max_position_embeddings": (
            "BatchError",
            random_batch(2, seq_len=longest, min_len=longest),
        ),
    }
    if Capability.ROUTING_REPLAY not in caps:
        routed = train_batch()
        routed[ROUTED_EXPERTS] = torch.zeros(*routed[INPUT_IDS].shape, 1, 1, dtype=torch.long)
        cases["routed_experts without routing_replay"] = ("CapabilityError", routed)
        asks: dict[str, Any] = {"moe_aux": {"coef": 0.1}, "return_routes": True}
        for field_name, value in asks.items():
            cases[f"BatchMeta({field_name}={value}) without routing_replay"] = (
                "CapabilityError",
                with_meta(train_batch(), **{field_name: value}),
            )
    else:
        cases["BatchMeta.moe_aux without the loss_mask it aggregates over"] = (
            "BatchError",
            with_meta(train_batch(), moe_aux={"coef": 0.1}),
        )
    return cases


def _no_trace(backend: str, policy: dict[str, Any]) -> dict[str, Any]:
    """Calls that must leave the engine as it was, each kind followed by a probe step: refused
    batches and a training step without a loss function; forward-only steps (in train mode,
    autograd on); a step whose loss function raises on its second micro-batch, then
    ``optimizer_zero_grad()``."""
    engine = build(backend, model=policy, optim=dict(PROBE_OPTIM), micro_batch_size=3)

    def train(batch: TensorDict) -> None:
        with engine.train_mode():
            engine.forward_backward_step(batch)

    refused = {
        case: (error, _raised(partial(train, batch)))
        for case, (error, batch) in _refused_batches(declared_capabilities(backend)).items()
    }
    engine.set_loss_fn(None)
    refused["a training step with no loss function"] = (
        "EngineCoreError",
        _raised(partial(train, train_batch())),
    )
    engine.set_loss_fn(nll_loss)
    after_refused = first_step(engine, train_batch())

    with engine.train_mode():
        with_loss = engine.forward_backward_step(train_batch(), forward_only=True).loss
        engine.set_loss_fn(None)
        cleared = engine.loss_fn is None
        without_loss = engine.forward_backward_step(train_batch(), forward_only=True).loss
        engine.set_loss_fn(nll_loss)
    forward_only = {
        "loss": with_loss,
        "loss_without_fn": without_loss,
        "loss_fn_kept": cleared and engine.loss_fn is nll_loss,
    }
    after_forward_only = first_step(engine, train_batch())

    calls: list[int] = []

    def failing(mb: TensorDict, out: TensorDict, ctx: Any) -> Any:
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("kit: the loss function failed on micro-batch 2")
        return nll_loss(mb, out, ctx)

    engine.set_loss_fn(failing)
    failed = _raised(partial(train, train_batch()))
    engine.set_loss_fn(nll_loss)
    engine.optimizer_zero_grad()
    return {
        "refused": refused,
        "after_refused": after_refused,
        "forward_only": forward_only,
        "after_forward_only": after_forward_only,
        "failed": failed,
        "after_failed": first_step(engine, train_batch()),
    }


def _skipped_step(backend: str, policy: dict[str, Any]) -> dict[str, Any]:
    """A step skipped for a NaN gradient norm, then the update oracle's first step: its
    grad norm and the weights after it (the log-probs, without ``weight_export``)."""
    engine = build(backend, model=policy, optim=dict(UPDATE_OPTIM), micro_batch_size=3)
    skipped = _skip_a_step(engine)
    with engine.train_mode():
        engine.forward_backward_step(engine.shard_data(masked_batch(0)))
        norm = engine.optimizer_step()
        engine.lr_scheduler_step()
        engine.optimizer_zero_grad()
    export = Capability.WEIGHT_EXPORT in declared_capabilities(backend)
    return {
        "skipped_norm": skipped,
        "norm": norm,
        "params": _params(engine) if export else None,
        "log_probs": None if export else forward(engine, eval_batch())[LOG_PROBS],
    }


def _values_at_token(backend: str, critic: dict[str, Any]) -> torch.Tensor:
    from engine_core.batch import VALUES

    engine = build(backend, model=critic, micro_batch_size=3)
    return forward(engine, with_meta(eval_batch(), values_at_token=True))[VALUES]


def _saved_tensors(backend: str, policy: dict[str, Any]) -> dict[str, Any]:
    """One training step with ``activation_offload``, under saved-tensor hooks of the caller's:
    how many tensors saved inside the model's forward reached them (the engine's own hooks,
    entered around the model, must take every one), and the step's loss and grad norm."""
    engine = build(
        backend, model=policy, activation_offload=True, optim={"lr": 1e-3, "clip_grad": None}
    )
    module = engine.module
    assert module is not None
    inside, reached = [False], [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        reached[0] += inside[0]
        return t

    def enter(*_: Any) -> None:
        inside[0] = True

    def leave(*_: Any) -> None:
        inside[0] = False

    hooks = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step = first_step(engine, train_batch())
    for h in hooks:
        h.remove()
    return {"reached": reached[0], "step": step}


def _saving(backend: str, policy: dict[str, Any], root: str) -> dict[str, Any]:
    """The checkpoint sequence's promises on one rank: the folder save_checkpoint returns and
    the job state committed with it; a second save of a step, a refusing
    ``checkpoint_preflight`` and a save interrupted after ``save_shards`` (each must commit
    nothing); ``load_shards`` of an empty folder; a checkpoint read as one written by two
    ranks (each rank's RNG streams stay its own)."""
    from engine_core.checkpoint import is_dir, list_checkpoints, load_torch, save_torch
    from engine_core.engine import CHECKPOINT_STATE_FILE
    from engine_core.errors import CheckpointError

    root = str(Path(root) / "saving")
    engine = build(backend, model=policy, optim={"lr": 1e-2, "clip_grad": None})
    first_step(engine, train_batch(0))  # megatron has no optimizer state to save before a step
    folder = engine.save_checkpoint(root, step=1, job_state={"data_position": 7})
    first_step(engine, train_batch(1))  # so that a checkpoint read would change the weights
    moved = _fingerprint(engine)
    out: dict[str, Any] = {
        "root": root,
        "folder": folder,
        "job_state": type(engine).load_job_state(folder),
        "again": _raised(lambda: engine.save_checkpoint(root, step=1)),
    }
    out["kept_after_again"] = [s for s, _ in list_checkpoints(root)]

    def refuse(path: str, *, saving: bool) -> None:
        raise CheckpointError(
            f"kit: checkpoint_preflight refuses to {'save' if saving else 'load'}"
        )

    engine.checkpoint_preflight = refuse  # type: ignore[method-assign]
    out["preflight_save"] = _raised(lambda: engine.save_checkpoint(root, step=2))
    out["preflight_load"] = _raised(lambda: engine.load_checkpoint(folder))
    del engine.checkpoint_preflight  # the class's own again
    out["preflight_wrote"] = is_dir(f"{root}/global_step_2") or is_dir(f"{root}/global_step_2.tmp")
    out["preflight_read"] = _fingerprint(engine) != moved

    shards = engine.save_shards

    def interrupted(folder: str) -> None:
        shards(folder)
        raise RuntimeError("kit: the save was interrupted after save_shards")

    engine.save_shards = interrupted  # type: ignore[method-assign]
    out["interrupted"] = _raised(lambda: engine.save_checkpoint(root, step=3))
    del engine.save_shards
    out["listed_after_interrupt"] = [s for s, _ in list_checkpoints(root)]
    out["committed_interrupted"] = is_dir(f"{root}/global_step_3")

    empty = Path(root) / "empty"
    empty.mkdir()
    out["empty"] = (str(empty), _raised(lambda: engine.load_shards(str(empty))))

    # a checkpoint written by two ranks, read by one: rank 0's core state file says world 2
    # (the folder no longer matches its manifest: read it as read_checkpoint_files does,
    # unverified); this rank's streams must go on as they were, not restart from the file's
    state_file = str(Path(folder) / CHECKPOINT_STATE_FILE.format(rank=0))
    core = load_torch(state_file)
    save_torch({**core, "world_size": 2}, state_file)
    _rng_draws()  # the streams move on from the saved ones
    streams = engine.rng_state()
    engine.read_checkpoint_files(folder)
    read = _rng_draws()
    engine.set_rng_state(streams)
    out["resharded_rng"] = (read, _rng_draws())
    return out


def _damaged(backend: str, policy: dict[str, Any], root: str) -> dict[str, Any]:
    """A checkpoint saved without a job state, then with one byte flipped in its biggest file,
    loaded on every rank: what each rank raised, and whether its weights (moved on since the
    save) changed."""
    import torch.distributed as dist

    from engine_core.checkpoint import MANIFEST_FILE

    root = str(Path(root) / "damaged")
    engine = build(backend, model=policy, optim={"lr": 1e-2, "clip_grad": None})
    first_step(engine, train_batch(0))
    folder = engine.save_checkpoint(root, step=1)
    first_step(engine, train_batch(1))  # so that a checkpoint read would change the weights
    moved = _fingerprint(engine)
    files = [p for p in Path(folder).rglob("*") if p.is_file() and p.name != MANIFEST_FILE]
    victim = max(files, key=lambda p: (p.stat().st_size, str(p)))
    dist.barrier()  # every rank has chosen before the file changes
    if dist.get_rank() == 0:
        with victim.open("r+b") as f:  # one bit, in place: the size stays
            f.seek(victim.stat().st_size // 2)
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ 0x01]))
    dist.barrier()
    return {
        "job_state": type(engine).load_job_state(folder),
        "file": victim.relative_to(folder).as_posix(),
        "refused": _raised(lambda: engine.load_checkpoint(folder)),
        "weights_moved": _fingerprint(engine) != moved,
    }


def _weight_stream(backend: str, policy: dict[str, Any], root: str) -> dict[str, Any]:
    """What the export methods give against ``named_full_params()``: with a bucket smaller
    than any tensor, through ``named_weights("model")`` and ``weight_buckets`` (and the
    buckets' sizes), in an ``export_hf`` folder (written, replaced after a step, kept when an
    export fails), and ``named_lora_params`` of an engine without ``lora``."""
    import json

    from safetensors.torch import load_file

    from engine_core.config import BUCKET_BYTES

    engine = build(backend, model=policy, optim={"lr": 1e-2, "clip_grad": None})
    full = _params(engine)

    def differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
        if got.keys() != want.keys():
            return sorted(got.keys() ^ want.keys())
        return sorted(k for k in want if not torch.equal(got[k], want[k]))

    bucket_bytes = 4096  # cuts the tiny model's weights into many buckets; the embedding alone
    buckets = [
        [(n, t.clone()) for n, t in bucket]
        for bucket in engine.weight_buckets("model", bucket_bytes)
    ]
    oversized = [
        [n for n, _ in b]
        for b in buckets
        if len(b) > 1 and sum(t.numel() * t.element_size() for _, t in b) > bucket_bytes
    ]
    out: dict[str, Any] = {
        "small_buckets": differ({n: t.clone() for n, t in engine.named_full_params(1)}, full),
        "named_weights": differ({n: t.clone() for n, t in engine.named_weights("model")}, full),
        "weight_buckets": differ({n: t for b in buckets for n, t in b}, full),
        "oversized": oversized,
        "bucket_bytes": bucket_bytes,
        "hf_config": {
            k: getattr(engine.hf_config, k, None)
            for k in ("model_type", "vocab_size", "max_position_embeddings")
        },
    }
    target = str(Path(root) / "hf-export")
    written = engine.export_hf(target)
    out["export_path"] = (target, written)
    out["export"] = differ(load_file(str(Path(written) / "model.safetensors")), full)
    out["export_config"] = json.loads((Path(written) / "config.json").read_text())["model_type"]
    first_step(engine, train_batch())
    stepped = _params(engine)
    own = engine.named_full_params

    def failing(bucket_bytes: int = BUCKET_BYTES) -> Any:
        names = own(bucket_bytes)
        yield next(names)
        raise RuntimeError("kit: the export failed while gathering")

    engine.named_full_params = failing  # type: ignore[method-assign]
    out["failed_export"] = _raised(lambda: engine.export_hf(target))
    del engine.named_full_params
    out["after_failed_export"] = differ(load_file(str(Path(written) / "model.safetensors")), full)
    engine.export_hf(target)
    out["replaced"] = differ(load_file(str(Path(written) / "model.safetensors")), stepped)
    if Capability.LORA not in declared_capabilities(backend):
        out["lora_refused"] = _raised(lambda: next(iter(engine.named_lora_params())))
    return out


def _ranks(backend: str, policy: dict[str, Any]) -> dict[str, Any]:
    """The layout properties against the process group, ``shard_data`` of a batch that does
    not split over the DP ranks, and ``global_context`` of this rank's share of a batch."""
    import torch.distributed as dist

    engine = build(backend, model=policy)
    group = engine.dp_group
    ctx = engine.global_context(engine.shard_data(masked_batch(0)), 1)
    return {
        "rank": dist.get_rank(),
        "dp": (engine.dp_rank, engine.dp_size),
        "group": (dist.get_rank(group), dist.get_world_size(group)),
        "collect": engine.is_collect_rank,
        "writes": engine.writes_full_params,
        "is_distributed": (engine.is_distributed, dist.is_initialized()),
        "uneven": _raised(lambda: engine.shard_data(random_batch(engine.dp_size + 1))),
        "counts": (ctx.global_num_tokens, ctx.global_num_samples),
    }


def no_process_group_checks(
    rank: int, world: int, backend: str, baseline: dict[str, str]
) -> dict[str, Any]:
    """The engine as a script or ``engine-core run`` uses it: one plain process, no process
    group beforehand. Build, forward, train, checkpoint round trip and export must all work."""
    _select(baseline)
    import torch.distributed as dist

    policy = {"path": baseline["policy_dir"]}
    results: dict[str, Any] = {"had_group": dist.is_available() and dist.is_initialized()}

    def lifecycle() -> dict[str, Any]:
        engine = build(backend, model=policy, optim={"lr": 1e-3, "clip_grad": None})
        # whether a default process group exists, as the engine says and as torch says
        distributed = (engine.is_distributed, dist.is_available() and dist.is_initialized())
        out = forward(engine, eval_batch())
        step = first_step(engine, train_batch())
        folder = engine.save_checkpoint(baseline["checkpoint_root"], step=1)
        loaded = build(backend, model=policy).load_checkpoint(folder)
        exported = len(_params(engine))
        return {
            "log_probs": out[LOG_PROBS],
            "step": step,
            "loaded": loaded,
            "exported": exported,
            "is_distributed": distributed,
        }

    _record(results, "lifecycle", lifecycle)
    return results


def _lora(backend: str, policy_dir: str) -> dict[str, Any]:
    engine = build(backend, model={"path": policy_dir, "lora": LORA})
    module = engine.module
    assert module is not None
    before = _params_unmerged(engine)
    _train(engine, range(2))
    after = _params_unmerged(engine)
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    with module.disable_adapter():  # type: ignore[operator]
        base = forward(engine, eval_batch())[LOG_PROBS]
    return {
        "changed": changed,
        "base_log_probs": base,
        "stream": _lora_stream(engine, after),
        "parts": _weight_parts(engine),
    }


def _routing(backend: str, root: str) -> dict[str, float]:
    """An engine that declares routing_replay, given a batch with ``routed_experts`` on a tiny
    Qwen3-MoE: how far its log-probs are from transformers' with those routes replayed, and
    from transformers' own routing (which the given routes differ from)."""
    from engine_core.batch import ROUTED_EXPERTS
    from engine_core.config import ModelConfig
    from engine_core.models import build_model
    from engine_core.moe import route_mismatch
    from engine_core.testing.moe import TINY_QWEN3_MOE, own_routes, routed_batch

    folder = str(Path(root) / "moe_policy")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: Any = build_model(ModelConfig(config=dict(TINY_QWEN3_MOE))).eval()
    model.save_pretrained(folder)
    batch, routes = routed_batch(model)
    want, _ = plain_log_probs(model, batch, routes)
    own, _ = plain_log_probs(model, batch)
    chosen = own_routes(model, batch, routes)  # the routers' own choice under the replay
    engine = build(backend, model={"path": folder})
    batch[ROUTED_EXPERTS] = routes
    out = forward(engine, with_meta(batch, return_routes=True))
    got = out[LOG_PROBS]
    mask = predicted_mask(batch[ATTENTION_MASK])
    real = batch[ATTENTION_MASK].bool()
    returned = out.get(ROUTED_EXPERTS)
    return {
        "gap": float((got - want).abs()[mask].max()),
        "own_gap": float((got - own).abs()[mask].max()),
        # BatchMeta.return_routes: the share of decisions that are not the routers' own
        "returned_mismatch": (
            1.0
            if returned is None or returned.shape != chosen.shape
            else route_mismatch(returned[real], chosen[real])
        ),
    }


def _lora_stream(engine: BaseEngine, held: dict[str, torch.Tensor]) -> list[str]:
    """What is wrong with ``named_lora_params`` against the peft model's own tensors ``held``:
    every tensor, then the adapters alone (what a rollout serving the adapters is sent)."""
    from engine_core.models import is_adapter_name

    problems: list[str] = []
    for adapters_only in (False, True):
        want = {n for n in held if is_adapter_name(n) or not adapters_only}
        try:
            got = {
                n: t.detach().clone()
                for n, t in engine.named_lora_params(1 << 16, adapters_only=adapters_only)
            }
        except NotImplementedError as e:
            return [f"named_lora_params() is not implemented: {e}"]
        call = f"named_lora_params(adapters_only={adapters_only})"
        if set(got) != want:
            missing, extra = sorted(want - set(got)), sorted(set(got) - want)
            problems.append(f"{call} misses {missing[:3]} and adds {extra[:3]}")
        wrong = sorted(n for n in want & set(got) if not torch.equal(got[n], held[n]))
        if wrong:
            problems.append(f"{call} gives other values than the model holds for {wrong[:3]}")
    return problems


def _weight_parts(engine: BaseEngine) -> list[str]:
    """Where ``named_weights`` of a LoRA model's parts differs from ``named_lora_params``."""
    problems = []
    for part, adapters_only in (("peft", False), ("adapters", True)):
        want = {n: t.clone() for n, t in engine.named_lora_params(adapters_only=adapters_only)}
        got = {n: t.clone() for n, t in engine.named_weights(part)}  # type: ignore[arg-type]
        wrong = sorted(got.keys() ^ want.keys()) or sorted(
            n for n in want if not torch.equal(got[n], want[n])
        )
        if wrong:
            problems.append(f"named_weights({part!r}) differs in {wrong[:3]}")
    return problems


def _params_unmerged(engine: BaseEngine) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    assert engine.module is not None
    state: dict[str, Any] = get_model_state_dict(engine.module)
    return {
        k: cast(torch.Tensor, v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in state.items()
    }


def single_process_checks(
    rank: int, world: int, backend: str, baseline: dict[str, str]
) -> dict[str, Any]:
    """Every single-process check; runs inside a one-rank process group."""
    _select(baseline)
    caps = declared_capabilities(backend)
    policy = {"path": baseline["policy_dir"]}
    critic = {"path": baseline["critic_dir"], "value_head": True}
    results: dict[str, Any] = {}
    layouts = [False, True] if Capability.PACKING in caps else [False]
    for packing in layouts:
        _record(
            results,
            f"outputs_packing={packing}",
            partial(_outputs, backend, model=policy, use_packing=packing, micro_batch_size=3),
        )
    # the output layer's plain forward (full logits) as well as the default chunked head
    _record(
        results,
        "outputs_full_logits",
        partial(_outputs, backend, model=policy, micro_batch_size=3, logits_chunk_tokens=None),
    )
    if Capability.VALUE_HEAD in caps:
        _record(
            results,
            "values",
            partial(_outputs, backend, model=critic, micro_batch_size=3),
        )
    variants: dict[str, dict[str, Any]] = {
        "mbs1": {"micro_batch_size": 1},
        "mbs3": {"micro_batch_size": 3},
        # chunks of 3 tokens cross sequence boundaries; null: full logits
        "chunks_of_3_tokens": {"micro_batch_size": 3, "logits_chunk_tokens": 3},
        "full_logits": {"micro_batch_size": 3, "logits_chunk_tokens": None},
    }
    if Capability.DYNAMIC_BATCH in caps:
        variants["budget40"] = {"max_tokens_per_micro_batch": 40}
    if Capability.GRADIENT_CHECKPOINTING in caps:
        variants["checkpointing"] = {"model": {**policy, "gradient_checkpointing": True}}
        _record(
            results,
            "recompute",
            lambda: {on: _block_calls(backend, policy, on) for on in (False, True)},
        )
    for name, overrides in variants.items():
        kw = {"model": policy, "optim": {"lr": 1e-3, "clip_grad": None}, **overrides}
        _record(results, f"step_{name}", partial(_step, backend, kw))
    _record(results, "modes", lambda: _modes(backend, policy))
    _record(results, "optimizer", lambda: _optimizer(backend, policy))
    _record(results, "to_meta", lambda: _to(backend, policy))
    if Capability.BF16 in caps:
        _record(results, "bf16", lambda: _bf16(backend, policy))
    if Capability.MIXED_PRECISION in caps:
        _record(results, "mixed_precision", lambda: _mixed_precision(backend, policy))
    if Capability.WEIGHT_EXPORT in caps:
        _record(results, "tied", lambda: _tied(backend, baseline["checkpoint_root"]))
    update = {"micro_batch_size": 3}
    if Capability.DYNAMIC_BATCH in caps:
        update = {"max_tokens_per_micro_batch": 40}
    _record(results, "update", lambda: _update(backend, policy, **update))
    _record(
        results, "checkpoint", lambda: _checkpoint(backend, policy, baseline["checkpoint_root"])
    )
    _record(results, "inputs", lambda: _inputs_unmodified(backend, policy))
    _record(results, "no_trace", lambda: _no_trace(backend, policy))
    _record(results, "skipped_step", lambda: _skipped_step(backend, policy))
    _record(results, "saving", lambda: _saving(backend, policy, baseline["checkpoint_root"]))
    if Capability.VALUE_HEAD in caps:
        _record(results, "at_token", lambda: _values_at_token(backend, critic))
    if Capability.ACTIVATION_OFFLOAD in caps:
        _record(results, "saved_tensors", lambda: _saved_tensors(backend, policy))
    if Capability.WEIGHT_EXPORT in caps:
        _record(results, "export", lambda: _params(build(backend, model=policy)))
        _record(
            results,
            "weight_stream",
            lambda: _weight_stream(backend, policy, baseline["checkpoint_root"]),
        )
    if Capability.LORA in caps:
        _record(results, "lora", lambda: _lora(backend, baseline["policy_dir"]))
    if Capability.ROUTING_REPLAY in caps:
        _record(results, "routing", lambda: _routing(backend, baseline["checkpoint_root"]))
    if Capability.OFFLOAD in caps:
        optim = {"lr": 1e-2, "clip_grad": 1.0}
        _record(
            results,
            "offload",
            lambda: {
                "on": _train(build(backend, model=policy, optim=optim, offload=True), range(2)),
                "off": _train(build(backend, model=policy, optim=optim), range(2)),
            },
        )
    return results


def _uneven_batch() -> TensorDict:
    """Long sequences first, short ones last: DP rank 0 needs more budget micro-batches."""
    long = random_batch(N // 2, seed=5, min_len=20)
    short = random_batch(N // 2, seed=6, min_len=3, seq_len=6)
    pad = torch.zeros(
        N // 2, long[INPUT_IDS].shape[1] - short[INPUT_IDS].shape[1], dtype=torch.long
    )
    from engine_core.batch import make_batch

    ids = torch.cat([long[INPUT_IDS], torch.cat([short[INPUT_IDS], pad], 1)])
    mask = torch.cat([long[ATTENTION_MASK], torch.cat([short[ATTENTION_MASK], pad], 1)])
    return make_batch(ids, mask)


def two_process_checks(
    rank: int, world: int, backend: str, baseline: dict[str, str]
) -> dict[str, Any]:
    """Data-parallel checks on two ranks (one DP rank each)."""
    _select(baseline)
    import torch.distributed as dist

    from engine_core.dispatch import Worker

    caps = declared_capabilities(backend)
    policy = {"path": baseline["policy_dir"]}
    results: dict[str, Any] = {}
    _record(
        results,
        "outputs",
        partial(_outputs, backend, model=policy, micro_batch_size=3),
    )

    def layout() -> dict[str, Any]:
        engine = build(backend, model=policy)
        worker = Worker()
        worker.register_mesh(
            "kit", dp_rank=engine.dp_rank, dp_size=engine.dp_size, is_collect=engine.is_collect_rank
        )
        return {
            "rank": dist.get_rank(),
            "dp_rank": engine.dp_rank,
            "dp_size": engine.dp_size,
            "collect": engine.is_collect_rank,
            "registered": worker.mesh_rank("kit").dp_rank == engine.dp_rank,
        }

    _record(results, "layout", layout)
    model_parallel = {
        Capability.TENSOR_PARALLEL: "tensor_parallel_size",
        Capability.PIPELINE_PARALLEL: "pipeline_parallel_size",
        Capability.CONTEXT_PARALLEL: "context_parallel_size",
    }
    for cap, field_name in model_parallel.items():
        if cap in caps:
            kw = {"model": policy, "micro_batch_size": 3, field_name: 2}
            _record(results, f"outputs_{cap}", partial(_outputs, backend, **kw))
    variants: dict[str, dict[str, Any]] = {"mbs2": {"micro_batch_size": 2}}
    if Capability.DYNAMIC_BATCH in caps:
        variants["budget40"] = {"max_tokens_per_micro_batch": 40}
    if Capability.CONTEXT_PARALLEL in caps:  # each row split over both ranks: one DP rank
        variants["cp2"] = {"micro_batch_size": 3, "context_parallel_size": 2}
    for name, overrides in variants.items():
        kw = {"model": policy, "optim": {"lr": 1e-3, "clip_grad": None}, **overrides}
        _record(results, f"step_{name}", partial(_step, backend, kw))
    if Capability.DYNAMIC_BATCH in caps:
        kw = {"model": policy, "max_tokens_per_micro_batch": 48}
        _record(results, "uneven_counts", partial(_step, backend, kw, _uneven_batch()))
    _record(results, "update", lambda: _update(backend, policy, micro_batch_size=2))
    # optimizer state sharded (or replicated) over two ranks: saved and restored by every rank
    _record(
        results, "checkpoint", lambda: _checkpoint(backend, policy, baseline["checkpoint_root"])
    )
    _record(results, "ranks", lambda: _ranks(backend, policy))
    _record(results, "damaged", lambda: _damaged(backend, policy, baseline["checkpoint_root"]))
    return results
