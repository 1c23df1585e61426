"""The critic's value head: a scalar per token in place of megatron-core's vocabulary output."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule

__all__ = ["ValueHead"]


class ValueHead(MegatronModule):
    """``score = hidden @ W^T + b`` (``W``: ``[1, hidden]``), replicated on every TP rank.

    Installed as ``GPTModel.output_layer`` on the last pipeline stage, so it keeps that
    layer's call signature; with sequence parallelism the hidden states are gathered first.
    Maps to a transformers token-classification model's ``score`` layer.
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.zeros(1, config.hidden_size, dtype=config.params_dtype, device=device)
        )
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype, device=device))
        self.sequence_parallel = config.sequence_parallel

    def forward(
        self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None
