"""Ranges in the distributions, the tested versions in ``engine_core/constraints.txt``: every
declared range holds the tested version, the core's torch range holds the torch SGLang pins,
and ``engine-core doctor`` names a library installed at a version other than the tested one."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from engine_core.doctor import _normalized, tested_versions, untested_versions

ROOT = Path(__file__).parents[1]
PYPROJECTS = [
    ROOT / "pyproject.toml",
    ROOT / "roles" / "pyproject.toml",
    *sorted((ROOT / "plugins").glob("*/pyproject.toml")),
]


def _requirements(path: Path) -> list[Requirement]:
    project = tomllib.loads(path.read_text())["project"]
    lines = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        lines += extra
    return [Requirement(line) for line in lines]


@pytest.mark.parametrize("path", PYPROJECTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_requirement_is_a_range_holding_the_tested_version(path: Path) -> None:
    tested = tested_versions()
    for req in _requirements(path):
        name = _normalized(req.name)
        if name.startswith("engine-core"):
            assert req.specifier.contains("0.1.0"), f"{path}: {req}"
            continue
        if name in ("vllm", "sglang"):  # GPU builds: the CPU build's version is the tested one
            continue
        assert name in tested, f"{path}: {req.name} is not in engine_core/constraints.txt"
        assert req.specifier.contains(tested[name], prereleases=True), (
            f"{path}: {req} excludes the tested {name}=={tested[name]}"
        )
        assert not any(s.operator == "==" for s in req.specifier), f"{path}: {req} is a pin"


def test_the_core_installs_beside_the_pins_of_sglang() -> None:
    """sglang 0.5.23 pins torch 2.14.1 and transformers 5.19.0: the core's ranges hold both."""
    core = {_normalized(r.name): r for r in _requirements(ROOT / "pyproject.toml")}
    assert core["torch"].specifier.contains("2.14.1")
    assert core["transformers"].specifier.contains("5.19.0")


def test_doctor_names_a_library_at_an_untested_version() -> None:
    assert untested_versions() == []  # make setup installs the tested versions
    torch_version = importlib.metadata.version("torch")
    other = {"torch": "2.12.0", "pluggy": importlib.metadata.version("pluggy")}
    assert untested_versions(other) == [("torch", torch_version, "2.12.0")]
