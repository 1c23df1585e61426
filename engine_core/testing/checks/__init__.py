"""The conformance kit's checks, one module per concern, each check beside the contract tests
that judge its result.

- :mod:`.registry`: :class:`~.registry.Check`, the layouts, and one process run per layout.
- :mod:`.verdict`: reading a check's result in a test; tolerances and shared assertions.
- :mod:`.outputs`: log-probs, entropy and values against plain transformers.
- :mod:`.gradients`: loss, grad norm and metrics for every micro-batching; recomputation and
  activation offload.
- :mod:`.modes`: ``train_mode`` / ``eval_mode``, ``to``, ``offload``.
- :mod:`.update`: the update against a plain AdamW loop; the optimizer and schedule.
- :mod:`.precision`: a bfloat16 model, and bfloat16 compute on float32 master weights.
- :mod:`.weights`: export, the weight streams, ``export_hf``, tied embeddings.
- :mod:`.lora`, :mod:`.routing`, :mod:`.vision`: LoRA adapters; MoE routing replay; images.
- :mod:`.checkpoint`: resume, rotation and the checkpoint sequence.
- :mod:`.refusals`: refused batches, inputs left unmodified, what leaves no trace, a skipped
  step.
- :mod:`.layout`: the DP layout, and the engine without a process group.
- :mod:`.construction`: capabilities and construction (no engine process).

:data:`REGISTRY` holds every check in run order.
"""

from __future__ import annotations

from engine_core.testing.checks import (
    checkpoint,
    gradients,
    layout,
    lora,
    modes,
    outputs,
    precision,
    refusals,
    routing,
    update,
    vision,
    weights,
)
from engine_core.testing.checks.registry import Check, Context, Layout, Registry

__all__ = ["REGISTRY", "Check", "Context", "Layout", "Registry"]

REGISTRY = Registry(
    (
        *outputs.CHECKS,
        *gradients.CHECKS,
        *modes.CHECKS,
        *update.CHECKS,
        *precision.CHECKS,
        *weights.CHECKS,
        *checkpoint.CHECKS,
        *refusals.CHECKS,
        *lora.CHECKS,
        *routing.CHECKS,
        *vision.CHECKS,
        *layout.CHECKS,
    )
)
