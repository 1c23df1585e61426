"""Plugin discovery, the backend registry, failure records and settings.

Discovery of the installed test plugins (tests/fixtures/plugins) runs in subprocesses that see
them through PYTHONPATH; registry behaviour is tested in-process on managers with autoload off.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

import pytest

from engine_core.capabilities import Capability
from engine_core.errors import (
    ConfigError,
    DuplicateBackendError,
    PluginError,
    PluginLoadError,
    UnknownBackendError,
)
from engine_core.hookspecs import BackendKind, BackendRegistry, hookimpl
from engine_core.plugins import PluginManager, load_plugins
from engine_core.settings import Settings
from tests.fixtures.plugins._install import install_test_plugins, run_python

# Run once in a subprocess that sees the installed test plugins; tests assert on its report.
_DISCOVER = textwrap.dedent(
    """
    import json, sys
    from engine_core.plugins import load_plugins
    from engine_core.resolve import resolve_engine_config
    from engine_core.settings import Settings

    m = load_plugins()
    out = {
        "plugins": [p.to_dict() for p in m.plugins()],
        "engines": m.registry.names("engine"),
        "config_imported_at_discovery": "engine_core_testplugin_good.config" in sys.modules,
    }
    for name in ("testbroken", "testbroken2", "nope"):
        try:
            m.get_engine(name)
        except Exception as e:
            out[name] = [type(e).__name__, str(e)]
    raw = {"backend": "testgood", "flavour": "spicy", "model": {"config": {"model_type": "qwen2"}}}
    spec, cfg = resolve_engine_config(raw, m)
    out["resolved"] = [type(cfg).__name__, cfg.flavour, spec.distribution, spec.version]
    out["target"] = spec.load_class().__name__
    for env in ({"ENGINE_CORE_DISABLE_PLUGIN_AUTOLOAD": "1"}, {"ENGINE_CORE_PLUGINS": "testgood"}):
        sub = load_plugins(Settings.from_env(env))
        out[json.dumps(env)] = [p.name for p in sub.plugins()]
        try:
            sub.get_engine("testbroken")
        except Exception as e:
            out[json.dumps(env) + " error"] = [type(e).__name__, str(e)]
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def discovered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    proc = run_python(["-c", _DISCOVER], install_test_plugins(tmp_path_factory))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _plugin(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in report["plugins"] if p["name"] == name)


# -- discovery through entry points (subprocess) -------------------------------------------------


def test_good_plugin_discovered_through_its_entry_point(discovered: dict[str, Any]) -> None:
    good = _plugin(discovered, "testgood")
    assert good["status"] == "ok"
    assert (good["distribution"], good["version"]) == ("engine-core-testplugin-good", "0.1.0")
    (backend,) = good["backends"]
    assert backend["kind"] == "engine" and backend["name"] == "testgood"
    assert backend["capabilities"] == ["cpu", "lora", "packing"]
    assert {"reference", "testgood"} <= set(discovered["engines"])  # other plugins may add more
    assert _plugin(discovered, "builtin")["status"] == "ok"


def test_discovery_is_lazy_and_selection_imports(discovered: dict[str, Any]) -> None:
    assert discovered["config_imported_at_discovery"] is False
    assert discovered["resolved"] == [
        "GoodEngineConfig",
        "spicy",
        "engine-core-testplugin-good",
        "0.1.0",
    ]
    assert discovered["target"] == "ReferenceEngine"


def test_broken_plugin_is_recorded_not_hidden(discovered: dict[str, Any]) -> None:
    broken = _plugin(discovered, "testbroken")
    assert broken["status"] == "failed"
    assert broken["distribution"] == "engine-core-testplugin-broken"
    assert "nonexistent_backend_lib" in broken["error"]
    assert "Traceback" in broken["traceback"]
    assert broken["install_hint"] == "pip install engine-core-testplugin-broken"


@pytest.mark.parametrize("name", ["testbroken", "testbroken2"])
def test_selecting_broken_plugin_backend_names_plugin_error_and_fix(
    discovered: dict[str, Any], name: str
) -> None:
    kind, message = discovered[name]
    assert kind == "PluginLoadError"
    assert "'testbroken'" in message
    assert "ModuleNotFoundError: No module named 'nonexistent_backend_lib'" in message
    assert "pip install engine-core-testplugin-broken" in message


def test_unknown_backend_lists_available_and_failed(discovered: dict[str, Any]) -> None:
    kind, message = discovered["nope"]
    assert kind == "UnknownBackendError"
    available = message.split("Available engines: ")[1].split(".")[0].split(", ")
    assert {"reference", "testgood"} <= set(available)
    assert "testbroken" in message and "nonexistent_backend_lib" in message


def test_autoload_disabled_loads_only_builtin(discovered: dict[str, Any]) -> None:
    key = json.dumps({"ENGINE_CORE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert discovered[key] == ["builtin"]
    kind, message = discovered[key + " error"]
    assert kind == "UnknownBackendError" and "autoload is disabled" in message


def test_allow_list_loads_listed_plugins_and_builtin(discovered: dict[str, Any]) -> None:
    key = json.dumps({"ENGINE_CORE_PLUGINS": "testgood"})
    assert discovered[key] == ["builtin", "testgood"]
    kind, message = discovered[key + " error"]
    assert kind == "UnknownBackendError"
    skipped = message.split("Skipped by ENGINE_CORE_PLUGINS: ")[1].split(" (")[0].split(", ")
    assert "testbroken" in skipped and "testgood" not in skipped


# -- the registry, in-process ---------------------------------------------------------------------


class _Plugin:
    """A plugin object registering one engine; pluggy accepts objects as well as modules."""

    def __init__(
        self,
        name: str,
        target: str = "engine_core.reference_engine:ReferenceEngine",
        *,
        config: str = "engine_core.reference_engine:ReferenceEngineConfig",
        capabilities: frozenset[Any] = frozenset({Capability.CPU}),
        override: bool = False,
    ) -> None:
        self.name, self.target, self.config = name, target, config
        self.capabilities, self.override = capabilities, override

    @hookimpl
    def engine_core_register(self, registry: BackendRegistry) -> None:
        registry.register_engine(
            self.name,
            self.target,
            config=self.config,
            capabilities=self.capabilities,
            override=self.override,
        )


@pytest.fixture
def manager() -> PluginManager:
    return load_plugins(Settings(disable_plugin_autoload=True))


def test_builtin_reference_engine_registered(manager: PluginManager) -> None:
    spec = manager.get_engine("reference")
    assert spec.plugin == "builtin" and spec.distribution == "engine-core"
    assert {Capability.CPU, Capability.PACKING, Capability.DYNAMIC_BATCH} <= spec.capabilities
    assert spec.load_class().__name__ == "ReferenceEngine"
    assert spec.load_config_class().__name__ == "ReferenceEngineConfig"


def test_duplicate_registration_needs_override(manager: PluginManager) -> None:
    with pytest.raises(DuplicateBackendError, match="pass override=True") as info:
        manager.register(_Plugin("reference"), "dup")
    assert "'builtin'" in str(info.value) and "'dup'" in str(info.value)
    # The failed plugin left nothing behind.
    assert [p.name for p in manager.plugins()] == ["builtin"]
    assert manager.get_engine("reference").plugin == "builtin"
    manager.register(_Plugin("reference", override=True), "winner")
    assert manager.get_engine("reference").plugin == "winner"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target": "no_colon.module"}, r"'package\.module:Class'"),
        ({"config": "pkg.mod:"}, r"config='pkg\.mod:'"),
        (
            {"capabilities": frozenset({"telepathy"})},
            r"unknown capability 'telepathy'.*allowed: value_head",
        ),
    ],
)
def test_bad_registrations_are_refused(
    manager: PluginManager, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(PluginError, match=match):
        manager.register(_Plugin("x", **kwargs), "bad")
    assert "x" not in manager.registry.names(BackendKind.ENGINE)


def test_unknown_backend_error_lists_names(manager: PluginManager) -> None:
    with pytest.raises(
        UnknownBackendError,
        match=r"unknown engine 'fsdp9'.*Available engines: "
        r"reference",
    ) as info:
        manager.get_engine("fsdp9")
    assert isinstance(info.value, KeyError)
    with pytest.raises(UnknownBackendError, match=r"Available rollouts: \(none\)"):
        manager.get_rollout("hf")


def test_missing_backend_module_names_plugin_exception_and_install(
    manager: PluginManager,
) -> None:
    manager.register(
        _Plugin("ghost", target="ghost_backend_pkg.engine:GhostEngine"),
        "ghost",
        distribution="engine-core-ghost",
        version="1.0",
    )
    spec = manager.get_engine("ghost")  # registered fine: nothing imported yet
    with pytest.raises(PluginLoadError) as info:
        spec.load_class()
    message = str(info.value)
    assert "'ghost'" in message and "ModuleNotFoundError" in message
    assert "pip install engine-core-ghost" in message


def test_target_must_be_the_right_base_class(manager: PluginManager) -> None:
    manager.register(_Plugin("wrong", target="engine_core.config:EngineConfig"), "wrong")
    with pytest.raises(PluginError, match="not a subclass of BaseEngine"):
        manager.get_engine("wrong").load_class()


def test_unknown_hook_is_refused(manager: PluginManager) -> None:
    class Typo:
        @hookimpl
        def engine_core_registr(self, registry: BackendRegistry) -> None: ...

    class WrongArgs:
        @hookimpl
        def engine_core_register(self, registry: BackendRegistry, extra: int) -> None: ...

    with pytest.raises(PluginError, match="engine_core_registr"):
        manager.register(Typo(), "typo")
    with pytest.raises(PluginError, match="'wrong-args' does not match engine_core.hookspecs"):
        manager.register(WrongArgs(), "wrong-args")
    manager.check_pending()  # the refused plugins were unregistered
    assert [p.name for p in manager.plugins()] == ["builtin"]


def test_plugin_registered_twice_is_refused(manager: PluginManager) -> None:
    plugin = _Plugin("once")
    manager.register(plugin, "once")
    with pytest.raises(PluginError, match="already registered as 'once'"):
        manager.register(plugin, "twice")
    with pytest.raises(PluginError, match="a plugin named 'once' is already registered"):
        manager.register(_Plugin("other"), "once")


def test_managers_share_no_state() -> None:
    a = load_plugins(Settings(disable_plugin_autoload=True))
    b = load_plugins(Settings(disable_plugin_autoload=True))
    a.register(_Plugin("only-in-a"), "a")
    assert "only-in-a" in a.registry.names(BackendKind.ENGINE)
    assert "only-in-a" not in b.registry.names(BackendKind.ENGINE)


def test_doctor_checks_report_each_plugin(manager: PluginManager) -> None:
    checks = manager.doctor_checks()
    assert [(c.name, c.ok) for c in checks] == [("plugin builtin", True)]


# -- settings --------------------------------------------------------------------------------------


def test_settings_from_env() -> None:
    s = Settings.from_env(
        {
            "ENGINE_CORE_DISABLE_PLUGIN_AUTOLOAD": "TRUE",
            "ENGINE_CORE_PLUGINS": " fsdp, vllm ,,fsdp",
            "ENGINE_CORE_LOG_LEVEL": "debug",
        }
    )
    assert s == Settings(disable_plugin_autoload=True, plugins=("fsdp", "vllm"), log_level="DEBUG")
    assert Settings.from_env({}) == Settings()
    assert s.allows("builtin") and s.allows("vllm") and not s.allows("megatron")


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"ENGINE_CORE_DISABLE_PLUGIN_AUTOLOAD": "maybe"}, r"AUTOLOAD='maybe'.*allowed: 1, true"),
        ({"ENGINE_CORE_PLUGINS": "fsdp,no way"}, r"PLUGINS='fsdp,no way'.*\['no way'\]"),
        ({"ENGINE_CORE_LOG_LEVEL": "LOUD"}, r"LOG_LEVEL='LOUD'.*allowed: DEBUG, INFO"),
    ],
)
def test_invalid_settings_name_variable_value_and_allowed(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Settings.from_env(env)


# -- ENGINE_CORE_EXTRA_PLUGINS ---------------------------------------------------------------------

_EXTRA_MODULE = textwrap.dedent(
    """
    from engine_core.capabilities import Capability
    from engine_core.hookspecs import hookimpl

    @hookimpl
    def engine_core_register(registry):
        registry.register_engine(
            "extra-engine",
            "engine_core.reference_engine:ReferenceEngine",
            config="engine_core.reference_engine:ReferenceEngineConfig",
            capabilities=frozenset({Capability.CPU}),
        )
    """
)


@pytest.fixture
def extra_module(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "engine_core_extra_test_plugin.py").write_text(_EXTRA_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "engine_core_extra_test_plugin"


def test_extra_plugin_is_discovered_and_says_where_it_came_from(extra_module: str) -> None:
    m = load_plugins(Settings(extra_plugins=(("extra", extra_module),)))
    spec = m.get_engine("extra-engine")
    assert spec.plugin == "extra"
    (info,) = [p for p in m.plugins() if p.name == "extra"]
    assert info.status == "ok" and info.source == f"ENGINE_CORE_EXTRA_PLUGINS: {extra_module}"
    assert info.to_dict()["source"] == info.source and info.distribution == ""
    assert [b.name for b in info.backends] == ["extra-engine"]


def test_extra_plugins_follow_the_allow_list_and_autoload(extra_module: str) -> None:
    extra = (("extra", extra_module),)
    skipped = load_plugins(Settings(plugins=("fsdp",), extra_plugins=extra))
    with pytest.raises(UnknownBackendError, match=r"Skipped by ENGINE_CORE_PLUGINS: .*extra"):
        skipped.get_engine("extra-engine")
    allowed = load_plugins(Settings(plugins=("extra",), extra_plugins=extra))
    assert [p.name for p in allowed.plugins()] == ["builtin", "extra"]
    off = load_plugins(Settings(disable_plugin_autoload=True, extra_plugins=extra))
    assert [p.name for p in off.plugins()] == ["builtin"]


def test_extra_plugin_that_cannot_be_imported_is_recorded_and_named() -> None:
    settings = Settings(disable_plugin_autoload=False, plugins=("gone",),
                        extra_plugins=(("gone", "no_such_pkg_for_engine_core.plugin"),))  # fmt: skip
    m = load_plugins(settings)
    (info,) = m.failed_plugins()
    assert info.name == "gone" and info.error is not None
    assert info.error.startswith(
        "ModuleNotFoundError: No module named 'no_such_pkg_for_engine_core"
    )
    assert "PYTHONPATH" in str(info.install_hint)
    with pytest.raises(PluginLoadError) as err:
        m.get_engine("gone-engine")
    message = str(err.value)
    assert "ENGINE_CORE_EXTRA_PLUGINS: no_such_pkg_for_engine_core.plugin" in message
    assert "make module 'no_such_pkg_for_engine_core.plugin' importable" in message
    assert "pip install" not in message


def test_settings_read_extra_plugins() -> None:
    env = {"ENGINE_CORE_EXTRA_PLUGINS": " a = pkg.mod , b=other.plugin,"}
    assert Settings.from_env(env).extra_plugins == (("a", "pkg.mod"), ("b", "other.plugin"))
    assert Settings.from_env({"ENGINE_CORE_EXTRA_PLUGINS": ""}).extra_plugins == ()


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ("pkg.mod", r"'pkg\.mod' has no '='.*'name=package\.module'"),
        ("a=pkg.mod,a=other", r"the name 'a' is given twice"),
        ("builtin=pkg.mod", r"'builtin' is the core's own plugin"),
        ("no way=pkg.mod", r"invalid plugin name 'no way'"),
        ("a=pkg..mod", r"'pkg\.\.mod' \(for 'a'\) is not a dotted module path"),
        ("a=pkg.mod:register", r"is not a dotted module path"),
    ],
)
def test_invalid_extra_plugins_are_refused(raw: str, match: str) -> None:
    with pytest.raises(ConfigError, match=rf"ENGINE_CORE_EXTRA_PLUGINS=.*{match}"):
        Settings.from_env({"ENGINE_CORE_EXTRA_PLUGINS": raw})


def test_test_sessions_see_the_example_engine_through_the_setting() -> None:
    # tests/conftest.py names it; nothing installs it
    (info,) = [p for p in load_plugins().plugins() if p.name == "example"]
    assert info.source == "ENGINE_CORE_EXTRA_PLUGINS: engine_core_example.plugin"
    assert "example-bad-order" in [b.name for b in info.backends]


def test_a_users_environment_lists_no_example_engines() -> None:
    # run_python drops every ENGINE_CORE_* variable and PYTHONPATH, as in a user's shell
    proc = run_python(["-m", "engine_core.cli", "plugins", "--json"], None)
    assert proc.returncode == 0, proc.stderr
    plugins = json.loads(proc.stdout)["plugins"]
    assert "example" not in [p["name"] for p in plugins]
    backends = [b["name"] for p in plugins for b in p["backends"]]
    assert "reference" in backends
    assert not [b for b in backends if b.startswith("example")], backends
