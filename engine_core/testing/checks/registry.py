"""The kit's check registry: what a check is, which checks an engine gets, and how one process
run gathers their raw results.

A :class:`Check` is registered beside the contract tests that read its result (one module per
concern in :mod:`engine_core.testing.checks`), with the layout it runs in and the capabilities
it needs. :func:`run_layout` runs, in one process of a layout, every registered check whose
needs the engine declares; an exception in one check is recorded as its result, not raised,
so each contract test fails with its own message. A test reads its check's result through the
same object (:func:`engine_core.testing.checks.verdict.result`), never through a typed key.
"""

from __future__ import annotations

import enum
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine_core.capabilities import Capability

__all__ = [
    "ERROR",
    "Check",
    "Context",
    "Layout",
    "Registry",
    "context_of",
]

ERROR = "error"  # a check that raised: its result is {ERROR: the traceback}


class Layout(enum.Enum):
    """The process layouts the kit runs an engine in (one process run each)."""

    SINGLE = "one rank in a one-rank process group"
    TWO = "two ranks, one DP rank each"
    PLAIN = "one plain process without a process group"


@dataclass(frozen=True)
class Context:
    """What a check runs on: the backend, its declared capabilities and the kit's saved
    models (a policy, a critic with a value head) and a folder for what it writes."""

    backend: str
    caps: frozenset[Capability]
    policy_dir: str
    critic_dir: str
    root: str

    @property
    def policy(self) -> dict[str, Any]:
        return {"path": self.policy_dir}

    @property
    def critic(self) -> dict[str, Any]:
        return {"path": self.critic_dir, "value_head": True}


@dataclass(frozen=True)
class Check:
    """One check run inside the engine's processes: ``run(context)`` returns its raw result.

    ``needs``: it runs only on engines that declare all of these; ``unless``: only on engines
    that declare none of these. ``always``: it runs whatever ``--engine-core-kit-only`` selects
    (a fact about the process, not a check of the engine)."""

    name: str
    layout: Layout
    run: Callable[[Context], Any]
    needs: frozenset[Capability] = field(default_factory=frozenset)
    unless: frozenset[Capability] = field(default_factory=frozenset)
    always: bool = False

    def applies(self, caps: frozenset[Capability]) -> bool:
        """Whether an engine declaring ``caps`` gets this check."""
        return self.needs <= caps and not self.unless & caps


class Registry:
    """The registered checks, in run order; a name is unique within its layout (a process's
    results are keyed by it)."""

    def __init__(self, checks: Iterable[Check]) -> None:
        self._checks: tuple[Check, ...] = tuple(checks)
        seen: dict[tuple[Layout, str], Check] = {}
        for check in self._checks:
            key = (check.layout, check.name)
            if key in seen:
                raise ValueError(
                    f"two kit checks of layout {check.layout.name} are named {check.name!r} "
                    f"({seen[key].run} and {check.run}); give each its own name."
                )
            seen[key] = check

    def __iter__(self) -> Any:
        return iter(self._checks)

    def select(
        self, layout: Layout, caps: frozenset[Capability], only: tuple[str, ...] = ()
    ) -> list[Check]:
        """The checks of ``layout`` an engine declaring ``caps`` gets; with ``only``, those
        whose name starts with one of its prefixes (and those that always run)."""
        return [
            c
            for c in self._checks
            if c.layout is layout
            and c.applies(caps)
            and (not only or c.always or c.name.startswith(only))
        ]

    def run_layout(
        self, layout: Layout, context: Context, only: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """Every selected check's raw result, by check name (a check that raised:
        ``{ERROR: traceback}``)."""
        results: dict[str, Any] = {}
        for check in self.select(layout, context.caps, only):
            try:
                results[check.name] = check.run(context)
            except Exception:  # one broken check must not hide the others
                results[check.name] = {ERROR: traceback.format_exc()}
        return results


def context_of(backend: str, caps: frozenset[Capability], paths: Mapping[str, str]) -> Context:
    """The context of the kit's process arguments (the saved models' folders, the checkpoint
    root)."""
    return Context(
        backend=backend,
        caps=caps,
        policy_dir=paths["policy_dir"],
        critic_dir=paths["critic_dir"],
        root=paths["checkpoint_root"],
    )
