"""Everything a backend author needs, in one place: ``from engine_core.backend import ...``.

An engine plugin subclasses :class:`BaseEngine` (usually with :class:`SingleOptimizerMixin`),
builds its model with :func:`build_model`, keeps checkpoint files inside the folder the core's
checkpoint sequence hands it (:meth:`BaseEngine.save_shards` / :meth:`BaseEngine.load_shards`)
with the I/O helpers below, and registers itself with :func:`hookimpl` on a
:class:`BackendRegistry`. A rollout plugin subclasses :class:`BaseRollout`, uses the weight
bucket helpers and sets the variables its library reads on import with :func:`set_for_process`
or :func:`set_default_for_process`. The in-repository plugins import only from here, so this
list is the edge of what a backend may rely on; anything else in ``engine_core`` may change
without notice.

Names are imported on first use: a plugin's registration module can import ``hookimpl`` and
``Capability`` from here without paying for torch.

What each ``BaseEngine`` method must do, and which ones have defaults, is on the class; the
conformance kit (``pytest --engine-core-backend=NAME``) checks every clause.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core._lazy import lazy_exports

# public name -> module defining it
_EXPORTS: dict[str, str] = {
    # the engine contract
    "BaseEngine": "engine_core.engine",
    "CHECKPOINT_STATE_FILE": "engine_core.engine_checkpoint",
    "EngineOutput": "engine_core.engine",
    "MicroBatchResults": "engine_core.engine",
    "ModelInputs": "engine_core.model_inputs",
    "InputPart": "engine_core.model_inputs",
    "HeadRequest": "engine_core.model_inputs",
    "loss_mask_of": "engine_core.model_inputs",
    "row_to_batch": "engine_core.model_inputs",
    "predicted_mask": "engine_core.model_inputs",
    "RoutingInputs": "engine_core.routing_replay",
    "balance_of": "engine_core.routing_replay",
    "routing_request": "engine_core.routing_replay",
    "token_log_probs": "engine_core.log_probs",
    "CP_GROUP_ATTR": "engine_core.context_parallel",
    "chunked_token_log_probs": "engine_core.log_probs",
    "chunk_tokens_for": "engine_core.log_probs",
    "HeadGrads": "engine_core.log_probs",
    "ChunkedHead": "engine_core.log_probs",
    "HeadChunk": "engine_core.log_probs",
    "WholeVocabulary": "engine_core.log_probs",
    "logits_grad_": "engine_core.log_probs",
    "chunk_logits_": "engine_core.log_probs",
    "logits_buffer": "engine_core.log_probs",
    "Capability": "engine_core.capabilities",
    "StrEnum": "engine_core.capabilities",
    # configs
    "EngineConfig": "engine_core.config",
    "FrozenModel": "engine_core.config",
    "LoraConfig": "engine_core.config",
    "ModelConfig": "engine_core.config",
    "OptimConfig": "engine_core.config",
    # registration
    "BackendRegistry": "engine_core.hookspecs",
    "hookimpl": "engine_core.hookspecs",
    # models
    "DTYPES": "engine_core.models",
    "build_hf_config": "engine_core.models",
    "build_model": "engine_core.models",
    "is_adapter_name": "engine_core.models",
    "adapted_modules": "engine_core.models",
    "RouteRecorder": "engine_core.moe",
    "check_routes": "engine_core.moe",
    # images (vision-language models)
    "PIXEL_VALUES": "engine_core.vision",
    "IMAGE_GRID_THW": "engine_core.vision",
    "ROPE_POSITIONS": "engine_core.vision",
    "VisionInputs": "engine_core.vision",
    "check_vision_batch": "engine_core.vision",
    "has_images": "engine_core.vision",
    "patch_counts": "engine_core.vision",
    "images_in_order": "engine_core.vision",
    "is_vision_config": "engine_core.vision",
    "patch_width": "engine_core.vision",
    "prompt_images": "engine_core.vision",
    "single_frame_images": "engine_core.vision",
    "vision_token_ids": "engine_core.vision",
    "ROUTED_EXPERTS": "engine_core.batch",
    "MOE_AUX": "engine_core.batch",
    "MoeAuxLoss": "engine_core.batch",
    "balance_loss": "engine_core.moe",
    "balance_metric": "engine_core.moe",
    "AdapterFolders": "engine_core.adapters",
    "split_peft_tensors": "engine_core.adapters",
    "CutBuckets": "engine_core.rollout",
    "iter_buckets": "engine_core.rollout",
    "WeightPart": "engine_core.engine_export",
    "merged_lora_tensors": "engine_core.models",
    "checkpoint_tensors": "engine_core.models",
    # optimizer, schedule, RNG
    "SingleOptimizerMixin": "engine_core.optim",
    "build_lr_scheduler": "engine_core.optim",
    "build_optimizer": "engine_core.optim",
    "capture_rng": "engine_core.optim",
    "clip_and_step": "engine_core.optim",
    "lr_lambda": "engine_core.optim",
    "restore_rng": "engine_core.optim",
    "scheduler_state": "engine_core.optim",
    "total_grad_norm": "engine_core.optim",
    # checkpoint file I/O (local paths or fsspec URLs; state files never unpickled)
    "is_dir": "engine_core.checkpoint",
    "is_file": "engine_core.checkpoint",
    "join": "engine_core.checkpoint",
    "load_safetensors": "engine_core.checkpoint",
    "load_torch": "engine_core.checkpoint",
    "save_safetensors": "engine_core.checkpoint",
    "save_torch": "engine_core.checkpoint",
    # batches, packing, losses, collectives
    "ATTENTION_MASK": "engine_core.batch",
    "ENTROPY": "engine_core.batch",
    "INPUT_IDS": "engine_core.batch",
    "LOG_PROBS": "engine_core.batch",
    "LOSS_MASK": "engine_core.batch",
    "POSITION_IDS": "engine_core.batch",
    "VALUES": "engine_core.batch",
    "BatchMeta": "engine_core.batch",
    "get_meta": "engine_core.batch",
    "PackedSequences": "engine_core.packing",
    "pack": "engine_core.packing",
    "sequence_start_mask": "engine_core.packing",
    "unpack": "engine_core.packing",
    "GlobalBatchContext": "engine_core.loss",
    "Metric": "engine_core.loss",
    "MetricAccumulator": "engine_core.loss",
    "all_reduce_cpu": "engine_core.comm",
    "collective_device": "engine_core.comm",
    # rollouts and weight sync
    "BaseRollout": "engine_core.rollout",
    "RolloutConfig": "engine_core.rollout",
    "SamplingParams": "engine_core.rollout",
    "WeightBucket": "engine_core.rollout",
    "confirm_bucket": "engine_core.rollout",
    "model_weight_shapes": "engine_core.rollout",
    "prompt_tensors": "engine_core.rollout",
    "prompt_seeds": "engine_core.rollout",
    "stop_string_end": "engine_core.stop_strings",
    "holds_stop_string": "engine_core.stop_strings",
    "load_stop_tokenizer": "engine_core.stop_strings",
    "tokenizer_folder": "engine_core.stop_strings",
    "sample_seeds": "engine_core.rollout",
    "derive_seed": "engine_core.rollout",
    "response_batch": "engine_core.rollout",
    "place_routes": "engine_core.rollout",
    "top_log_prob_tensors": "engine_core.rollout",
    "meta_model": "engine_core.rollout",
    "saved_model_folder": "engine_core.rollout",
    "tensor_checksum": "engine_core.rollout",
    "verified_buckets": "engine_core.rollout",
    "checked_buckets": "engine_core.rollout",
    "sent_buckets": "engine_core.rollout",
    "SentBucket": "engine_core.rollout",
    "BUCKET_BYTES": "engine_core.rollout",
    "TRUNCATED": "engine_core.rollout",
    "PROMPT_IDS": "engine_core.rollout",
    "PROMPT_MASK": "engine_core.rollout",
    "PROMPT_SEED": "engine_core.rollout",
    "RESPONSE_IDS": "engine_core.rollout",
    "RESPONSE_MASK": "engine_core.rollout",
    "ROLLOUT_LOG_PROBS": "engine_core.rollout",
    "ROLLOUT_TOP_IDS": "engine_core.rollout",
    "ROLLOUT_TOP_LOG_PROBS": "engine_core.rollout",
    # the environment a backend's library reads when it is imported
    "set_for_process": "engine_core.launch",
    "set_default_for_process": "engine_core.launch",
    # errors
    "BatchError": "engine_core.errors",
    "CapabilityError": "engine_core.errors",
    "CheckpointError": "engine_core.errors",
    "ConfigError": "engine_core.errors",
    "EngineCoreError": "engine_core.errors",
    "WeightSyncError": "engine_core.errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from engine_core.adapters import AdapterFolders, split_peft_tensors
    from engine_core.batch import (
        ATTENTION_MASK,
        ENTROPY,
        INPUT_IDS,
        LOG_PROBS,
        LOSS_MASK,
        MOE_AUX,
        POSITION_IDS,
        ROUTED_EXPERTS,
        VALUES,
        BatchMeta,
        MoeAuxLoss,
        get_meta,
    )
    from engine_core.capabilities import Capability, StrEnum
    from engine_core.checkpoint import (
        is_dir,
        is_file,
        join,
        load_safetensors,
        load_torch,
        save_safetensors,
        save_torch,
    )
    from engine_core.comm import all_reduce_cpu, collective_device
    from engine_core.config import EngineConfig, FrozenModel, LoraConfig, ModelConfig, OptimConfig
    from engine_core.context_parallel import CP_GROUP_ATTR
    from engine_core.engine import BaseEngine, EngineOutput, MicroBatchResults
    from engine_core.engine_checkpoint import CHECKPOINT_STATE_FILE
    from engine_core.engine_export import WeightPart
    from engine_core.errors import (
        BatchError,
        CapabilityError,
        CheckpointError,
        ConfigError,
        EngineCoreError,
        WeightSyncError,
    )
    from engine_core.hookspecs import BackendRegistry, hookimpl
    from engine_core.launch import set_default_for_process, set_for_process
    from engine_core.log_probs import (
        ChunkedHead,
        HeadChunk,
        HeadGrads,
        WholeVocabulary,
        chunk_logits_,
        chunk_tokens_for,
        chunked_token_log_probs,
        logits_buffer,
        logits_grad_,
        token_log_probs,
    )
    from engine_core.loss import GlobalBatchContext, Metric, MetricAccumulator
    from engine_core.model_inputs import (
        HeadRequest,
        InputPart,
        ModelInputs,
        loss_mask_of,
        predicted_mask,
        row_to_batch,
    )
    from engine_core.models import (
        DTYPES,
        adapted_modules,
        build_hf_config,
        build_model,
        checkpoint_tensors,
        is_adapter_name,
        merged_lora_tensors,
    )
    from engine_core.moe import RouteRecorder, balance_loss, balance_metric, check_routes
    from engine_core.optim import (
        SingleOptimizerMixin,
        build_lr_scheduler,
        build_optimizer,
        capture_rng,
        clip_and_step,
        lr_lambda,
        restore_rng,
        scheduler_state,
        total_grad_norm,
    )
    from engine_core.packing import PackedSequences, pack, sequence_start_mask, unpack
    from engine_core.rollout import (
        BUCKET_BYTES,
        PROMPT_IDS,
        PROMPT_MASK,
        PROMPT_SEED,
        RESPONSE_IDS,
        RESPONSE_MASK,
        ROLLOUT_LOG_PROBS,
        ROLLOUT_TOP_IDS,
        ROLLOUT_TOP_LOG_PROBS,
        TRUNCATED,
        BaseRollout,
        CutBuckets,
        RolloutConfig,
        SamplingParams,
        SentBucket,
        WeightBucket,
        checked_buckets,
        confirm_bucket,
        derive_seed,
        iter_buckets,
        meta_model,
        model_weight_shapes,
        place_routes,
        prompt_seeds,
        prompt_tensors,
        response_batch,
        sample_seeds,
        saved_model_folder,
        sent_buckets,
        tensor_checksum,
        top_log_prob_tensors,
        verified_buckets,
    )
    from engine_core.routing_replay import RoutingInputs, balance_of, routing_request
    from engine_core.stop_strings import (
        holds_stop_string,
        load_stop_tokenizer,
        stop_string_end,
        tokenizer_folder,
    )
    from engine_core.vision import (
        IMAGE_GRID_THW,
        PIXEL_VALUES,
        ROPE_POSITIONS,
        VisionInputs,
        check_vision_batch,
        has_images,
        images_in_order,
        is_vision_config,
        patch_counts,
        patch_width,
        prompt_images,
        vision_token_ids,
    )


__getattr__, __dir__ = lazy_exports(
    __name__, _EXPORTS, globals(), "; the backend surface is engine_core.backend.__all__"
)
