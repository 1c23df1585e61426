"""The engine contract, as pytest tests run against every ``--engine-core-backend``.

Collected by the ``engine_core`` pytest plugin when that option is given; each test is marked
``engine_core_contract`` and parametrized by backend name. Failures name the broken contract.
The tests live beside the checks whose results they judge, one module per concern in
:mod:`engine_core.testing.checks`; this module holds the fixtures that run the kit's processes
(one run per layout) and gathers the tests, so their ids stay ``contract.py::test_...``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_core.capabilities import Capability
from engine_core.errors import PluginError
from engine_core.plugins import load_plugins
from engine_core.testing.checks.checkpoint import (
    test_a_damaged_checkpoint_is_refused_on_every_rank,
    test_a_refused_or_interrupted_save_commits_nothing,
    test_a_resharded_load_keeps_each_ranks_rng,
    test_checkpoint_resume_and_rotation,
    test_checkpoint_with_two_dp_ranks,
    test_load_shards_refuses_a_folder_without_its_files,
    test_save_checkpoint_commits_the_step_folder_and_job_state,
)
from engine_core.testing.checks.construction import (
    test_a_subclass_cannot_redefine_a_private_helper,
    test_an_engine_takes_a_resolved_config_and_init_model_first,
    test_registered_class_declares_the_registered_capabilities,
    test_undeclared_capabilities_are_refused,
)
from engine_core.testing.checks.gradients import (
    test_activation_offload_takes_the_models_saved_tensors,
    test_gradient_checkpointing_recomputes_the_blocks,
    test_gradient_invariance_single_process,
    test_gradient_invariance_two_dp_ranks,
    test_metrics_reduce_over_micro_batches_and_ranks,
    test_micro_batch_counts_agree_across_dp_ranks,
)
from engine_core.testing.checks.layout import (
    test_dp_group_holds_the_dp_ranks,
    test_global_context_counts_every_dp_rank,
    test_is_distributed_follows_the_default_process_group,
    test_one_collect_rank_per_dp_rank,
    test_one_rank_writes_the_full_params,
    test_runs_without_a_process_group,
    test_shard_data_refuses_a_batch_that_does_not_split,
)
from engine_core.testing.checks.lora import (
    test_lora_trains_adapters_only,
    test_named_weights_sends_a_lora_models_parts,
)
from engine_core.testing.checks.modes import (
    test_modes_restore_the_module_and_autograd_on_exit,
    test_offload_loads_on_entering_a_mode_and_offloads_on_exit,
    test_offload_trains_the_same,
    test_to_moves_what_its_flags_say,
    test_to_round_trip_keeps_outputs,
    test_train_and_eval_modes,
)
from engine_core.testing.checks.outputs import (
    test_log_probs_and_entropy_match_transformers,
    test_model_parallel_outputs_match_transformers,
    test_outputs_with_two_dp_ranks_match_transformers,
    test_values_at_token_read_the_head_at_each_token,
    test_values_match_transformers,
)
from engine_core.testing.checks.precision import (
    mixed_precision_oracle,
    test_bf16_model_keeps_its_dtype_and_gives_float32_log_probs,
    test_mixed_precision_computes_in_bf16_on_float32_master_weights,
)
from engine_core.testing.checks.refusals import (
    first_step_oracle,
    test_a_refused_batch_changes_nothing,
    test_a_skipped_step_leaves_the_optimizer_as_it_was,
    test_forward_only_accumulates_no_gradient,
    test_inputs_left_unmodified,
    test_optimizer_zero_grad_clears_a_failed_step,
)
from engine_core.testing.checks.routing import test_routing_replay_follows_the_given_routes
from engine_core.testing.checks.update import (
    test_optimizer_step_semantics,
    test_update_matches_a_plain_adamw_loop_single_process,
    test_update_matches_a_plain_adamw_loop_two_dp_ranks,
    update_oracle,
)
from engine_core.testing.checks.vision import test_log_probs_with_images_match_transformers
from engine_core.testing.checks.weights import (
    test_export_hf_writes_replaces_and_survives_a_failure,
    test_hf_config_is_the_models,
    test_named_lora_params_refuses_without_lora,
    test_tied_embeddings_export_and_checkpoint,
    test_weight_export_matches_hf_state_dict,
    test_weight_streams_give_the_full_params,
)
from engine_core.testing.distributed import run_distributed
from engine_core.testing.drive import declared_capabilities
from engine_core.testing.kit import (
    no_process_group_checks,
    single_process_checks,
    two_process_checks,
)
from engine_core.testing.oracle import Baseline, make_baseline

# the tests and the fixtures they need, gathered from their concern modules for collection
__all__ = [
    "caps",
    "double",
    "first_step_oracle",
    "kit_baseline",
    "mixed_precision_oracle",
    "plain",
    "single",
    "update_oracle",
    "test_a_damaged_checkpoint_is_refused_on_every_rank",
    "test_a_refused_batch_changes_nothing",
    "test_a_refused_or_interrupted_save_commits_nothing",
    "test_a_resharded_load_keeps_each_ranks_rng",
    "test_a_skipped_step_leaves_the_optimizer_as_it_was",
    "test_a_subclass_cannot_redefine_a_private_helper",
    "test_activation_offload_takes_the_models_saved_tensors",
    "test_an_engine_takes_a_resolved_config_and_init_model_first",
    "test_bf16_model_keeps_its_dtype_and_gives_float32_log_probs",
    "test_checkpoint_resume_and_rotation",
    "test_checkpoint_with_two_dp_ranks",
    "test_dp_group_holds_the_dp_ranks",
    "test_export_hf_writes_replaces_and_survives_a_failure",
    "test_forward_only_accumulates_no_gradient",
    "test_global_context_counts_every_dp_rank",
    "test_gradient_checkpointing_recomputes_the_blocks",
    "test_gradient_invariance_single_process",
    "test_gradient_invariance_two_dp_ranks",
    "test_hf_config_is_the_models",
    "test_inputs_left_unmodified",
    "test_is_distributed_follows_the_default_process_group",
    "test_load_shards_refuses_a_folder_without_its_files",
    "test_log_probs_and_entropy_match_transformers",
    "test_log_probs_with_images_match_transformers",
    "test_lora_trains_adapters_only",
    "test_metrics_reduce_over_micro_batches_and_ranks",
    "test_micro_batch_counts_agree_across_dp_ranks",
    "test_mixed_precision_computes_in_bf16_on_float32_master_weights",
    "test_model_parallel_outputs_match_transformers",
    "test_modes_restore_the_module_and_autograd_on_exit",
    "test_named_lora_params_refuses_without_lora",
    "test_named_weights_sends_a_lora_models_parts",
    "test_offload_loads_on_entering_a_mode_and_offloads_on_exit",
    "test_offload_trains_the_same",
    "test_one_collect_rank_per_dp_rank",
    "test_one_rank_writes_the_full_params",
    "test_optimizer_step_semantics",
    "test_optimizer_zero_grad_clears_a_failed_step",
    "test_outputs_with_two_dp_ranks_match_transformers",
    "test_registered_class_declares_the_registered_capabilities",
    "test_routing_replay_follows_the_given_routes",
    "test_runs_without_a_process_group",
    "test_save_checkpoint_commits_the_step_folder_and_job_state",
    "test_shard_data_refuses_a_batch_that_does_not_split",
    "test_tied_embeddings_export_and_checkpoint",
    "test_to_moves_what_its_flags_say",
    "test_to_round_trip_keeps_outputs",
    "test_train_and_eval_modes",
    "test_undeclared_capabilities_are_refused",
    "test_update_matches_a_plain_adamw_loop_single_process",
    "test_update_matches_a_plain_adamw_loop_two_dp_ranks",
    "test_values_at_token_read_the_head_at_each_token",
    "test_values_match_transformers",
    "test_weight_export_matches_hf_state_dict",
    "test_weight_streams_give_the_full_params",
]

pytestmark = pytest.mark.engine_core_contract


@pytest.fixture(scope="session")
def kit_baseline(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    return make_baseline(str(tmp_path_factory.mktemp("engine-core-kit")))


@pytest.fixture(scope="module")
def caps(engine_core_backend: str) -> frozenset[Capability]:
    found = declared_capabilities(engine_core_backend)
    if Capability.CPU not in found:
        pytest.skip(f"{engine_core_backend!r} does not declare 'cpu'; the kit runs on CPU only")
    return found


def _preload(config: pytest.Config) -> tuple[str, ...]:
    """Modules the kit's processes start with imported: the engine class of every backend this
    run checks and what it imports only as it builds (so the fork server they start from is
    started once for the whole kit, not again for each backend, and no process imports them
    again) and the transformers model of the kit's tiny Qwen2. A backend that is not
    registered adds nothing here; its own tests report it."""
    registry = load_plugins()
    modules = []
    for backend in dict.fromkeys(config.getoption("engine_core_backend")):
        try:
            spec = registry.get_engine(backend)
        except PluginError:  # reported by the backend's own tests
            continue
        modules += [spec.target.partition(":")[0], *spec.imports]
    return (*modules, "transformers.models.qwen2.modeling_qwen2")


def _paths(
    baseline: Baseline, backend: str, tag: str, request: pytest.FixtureRequest
) -> dict[str, str]:
    root = Path(baseline.root) / f"ckpt-{backend}-{tag}"
    return {
        "policy_dir": baseline.policy_dir,
        "critic_dir": baseline.critic_dir,
        "checkpoint_root": str(root),
        "only": ",".join(_only(request.config.getoption("engine_core_kit_only"), backend)),
    }


def _only(prefixes: list[str], backend: str) -> list[str]:
    """The ``--engine-core-kit-only`` prefixes that limit ``backend``'s checks: each plain
    ``CHECK``, and each ``NAME:CHECK`` whose NAME is ``backend`` (another engine's are not
    its). A run that names none for ``backend`` runs every check that applies to it."""
    kept = []
    for prefix in prefixes:
        name, colon, check = prefix.rpartition(":")
        if not colon:
            kept.append(prefix)
        elif name == backend:
            kept.append(check)
    return kept


@pytest.fixture(scope="module")
def single(
    engine_core_backend: str,
    caps: frozenset,
    kit_baseline: Baseline,
    request: pytest.FixtureRequest,
) -> dict[str, Any]:
    paths = _paths(kit_baseline, engine_core_backend, "1", request)
    (result,) = run_distributed(
        single_process_checks,
        1,
        engine_core_backend,
        paths,
        preload=_preload(request.config),
    )
    return result


@pytest.fixture(scope="module")
def double(
    engine_core_backend: str,
    caps: frozenset,
    kit_baseline: Baseline,
    request: pytest.FixtureRequest,
) -> list[dict]:
    if Capability.DATA_PARALLEL not in caps:
        pytest.skip(f"{engine_core_backend!r} does not declare 'data_parallel'")
    paths = _paths(kit_baseline, engine_core_backend, "2", request)
    return run_distributed(
        two_process_checks,
        2,
        engine_core_backend,
        paths,
        preload=_preload(request.config),
    )


@pytest.fixture(scope="module")
def plain(
    engine_core_backend: str,
    caps: frozenset,
    kit_baseline: Baseline,
    request: pytest.FixtureRequest,
) -> dict[str, Any]:
    paths = _paths(kit_baseline, engine_core_backend, "0", request)
    (result,) = run_distributed(
        no_process_group_checks,
        1,
        engine_core_backend,
        paths,
        pg_backend=None,
        preload=_preload(request.config),
    )
    return result
