"""The one hook of the generic micro-batch loop: :class:`ForwardExtension`.

A feature that acts around the model call (a mixture of experts' routing replay and balance
loss, :mod:`engine_core.routing_replay`) is a :class:`ForwardExtension`, chosen once when the
engine is built (:meth:`BaseEngine.forward_extension
<engine_core.engine.BaseEngine.forward_extension>`). The loop calls it at fixed points and never
branches on the feature:

1. :meth:`ForwardExtension.check_batch` once per step, before anything runs;
2. the extension's :attr:`~ForwardExtension.input_parts` are built with each micro-batch's
   inputs;
3. :meth:`ForwardExtension.begin` makes each micro-batch's :class:`MicroBatchHooks`, which
   :meth:`~engine_core.engine.BaseEngine.forward_model` enters around the model call
   (:meth:`~MicroBatchHooks.model_context`, then :meth:`~MicroBatchHooks.after_model`), and the
   loop asks for the outputs it adds (:meth:`~MicroBatchHooks.add_outputs`) and for the loss
   it adds (:meth:`~MicroBatchHooks.add_loss`).

What the forward produces for the feature stays in the micro-batch's hooks, never in the
inputs. The base classes do nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from tensordict import TensorDict
from torch import nn

if TYPE_CHECKING:
    from engine_core.loss import GlobalBatchContext, Metric
    from engine_core.model_inputs import InputPart, ModelInputs

__all__ = ["NO_HOOKS", "ForwardExtension", "MicroBatchHooks"]


class MicroBatchHooks:
    """One micro-batch's share of a :class:`ForwardExtension`; this base adds nothing."""

    def model_context(self, module: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context entered around the model call, inside the engine's own contexts."""
        return contextlib.nullcontext()

    def after_model(self) -> None:
        """Called once the model call and its contexts have ended (before its outputs are
        prepared): collect what the call left."""

    def add_outputs(self, out: TensorDict, inputs: ModelInputs, micro_batch: TensorDict) -> None:
        """Add the feature's per-sample outputs to the micro-batch's ``out`` (batch layout)."""

    def add_loss(
        self,
        loss: torch.Tensor,
        metrics: Mapping[str, Metric],
        micro_batch: TensorDict,
        ctx: GlobalBatchContext,
    ) -> tuple[torch.Tensor, Mapping[str, Metric]]:
        """The loss function's ``(loss, metrics)`` with the feature's own terms added."""
        return loss, metrics


#: the hooks of a micro-batch the extension has nothing to do for
NO_HOOKS = MicroBatchHooks()


class ForwardExtension:
    """What a feature adds to the generic micro-batch loop; this base adds nothing."""

    #: the inputs the feature reads, built with every micro-batch's (:class:`InputPart`)
    input_parts: ClassVar[tuple[type[InputPart], ...]] = ()

    def check_batch(self, batch: TensorDict, engine: str) -> None:
        """Refuse, before anything runs, a ``batch`` that asks the feature for what the engine
        (named ``engine``) cannot give."""

    def begin(self, inputs: ModelInputs, micro_batch: TensorDict) -> MicroBatchHooks:
        """The hooks of one micro-batch, whose inputs are ``inputs``."""
        return NO_HOOKS
