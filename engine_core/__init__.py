"""engine-core: backend-agnostic contracts for RL post-training of language models.

The public API lives here; roles and user scripts import only from this package's top level.
Names are imported on first use, so ``import engine_core`` is cheap (the CLI and plugin
discovery do not pay for torch) and never imports an optional backend (Ray, vLLM, SGLang,
megatron-core).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module defining it
_EXPORTS: dict[str, str] = {
    "pack_token_budget": "engine_core.microbatch",
    "sequence_start_mask": "engine_core.packing",
    "pack_tensor": "engine_core.packing",
    "inverse_permutation": "engine_core.balance",
    "balanced_partition": "engine_core.balance",
    "balance_batch": "engine_core.balance",
    "ATTENTION_MASK": "engine_core.batch",
    "BatchMeta": "engine_core.batch",
    "ENTROPY": "engine_core.batch",
    "INPUT_IDS": "engine_core.batch",
    "LOG_PROBS": "engine_core.batch",
    "LOSS_MASK": "engine_core.batch",
    "POSITION_IDS": "engine_core.batch",
    "VALUES": "engine_core.batch",
    "get_meta": "engine_core.batch",
    "make_batch": "engine_core.batch",
    "require_keys": "engine_core.batch",
    "require_token_shaped": "engine_core.batch",
    "sequence_lengths": "engine_core.batch",
    "set_meta": "engine_core.batch",
    "with_meta": "engine_core.batch",
    "validate_batch": "engine_core.batch",
    "Capability": "engine_core.capabilities",
    "check_capabilities": "engine_core.capabilities",
    "EngineConfig": "engine_core.config",
    "FrozenModel": "engine_core.config",
    "Seeded": "engine_core.config",
    "LoraConfig": "engine_core.config",
    "ModelConfig": "engine_core.config",
    "OptimConfig": "engine_core.config",
    "apply_overrides": "engine_core.configio",
    "load_yaml": "engine_core.configio",
    "prefix_validation_error": "engine_core.configio",
    "BaseEngine": "engine_core.engine",
    "EngineOutput": "engine_core.engine",
    "MicroBatchResults": "engine_core.engine",
    "ModelInputs": "engine_core.engine",
    "loss_mask_of": "engine_core.engine",
    "predicted_mask": "engine_core.engine",
    "BatchError": "engine_core.errors",
    "CapabilityError": "engine_core.errors",
    "CheckpointError": "engine_core.errors",
    "ConfigError": "engine_core.errors",
    "DispatchError": "engine_core.errors",
    "DuplicateBackendError": "engine_core.errors",
    "EngineCoreError": "engine_core.errors",
    "MeshRegistrationError": "engine_core.errors",
    "PluginError": "engine_core.errors",
    "PluginLoadError": "engine_core.errors",
    "TokenBudgetError": "engine_core.errors",
    "UnknownBackendError": "engine_core.errors",
    "WeightSyncError": "engine_core.errors",
    "BackendKind": "engine_core.hookspecs",
    "BackendRegistry": "engine_core.hookspecs",
    "BackendSpec": "engine_core.hookspecs",
    "DoctorCheck": "engine_core.hookspecs",
    "hookimpl": "engine_core.hookspecs",
    "GlobalBatchContext": "engine_core.loss",
    "LossAggregation": "engine_core.loss",
    "LossFn": "engine_core.loss",
    "Metric": "engine_core.loss",
    "MetricAccumulator": "engine_core.loss",
    "Reduction": "engine_core.loss",
    "aggregate_loss": "engine_core.loss",
    "token_mean_metric": "engine_core.loss",
    "MicroBatchPlan": "engine_core.microbatch",
    "plan_fixed": "engine_core.microbatch",
    "plan_token_budget": "engine_core.microbatch",
    "prepare_micro_batches": "engine_core.microbatch",
    "PackedSequences": "engine_core.packing",
    "pack": "engine_core.packing",
    "unpack": "engine_core.packing",
    "PluginInfo": "engine_core.plugins",
    "PluginManager": "engine_core.plugins",
    "load_plugins": "engine_core.plugins",
    "resolve_engine_config": "engine_core.resolve",
    "resolve_rollout_config": "engine_core.resolve",
    "BaseRollout": "engine_core.rollout",
    "RolloutConfig": "engine_core.rollout",
    "SamplingParams": "engine_core.rollout",
    "Settings": "engine_core.settings",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from engine_core.balance import balance_batch, balanced_partition, inverse_permutation
    from engine_core.batch import (
        ATTENTION_MASK,
        ENTROPY,
        INPUT_IDS,
        LOG_PROBS,
        LOSS_MASK,
        POSITION_IDS,
        VALUES,
        BatchMeta,
        get_meta,
        make_batch,
        require_keys,
        require_token_shaped,
        sequence_lengths,
        set_meta,
        validate_batch,
        with_meta,
    )
    from engine_core.capabilities import Capability, check_capabilities
    from engine_core.config import (
        EngineConfig,
        FrozenModel,
        LoraConfig,
        ModelConfig,
        OptimConfig,
        Seeded,
    )
    from engine_core.configio import apply_overrides, load_yaml, prefix_validation_error
    from engine_core.engine import (
        BaseEngine,
        EngineOutput,
        MicroBatchResults,
        ModelInputs,
        loss_mask_of,
        predicted_mask,
    )
    from engine_core.errors import (
        BatchError,
        CapabilityError,
        CheckpointError,
        ConfigError,
        DispatchError,
        DuplicateBackendError,
        EngineCoreError,
        MeshRegistrationError,
        PluginError,
        PluginLoadError,
        TokenBudgetError,
        UnknownBackendError,
        WeightSyncError,
    )
    from engine_core.hookspecs import (
        BackendKind,
        BackendRegistry,
        BackendSpec,
        DoctorCheck,
        hookimpl,
    )
    from engine_core.loss import (
        GlobalBatchContext,
        LossAggregation,
        LossFn,
        Metric,
        MetricAccumulator,
        Reduction,
        aggregate_loss,
        token_mean_metric,
    )
    from engine_core.microbatch import (
        MicroBatchPlan,
        pack_token_budget,
        plan_fixed,
        plan_token_budget,
        prepare_micro_batches,
    )
    from engine_core.packing import PackedSequences, pack, pack_tensor, sequence_start_mask, unpack
    from engine_core.plugins import PluginInfo, PluginManager, load_plugins
    from engine_core.resolve import resolve_engine_config, resolve_rollout_config
    from engine_core.rollout import BaseRollout, RolloutConfig, SamplingParams
    from engine_core.settings import Settings


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
