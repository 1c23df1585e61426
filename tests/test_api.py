"""The public API surface: every exported name resolves, and importing the package is cheap."""

from __future__ import annotations

import subprocess
import sys

import engine_core


def test_every_exported_name_resolves() -> None:
    for name in engine_core.__all__:
        assert getattr(engine_core, name) is not None, name


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        engine_core.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


def test_import_pulls_in_no_heavy_backend() -> None:
    code = (
        "import sys, engine_core, engine_core.plugins\n"
        "engine_core.load_plugins()\n"
        "heavy = [m for m in ('torch', 'ray', 'vllm', 'sglang', 'megatron') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_roles_import_no_plugin() -> None:
    """roles/ works with any engine: it may import engine_core, never a backend plugin (its own
    algorithms plugin is part of it)."""
    import ast
    import importlib.metadata as md
    from pathlib import Path

    plugins = {
        ep.value.split(":")[0].split(".")[0] for ep in md.entry_points(group="engine_core.plugins")
    } - {"engine_core", "engine_core_roles"}
    assert plugins, "no plugin installed: this test would check nothing"
    imported: dict[str, set[str]] = {}
    for path in (Path(__file__).parents[1] / "roles" / "engine_core_roles").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                imported.setdefault(name.split(".")[0], set()).add(path.name)
    offending = {p: sorted(imported[p]) for p in plugins if p in imported}
    assert not offending, f"roles/ imports backend plugins: {offending}"


# ---------------------------------------------------------------------------- backend surface
BACKEND_SURFACE = {
    # the engine contract, configs and registration
    "BaseEngine", "CHECKPOINT_STATE_FILE", "EngineOutput", "MicroBatchResults", "ModelInputs",
    "InputPart", "RoutingInputs",
    "loss_mask_of", "predicted_mask", "token_log_probs", "chunked_token_log_probs", "CP_GROUP_ATTR",
    "HeadRequest", "chunk_tokens_for", "HeadGrads", "logits_grad_", "chunk_logits_", "ChunkedHead",
    "HeadChunk",
    "WholeVocabulary",
    "logits_buffer", "row_to_batch", "balance_of", "balance_loss", "balance_metric", "routing_request",
    "Capability", "StrEnum",
    "EngineConfig", "FrozenModel", "LoraConfig", "ModelConfig", "OptimConfig",
    "BackendRegistry", "hookimpl",
    # models, optimizer, schedule, RNG
    "DTYPES", "build_hf_config", "build_model", "is_adapter_name", "adapted_modules", "merged_lora_tensors", "checkpoint_tensors", "AdapterFolders", "split_peft_tensors", "RouteRecorder", "check_routes", "ROUTED_EXPERTS", "MOE_AUX", "MoeAuxLoss", "CutBuckets", "WeightPart",
    "iter_buckets",
    "SingleOptimizerMixin",
    "build_lr_scheduler", "build_optimizer", "capture_rng", "clip_and_step", "lr_lambda",
    "restore_rng", "scheduler_state", "total_grad_norm",
    # checkpoint file I/O
    "is_dir", "is_file", "join", "load_safetensors", "load_torch", "save_safetensors",
    "save_torch",
    # batches, packing, losses, collectives
    "ATTENTION_MASK", "ENTROPY", "INPUT_IDS", "LOG_PROBS", "LOSS_MASK", "POSITION_IDS",
    "VALUES", "BatchMeta", "get_meta", "PackedSequences", "pack", "sequence_start_mask",
    "unpack", "GlobalBatchContext", "Metric", "MetricAccumulator", "all_reduce_cpu",
    "collective_device",
    # rollouts and weight sync
    "BaseRollout", "RolloutConfig", "SamplingParams", "WeightBucket", "confirm_bucket",
    "model_weight_shapes", "prompt_tensors", "response_batch", "place_routes", "meta_model", "saved_model_folder",
    "top_log_prob_tensors",
    "tensor_checksum", "verified_buckets", "sent_buckets", "checked_buckets", "SentBucket",
    "BUCKET_BYTES", "TRUNCATED", "PROMPT_IDS", "PROMPT_MASK", "PROMPT_SEED",
    "RESPONSE_IDS", "RESPONSE_MASK", "ROLLOUT_LOG_PROBS", "ROLLOUT_TOP_IDS", "ROLLOUT_TOP_LOG_PROBS",
    "prompt_seeds", "sample_seeds",
    "derive_seed",
    # images (vision-language models)
    "PIXEL_VALUES", "IMAGE_GRID_THW", "ROPE_POSITIONS", "VisionInputs", "check_vision_batch",
    "has_images", "patch_counts", "images_in_order", "is_vision_config", "patch_width",
    "prompt_images", "single_frame_images", "vision_token_ids",
    # stop strings
    "stop_string_end", "holds_stop_string", "tokenizer_folder", "load_stop_tokenizer",
    # the environment a backend's library reads
    "set_for_process", "set_default_for_process",
    # errors
    "BatchError", "CapabilityError", "CheckpointError", "ConfigError", "EngineCoreError",
    "WeightSyncError",
}  # fmt: skip


def test_backend_surface_is_exactly_the_documented_list() -> None:
    """Adding or removing a name from engine_core.backend is a decision: update this list."""
    import engine_core.backend as backend

    assert set(backend.__all__) == BACKEND_SURFACE
    for name in backend.__all__:
        assert getattr(backend, name) is not None, name
    assert sorted(dir(backend)) == sorted(BACKEND_SURFACE)


def test_backend_registration_names_are_cheap() -> None:
    """A plugin's registration module imports hookimpl and Capability from the surface
    without importing torch."""
    code = (
        "import sys\n"
        "from engine_core.backend import BackendRegistry, Capability, hookimpl\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plugins_import_only_the_backend_surface() -> None:
    """Every in-repository plugin (and the example engine) imports engine_core only through
    engine_core.backend (tests and the conformance kit aside)."""
    import ast
    from pathlib import Path

    root = Path(__file__).parents[1]
    sources = [
        *root.glob("plugins/*/engine_core_*/*.py"),
        *root.glob("tests/fixtures/example_engine/engine_core_example/*.py"),
    ]
    assert sources
    offenders = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            for module in modules:
                top = module.split(".")[0]
                if top == "engine_core" and module != "engine_core.backend":
                    offenders.append(f"{path.relative_to(root)}: {module}")
    assert not offenders, offenders


def test_subclass_cannot_shadow_base_engine_privates() -> None:
    import pytest

    from engine_core.backend import BaseEngine

    with pytest.raises(TypeError, match=r"redefines \['_mode'\], private to BaseEngine"):

        class Shadowing(BaseEngine):  # noqa: F841
            def _mode(self):  # type: ignore[no-untyped-def, override]
                return None
