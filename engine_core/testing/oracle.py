"""The kit's oracle: its saved tiny models and batches, and what plain transformers (and a
plain PyTorch training loop) give on them, which every engine must give too.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from engine_core.batch import ATTENTION_MASK, INPUT_IDS, LOSS_MASK, BatchMeta, set_meta
from engine_core.engine import loss_mask_of, predicted_mask
from engine_core.moe import replaying
from engine_core.testing.models import TINY_QWEN2, random_batch

__all__ = [
    "MIXED_PRECISION_OPTIM",
    "N",
    "UPDATE_CAUSES",
    "UPDATE_OPTIM",
    "UPDATE_STEPS",
    "Baseline",
    "eval_batch",
    "make_baseline",
    "masked_batch",
    "plain_log_probs",
    "plain_loss_and_grad_norm",
    "plain_update",
    "plain_values",
    "train_batch",
]

N = 8  # samples per batch (divisible by DP size 2)


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
