"""``BaseEngine``: the contract every training backend implements.

The generic parts live here so every engine behaves the same: micro-batch preparation, the
global-batch loss context, metric reduction and restoring outputs to input order
(:meth:`BaseEngine.forward_backward_step`). A forward step is split in three overridable parts
(:meth:`prepare_model_inputs`, :meth:`forward_model`, :meth:`prepare_model_outputs`) whose
defaults serve transformers causal LMs and value heads, packed (padding-free) by default.

Backends implement the abstract methods: model construction, optimizer steps, device moves,
checkpoints and weight export.

Each concern beside the template has a module of its own: the model inputs and their parts
(:mod:`engine_core.model_inputs`), the loop's one hook (:mod:`engine_core.forward_extension`)
and mixture-of-experts routing as that hook (:mod:`engine_core.routing_replay`), the default
outputs (:mod:`engine_core.model_outputs`), the checkpoint sequence
(:mod:`engine_core.engine_checkpoint`) and the weight export (:mod:`engine_core.engine_export`).
Every name users import from here stays importable from here.
"""

from __future__ import annotations

import abc
import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from engine_core.activation_offload import OffloadActivations
from engine_core.batch import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    BatchMeta,
    get_meta,
    validate_batch,
)
from engine_core.capabilities import Capability
from engine_core.comm import all_reduce_cpu
from engine_core.config import EngineConfig
from engine_core.context_parallel import SequenceShard, shard_row
from engine_core.engine_checkpoint import CHECKPOINT_STATE_FILE, JOB_STATE_FILE, EngineCheckpoints
from engine_core.engine_export import WEIGHT_PARTS, WeightExport, WeightPart
from engine_core.errors import EngineCoreError
from engine_core.forward_extension import ForwardExtension, MicroBatchHooks
from engine_core.log_probs import DEFAULT_CHUNK_ELEMENTS, chunked_head, head_of, token_log_probs
from engine_core.loss import GlobalBatchContext, LossFn, MetricAccumulator
from engine_core.microbatch import prepare_micro_batches
from engine_core.model_inputs import (
    HeadRequest,
    InputPart,
    ModelInputs,
    loss_mask_of,
    next_token_targets,
    predicted_mask,
    row_to_batch,
)
from engine_core.model_outputs import ModelOutputs
from engine_core.packing import pack
from engine_core.routing_replay import (
    RoutingInputs,
    RoutingReplay,
    balance_of,
    refuse_routing,
    routing_request,
)
from engine_core.vision import (
    ROPE_POSITIONS,
    VisionInputs,
    check_vision_batch,
    has_images,
    is_vision_config,
    refuse_vision,
    rope_positions,
)

# attention kernels that take the packed row's sequence boundaries as cu_seq_lens_* kwargs
VARLEN_KERNELS = frozenset({"sdpa_varlen", "flash_attention_2"})

__all__ = [
    "CHECKPOINT_STATE_FILE",
    "JOB_STATE_FILE",
    "BaseEngine",
    "EngineOutput",
    "HeadRequest",
    "InputPart",
    "MicroBatchResults",
    "ModelInputs",
    "RoutingInputs",
    "WEIGHT_PARTS",
    "WeightPart",
    "loss_mask_of",
    "row_to_batch",
    "balance_of",
    "routing_request",
    "predicted_mask",
    "token_log_probs",
]


@dataclass
class EngineOutput:
    """What :meth:`BaseEngine.forward_backward_step` returns.

    ``outputs`` holds per-sample, per-token tensors (``log_probs``, optional ``entropy`` and
    ``values``) in the input order. ``loss`` is the global loss (summed over micro-batches and DP
    ranks), ``None`` when no loss function is set. ``metrics`` are reduced as declared.
    """

    outputs: TensorDict
    loss: float | None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class MicroBatchResults:
    """What :meth:`BaseEngine.run_micro_batches` returns: one output per micro-batch (plan
    order), this rank's summed loss and the metrics of every micro-batch (not yet reduced
    across DP ranks)."""

    outputs: list[TensorDict]
    loss: torch.Tensor
    metrics: MetricAccumulator


class BaseEngine(ModelOutputs, EngineCheckpoints, WeightExport, abc.ABC):
    """A training backend for one model (actor, critic, reference or reward).

    Subclasses set :attr:`capabilities` and :attr:`config_class` and implement the abstract
    methods: :meth:`init_model` (sets ``self.module``), :meth:`optimizer_zero_grad`,
    :meth:`optimizer_step`, :meth:`lr_scheduler_step` (or list ``SingleOptimizerMixin`` first
    among the bases), :meth:`to`, :meth:`save_shards`, :meth:`load_shards` and
    :meth:`named_full_params`.

    Methods with defaults, overridden when the backend needs it:

    - gradient sync: :meth:`backward` (default ``loss.backward()``), :meth:`no_sync` (default: no
      context) and :meth:`finish_backward` (default: nothing). The defaults are right for a
      model whose gradients need no reduction (one rank) or are reduced by hooks as a sum; a
      backend that averages over ranks scales the loss by ``dp_size`` in :meth:`backward`.
    - layout: :attr:`dp_group`, :attr:`dp_rank`, :attr:`dp_size`, :attr:`is_collect_rank`,
      :attr:`device`.
    - the forward step: :meth:`prepare_model_inputs`, :meth:`forward_model`,
      :meth:`prepare_model_outputs`, :meth:`token_log_probs`, and :meth:`run_micro_batches`
      for engines whose schedule owns the micro-batch loop.
    - checkpoints: :meth:`save_checkpoint` / :meth:`load_checkpoint` are the core's sequence;
      engines add :meth:`checkpoint_preflight`, :meth:`checkpoint_extra_state`,
      :meth:`rng_state` and their setters when they hold more state.

    Names starting with ``_`` belong to this class; a subclass that redefines one is refused.
    """

    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    config_class: ClassVar[type[EngineConfig]] = EngineConfig

    def __init__(self, config: EngineConfig) -> None:
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, got "
                f"{type(config).__name__}; resolve the config with resolve_engine_config()."
            )
        self.config = config
        self.module: nn.Module | None = None
        self.__loss_fn: LossFn | None = None  # name-mangled: a subclass cannot shadow it
        # activation offload's hooks: one object for the engine's life, entered at every forward
        self.__offload = OffloadActivations() if config.activation_offload else None
        self.__extension = self.forward_extension()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a subclass that redefines one of ``BaseEngine``'s private helpers: the base
        class relies on them, and a silent shadow would change what it does."""
        super().__init_subclass__(**kwargs)
        clash = sorted(
            name
            for name in vars(cls)
            if name.startswith("_")
            and not name.startswith("__")
            and any(name in vars(core) for core in _CORE_CLASSES)
            and cls is not BaseEngine
        )
        if clash:
            raise TypeError(
                f"{cls.__name__} redefines {clash}, private to BaseEngine; rename them (public "
                f"extension points are the documented methods, e.g. is_distributed, "
                f"save_shards, load_shards, rng_state)."
            )

    @property
    def loss_fn(self) -> LossFn | None:
        """The loss set with :meth:`set_loss_fn` (``None``: forward-only)."""
        return self.__loss_fn

    # ------------------------------------------------------------------ lifecycle
    @abc.abstractmethod
    def init_model(self) -> None:
        """Build or load the model as ``config.model`` says, the optimizer and the LR scheduler.

        Also called in a plain process with no process group (a script, ``engine-core run``):
        the engine then creates the one-rank group it needs, or runs without collectives."""

    @contextlib.contextmanager
    def train_mode(self) -> Iterator[None]:
        """Model in train mode (loaded onto the device first when offloading is configured)."""
        with self._mode(train=True):
            yield

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        """Model in eval mode, no autograd (loaded onto the device first when offloading)."""
        with self._mode(train=False), torch.no_grad():
            yield

    @contextlib.contextmanager
    def _mode(self, *, train: bool) -> Iterator[None]:
        module = self.require_module()
        if self.config.offload:
            self.to(self.device)
        was_training = module.training
        if was_training != train:  # train() walks every submodule: only when it changes
            module.train(train)
        try:
            yield
        finally:
            if module.training != was_training:
                module.train(was_training)
            if self.config.offload:
                self.to("cpu")

    # ------------------------------------------------------------------ distributed layout
    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel process group (``None``: the default group, if initialized)."""
        return None

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp_group) if self.is_distributed else 0

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self.dp_group) if self.is_distributed else 1

    @property
    def is_collect_rank(self) -> bool:
        """Whether this rank's outputs are collected (one per DP rank; TP/PP engines override)."""
        return True

    @property
    def writes_full_params(self) -> bool:
        """Whether this rank is the one that keeps what :meth:`named_full_params` gathers (the
        collect rank of DP rank 0: model-parallel ranks share a dp_rank): it writes the export
        and sends the weights out of the group."""
        return self.dp_rank == 0 and self.is_collect_rank

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def context_parallel_group(self) -> dist.ProcessGroup | None:
        """The group of ranks that split each packed row between them (Ulysses context
        parallelism, :mod:`engine_core.context_parallel`); None: each rank runs whole rows.
        Engines that set it attach it to their attention layers too."""
        return None

    @property
    def is_distributed(self) -> bool:
        """Whether a default process group is initialized (collectives are possible)."""
        return dist.is_available() and dist.is_initialized()

    def shard_data(self, batch: TensorDict) -> TensorDict:
        """This DP rank's contiguous chunk of a global batch (SPMD use under ``torchrun``).

        A batch that does not divide by ``dp_size`` is an
        :class:`~engine_core.errors.EngineCoreError`."""
        n = int(batch.batch_size[0])
        if n % self.dp_size:
            raise EngineCoreError(
                f"shard_data: batch of {n} samples does not divide by dp_size={self.dp_size}; "
                f"pass a multiple of {self.dp_size} samples."
            )
        per_rank = n // self.dp_size
        return batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]  # a view

    def unshard_data(self, outputs: TensorDict) -> TensorDict:
        """Gather every DP rank's outputs into the global batch, ordered by DP rank."""
        from engine_core.comm import all_gather_tensordict

        if self.dp_size == 1:
            return outputs
        return all_gather_tensordict(outputs, group=self.dp_group)

    # ------------------------------------------------------------------ forward / backward
    def set_loss_fn(self, fn: LossFn | None) -> None:
        """Set the loss ``fn(micro_batch, outputs, ctx) -> (loss, {name: Metric})``."""
        self.__loss_fn = fn

    def global_context(self, batch: TensorDict, num_micro_batches: int) -> GlobalBatchContext:
        """Loss-token and sample counts summed over every DP rank (one all-reduce)."""
        mask = loss_mask_of(batch)
        counts = torch.tensor([int(mask.sum()), int(mask.any(-1).sum())], dtype=torch.int64)
        if self.is_distributed and self.dp_size > 1:
            counts = all_reduce_cpu(counts, group=self.dp_group)
        return GlobalBatchContext(
            global_num_tokens=int(counts[0]),
            global_num_samples=int(counts[1]),
            dp_size=self.dp_size,
            num_micro_batches=num_micro_batches,
        )

    def forward_backward_step(self, batch: TensorDict, forward_only: bool = False) -> EngineOutput:
        """Run every micro-batch of this rank's ``batch``; accumulate gradients unless forward-only.

        Gradients are the sum over micro-batches and DP ranks of each micro-batch's loss
        gradient (see :mod:`engine_core.loss`), complete when this returns. A forward-only step
        runs no backward and leaves the gradients as they were. On a token budget every DP rank
        runs the same number of micro-batches (the plan is agreed over the DP group). The
        caller's ``batch`` is left as it was: no key added, removed or changed.

        Refused before anything runs, the engine unchanged: a batch that
        :func:`~engine_core.batch.validate_batch` refuses, a token id outside the model's
        vocabulary, a sample longer than its ``max_position_embeddings`` or ``BatchMeta.moe_aux``
        without ``loss_mask`` (:class:`~engine_core.errors.BatchError`); ``routed_experts``,
        ``BatchMeta.moe_aux`` or ``BatchMeta.return_routes`` on an engine without ``routing_replay``
        (:class:`~engine_core.errors.CapabilityError`); a training step with no loss function
        (:class:`~engine_core.errors.EngineCoreError`). An exception raised while the step runs
        (the loss function's, say) propagates as raised; gradients the micro-batches before it
        accumulated stay until :meth:`optimizer_zero_grad`, after which the engine trains on as
        before.
        """
        validate_batch(batch)
        self._check_model_limits(batch)
        if Capability.ROUTING_REPLAY not in self.capabilities:  # read at every step, as declared
            refuse_routing(batch, type(self).__name__)
        if Capability.VISION not in self.capabilities:
            refuse_vision(batch, type(self).__name__)
        check_vision_batch(batch, self.hf_config)
        self.__extension.check_batch(batch, type(self).__name__)
        if not forward_only and self.loss_fn is None:
            raise EngineCoreError(
                "forward_backward_step(forward_only=False) needs a loss; call set_loss_fn() first."
            )
        module = self.require_module()
        if has_images(batch) and ROPE_POSITIONS not in batch.keys():
            # once per sample, before the split; on a copy: the caller's batch stays as it was
            batch = batch.copy()
            batch[ROPE_POSITIONS] = rope_positions(module, batch)
        cfg = self.config
        micro_batches, plan = prepare_micro_batches(
            batch,
            micro_batch_size=cfg.micro_batch_size,
            max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
            group=self.dp_group if self.is_distributed else None,
        )
        ctx = self.global_context(batch, len(micro_batches))
        results = self.run_micro_batches(micro_batches, ctx, forward_only=forward_only)
        total_loss: float | None = None
        if self.loss_fn is not None:
            local_loss = results.loss.detach().double().cpu().reshape(())
            if self.is_distributed and self.dp_size > 1:
                local_loss = all_reduce_cpu(local_loss, group=self.dp_group)
            total_loss = float(local_loss)
        return EngineOutput(
            plan.restore(results.outputs), total_loss, results.metrics.reduce(self.dp_group)
        )

    def run_micro_batches(
        self, micro_batches: list[TensorDict], ctx: GlobalBatchContext, *, forward_only: bool
    ) -> MicroBatchResults:
        """Forward (and backward) every micro-batch, in order; finish the gradient reduction.

        The default loop serves engines whose model runs whole on each rank: forward each
        micro-batch through :meth:`prepare_model_inputs` / :meth:`forward_model` /
        :meth:`prepare_model_outputs`, apply the loss, :meth:`backward` it (gradient sync
        deferred with :meth:`no_sync` until the last micro-batch), then
        :meth:`finish_backward`. Engines whose schedule owns the micro-batch loop (pipeline
        parallelism) override it; every rank must return the results of every micro-batch.
        """
        acc = MetricAccumulator()
        outputs: list[TensorDict] = []
        local_loss = torch.zeros((), dtype=torch.float64)
        last = len(micro_batches) - 1
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        for i, mb in enumerate(micro_batches):
            sync = forward_only or i == last
            with grad_ctx, contextlib.nullcontext() if sync else self.no_sync():
                inputs = self.prepare_model_inputs(mb)
                inputs.head = self._head_request(inputs, mb)
                hooks = self.__extension.begin(inputs, mb)
                raw = self.forward_model(inputs, hooks)
                out = self.prepare_model_outputs(raw, inputs, mb)
                hooks.add_outputs(out, inputs, mb)
                if self.loss_fn is not None:
                    loss, metrics = self.loss_fn(mb, out, ctx)
                    loss, metrics = hooks.add_loss(loss, metrics, mb, ctx)
                    if not forward_only:
                        self.backward(loss)
                    local_loss += loss.detach().double().cpu()
                    acc.update(metrics)
            outputs.append(out.detach())
        if not forward_only:
            self.finish_backward()
        return MicroBatchResults(outputs, local_loss, acc)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Context for non-final micro-batches: skip gradient sync where the backend can.

        Default: no context (every backward syncs, if the backend syncs in backward at all).
        DDP-style engines return ``module.no_sync()``."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's loss (already globally normalized).

        Default: ``loss.backward()``. The contract wants gradients summed over micro-batches
        and DP ranks; a backend whose reduction averages over ranks (DDP, FSDP) backpropagates
        ``loss * dp_size`` instead."""
        loss.backward()

    def finish_backward(self) -> None:
        """Called once after the last micro-batch's backward: finish gradient reduction.

        Default: nothing (gradients are complete). Engines that reduce explicitly (one
        all-reduce over the DP group, say) do it here."""

    def prepare_model_inputs(self, micro_batch: TensorDict) -> ModelInputs:
        """Model kwargs: packed (padding-free) by default, padded when ``use_packing=False``;
        then each of :meth:`input_parts` built on that row (:class:`InputPart`).

        Packed calls pass per-sequence ``position_ids`` and ``use_cache=False``: transformers
        only detects packed sequences without a KV cache, else attention leaks across them.
        """
        ids, mask = micro_batch[INPUT_IDS], micro_batch[ATTENTION_MASK]
        dev = self.device
        cp = self.context_parallel_group
        if self.config.use_packing or cp is not None:  # a row split over cp ranks is packed
            packed = pack(ids, mask)
            row, pos, cu = packed.input_ids, packed.position_ids, packed.cu_seqlens
            longest = packed.max_seqlen
            shard: SequenceShard | None = None
            targets: torch.Tensor | None = None
            if cp is not None:  # this rank's slice of the row, padded to split evenly
                shard, row, pos, targets, cu = shard_row(row, pos, cu, cp)
                row, pos, targets = shard.local(row), shard.local(pos), shard.local(targets)
                longest = max(longest, shard.padded - shard.length)
            kwargs = {"input_ids": row.to(dev), "position_ids": pos.to(dev), "use_cache": False}
            if self.config.model.attn_implementation in VARLEN_KERNELS:
                # sequence boundaries for varlen kernels (read from position ids otherwise)
                cu = cu.to(dev)
                kwargs.update(
                    cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest
                )
            inputs = ModelInputs(
                kwargs, packed, targets=None if targets is None else targets.to(dev), shard=shard
            )
        else:
            kwargs = {
                "input_ids": ids.to(dev),
                "attention_mask": mask.to(dev),
                "position_ids": micro_batch[POSITION_IDS].to(dev),
                "use_cache": False,
            }
            inputs = ModelInputs(kwargs, None)
        for kind in self.input_parts():
            part = kind.build(micro_batch, inputs)
            if part is not None:
                inputs.add(part)
                inputs.kwargs.update(part.model_kwargs(dev))
        return inputs

    def input_parts(self) -> tuple[type[InputPart], ...]:
        """The parts :meth:`prepare_model_inputs` builds for every micro-batch: the forward
        extension's (:attr:`ForwardExtension.input_parts
        <engine_core.forward_extension.ForwardExtension.input_parts>`). An engine whose model
        takes more (images, say) returns them after these: each is a small
        :class:`InputPart`, and the loop is unchanged."""
        parts = self.__extension.input_parts
        if is_vision_config(self.hf_config):  # every call: its positions are 4 rows
            parts = (*parts, VisionInputs)
        return parts

    def forward_extension(self) -> ForwardExtension:
        """The engine's one hook into the micro-batch loop, chosen once when it is built
        (:mod:`engine_core.forward_extension`): mixture-of-experts routing
        (:class:`~engine_core.routing_replay.RoutingReplay`) for an engine that declares
        ``routing_replay``, else the base extension, which adds nothing."""
        if Capability.ROUTING_REPLAY in self.capabilities:
            return RoutingReplay()
        return ForwardExtension()

    def _head_request(self, inputs: ModelInputs, micro_batch: TensorDict) -> HeadRequest | None:
        """Whether the output layer computes log-probs in chunks for this micro-batch
        (``logits_chunk_tokens``), for engines that keep the default forward and head."""
        setting = self.config.logits_chunk_tokens
        cls = type(self)
        if (
            setting is None
            or self.config.model.value_head
            or cls.forward_model is not BaseEngine.forward_model
            or cls.prepare_model_outputs is not BaseEngine.prepare_model_outputs
            or cls.token_log_probs is not BaseEngine.token_log_probs
        ):
            return None
        head, _ = head_of(self.require_module())
        if head is None:
            return None
        targets = next_token_targets(inputs)
        # out_features, not the weight's shape: a sharded weight's shape is its shard's
        if setting == "auto" and targets.numel() * head.out_features <= DEFAULT_CHUNK_ELEMENTS:
            # one chunk would hold every token's logits and keep them for the backward: the
            # plain layer holds no more, and autograd's own backward is cheaper than the chunks'
            return None
        chunk = None if setting == "auto" else int(setting)
        meta: BatchMeta = get_meta(micro_batch)
        return HeadRequest(head, targets, meta.temperature, meta.compute_entropy, chunk)

    def forward_model(self, inputs: ModelInputs, hooks: MicroBatchHooks | None = None) -> Any:
        """Call the model; with ``inputs.head``, its output layer gives log-probs and entropy
        (:func:`~engine_core.log_probs.chunked_head`) instead of logits. With
        ``activation_offload``, inside the engine's
        :class:`~engine_core.activation_offload.OffloadActivations`. ``hooks``, the forward
        extension's for this micro-batch (:mod:`engine_core.forward_extension`), are entered
        innermost around the call (mixture-of-experts routers replay and record there,
        :mod:`engine_core.routing_replay`) and told when it has ended."""
        module = self.require_module()
        request = inputs.head
        offload = self.__offload if self.__offload is not None else contextlib.nullcontext()
        around = contextlib.nullcontext() if hooks is None else hooks.model_context(module)
        vision = inputs.part(VisionInputs)
        tower = contextlib.nullcontext() if vision is None else vision.tower_context(module)
        with self.forward_context(), offload, around, tower:
            if request is None:
                raw = module(**inputs.kwargs)
            else:
                with chunked_head(
                    request.head,
                    request.targets,
                    temperature=request.temperature,
                    entropy=request.entropy,
                    chunk_tokens=request.chunk_tokens,
                ):
                    raw = module(**inputs.kwargs)
        if hooks is not None:
            hooks.after_model()
        return raw

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """Context around each call of the model in :meth:`forward_model`.

        Default: none. An engine that meets ``compute_dtype`` with autocast returns
        ``torch.autocast(self.device.type, dtype=...)`` here: the model's forward, and the
        backward recorded for it, compute in that dtype; the parameters and their gradients
        stay in ``model.dtype``, and log-probs are float32 as always."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ optimizer
    @abc.abstractmethod
    def optimizer_zero_grad(self) -> None:
        """Clear gradients."""

    @abc.abstractmethod
    def optimizer_step(self) -> float:
        """Clip, step and return the grad norm (before clipping); on a non-finite norm skip the
        update: the weights and the optimizer's state (AdamW's moments and step count) stay as
        they were, and the non-finite norm is returned."""

    @abc.abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule and return the new learning rate."""

    # ------------------------------------------------------------------ state
    @abc.abstractmethod
    def to(self, device: torch.device | str, *, model: bool = True, optimizer: bool = True) -> None:
        """Move model and/or optimizer state (offload to ``"cpu"`` and back)."""

    # ------------------------------------------------------------------ helpers
    @functools.cached_property
    def hf_config(self) -> Any:
        """The model's transformers config (vocabulary size, maximum positions, ...)."""
        from engine_core.models import build_hf_config

        return build_hf_config(self.config.model)

    def _check_model_limits(self, batch: TensorDict) -> None:
        """Token ids inside the vocabulary and sequences within the model's positions, checked
        before anything runs (a model would index out of range, or extrapolate silently)."""
        from engine_core.errors import BatchError

        text = self.hf_config.get_text_config()
        vocab = getattr(text, "vocab_size", None)
        top = int(batch[INPUT_IDS].max())
        if vocab is not None and top >= vocab:
            raise BatchError(
                f"input_ids holds token id {top}, outside the model's vocabulary of {vocab} "
                f"(ids 0..{vocab - 1}); the tokenizer and the model do not match, or the model's "
                f"vocab_size is too small for the task's tokens."
            )
        positions = getattr(text, "max_position_embeddings", None)
        longest = int(batch[ATTENTION_MASK].sum(-1).max())
        if positions is not None and longest > positions:
            raise BatchError(
                f"a sample holds {longest} tokens, more than the model's "
                f"max_position_embeddings ({positions}); shorten prompts or max_new_tokens, or "
                f"use a model with more positions."
            )

    def require_module(self) -> nn.Module:
        """``self.module``, or an error saying to call :meth:`init_model` first."""
        if self.module is None:
            raise EngineCoreError(
                f"{type(self).__name__}: call init_model() before using the engine."
            )
        return self.module


# the classes whose private names a subclass may not redefine (BaseEngine and its mixins)
_CORE_CLASSES: tuple[type, ...] = (BaseEngine, ModelOutputs, EngineCheckpoints, WeightExport)
