"""Imports point one way (``docs/concepts.md``, "Layers above the engines").

- The core (``engine_core``) imports nothing above it: neither the roles nor any plugin.
- A plugin (``engine_core_fsdp``, ``engine_core_hf``, ...) imports the core and itself only.
- The layers of ``engine_core_roles``: a module imports its own layer and the layers listed below
  it, never one above; every import of the package names a module (not a sub-package's
  re-exports, not the package root) at module level; and no two modules import each other,
  directly or around a circle.

Relative imports (``from ..trainer import loop``) are resolved to the module they name and held to
the same rules as absolute ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = "engine_core_roles"
SOURCE = ROOT / "roles" / PACKAGE
CORE = "engine_core"
PLUGINS = {
    f"engine_core_{name}": ROOT / "plugins" / name / f"engine_core_{name}"
    for name in ("fsdp", "hf", "megatron", "sglang", "vllm")
}
# the packages above the core: the core imports none of them
ABOVE_CORE = frozenset({PACKAGE, *PLUGINS})

# what each layer may import besides itself (and engine_core, which any layer may)
ALLOWED: dict[str, frozenset[str]] = {
    "batch": frozenset(),
    "algorithms": frozenset({"batch"}),
    "models": frozenset({"batch", "algorithms"}),
    "distributed": frozenset({"batch", "algorithms", "models"}),
    "data": frozenset({"batch"}),
    "episodes": frozenset({"batch", "data"}),
    "trainer": frozenset({"batch", "algorithms", "models", "distributed", "data", "episodes"}),
    "serving": frozenset({"batch", "data", "episodes"}),
    "jobs": frozenset(
        {"batch", "algorithms", "models", "distributed", "data", "episodes", "trainer", "serving"}
    ),
}


def package_sources(package: str = PACKAGE, source: Path = SOURCE) -> dict[str, str]:
    """Every module of ``package`` by dotted name (a sub-package as its ``__init__``, its name
    ending in ``.__init__`` so a relative import inside it resolves from the package itself)."""
    out = {}
    for path in sorted(source.rglob("*.py")):
        parts = path.relative_to(source).with_suffix("").parts
        out[".".join((package, *parts))] = path.read_text()
    return out


def _module_name(key: str) -> str:
    return key.removesuffix(".__init__")


def imported(key: str, node: ast.AST) -> list[str]:
    """The modules an import statement of module ``key`` names, relative ones resolved."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if not node.level:
        return [node.module or ""]
    # level 1 is the package holding the module (an __init__'s own package), each level one up
    base = key.split(".")[: -node.level]
    if not base:
        return [f"{'.' * node.level}{node.module or ''} (beyond the top-level package)"]
    if node.module:
        return [".".join((*base, node.module))]
    return [".".join((*base, a.name)) for a in node.names]  # from . import loop


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def problems(sources: dict[str, str]) -> list[str]:
    """Each import that breaks the rules above, and each import circle, as one sentence."""
    found: list[str] = []
    graph: dict[str, set[str]] = {_module_name(k): set() for k in sources}
    packages = {_module_name(k) for k in sources if k.endswith(".__init__")}
    for key, text in sources.items():
        module = _module_name(key)
        tree = ast.parse(text)
        top = {id(node) for node in tree.body}
        # a module-level `if TYPE_CHECKING:` block holds imports for type checkers only (a lazy
        # package's names): module level too
        for node in tree.body:
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                top |= {id(child) for child in node.body}
        mine = layer_of(module)
        for node in ast.walk(tree):
            for target in imported(key, node):
                if target.split(".")[0] != PACKAGE:
                    continue
                where = f"{module}:{node.lineno} imports {target}"
                if id(node) not in top:
                    found.append(f"{where} inside a function: import it at module level")
                if mine is None:
                    continue  # the package root is the public face: it re-exports every layer
                if target in packages:
                    found.append(f"{where}, a package's re-exports: name the module instead")
                theirs = layer_of(target)
                if theirs is not None and theirs != mine and theirs not in ALLOWED[mine]:
                    found.append(
                        f"{where}: layer {mine!r} may import only "
                        f"{sorted(ALLOWED[mine]) or 'nothing'} besides itself"
                    )
                if target in graph and target != module:
                    graph[module].add(target)
    # circles: a depth-first search over the module graph (package roots aside: they only
    # re-export, and importing a submodule runs its package's __init__ first by design)
    edges = {
        m: {t for t in ts if t not in packages} for m, ts in graph.items() if m not in packages
    }
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                found.append("import circle: " + " -> ".join(stack[stack.index(t) :] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return found


def test_every_module_belongs_to_a_layer() -> None:
    layers = {layer_of(_module_name(m)) for m in package_sources()} - {None}
    assert layers == set(ALLOWED), f"modules outside the documented layers: {layers - set(ALLOWED)}"
    assert "recipes" not in layers


def test_imports_point_down_and_never_circle() -> None:
    assert problems(package_sources()) == []


def upward_imports(package: str, sources: dict[str, str], allowed: frozenset[str]) -> list[str]:
    """Each import of ``sources`` (anywhere: at module level or inside a function) of one of
    our packages other than ``package`` itself and ``allowed``, as one sentence."""
    ours = {CORE, *ABOVE_CORE}
    found = []
    for key, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            for target in imported(key, node):
                top = target.split(".")[0]
                if target.startswith(".") or (top in ours and top not in {package, *allowed}):
                    found.append(
                        f"{_module_name(key)}:{node.lineno} imports {target}: {package} may "
                        f"import only {sorted(allowed) or 'nothing'} of ours besides itself"
                    )
    return found


def core_problems(sources: dict[str, str]) -> list[str]:
    return upward_imports(CORE, sources, frozenset())


def plugin_problems(package: str, sources: dict[str, str]) -> list[str]:
    return upward_imports(package, sources, frozenset({CORE}))


def test_the_core_imports_nothing_above_it() -> None:
    assert core_problems(package_sources(CORE, ROOT / CORE)) == []


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
def test_a_plugin_imports_the_core_and_itself_only(plugin: str) -> None:
    assert plugin_problems(plugin, package_sources(plugin, PLUGINS[plugin])) == []


def _with(sources: dict[str, str], module: str, line: str) -> dict[str, str]:
    out = dict(sources)
    key = module if module in out else f"{module}.__init__"
    out[key] = out[key] + "\n" + line + "\n"
    return out


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        (  # a loss that reaches up into the trainer
            f"{PACKAGE}.algorithms.losses",
            f"from {PACKAGE}.trainer.loop import RLTrainer",
            "layer 'algorithms' may import only ['batch']",
        ),
        (  # data reaching into episodes (the circle text <-> agents of old)
            f"{PACKAGE}.data.datasets.prompts",
            f"from {PACKAGE}.episodes.metrics import episode_metrics",
            "layer 'data' may import only ['batch']",
        ),
        (  # the same circle hidden in a function
            f"{PACKAGE}.batch.build",
            f"def _late():\n    from {PACKAGE}.batch.keys import ROW\n    return ROW",
            "inside a function",
        ),
        (  # two modules of one layer importing each other
            f"{PACKAGE}.trainer.guards",
            f"from {PACKAGE}.trainer.loop import RLTrainer",
            "import circle: ",
        ),
        (
            f"{PACKAGE}.trainer.loop",
            f"from {PACKAGE}.episodes import episode_metrics",
            "a package's re-exports",
        ),
        (  # relative, upward: algorithms reaching the trainer
            f"{PACKAGE}.algorithms.losses",
            "from ..trainer.loop import RLTrainer",
            "layer 'algorithms' may import only ['batch']",
        ),
        (  # relative, from a package's __init__ (level 1 is the package itself, 2 the root)
            f"{PACKAGE}.data",
            "from ..trainer.loop import RLTrainer",
            "layer 'data' may import only ['batch']",
        ),
        (  # relative, a sub-package's re-exports
            f"{PACKAGE}.trainer.loop",
            "from ..episodes import episode_metrics",
            "a package's re-exports",
        ),
        (  # relative, a circle within a layer
            f"{PACKAGE}.trainer.guards",
            "from . import loop",
            "import circle: ",
        ),
    ],
)
def test_a_wrong_way_import_is_caught(module: str, line: str, expected: str) -> None:
    found = problems(_with(package_sources(), module, line))
    assert found, f"nothing caught for {line!r} in {module}"
    assert any(expected in f for f in found), found


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("engine_core.engine", f"from {PACKAGE}.trainer.loop import RLTrainer"),
        ("engine_core.batch", f"import {PACKAGE}"),
        ("engine_core.rollout", "from engine_core_hf.rollout import HFRollout"),
        ("engine_core.plugins", "def _late():\n    import engine_core_fsdp.fsdp2\n"),
        ("engine_core.testing", "from engine_core_megatron import engine"),
        ("engine_core.cli", "from ... import anything"),  # past the top-level package
    ],
)
def test_an_import_from_the_core_upward_is_caught(module: str, line: str) -> None:
    sources = package_sources(CORE, ROOT / CORE)
    assert core_problems(_with(sources, module, line)), f"nothing caught for {line!r}"


@pytest.mark.parametrize(
    ("plugin", "module", "line"),
    [
        ("engine_core_vllm", "engine_core_vllm.rollout", f"from {PACKAGE}.batch import keys"),
        ("engine_core_fsdp", "engine_core_fsdp.fsdp2", "from engine_core_megatron import convert"),
        ("engine_core_hf", "engine_core_hf", "from engine_core_vllm.rollout import VLLMRollout"),
    ],
)
def test_an_import_from_a_plugin_outside_the_core_is_caught(
    plugin: str, module: str, line: str
) -> None:
    sources = package_sources(plugin, PLUGINS[plugin])
    assert plugin_problems(plugin, _with(sources, module, line)), f"nothing caught for {line!r}"


MAX_LINES = 700


def test_no_module_is_over_700_lines_without_saying_why() -> None:
    """A module outside the tests holds one concern: over 700 lines, its docstring says why
    ("Over 700 lines on purpose: ...")."""
    roots = [ROOT / CORE, SOURCE, *PLUGINS.values()]
    long = []
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Over 700 lines on purpose" not in doc:
                long.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not long, f"split these by concern, or say why in the docstring: {long}"
