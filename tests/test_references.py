"""Every dotted name of ours that the code, the docs and the benchmarks mention
(``engine_core_roles.distributed.weights.WeightLink``, ``engine_core.moe``) names a module that
exists, and a name defined at the top of that module: a module that moved leaves no stale
reference behind. Modules are found and read, never imported (a plugin's imports are heavy)."""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).parents[1]
WHERE = ("engine_core", "roles", "plugins", "docs", "benchmarks", "README.md")
PACKAGES = r"engine_core(?:_roles|_fsdp|_hf|_vllm|_sglang|_megatron)?"
# not preceded by a dot or a word character: `llm_engine.engine_core.shutdown` is vLLM's own
DOTTED = re.compile(rf"(?<![\w.]){PACKAGES}(?:\.[A-Za-z_]\w*)+")
# entry-point groups are dotted names of ours that no module carries
NOT_MODULES = frozenset({"engine_core.plugins.hooks", "engine_core.commands"})


@cache
def _spec_origin(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


@cache
def _top_names(path: str) -> frozenset[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
            # a lazy package's public names: the keys of its `_EXPORTS` table
            if node.target.id == "_EXPORTS" and isinstance(node.value, ast.Dict):
                names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return frozenset(names)


def stale(name: str) -> str | None:
    """Why ``name`` names nothing; None when it names a module, or a module's top-level name
    (and, past that, any attribute: a class's method is not checked)."""
    if name in NOT_MODULES or any(name.startswith(n + ".") for n in NOT_MODULES):
        return None
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        origin = _spec_origin(".".join(parts[:i]))
        if origin is None:
            continue
        if i == len(parts) or not origin.endswith(".py"):
            return None
        if parts[i] in _top_names(origin):
            return None
        return f"{'.'.join(parts[:i])} defines no {parts[i]!r}"
    return f"no module {parts[0]!r}"


def references() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for top in WHERE:
        base = ROOT / top
        paths = [base] if base.is_file() else sorted(base.rglob("*"))
        for path in paths:
            if path.suffix not in (".py", ".md") or "/tests/" in str(path.relative_to(ROOT)):
                continue
            for match in DOTTED.finditer(path.read_text(errors="replace")):
                found.setdefault(match.group(0).rstrip("."), set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_dotted_name_of_ours_names_something() -> None:
    broken = {
        name: (why, sorted(files))
        for name, files in references().items()
        if (why := stale(name)) is not None
    }
    assert broken == {}, broken


def test_a_stale_reference_is_caught() -> None:
    assert stale("engine_core_roles.weights.WeightLink") is not None  # moved to distributed/
    assert stale("engine_core.engine.NoSuchName") == "engine_core.engine defines no 'NoSuchName'"
    assert stale("engine_core_roles.distributed.weights.WeightLink") is None
    assert stale("engine_core.engine.BaseEngine.forward_backward_step") is None
