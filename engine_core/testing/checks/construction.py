"""Construction and capabilities, checked in the pytest process itself: the registered class
declares what its registration does, an undeclared capability is refused at resolution, an
engine takes only a resolved config and needs ``init_model()`` first, and a subclass cannot
redefine ``BaseEngine``'s private helpers.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine_core.capabilities import Capability
from engine_core.errors import CapabilityError, EngineCoreError
from engine_core.plugins import load_plugins
from engine_core.resolve import resolve_engine_config
from engine_core.testing.checks.verdict import exception
from engine_core.testing.drive import CAPABILITY_TRIGGERS
from engine_core.testing.models import engine_config
from engine_core.testing.oracle import train_batch

__all__ = [
    "test_a_subclass_cannot_redefine_a_private_helper",
    "test_an_engine_takes_a_resolved_config_and_init_model_first",
    "test_registered_class_declares_the_registered_capabilities",
    "test_undeclared_capabilities_are_refused",
]


def test_undeclared_capabilities_are_refused(engine_core_backend: str, caps: frozenset) -> None:
    manager = load_plugins()
    for cap, trigger in CAPABILITY_TRIGGERS.items():
        if cap in caps:
            continue
        raw = engine_config(backend=engine_core_backend, **trigger)
        if cap != Capability.PACKING:
            raw.setdefault("use_packing", Capability.PACKING in caps)
        # refused at resolution: by the capability check, or by the backend's own config
        # validation, with a message naming the capability or the option that asks for it
        with pytest.raises((CapabilityError, ValueError)) as refused:
            resolve_engine_config(raw, manager)
        names = [str(cap), *_option_names(trigger)]
        assert any(n in str(refused.value) for n in names), (
            f"[capabilities] {cap} is not declared and was refused, but the message names none "
            f"of {names}: {refused.value}"
        )


def _option_names(trigger: dict[str, Any]) -> list[str]:
    names = []
    for key, value in trigger.items():
        if key == "model":
            names += [k for k in value if k != "config"]
        else:
            names.append(key)
    return names


def test_registered_class_declares_the_registered_capabilities(engine_core_backend: str) -> None:
    spec = load_plugins().get_engine(engine_core_backend)
    cls = spec.load_class()
    assert frozenset(cls.capabilities) == frozenset(spec.capabilities), (
        f"[capabilities] the registry lists {sorted(map(str, spec.capabilities))} but "
        f"{cls.__name__}.capabilities is {sorted(map(str, cls.capabilities))}"
    )


def test_an_engine_takes_a_resolved_config_and_init_model_first(
    engine_core_backend: str, caps: frozenset
) -> None:
    manager = load_plugins()
    cls = manager.get_engine(engine_core_backend).load_class()
    raw = engine_config(backend=engine_core_backend, use_packing=Capability.PACKING in caps)
    refused = exception(lambda: cls(raw))
    if not isinstance(refused, TypeError) or "resolve_engine_config" not in str(refused):
        pytest.fail(
            f"[construction] {cls.__name__}(<a raw config dict>) raised {refused!r}; want a "
            f"TypeError saying to resolve the config with resolve_engine_config() "
            f"(BaseEngine.__init__ checks config_class: call it first)."
        )
    _, config = resolve_engine_config(raw, manager)
    engine = cls(config)
    calls = {
        "require_module()": engine.require_module,
        "forward_backward_step(forward_only=True)": lambda: engine.forward_backward_step(
            train_batch(), forward_only=True
        ),
    }
    for name, call in calls.items():
        got = exception(call)
        if not isinstance(got, EngineCoreError) or "init_model" not in str(got):
            pytest.fail(
                f"[construction] {name} before init_model() raised {got!r}; want an "
                f"EngineCoreError saying to call init_model() first (BaseEngine.require_module)."
            )


def test_a_subclass_cannot_redefine_a_private_helper(engine_core_backend: str) -> None:
    cls = load_plugins().get_engine(engine_core_backend).load_class()
    refused = exception(lambda: type("Shadowing", (cls,), {"_check_model_limits": len}))
    if not isinstance(refused, TypeError) or "_check_model_limits" not in str(refused):
        pytest.fail(
            f"[private names] a subclass of {cls.__name__} redefining BaseEngine's "
            f"_check_model_limits gave {refused!r}; want a TypeError naming it "
            f"(BaseEngine.__init_subclass__: keep it, or call super().__init_subclass__())."
        )
