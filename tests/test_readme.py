"""Every Python block in the README runs as written; the training script learns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_own_script_section_trains_with_public_imports_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", _section("Your own script"), flags=re.S)
    assert len(blocks) == 1, "the section shows one complete program"
    program = blocks[0]
    imports = re.findall(r"^(?:from|import) (\S+)", program, flags=re.M)
    assert set(imports) <= {"torch", "engine_core", "engine_core_roles"}, imports
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(program, str(README), "exec"), namespace)  # noqa: S102 - our own docs
    rewards = namespace["rewards"]
    assert isinstance(rewards, list) and len(rewards) == 60
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.25, (first, last)  # it learns, as the section says
    printed = capsys.readouterr().out
    assert "steps 51-60: mean reward" in printed


def test_every_python_block_is_the_tested_program() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    assert blocks == re.findall(r"```python\n(.*?)```", _section("Your own script"), flags=re.S)
