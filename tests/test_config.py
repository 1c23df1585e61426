"""Config loading (YAML + dotted overrides) and resolution against a backend's capabilities."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError

from engine_core.capabilities import Capability
from engine_core.config import EngineConfig, OptimConfig
from engine_core.configio import apply_overrides, load_yaml, prefix_validation_error
from engine_core.errors import CapabilityError, ConfigError, UnknownBackendError
from engine_core.hookspecs import BackendRegistry, hookimpl
from engine_core.plugins import PluginManager, load_plugins
from engine_core.resolve import resolve_engine_config, resolve_rollout_config
from engine_core.settings import Settings
from engine_core_roles.jobs.cli import RECIPES

RECIPE = RECIPES / "sft_tiny.yaml"


def _engine(**fields: Any) -> dict[str, Any]:
    return {"backend": "reference", "model": {"config": {"model_type": "qwen2"}}, **fields}


@pytest.fixture
def manager() -> PluginManager:
    return load_plugins(Settings(disable_plugin_autoload=True))


# -- YAML and overrides ---------------------------------------------------------------------------


def test_yaml_and_dotted_overrides_give_typed_values(tmp_path: Path) -> None:
    data = load_yaml(RECIPE)
    out = apply_overrides(
        data,
        [
            "engine.micro_batch_size=4",
            "engine.use_packing=false",
            "engine.optim.betas=[0.8, 0.9]",
            "engine.model.path=null",
            "engine.optim.lr=1e-4",
            "task.name='007'",
            "new.deeply.nested=x=y",
        ],
    )
    engine = out["engine"]
    assert engine["micro_batch_size"] == 4 and isinstance(engine["micro_batch_size"], int)
    assert engine["use_packing"] is False
    assert engine["optim"]["betas"] == [0.8, 0.9]
    assert engine["model"]["path"] is None
    assert engine["optim"]["lr"] == 1e-4
    assert out["task"]["name"] == "007"
    assert out["new"] == {"deeply": {"nested": "x=y"}}
    # A new dict: the loaded data is untouched.
    assert data["engine"]["micro_batch_size"] == 16 and "new" not in data
    assert data["engine"]["optim"]["lr"] == 3e-3
    # "1e-4" is a float for our loader; PyYAML's own safe loader is left as it was.
    assert yaml.safe_load("1e-4") == "1e-4"


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("engine.micro_batch_size", r"'engine\.micro_batch_size' has no '='.*'dotted\.key=value'"),
        ("=4", r"'=4' has an empty key.*'dotted\.key=value'"),
        ("engine..seed=1", r"empty key"),
        ("engine.backend.name=x", r"'engine\.backend' is a str.*not a mapping"),
        ("steps=[1", r"not valid YAML"),
    ],
)
def test_bad_overrides_say_what_and_how(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        apply_overrides(load_yaml(RECIPE), [override])


def test_load_yaml_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_yaml(tmp_path / "missing.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping.*got a list"):
        load_yaml(listing)
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(broken)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert load_yaml(empty) == {}
    assert load_yaml(f"file://{RECIPE}") == load_yaml(RECIPE)  # fsspec URL


def test_prefix_validation_error_keeps_types_and_context() -> None:
    class Inner(BaseModel):
        size: PositiveInt

    with pytest.raises(ValidationError) as info:
        Inner.model_validate({"size": 0})
    err = prefix_validation_error(info.value, ("actor", "engine"), "Job")
    (detail,) = err.errors()
    assert detail["loc"] == ("actor", "engine", "size")
    assert detail["type"] == "greater_than" and detail["ctx"] == {"gt": 0}
    assert "actor.engine.size" in str(err) and err.title == "Job"


# -- engine resolution ---------------------------------------------------------------------------


def test_resolves_reference_engine(manager: PluginManager) -> None:
    spec, cfg = resolve_engine_config(_engine(micro_batch_size=2), manager)
    assert spec.name == "reference"
    assert type(cfg).__name__ == "ReferenceEngineConfig" and isinstance(cfg, EngineConfig)
    assert cfg.micro_batch_size == 2


def test_resolves_recipe_with_overrides(manager: PluginManager) -> None:
    # this manager loads only the core, so select the core's engine
    raw = apply_overrides(
        load_yaml(RECIPE), ["engine.backend=reference", "engine.micro_batch_size=4"]
    )
    _, cfg = resolve_engine_config(raw["engine"], manager)
    assert cfg.micro_batch_size == 4


@pytest.mark.parametrize(
    ("fields", "capability"),
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel"),
        ({"offload": True}, "offload"),
        ({"model": {"config": {"model_type": "qwen2"}, "lora": {"rank": 4}}}, "lora"),
    ],
)
def test_unsupported_capability_is_refused(
    manager: PluginManager, fields: dict[str, Any], capability: str
) -> None:
    with pytest.raises(CapabilityError) as info:
        resolve_engine_config(_engine(**fields), manager)
    message = str(info.value)
    assert f"does not support: {capability}" in message
    assert "'reference'" in message and message.startswith("engine:")


class _Fp32OnlyPlugin:
    @hookimpl
    def engine_core_register(self, registry: BackendRegistry) -> None:
        registry.register_engine(
            "fp32-only",
            "engine_core.reference_engine:ReferenceEngine",
            config="engine_core.reference_engine:ReferenceEngineConfig",
            capabilities={Capability.CPU, Capability.PACKING},
        )


def test_compute_dtype_asks_for_mixed_precision(manager: PluginManager) -> None:
    _, cfg = resolve_engine_config(_engine(compute_dtype="bfloat16"), manager)
    assert cfg.compute_dtype == "bfloat16"
    assert Capability.MIXED_PRECISION in cfg.required_capabilities()
    # computing in the weights' own dtype is no mixed precision
    bf16 = {"config": {"model_type": "qwen2"}, "dtype": "bfloat16"}
    _, cfg = resolve_engine_config(_engine(model=bf16, compute_dtype="bfloat16"), manager)
    assert cfg.compute_dtype is None
    assert Capability.MIXED_PRECISION not in cfg.required_capabilities()
    manager.register(_Fp32OnlyPlugin(), "fp32-only-plugin")
    with pytest.raises(CapabilityError, match="'fp32-only' does not support: mixed_precision"):
        resolve_engine_config(_engine(backend="fp32-only", compute_dtype="bfloat16"), manager)


@pytest.mark.parametrize(
    ("dtype", "compute", "relation"),
    [("bfloat16", "float32", "wider than"), ("float16", "bfloat16", "as wide as")],
)
def test_compute_dtype_must_be_narrower_than_the_weights(
    manager: PluginManager, dtype: str, compute: str, relation: str
) -> None:
    model = {"config": {"model_type": "qwen2"}, "dtype": dtype}
    with pytest.raises(ValidationError) as info:
        resolve_engine_config(_engine(model=model, compute_dtype=compute), manager)
    assert f"compute_dtype={compute!r} is {relation} model.dtype={dtype!r}" in str(info.value)


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"micro_batch_size": -1}, "engine.micro_batch_size"),
        ({"max_tokens_per_micro_batch": 0}, "engine.max_tokens_per_micro_batch"),
        ({"micro_batch_szie": 2}, "engine.micro_batch_szie"),
        ({"use_packing": "sometimes"}, "engine.use_packing"),
        ({"optim": {"lr": "fast"}}, "engine.optim.lr"),
        ({"model": {"config": {"model_type": "qwen2"}, "dtype": "int3"}}, "engine.model.dtype"),
    ],
)
def test_bad_values_carry_the_full_field_path(
    manager: PluginManager, fields: dict[str, Any], loc: str
) -> None:
    with pytest.raises(ValidationError) as info:
        resolve_engine_config(_engine(**fields), manager)
    assert loc in str(info.value)
    assert tuple(loc.split(".")) in [e["loc"] for e in info.value.errors()]


@pytest.mark.parametrize(
    ("fields", "loc", "suggestion"),
    [
        ({"micro_batch_sise": 4}, ("engine", "micro_batch_sise"), "'micro_batch_size'"),
        ({"optim": {"lrr": 1e-3}}, ("engine", "optim", "lrr"), "'lr'"),
        (
            {"optim": {"warmup": {"total_steps": 5}}},
            ("engine", "optim", "warmup"),
            "'warmup_steps' or 'total_steps' (for 'warmup.total_steps')",
        ),
    ],
)
def test_unknown_keys_suggest_close_matches_and_list_valid_keys(
    manager: PluginManager, fields: dict[str, Any], loc: tuple[str, ...], suggestion: str
) -> None:
    with pytest.raises(ValidationError) as info:
        resolve_engine_config(_engine(**fields), manager)
    (error,) = info.value.errors()
    assert error["loc"] == loc and error["type"] == "extra_forbidden"
    assert f"did you mean {suggestion}?" in error["msg"]
    model = EngineConfig if len(loc) == 2 else OptimConfig
    assert f"Valid keys here: {', '.join(model.model_fields)}." in error["msg"]


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    with pytest.raises(ValidationError) as info:
        OptimConfig.model_validate({"zzz": 1, "lr": 0})
    by_loc = {e["loc"]: e for e in info.value.errors()}
    assert "did you mean" not in by_loc[("zzz",)]["msg"]
    assert "Valid keys here: lr, weight_decay," in by_loc[("zzz",)]["msg"]
    assert by_loc[("lr",)]["type"] == "greater_than"  # other errors are kept as they were


def test_nested_path_prefix(manager: PluginManager) -> None:
    with pytest.raises(ValidationError, match=r"actor\.engine\.micro_batch_size"):
        resolve_engine_config(_engine(micro_batch_size=0), manager, path=("actor", "engine"))


def test_model_level_errors_point_at_the_section(manager: PluginManager) -> None:
    with pytest.raises(ValidationError) as info:
        resolve_engine_config(_engine(micro_batch_size=2, max_tokens_per_micro_batch=64), manager)
    assert info.value.errors()[0]["loc"] == ("engine",)
    assert "not both" in str(info.value)


def test_backend_missing_or_unknown(manager: PluginManager) -> None:
    with pytest.raises(ConfigError, match=r"engine\.backend is missing.*engines: reference"):
        resolve_engine_config({"model": {}}, manager)
    with pytest.raises(ConfigError, match=r"got int 7; available engines: reference"):
        resolve_engine_config({"backend": 7}, manager)
    with pytest.raises(UnknownBackendError, match=r"'megatorn'.*Available engines: reference"):
        resolve_engine_config(_engine(backend="megatorn"), manager)
    with pytest.raises(ConfigError, match="must be a mapping"):
        resolve_engine_config(["reference"], manager)  # type: ignore[arg-type]


# -- rollout resolution ---------------------------------------------------------------------------


class EchoRolloutConfig(BaseModel):
    """A rollout config asking for a capability through ``required_capabilities()``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str
    sleep_between_steps: bool = False
    max_batch: PositiveInt = 8

    def required_capabilities(self) -> set[Capability]:
        return {Capability.SLEEP} if self.sleep_between_steps else set()


class _RolloutPlugin:
    @hookimpl
    def engine_core_register(self, registry: BackendRegistry) -> None:
        registry.register_rollout(
            "echo",
            "engine_core.rollout:BaseRollout",
            config=f"{__name__}:EchoRolloutConfig",
            capabilities={Capability.LOGPROBS},
        )


def test_rollout_resolution(manager: PluginManager) -> None:
    manager.register(_RolloutPlugin(), "echo-plugin")
    spec, cfg = resolve_rollout_config({"backend": "echo", "max_batch": 4}, manager)
    assert spec.plugin == "echo-plugin" and isinstance(cfg, EchoRolloutConfig)
    with pytest.raises(ValidationError, match=r"rollout\.max_batch"):
        resolve_rollout_config({"backend": "echo", "max_batch": -4}, manager)
    with pytest.raises(CapabilityError, match=r"rollout: backend 'echo' does not support: sleep"):
        resolve_rollout_config({"backend": "echo", "sleep_between_steps": True}, manager)
    with pytest.raises(UnknownBackendError, match=r"Available rollouts: echo"):
        resolve_rollout_config({"backend": "vllm"}, manager)


def test_a_rollout_config_asks_its_rollout_for_lora_and_routes() -> None:
    """model.lora needs a rollout that serves adapters unmerged (lora), return_routes one that
    returns routes (routing_replay): the example rollout declares neither, hf both."""
    from engine_core.plugins import load_plugins

    plugins = load_plugins()
    plain = {"config": {"model_type": "qwen2"}}
    lora = {**plain, "lora": {"rank": 4}}
    with pytest.raises(CapabilityError, match=r"backend 'example' does not support: lora"):
        resolve_rollout_config({"backend": "example", "model": lora}, plugins)
    with pytest.raises(CapabilityError, match=r"does not support: routing_replay"):
        resolve_rollout_config(
            {"backend": "example", "model": plain, "return_routes": True}, plugins
        )
    _, cfg = resolve_rollout_config(
        {"backend": "hf", "model": lora, "return_routes": True}, plugins
    )
    assert cfg.required_capabilities() == {Capability.LORA, Capability.ROUTING_REPLAY}


def test_derived_engine_values_are_computed_before_the_frozen_config_exists() -> None:
    """Packing attends through sdpa_varlen when the model names no attention, and a compute
    dtype equal to the model's is no mixed precision: both derived on the input, so the
    validated config is never written to after it is built."""
    import inspect

    import engine_core.config

    qwen = {"config": {"model_type": "qwen2"}}
    packed = EngineConfig(backend="x", model=qwen, compute_dtype="float32")
    assert packed.model.attn_implementation == "sdpa_varlen" and packed.compute_dtype is None
    padded = EngineConfig(backend="x", model=qwen, use_packing=False)
    assert padded.model.attn_implementation is None
    split = EngineConfig(backend="x", model=qwen, use_packing=False, context_parallel_size=2)
    assert split.model.attn_implementation == "sdpa_varlen"
    named = EngineConfig(backend="x", model={**qwen, "attn_implementation": "eager"})
    assert named.model.attn_implementation == "eager"
    mixed = EngineConfig(backend="x", model=qwen, compute_dtype="bfloat16")
    assert mixed.compute_dtype == "bfloat16"
    assert "object.__setattr__" not in inspect.getsource(engine_core.config)


def test_the_derived_engine_values_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The two rewrites on the input are kept (packed recipes leave the attention unset) and
    said: one info line each, naming what was received and what it became."""
    qwen = {"config": {"model_type": "qwen2"}}
    with caplog.at_level("INFO", logger="engine_core.config"):
        EngineConfig(backend="x", model=qwen, compute_dtype="float32")
    lines = [r.getMessage() for r in caplog.records]
    assert any("attn_implementation unset, set to sdpa_varlen (use_packing)" in m for m in lines)
    assert any("compute_dtype=float32 equals model.dtype, read as None" in m for m in lines)
    caplog.clear()
    with caplog.at_level("INFO", logger="engine_core.config"):
        EngineConfig(backend="x", model={**qwen, "attn_implementation": "eager"})
    assert not caplog.records


def test_a_derived_config_is_validated() -> None:
    """validated_copy runs every check a new config runs: a bad derived value is refused, where
    model_copy(update=...) would have built it."""
    qwen = {"config": {"model_type": "qwen2"}}
    cfg = EngineConfig(backend="x", model=qwen, micro_batch_size=2)
    with pytest.raises(ValidationError, match="micro_batch_size"):
        cfg.validated_copy(micro_batch_size=0)
    with pytest.raises(ValidationError, match="set micro_batch_size .* or max_tokens_per_micro"):
        cfg.validated_copy(max_tokens_per_micro_batch=64)
    assert cfg.validated_copy(micro_batch_size=4).micro_batch_size == 4
    assert cfg.validated_copy().model_fields_set == cfg.model_fields_set
