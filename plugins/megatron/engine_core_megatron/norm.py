"""RMSNorm for megatron-core's local layer spec that also runs under sequence parallelism.

megatron-core 0.16's local norm (``WrappedTorchNorm``) refuses ``sequence_parallel``. With
sequence parallelism a norm sees only this TP rank's slice of the sequence, so its weight's
gradient is partial on each rank; megatron-core sums such gradients over the TP group when the
parameter carries ``sequence_parallel = True`` (``finalize_model_grads``). :class:`LocalRMSNorm`
is ``torch.nn.RMSNorm`` with that mark, built with megatron-core's norm arguments, so the same
class serves the layers' norms and the final norm with or without sequence parallelism.

It is built in ``config.params_dtype``. megatron-core's local norm ignores it and stays fp32 in
a bf16 model, which keeps it off the fused kernel and misaligns megatron's optimizer: its
checkpoint mapping pairs bf16 parameters with optimizer state by position.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LocalRMSNorm"]


class LocalRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` taking megatron-core's norm constructor arguments."""

    def __init__(
        self,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> None:
        if normalization != "RMSNorm" or zero_centered_gamma:
            raise ValueError(
                f"LocalRMSNorm is an RMSNorm with a plain weight; got normalization="
                f"{normalization!r}, zero_centered_gamma={zero_centered_gamma}."
            )
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        # partial gradients on each TP rank under sequence parallelism: megatron sums them
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
