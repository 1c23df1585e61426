"""The megatron engine's micro-batch loop: megatron-core's forward-backward schedule driven
with the core's micro-batches (:func:`run_schedule`).

The steps, each a small function: refuse a batch the interleaved schedule cannot split
(:func:`check_micro_batches`); prepare every micro-batch's inputs; point the model chunks'
config at the engine's gradient sync (:func:`configure_chunks`); run the schedule, whose
forward step (:meth:`PipelineStep.forward_step`) calls the model chunk with a chunked output
layer, the fused cross-entropy or plain logits, and whose loss function
(:meth:`PipelineStep.loss_func`) prepares the outputs and applies the core's loss; then the
last stage's results go to every stage (:func:`stage_results`). The mixture-of-experts share is
the engine's :class:`~engine_core_megatron.schedule_routing.ScheduleRouting`, called at fixed
points.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_core.backend import (
    LOG_PROBS,
    EngineCoreError,
    GlobalBatchContext,
    HeadRequest,
    MetricAccumulator,
    MicroBatchResults,
    ModelInputs,
)
from engine_core_megatron._pipeline import broadcast_results
from engine_core_megatron.vocab_parallel import chunked_output_layer

__all__ = ["PipelineStep", "check_micro_batches", "configure_chunks", "run_schedule"]


def check_micro_batches(engine: Any, n: int) -> None:
    """Refuse ``n`` micro-batches that the interleaved schedule cannot run."""
    pp = engine.config.pipeline_parallel_size
    if engine.config.virtual_pipeline_parallel_size and n % pp:
        raise EngineCoreError(
            f"megatron: the interleaved pipeline schedule needs a number of micro-batches "
            f"divisible by pipeline_parallel_size ({pp}); this batch has {n}. Choose "
            f"micro_batch_size so that the batch splits into a multiple of {pp}, or unset "
            f"virtual_pipeline_parallel_size."
        )


class PipelineStep:
    """The schedule's forward step and loss function for one call, and what they collect: the
    outputs, the loss sum and the metrics of the micro-batches this stage ends."""

    def __init__(self, engine: Any, ctx: GlobalBatchContext) -> None:
        self.engine, self.ctx = engine, ctx
        self.acc = MetricAccumulator()
        self.outputs: list[TensorDict] = []
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.one = torch.ones((), dtype=torch.int, device=engine.device)

    def loss_func(
        self, mb: TensorDict, inputs: ModelInputs, fused: bool, output: torch.Tensor
    ) -> Any:
        engine = self.engine
        # the model's output: logits [b, s, vocab/tp], (log-prob, entropy) [b, s, 2] from
        # a chunked output layer (inputs.head, see _chunked_head_request), or per-token
        # NLL [b, s] of the next token when it computed log-probs itself (_fused_log_probs)
        output = output[:, : inputs.kwargs["length"]]
        if fused:
            out = engine.place_next_token_outputs({LOG_PROBS: -output[:, :-1]}, inputs, mb)
        else:
            out = engine.prepare_model_outputs(SimpleNamespace(logits=output), inputs, mb)
        self.outputs.append(out.detach())
        if engine.loss_fn is None:
            return torch.zeros((), device=output.device, requires_grad=False), self.one, {}
        loss, metrics = engine.loss_fn(mb, out, self.ctx)
        self.acc.update(metrics)
        self.loss_sum = self.loss_sum + loss.detach().double().cpu()
        return loss.to(output.device), self.one, {}

    def forward_step(self, data_iterator: Iterator[Any], model: torch.nn.Module) -> Any:
        engine = self.engine
        mb, inputs = next(data_iterator)
        kwargs = {k: v for k, v in inputs.kwargs.items() if k != "length"}
        engine._schedule_routing.enter(inputs, mb, self.ctx)  # what it asks of the routers
        # only the chunk that ends the pipeline has the output layer (model: DDP-wrapped)
        head = engine._chunked_head_request(inputs, mb) if model.module.post_process else None
        if head is not None:
            return self._chunked_forward(model, kwargs, mb, inputs, head)
        fused = engine._fused_log_probs(mb)
        if fused:  # labels[t] = token t + 1; the last position's label is dropped
            kwargs["labels"] = torch.roll(kwargs["input_ids"], -1, dims=1)
        return model(**kwargs), functools.partial(self.loss_func, mb, inputs, fused)

    def _chunked_forward(
        self,
        model: torch.nn.Module,
        kwargs: dict[str, Any],
        mb: TensorDict,
        inputs: ModelInputs,
        head: HeadRequest,
    ) -> Any:
        """The last chunk's forward with its output layer giving (log-prob, entropy)."""
        inputs.head = head  # prepare_model_outputs reads (log-prob, entropy) from it
        with chunked_output_layer(
            head.head,
            head.targets,
            vocab_size=self.engine.layout.vocab_size,
            temperature=head.temperature,
            entropy=head.entropy,
            chunk_tokens=head.chunk_tokens,
        ):
            output = model(**kwargs)
        return output, functools.partial(self.loss_func, mb, inputs, False)


def configure_chunks(chunks: list[torch.nn.Module]) -> None:
    """Point megatron-core's schedule at the chunks' gradient sync and the finalisation
    without rescaling."""
    chunk_config = chunks[0].module.config
    chunk_config.no_sync_func = (
        [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    )
    chunk_config.finalize_model_grads_func = _finalize_without_rescaling


def stage_results(engine: Any, step: PipelineStep) -> MicroBatchResults:
    """The last stage's results, on every stage (broadcast over the pipeline group)."""
    results = (
        MicroBatchResults(step.outputs, step.loss_sum, step.acc) if engine.is_last_stage else None
    )
    if engine.config.pipeline_parallel_size > 1:
        group = engine._ps.get_pipeline_model_parallel_group()
        last = dist.get_process_group_ranks(group)[-1]
        results = broadcast_results(results, src=last, group=group, device=engine.device)
    assert results is not None
    return results


def run_schedule(
    engine: Any, micro_batches: list[TensorDict], ctx: GlobalBatchContext, *, forward_only: bool
) -> MicroBatchResults:
    """Forward (and backward) every micro-batch through megatron-core's schedule; every rank
    returns the results of every micro-batch."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = len(micro_batches)
    check_micro_batches(engine, n)
    prepared = [(mb, engine.prepare_model_inputs(mb)) for mb in micro_batches]
    routing = engine._schedule_routing
    routing.start(forward_only=forward_only)
    step = PipelineStep(engine, ctx)
    chunks = engine.chunks
    configure_chunks(chunks)
    data: Any = [iter(prepared) for _ in chunks] if len(chunks) > 1 else iter(prepared)
    grad = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad:
        get_forward_backward_func()(
            forward_step_func=step.forward_step,
            data_iterator=data,
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=n,
            seq_length=max(int(p[1].kwargs["input_ids"].shape[1]) for p in prepared),
            micro_batch_size=max(int(p[1].kwargs["input_ids"].shape[0]) for p in prepared),
            forward_only=forward_only,
        )
    routing.finish()
    results = stage_results(engine, step)
    routing.add_outputs(prepared, results, ctx)
    return results


def _finalize_without_rescaling(
    model: list[torch.nn.Module], num_tokens: Any = None, **kwargs: Any
) -> None:
    """megatron-core's gradient finalisation (DP reduction, tied-embedding and sequence-parallel
    all-reduces) without its rescaling by the token count: the core's losses are normalised
    by global counts already."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)
