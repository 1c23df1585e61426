"""``Reference``: log-probs of the frozen reference policy.

Either its own engine (a frozen copy of the initial policy), or — when the actor trains LoRA
adapters — the actor's engine with the adapters disabled, which needs no second model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tensordict import TensorDict

from engine_core import LOG_PROBS, BaseEngine, CapabilityError, with_meta
from engine_core_roles.batch.keys import REF_LOG_PROBS

__all__ = ["Reference"]


class Reference:
    """Reference log-probs from ``engine``; ``use_disabled_adapters`` reuses a LoRA actor's engine.

    Log-probs are computed at the temperature in the batch's metadata, like the actor's: the
    temperature the samples were drawn at (:func:`engine_core_roles.training_batch`).
    """

    def __init__(self, engine: BaseEngine, *, use_disabled_adapters: bool = False) -> None:
        if use_disabled_adapters and not hasattr(engine.module, "disable_adapter"):
            raise CapabilityError(
                "use_disabled_adapters needs an engine whose model has LoRA adapters "
                "(model.lora set); otherwise give the Reference its own engine."
            )
        self.engine = engine
        self.use_disabled_adapters = use_disabled_adapters

    @contextlib.contextmanager
    def _policy(self) -> Iterator[None]:
        if self.use_disabled_adapters:
            with self.engine.module.disable_adapter():  # type: ignore[union-attr, operator]
                yield
        else:
            yield

    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        batch = with_meta(batch, compute_entropy=False)
        self.engine.set_loss_fn(None)
        with self.engine.eval_mode(), self._policy():
            out = self.engine.forward_backward_step(batch, forward_only=True)
        return TensorDict({REF_LOG_PROBS: out.outputs[LOG_PROBS]}, batch_size=batch.batch_size)
