"""The documentation site builds without warnings, its pages read in full as plain Markdown and
are current with what they are generated from, and its Python examples run as written."""

from __future__ import annotations

import difflib
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from engine_core import load_plugins
from tests._forkserver import ForkServer

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
GENERATOR = "python docs/hooks/generate.py"
# pages whose ```python blocks are run, in order, in one namespace per page
EXECUTED_PAGES = ("quickstart.md", "write-your-own-engine.md")
# pages whose Python examples run (their shell lines name files the example writes)
PYTHON_PAGES = (
    *EXECUTED_PAGES,
    "your-data.md",
    "sft.md",
    "agents.md",
    "serving.md",
    "moe.md",
    "vision.md",
)
PYTHON_BLOCK = re.compile(r"^(`{3,})python[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")


def python_blocks(page: Path) -> list[tuple[str, str]]:
    """(name, source) of each ```python block."""
    text = page.read_text(encoding="utf-8")
    return [
        (f"{page.relative_to(ROOT)} python block {i + 1}", block)
        for i, (_, block) in enumerate(PYTHON_BLOCK.findall(text))
    ]


@pytest.fixture(scope="module")
def generator() -> Iterator[ModuleType]:
    """``docs/hooks/generate.py``, imported with its folder on the path (as a script has it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(DOCS / "hooks"))
        yield importlib.import_module("generate")


def test_site_builds_strict_without_warnings(tmp_path: Path) -> None:
    site = tmp_path / "site"
    # The theme prints an end-of-life notice on every build (not a build warning; it names the
    # variable that turns it off, which would match the check below).
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    warnings = [line for line in output.splitlines() if "WARNING" in line]
    assert not warnings, "\n".join(warnings)

    # the generated parts are in the pages, the site shows them without a hook
    config = (site / "config" / "index.html").read_text(encoding="utf-8")
    assert 'id="engineconfig"' in config and 'id="rljobconfig"' in config
    for name in ("reference", "fsdp", "fsdp2", "megatron", "hf", "vllm", "sglang"):
        assert f"<code>{name}</code>" in config, f"backend {name} missing"
    tutorial = (site / "write-your-own-engine" / "index.html").read_text(encoding="utf-8")
    for name in ("ExampleEngineConfig", "engine_core_register", "engine_core_example.plugin"):
        assert name in tutorial
    assert "--8&lt;--" not in tutorial
    fsdp = (site / "plugins" / "fsdp" / "index.html").read_text(encoding="utf-8")
    assert "engine-core-fsdp" in fsdp and "Registered backends" in fsdp


# -- generated pages -----------------------------------------------------------------------------


def test_generated_pages_are_current(generator: ModuleType) -> None:
    pages = generator.generated_pages()
    expected = {"config.md", "write-your-own-engine.md", "write-your-own-rollout.md"} | {
        f"plugins/{p.name}" for p in (DOCS / "plugins").glob("*.md")
    }
    assert expected <= {p.relative_to(DOCS).as_posix() for p in pages}, "markers went missing"
    stale = {p: text for p, text in pages.items() if p.read_text(encoding="utf-8") != text}
    if stale:
        first, text = next(iter(stale.items()))
        diff = difflib.unified_diff(
            first.read_text(encoding="utf-8").splitlines(),
            text.splitlines(),
            str(first.relative_to(ROOT)),
            "generated",
            lineterm="",
        )
        pytest.fail(
            f"stale generated pages: {', '.join(str(p.relative_to(ROOT)) for p in stale)}. "
            f"Run `{GENERATOR}` (e.g. with .venv/bin/python) and commit the pages.\n"
            + "\n".join(list(diff)[:60])
        )


def test_config_reference_lists_exactly_the_in_repo_backends(generator: ModuleType) -> None:
    plugins = {p.name for p in generator.in_repo_plugins()}
    assert {"builtin", "fsdp", "megatron", "hf", "vllm", "sglang"} <= plugins
    assert "example" not in plugins
    backends = generator.in_repo_backends()
    assert {s.plugin for s in backends} == plugins, "an in-repo plugin registers nothing"
    # the same backends as discovery finds for these plugins, whatever else is installed
    installed = {(s.plugin, s.name) for s in load_plugins().registry.specs()}
    assert {(s.plugin, s.name) for s in backends} == {p for p in installed if p[0] in plugins}

    config = (DOCS / "config.md").read_text(encoding="utf-8")
    headings = re.findall(r"^### (?:Engine|Rollout) (.*?): \w+ \{#", config, re.M)
    documented = {name for h in headings for name in re.findall(r"`([^`]+)`", h)}
    assert documented == {s.name for s in backends}


def test_generator_ignores_the_environment() -> None:
    # settings that change what discovery finds leave the generated pages as they are
    env = {
        **os.environ,
        "ENGINE_CORE_PLUGINS": "example",
        "ENGINE_CORE_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    proc = subprocess.run(
        [sys.executable, "docs/hooks/generate.py", "--check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "page", sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")), ids=str
)
def test_page_reads_raw(page: str) -> None:
    """No include syntax or placeholder that only the site build would fill."""
    text = (DOCS / page).read_text(encoding="utf-8")
    assert "--8<--" not in text, f"{page}: an include marker; use <!-- include: PATH -->"
    assert "<!-- engine-core:" not in text, f"{page}: a build-time placeholder"
    for start, body in _fences(text):
        assert body.strip(), f"{page}: the code fence on line {start} is empty"


def _fences(text: str) -> list[tuple[int, str]]:
    """(line number, body) of every fenced code block."""
    fences: list[tuple[int, str]] = []
    opened: tuple[int, str] | None = None
    body: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if opened is None:
            if m:
                opened, body = (n, m.group(1)), []
        elif m and m.group(1).startswith(opened[1]) and not line.strip().strip(opened[1][0]):
            fences.append((opened[0], "\n".join(body)))
            opened = None
        else:
            body.append(line)
    assert opened is None, f"the code fence on line {opened[0]} is never closed"
    return fences


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_blocks_run(page: str, tmp_path: Path, job_server: ForkServer) -> None:
    """In a child forked from a server that has imported what the examples import
    (``tests/_forkserver.py``): each page costs its examples, not an interpreter start. The
    namespace is fresh for each page, so an example that forgets an import still fails."""
    blocks = python_blocks(DOCS / page)
    assert blocks, f"{page} should show a Python example"
    log = tmp_path / "output.log"
    # cwd: anything an example writes stays out of the repository
    code = job_server.run(blocks=blocks, cwd=str(tmp_path), log=str(log), timeout=300)
    assert code == 0, log.read_text(errors="replace")


# -- the shell commands of the executed pages ----------------------------------------------------

BASH_BLOCK = re.compile(r"^```bash[^\n]*\n(.*?)^```", re.M | re.S)
# commands the test suite already runs in its own way: `make test` is this suite, the setup
# installed every `pip install` target, and `make test` runs the conformance kit on the example
# engine. `make run` is `engine-core run` once the setup is done: it runs below, shortened.
NOT_RERUN = ("make test", "pip install ", "pytest ")


def shell_commands() -> list[str]:
    """The executed pages' commands, each once: a command the pages give twice, through
    ``.venv/bin/engine-core`` and through ``engine-core`` on the PATH, runs the same ``main``."""
    commands: dict[str, str] = {}
    for page in EXECUTED_PAGES:
        for block in BASH_BLOCK.findall((DOCS / page).read_text(encoding="utf-8")):
            for line in block.splitlines():
                command = line.split("#", 1)[0].strip()
                if command == "make run":
                    command = "engine-core run"
                if command and not command.startswith(NOT_RERUN):
                    same = re.sub(r"^\S*/engine-core\b", "engine-core", command)
                    commands.setdefault(" ".join(same.split()), command)
    return list(commands.values())


# Each command runs in a child forked from the suite's job server (tests/_forkserver.py), which
# has imported what the commands import: a run costs the command, not an interpreter start.


def _shortened(command: str, out: Path, previous: Path | None) -> tuple[list[str], Path]:
    """The documented command's arguments, with only its length and output folder changed."""
    words = command.split()
    assert words[0].endswith("engine-core"), f"unexpected command in the docs: {command}"
    args = words[1:]
    folder = out
    if args[0] in ("run", "train"):
        if "--resume" in args:  # continue the previous run for one more step
            assert previous is not None, "a --resume example needs a run before it"
            folder, steps = previous, 3
        else:
            steps = 2
        args += [f"steps={steps}", "log_every=1", f"output_dir={folder}"]
    elif args[0] == "parity":
        args += ["--steps", "2"]
    return args, folder


# The commands in three independent sets, each a class of its own, so that the two pytest
# workers (--dist loadscope: a class is a unit) run them side by side: the ones that start
# Ray or vLLM, the ones that start worker or replica processes, and the rest (a --resume
# example stays with the run before it).
COMMAND_SETS = {
    "ray_and_vllm": ("placement.executor=ray", "rollout.backend=vllm"),
    "processes": ("rollout_placement=process",),
}


def _command_set(command: str) -> str:
    for name, marks in COMMAND_SETS.items():
        if any(mark in command for mark in marks):
            return name
    return "in_process"


def test_every_documented_command_is_in_one_set() -> None:
    commands = shell_commands()
    assert any("--resume" in c for c in commands) and any(" plugins" in c for c in commands)
    sets = {_command_set(c) for c in commands}
    assert sets == {*COMMAND_SETS, "in_process"}, f"a set has no command left: {sets}"
    resumed = [i for i, c in enumerate(commands) if "--resume" in c]
    assert all(_command_set(commands[i - 1]) == _command_set(commands[i]) for i in resumed)


def _run_commands(name: str, tmp_path: Path, server: ForkServer) -> None:
    commands = [c for c in shell_commands() if _command_set(c) == name]
    previous: Path | None = None
    for i, command in enumerate(commands):
        args, previous = _shortened(command, tmp_path / f"command_{i}", previous)
        log = tmp_path / f"command_{i}.log"
        # recipe paths in the docs are relative to the repository root
        code = server.run(
            args=args, cwd=str(ROOT), env={"COLUMNS": "160"}, log=str(log), timeout=600
        )
        assert code == 0, f"{command}\n{log.read_text(errors='replace')}"


class TestDocumentedCommandsRayAndVllm:
    def test_they_run(self, tmp_path: Path, job_server: ForkServer) -> None:
        _run_commands("ray_and_vllm", tmp_path, job_server)


class TestDocumentedCommandsWithProcesses:
    def test_they_run(self, tmp_path: Path, job_server: ForkServer) -> None:
        _run_commands("processes", tmp_path, job_server)


class TestDocumentedCommandsInProcess:
    def test_they_run(self, tmp_path: Path, job_server: ForkServer) -> None:
        _run_commands("in_process", tmp_path, job_server)
