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
    """roles/ works with any engine: it may import engine_core, never a backend plugin."""
    import ast
    import importlib.metadata as md
    from pathlib import Path

    plugins = {
        ep.value.split(":")[0].split(".")[0]
        for ep in md.entry_points(group="engine_core.plugins")
    } - {"engine_core"}
    assert plugins, "no plugin installed: this test would check nothing"
    imported: dict[str, set[str]] = {}
    for path in (Path(__file__).parents[1] / "roles").glob("*.py"):
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
