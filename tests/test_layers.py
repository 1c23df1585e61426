"""The layers of ``engine_core_roles`` import one way (``docs/concepts.md``, "Layers above the
engines"): a module imports its own layer and the layers listed below it, never one above; every
import of the package names a module (not a sub-package's re-exports, not the package root) at
module level; and no two modules import each other, directly or around a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "engine_core_roles"
SOURCE = Path(__file__).parents[1] / "roles" / PACKAGE

# what each layer may import besides itself (and engine_core, which any layer may)
ALLOWED: dict[str, frozenset[str]] = {
    "batch": frozenset(),
    "algorithms": frozenset({"batch"}),
    "roles": frozenset({"batch", "algorithms"}),
    "distributed": frozenset({"batch", "algorithms", "roles"}),
    "data": frozenset({"batch"}),
    "episodes": frozenset({"batch", "data"}),
    "trainer": frozenset({"batch", "algorithms", "roles", "distributed", "data", "episodes"}),
    "jobs": frozenset(
        {"batch", "algorithms", "roles", "distributed", "data", "episodes", "trainer"}
    ),
}


def package_sources() -> dict[str, str]:
    """Every module of the package by dotted name (a sub-package as its ``__init__``)."""
    out = {}
    for path in sorted(SOURCE.rglob("*.py")):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((PACKAGE, *parts))] = path.read_text()
    return out


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def problems(sources: dict[str, str]) -> list[str]:
    """Each import that breaks the rules above, and each import circle, as one sentence."""
    found: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in sources}
    packages = {m for m in sources if (SOURCE / Path(*m.split(".")[1:]) / "__init__.py").exists()}
    for module, text in sources.items():
        tree = ast.parse(text)
        top = {id(node) for node in tree.body}
        # a module-level `if TYPE_CHECKING:` block holds imports for type checkers only (a lazy
        # package's names): module level too
        for node in tree.body:
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                top |= {id(child) for child in node.body}
        mine = layer_of(module)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module]
            else:
                continue
            for target in targets:
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
    layers = {layer_of(m) for m in package_sources()} - {None}
    assert layers == set(ALLOWED), f"modules outside the documented layers: {layers - set(ALLOWED)}"
    assert "recipes" not in layers


def test_imports_point_down_and_never_circle() -> None:
    assert problems(package_sources()) == []


def _with(sources: dict[str, str], module: str, line: str) -> dict[str, str]:
    out = dict(sources)
    out[module] = out[module] + "\n" + line + "\n"
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
            f"{PACKAGE}.data.prompts",
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
    ],
)
def test_a_wrong_way_import_is_caught(module: str, line: str, expected: str) -> None:
    found = problems(_with(package_sources(), module, line))
    assert found, f"nothing caught for {line!r} in {module}"
    assert any(expected in f for f in found), found
