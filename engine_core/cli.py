"""The ``engine-core`` command line: its parser, its exit codes, and the core's own commands.

A subcommand is one small function ``(args, settings) -> exit code`` plus an optional function
adding its arguments, described by a :class:`Command`. :data:`COMMANDS` holds the core's
(``plugins``, ``doctor``, ``parity``). A distribution above the core adds its own through the
``engine_core.commands`` entry-point group, each entry a sequence of :class:`Command` (the jobs'
``run`` and ``train``: ``jobs = "engine_core_roles.jobs.cli:COMMANDS"``), so the core names nothing
above it and imports only point down.

Exit codes: 0 success; 1 the command ran and found a problem (``doctor``, a ``parity`` FAIL)
or a run failed after it started (one line says what failed and what is still safe; the
traceback is in the run's ``run.log``); 2 bad usage, config or environment (the message says
what to fix); 3 a run stopped on request (a stop signal such as SIGTERM, or its wall-time limit)
after writing a checkpoint: rerun the same command with ``--resume auto`` to continue. ``engine-core plugins`` exits 0 even when some
plugins failed to load: the listing is informational and shows each failure with its fix.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from rich.text import Text

from engine_core import __version__
from engine_core.configio import describe_validation_error
from engine_core.errors import (
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    EngineCoreError,
    RunFailed,
    RunStopped,
)
from engine_core.plugins import PluginInfo, load_plugins
from engine_core.settings import Settings

__all__ = ["COMMAND_GROUP", "COMMANDS", "Command", "build_parser", "installed_commands", "main"]

COMMAND_GROUP = "engine_core.commands"
"""The entry-point group through which installed distributions add subcommands."""


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, its runner and its arguments."""

    name: str
    help: str
    run: Callable[[argparse.Namespace, Settings], int]
    add_arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments


# -- engine-core plugins -------------------------------------------------------------------------


def _plugins_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def run_plugins(args: argparse.Namespace, settings: Settings) -> int:
    """List every discovered plugin, its backends and capabilities, and any load failure."""
    infos = load_plugins(settings).plugins()
    if args.json:
        sys.stdout.write(json.dumps({"plugins": [p.to_dict() for p in infos]}, indent=2) + "\n")
        return 0
    console = Console()
    console.print(_plugins_table(infos))
    failed = [p for p in infos if p.status == "failed"]
    summary = f"{len(infos)} plugin(s), {len(failed)} failed to load."
    if failed:
        summary += " Their backends cannot be selected until fixed; see the hints above."
    console.print(Text(summary))
    return 0  # informational even with failures; `engine-core doctor` exits 1 on problems


def _plugins_table(infos: Sequence[PluginInfo]) -> Table:
    table = Table(title="engine-core plugins", show_lines=True)
    for column in ("plugin", "distribution", "version", "status", "registered / error"):
        table.add_column(column, overflow="fold")
    for p in infos:
        if p.status == "ok":
            status = Text("ok", style="green")
            lines = [
                f"{b.kind}:{b.name}  [{', '.join(sorted(map(str, b.capabilities)))}]"
                for b in p.backends
            ] + [
                f"{a.kind}:{a.name}"
                + (f"  (needs {', '.join(sorted(a.needs))})" if a.needs else "")
                for a in p.algorithms
            ]
            detail = Text("\n".join(lines) or "(registered no backends)")
        else:
            status = Text("failed", style="bold red")
            detail = Text(f"{p.error}\nfix: {p.install_hint}", style="red")
        table.add_row(p.name, p.distribution or p.source, p.version or "-", status, detail)
    return table


# -- engine-core doctor --------------------------------------------------------------------------


def run_doctor(args: argparse.Namespace, settings: Settings) -> int:
    """The core's environment checks and every plugin's; exit 1 if a required one failed."""
    from engine_core.doctor import environment_checks

    del args
    manager = load_plugins(settings)
    checks = environment_checks(manager) + manager.doctor_checks()
    table = Table(title="engine-core doctor", show_lines=True)
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for c in checks:
        if c.ok:
            status = Text("ok", style="green")
        elif c.optional:
            status = Text("missing", style="yellow")
        else:
            status = Text("FAILED", style="bold red")
        table.add_row(Text(c.name), status, Text(c.detail), Text("" if c.ok else c.hint))
    Console().print(table)
    failed = [c.name for c in checks if not c.ok and not c.optional]
    if failed:
        Console().print(f"[bold red]{len(failed)} required check(s) failed:[/] {', '.join(failed)}")
    return 1 if failed else 0


# -- engine-core parity --------------------------------------------------------------------------


def _parity_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "backends", nargs="+", metavar="BACKEND", help="engines; the first is the baseline"
    )
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    parser.add_argument(
        "--world-size", type=int, default=2, help="gloo processes per backend (default 2)"
    )
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--rtol", type=float, default=1e-5, help="loss / grad-norm tolerance")
    parser.add_argument("--atol-logprob", type=float, default=1e-5, help="log-prob tolerance")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shared initial weights")
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write every figure as JSON to PATH; an existing file is refused unless "
        "--overwrite is given",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --json file")


def run_parity_command(args: argparse.Namespace, settings: Settings) -> int:
    """Same model, data and steps through several engines; a table and a verdict."""
    from engine_core.parity import claim_report_path, print_report, run_parity, write_report

    if args.json:  # refused before any model is built, not after the run
        claim_report_path(args.json, overwrite=args.overwrite)
    report = run_parity(
        args.backends,
        steps=args.steps,
        world_size=args.world_size,
        micro_batch_size=args.micro_batch_size,
        rtol=args.rtol,
        atol_log_prob=args.atol_logprob,
        seed=args.seed,
    )
    print_report(report, Console())
    if args.json:
        write_report(report, args.json, overwrite=args.overwrite)
    return 0 if report.passed else 1


COMMANDS: tuple[Command, ...] = (
    Command(
        "plugins",
        "list installed plugins, their backends and failures",
        run_plugins,
        _plugins_arguments,
    ),
    Command("doctor", "check the environment every installed plugin needs", run_doctor),
    Command(
        "parity",
        "run the same model, data and steps through several engines and compare",
        run_parity_command,
        _parity_arguments,
    ),
)


def installed_commands() -> tuple[list[Command], list[str]]:
    """The core's commands plus those of every ``engine_core.commands`` entry point.

    Returns the commands and one sentence per entry point that failed to load or to provide
    commands; a failure leaves the other commands usable. A name already taken is refused.
    """
    import importlib.metadata as md

    commands, problems = list(COMMANDS), []
    for ep in sorted(md.entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        try:
            provided = list(ep.load())
            if not all(isinstance(c, Command) for c in provided):
                raise TypeError("it is not a sequence of engine_core.cli.Command")
        except Exception as e:  # a broken distribution must not break the core's commands
            problems.append(
                f"the commands of {ep.name!r} ({ep.value}) failed to load: {e}; reinstall "
                "the distribution that provides them or uninstall it"
            )
            continue
        taken = {c.name for c in commands}
        for command in provided:
            if command.name in taken:
                problems.append(
                    f"{ep.name!r} ({ep.value}) offers a command {command.name!r} that another "
                    "already has; it is ignored"
                )
            else:
                commands.append(command)
    return commands, problems


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per entry of ``commands``."""
    parser = argparse.ArgumentParser(
        prog="engine-core",
        description="Run RL post-training code on any training and generation backend.",
        epilog="Environment: ENGINE_CORE_DISABLE_PLUGIN_AUTOLOAD, ENGINE_CORE_PLUGINS, "
        "ENGINE_CORE_LOG_LEVEL (see engine_core.settings).",
    )
    parser.add_argument("--version", action="version", version=f"engine-core {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in commands:
        command.add_arguments(sub.add_parser(command.name, help=command.help))
    return parser


def main(argv: Sequence[str] | None = None, commands: Sequence[Command] | None = None) -> int:
    """Run one of ``commands`` with ``argv``; returns the exit code.

    ``commands`` defaults to :func:`installed_commands`: the core's own plus every installed
    distribution's (the jobs' ``run`` and ``train`` when ``engine-core-roles`` is installed).
    A SIGINT outside a job's steps (a job's steps stop on it with a checkpoint, exit 3) is one
    line and :data:`~engine_core.errors.EXIT_INTERRUPTED`.
    """
    try:
        with _sigint_noted():
            return _main(argv, commands)
    except KeyboardInterrupt:
        sys.stderr.write(
            f"{_command_name}: interrupted (SIGINT) while it started or finished, outside its "
            f"steps; every checkpoint already committed is whole (rerun with --resume auto to "
            f"continue from the newest).\n"
        )
        return EXIT_INTERRUPTED


_command_name = "engine-core"
_sigint_seen = False


def sigint_seen() -> bool:
    """Whether a SIGINT reached this command since it started. Python drops the
    ``KeyboardInterrupt`` of a SIGINT that lands while a finalizer (``__del__``) runs, so a job
    taking SIGINT over for its steps asks this first (:func:`raise_if_interrupted`)."""
    return _sigint_seen


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` if a SIGINT reached this command (:func:`sigint_seen`)."""
    if _sigint_seen:
        raise KeyboardInterrupt


def _on_sigint(signum: int, frame: object) -> None:
    global _sigint_seen
    _sigint_seen = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigint_noted() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` as by default, and is noted (:func:`sigint_seen`),
    inside the block; on the main thread, unless SIGINT is ignored."""
    global _sigint_seen, _command_name
    _sigint_seen, _command_name = False, "engine-core"
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(
        signal.SIGINT
    ) in (signal.SIG_IGN, None):
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    hook = sys.unraisablehook

    def quiet_interrupts(unraisable: Any) -> None:
        # the KeyboardInterrupt of a SIGINT that landed in a finalizer: noted, it ends the run
        # at the next check (raise_if_interrupted) in one line; not a traceback on stderr
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            hook(unraisable)

    sys.unraisablehook = quiet_interrupts
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = hook
        _sigint_seen = False


def _main(argv: Sequence[str] | None, commands: Sequence[Command] | None) -> int:
    global _command_name
    if commands is None:
        commands, problems = installed_commands()
        for problem in problems:
            sys.stderr.write(f"engine-core: warning: {problem}\n")
    parser = build_parser(commands)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    command = {c.name: c for c in commands}[args.command]
    _command_name = f"engine-core {command.name}"
    return _run(command, args)


def _run(command: Command, args: argparse.Namespace) -> int:
    """``command`` on its parsed ``args``: its exit code, each failure one line."""
    try:
        settings = Settings.from_env()
        settings.configure_logging()
        return command.run(args, settings)
    except RunFailed as e:
        sys.stderr.write(f"{e}\n")
        return 1
    except RunStopped as e:
        sys.stderr.write(f"{e}\n")
        return EXIT_STOPPED
    except ValidationError as e:
        sys.stderr.write(f"engine-core {command.name}: error: {describe_validation_error(e)}\n")
        return 2
    except EngineCoreError as e:
        sys.stderr.write(f"engine-core {command.name}: error: {e}\n")
        return 2


if __name__ == "__main__":
    # Run as the importable module, not as __main__: installed commands are instances of
    # engine_core.cli.Command, which this file's __main__ copy would not recognise.
    from engine_core import cli as _cli

    raise SystemExit(_cli.main())
