"""The ``engine-core`` command line: ``plugins`` (table and JSON), ``doctor``, exit codes."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest

from engine_core.cli import COMMANDS, Command, build_parser
from engine_core.settings import Settings
from engine_core_roles.jobs.cli import RECIPES, main
from tests._forkserver import ForkServer
from tests.fixtures.plugins._install import (
    cli_server,
    install_test_plugins,
    run_cli,
    run_python,
)

SCRIPT = Path(sys.executable).parent / "engine-core"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_test_plugins(tmp_path_factory)


Cli = Callable[..., CompletedProcess[str]]


@pytest.fixture(scope="module")
def cli_forks(site: Path) -> Iterator[ForkServer]:
    server = cli_server(site)
    yield server
    server.close()


@pytest.fixture
def cli(cli_forks: ForkServer, tmp_path: Path) -> Cli:
    """``cli(args, env=None)``: ``python -m engine_core.cli ARGS`` with the test plugins
    installed, in a process of its own (forked: its imports are paid once per module)."""

    def run(args: list[str], env: dict[str, str] | None = None) -> CompletedProcess[str]:
        return run_cli(cli_forks, args, tmp_path, env)

    return run


def _json_plugins(stdout: str) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in json.loads(stdout)["plugins"]}


# -- with the installed test plugins (the script in its own interpreter, the rest forked) ---------


def test_plugins_table_shows_good_and_broken(site: Path) -> None:
    assert SCRIPT.exists(), "install the core first: pip install -e . --no-deps"
    proc = run_python([str(SCRIPT), "plugins"], site)
    assert proc.returncode == 0, proc.stderr  # informational even though one plugin failed
    out = proc.stdout
    assert "engine:testgood" in out and "cpu, lora, packing" in out
    assert "engine:reference" in out
    assert "testbroken" in out and "failed" in out
    assert "ModuleNotFoundError: No module named 'nonexistent_backend_lib'" in out
    assert "pip install engine-core-testplugin-broken" in out
    assert "1 failed to load" in out


def test_plugins_json_is_machine_readable(cli: Cli) -> None:
    proc = cli(["plugins", "--json"])
    assert proc.returncode == 0, proc.stderr
    plugins = _json_plugins(proc.stdout)
    # other plugins of this project may be installed too
    assert {"builtin", "testgood", "testbroken"} <= set(plugins)
    good, broken = plugins["testgood"], plugins["testbroken"]
    assert good["status"] == "ok" and good["version"] == "0.1.0"
    assert good["backends"][0]["name"] == "testgood"
    assert good["backends"][0]["config"] == "engine_core_testplugin_good.config:GoodEngineConfig"
    assert broken["status"] == "failed" and broken["backends"] == []
    assert broken["error"] == "ModuleNotFoundError: No module named 'nonexistent_backend_lib'"
    assert broken["install_hint"] == "pip install engine-core-testplugin-broken"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"ENGINE_CORE_DISABLE_PLUGIN_AUTOLOAD": "1"}, {"builtin"}),
        ({"ENGINE_CORE_PLUGINS": "testbroken"}, {"builtin", "testbroken"}),
    ],
)
def test_env_settings_control_discovery(cli: Cli, env: dict[str, str], expected: set[str]) -> None:
    proc = cli(["plugins", "--json"], env)
    assert proc.returncode == 0, proc.stderr
    assert set(_json_plugins(proc.stdout)) == expected


def test_doctor_fails_on_broken_plugin(cli: Cli) -> None:
    proc = cli(["doctor"])
    assert proc.returncode == 1
    assert "plugin testbroken" in proc.stdout and "FAILED" in proc.stdout
    assert "testgood environment" in proc.stdout  # a plugin's own check ran


# -- in-process ----------------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("ENGINE_CORE_DISABLE_PLUGIN_AUTOLOAD", "ENGINE_CORE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    return monkeypatch


def test_plugins_in_process(clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    assert main(["plugins", "--json"]) == 0
    assert _json_plugins(capsys.readouterr().out)["builtin"]["backends"][0]["name"] == "reference"
    assert main(["plugins"]) == 0
    assert "engine:reference" in capsys.readouterr().out


def test_invalid_env_is_a_usage_error(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    clean_env.setenv("ENGINE_CORE_LOG_LEVEL", "LOUD")
    assert main(["plugins"]) == 2
    err = capsys.readouterr().err
    assert "ENGINE_CORE_LOG_LEVEL='LOUD'" in err and "allowed: DEBUG" in err


def test_no_subcommand_prints_help(capsys: pytest.CaptureFixture) -> None:
    assert main([]) == 2
    assert "plugins" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["no-such-command"])
    assert info.value.code == 2


def test_command_table_is_extensible(capsys: pytest.CaptureFixture) -> None:
    def run_hello(args: argparse.Namespace, settings: Settings) -> int:
        print(f"hello {args.who}")
        return 0

    def hello_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("who")

    commands = (*COMMANDS, Command("hello", "say hello", run_hello, hello_arguments))
    args = build_parser(commands).parse_args(["hello", "world"])
    assert commands[-1].run(args, Settings()) == 0
    assert capsys.readouterr().out == "hello world\n"


def test_doctor_reports_the_environment(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import torch

    assert main(["doctor"]) == 0  # what is missing here (CUDA, sglang) is optional
    out = capsys.readouterr().out
    assert torch.__version__ in out and "distributed: gloo" in out
    for line in ("engines", "rollouts", "library peft", "library vllm", "tested versions"):
        assert line in out
    if not torch.cuda.is_available():  # an optional check says missing and what to install
        assert "missing" in out and "pip install 'engine-core-sglang[gpu]'" in out


@pytest.mark.parametrize(
    ("command", "recipe", "other"),
    [("run", "text_tiny.yaml", "sft_tiny.yaml"), ("train", "sft_tiny.yaml", "text_tiny.yaml")],
)
def test_help_names_each_commands_default_recipe(
    command: str, recipe: str, other: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"the shipped {recipe}" in out and other not in out


@pytest.mark.parametrize(
    ("override", "loc", "suggestion", "valid"),
    [
        (
            "runner.total_steps=5",
            "runner",
            "'trainer' or 'steps' (for 'runner.total_steps')",
            "steps",
        ),
        ("trainer.temprature=0.7", "trainer.temprature", "'temperature'", "samples_per_prompt"),
        ("step=5", "step", "'steps'", "steps"),
        ("engine.micro_batch_sise=4", "engine.micro_batch_sise", "'micro_batch_size'", "seed"),
        ("engine.optim.lrr=1", "engine.optim.lrr", "'lr'", "weight_decay"),
    ],
)
def test_run_refuses_unknown_keys_with_suggestions(
    override: str,
    loc: str,
    suggestion: str,
    valid: str,
    tmp_path: Path,
    clean_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    clean_env.chdir(tmp_path)  # the recipe's output_dir is relative: no earlier run is found
    assert main(["run", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"engine-core run: error: {loc}: Unknown key; did you mean {suggestion}?")
    assert "Valid keys here: " in err and valid in err.split("Valid keys here: ")[1]


@pytest.mark.parametrize(
    ("overrides", "printed"),
    [
        (["steps=-1"], "steps: Input should be greater than 0 (received -1)"),
        (
            ["trainer.temperature=abc"],
            "trainer.temperature: Input should be a valid number, unable to parse string as a "
            "number (received 'abc')",
        ),
        (
            ["engine.optim.lr=x", "engine.micro_batch_size=0"],
            "2 problems:\n"
            "  - engine.optim.lr: Input should be a valid number, unable to parse string as a "
            "number (received 'x')\n"
            "  - engine.micro_batch_size: Input should be greater than 0 (received 0)",
        ),
    ],
)
def test_a_config_error_prints_the_sentence_without_pydantics_framing(
    overrides: list[str],
    printed: str,
    tmp_path: Path,
    clean_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """What the user wrote wrong, where (the dotted path) and what was received: no model
    name, error type, whole input mapping or documentation link around it."""
    clean_env.chdir(tmp_path)
    assert main(["run", *overrides]) == 2
    assert capsys.readouterr().err == f"engine-core run: error: {printed}\n"
    assert not (tmp_path / "outputs").exists()  # refused before any folder is made


def test_a_run_that_fails_after_it_started_is_one_line_and_a_logged_traceback(
    tmp_path: Path, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A failure after the run started (here: weights blown up by lr=1e30, so the rollout
    samples from NaN probabilities) exits 1, not 2, with one line on stderr saying what failed,
    where its traceback is, and what is safe; the traceback is in the run's log file."""
    out = tmp_path / "run"
    args = [f"output_dir={out}", "steps=3", "engine.optim.lr=1e30", "engine.optim.clip_grad=null"]
    assert main(["run", *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("engine-core run failed: ")
    assert f"traceback in {out / 'run.log'}" in err and "are kept" in err
    log = (out / "run.log").read_text()
    assert "Traceback (most recent call last)" in log and "engine-core run failed" in log


def test_the_core_command_line_knows_no_command_above_it() -> None:
    """``run`` and ``train`` are the jobs' (engine_core_roles.jobs.cli), added on top of the
    core's table (that no core module imports the roles is tests/test_layers.py's rule)."""
    assert {c.name for c in COMMANDS} == {"plugins", "doctor", "parity"}


def test_installed_distributions_add_commands_and_a_broken_one_is_named(cli: Cli) -> None:
    """The core's script takes subcommands from ``engine_core.commands`` entry points: the
    jobs' (``engine-core-roles``) and a test plugin's ``hello``; one whose module is missing is
    named in one warning line and the other commands still run."""
    listing = cli(["--help"])
    assert listing.returncode == 0, listing.stderr
    for name in ("plugins", "doctor", "parity", "run", "train", "hello"):
        assert f"    {name} " in listing.stdout, (name, listing.stdout)
    warnings = [line for line in listing.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("engine-core: warning: "), warnings
    assert "'testbroken'" in warnings[0] and "no_such_module" in warnings[0]
    hello = cli(["hello", "world"])
    assert (hello.returncode, hello.stdout) == (0, "hello world\n"), hello.stderr


def test_resume_reads_auto_and_leaves_the_recipe_and_overrides_alone() -> None:
    from engine_core.cli import build_parser
    from engine_core_roles.jobs.cli import COMMANDS, _recipe

    parser = build_parser(COMMANDS)
    grpo = str(RECIPES / "grpo_tiny.yaml")
    for argv, mode, steps in (
        (["run", "--resume", "steps=7"], "latest", 7),  # the documented `--resume steps=900`
        (["run", "--resume", "auto", "steps=7"], "auto", 7),
        (["run", "--resume", grpo, "steps=7"], "latest", 7),
        (["run", grpo, "steps=7", "--resume", "auto"], "auto", 7),
        (["run", "steps=7"], None, 7),
    ):
        args = parser.parse_args(argv)
        assert args.resume == mode, argv
        assert _recipe(args, "grpo_tiny.yaml")["steps"] == steps, argv


def test_a_sigint_python_drops_in_a_finalizer_still_ends_the_run_before_its_steps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A SIGINT that lands while a ``__del__`` runs loses its KeyboardInterrupt (Python prints
    'Exception ignored' and goes on); the job's stop handling, taking SIGINT over, still ends
    the run there: one line, exit 130, no step run."""
    import gc
    import os
    import signal

    from engine_core.cli import Command, main
    from engine_core.errors import EXIT_INTERRUPTED
    from engine_core_roles.jobs.stopping import StopRequests

    steps: list[int] = []
    # SIGINT handled as in a terminal, even where pytest was started with it ignored (a
    # non-interactive shell's background job), which the command rightly leaves ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    class Interrupted:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)  # handled here, inside the finalizer

    def run(args: Any, settings: Any) -> int:
        Interrupted()
        gc.collect()
        with StopRequests(["SIGINT"], None).installed():
            steps.append(1)
        return 0

    try:
        code = main(["start"], commands=[Command("start", "start a run", run)])
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert code == EXIT_INTERRUPTED and not steps, err
    assert err.strip().splitlines()[-1].startswith("engine-core start: interrupted (SIGINT)")
