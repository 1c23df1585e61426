"""Token log-probs and entropy from logits split over the vocabulary (tensor parallelism).

Each TP rank holds ``logits[..., vocab_slice]``. The log-partition function, the target logit
and the expected logit are sums over the vocabulary, so each rank computes its partial sum and
one all-reduce per quantity combines them (megatron-core's, whose backward is the identity:
the loss downstream is replicated on every TP rank, so each rank's gradient for its own slice
is already complete): only ``[tokens]``-sized tensors cross
ranks, never the logits. Vocabulary rows added to make the vocabulary divide by the TP size are
masked out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_log_probs"]


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    next_ids: torch.Tensor,
    *,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``next_ids`` and optionally the entropy, from this rank's vocabulary slice.

    ``logits``: ``[..., V / tp]`` (this rank's slice, in rank order); ``next_ids``: ``[...]``
    global token ids. Differentiable; equal to a full-vocabulary ``log_softmax`` in fp32.
    """
    tp = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    rank = dist.get_rank(group) if tp > 1 else 0
    local = logits.float()
    width = local.shape[-1]
    start = rank * width
    valid = torch.arange(start, start + width, device=local.device) < vocab_size
    if not bool(valid.all()):
        local = local.masked_fill(~valid, float("-inf"))

    def total(x: torch.Tensor) -> torch.Tensor:
        if tp == 1:
            return x
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(x, group=group)

    with torch.no_grad():
        peak = local.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = local - peak.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = total(exp.sum(-1))
    log_z = sum_exp.log()
    in_slice = (next_ids >= start) & (next_ids < start + width)
    idx = (next_ids - start).clamp(0, width - 1)
    target = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * in_slice
    log_probs = total(target) - log_z
    ent = None
    if entropy:
        # H = log Z - E_p[shifted]; padded vocabulary rows have p = 0
        p_shifted = (exp * shifted.masked_fill(~valid, 0.0)).sum(-1)
        ent = log_z - total(p_shifted) / sum_exp
    return log_probs, ent
