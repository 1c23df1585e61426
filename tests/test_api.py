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
