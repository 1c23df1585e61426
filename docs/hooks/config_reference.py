"""The generated Markdown of the configuration reference and of the plugins' backend tables.

:func:`config_reference` renders ``config.md``'s tables: the pydantic models of the jobs, the
roles, the common engine and rollout fields, and the config class of every backend it is given.
:func:`backends_table` renders the table of one plugin's backends (``plugins/*.md``).

Both take the backends as a list of :class:`~engine_core.BackendSpec`, so the caller decides
which ones the docs show; ``generate.py`` passes those of the plugins shipped in this repository
and writes the result into the pages. A config class that fails to import is an error.
"""

from __future__ import annotations

import enum
import inspect
import types
import typing
from collections.abc import Iterable
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from engine_core import BackendKind, BackendSpec, EngineConfig, RolloutConfig, SamplingParams
from engine_core_roles import ActorConfig, CriticConfig
from engine_core_roles.data.tasks.digits import TaskConfig
from engine_core_roles.jobs.cli import DEFAULT_RL_RECIPE, DEFAULT_TRAIN_RECIPE
from engine_core_roles.jobs.rl.config import RLJobConfig
from engine_core_roles.jobs.sft import SFTJobConfig

__all__ = ["backends_table", "config_reference"]


# -- the configuration reference ---------------------------------------------------------------


class _Renderer:
    """Markdown for a set of models; each model gets one section, later mentions link to it."""

    def __init__(self, planned: Iterable[type[BaseModel]]) -> None:
        self.planned = set(planned)  # models that get a section of their own somewhere
        self.anchors: dict[type[BaseModel], str] = {}
        self.lines: list[str] = []

    def anchor(self, model: type[BaseModel]) -> str:
        return self.anchors.get(model) or model.__name__.lower()

    def section(
        self,
        model: type[BaseModel],
        *,
        title: str | None = None,
        anchor: str | None = None,
        intro: str = "",
        only: Iterable[str] | None = None,
    ) -> None:
        """A heading, the docstring, a field table, then nested models not documented elsewhere."""
        anchor = anchor or model.__name__.lower()
        self.anchors.setdefault(model, anchor)
        self.lines += [f"### {title or model.__name__} {{#{anchor}}}", ""]
        doc = model.__dict__.get("__doc__")  # the class's own, not an inherited one
        if doc:
            self.lines += [" ".join(inspect.cleandoc(doc).split()), ""]
        if intro:
            self.lines += [intro, ""]
        names = list(model.model_fields) if only is None else list(only)
        if names:
            self.lines += [*self.table(model, names), ""]
        for nested in _nested_models(model.model_fields[n] for n in names):
            if nested not in self.planned and nested not in self.anchors:
                self.section(nested)

    def table(self, model: type[BaseModel], names: list[str]) -> list[str]:
        rows = [
            "| field | type | default | constraints | description |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name in names:
            field = model.model_fields[name]
            cells = [
                f'<code class="config-field">{field.alias or name}</code>',
                self.type_of(field.annotation),
                _default(field),
                ", ".join(_constraints(field)),
                (field.description or "").replace("\n", " "),
            ]
            rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        return rows

    def type_of(self, annotation: Any) -> str:
        """The annotation as Markdown: code spans joined by ``|``, models linked."""
        return " | ".join(self._atoms(annotation))

    def _atoms(self, tp: Any) -> list[str]:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Annotated:
            return self._atoms(args[0])
        if origin in (typing.Union, types.UnionType):
            return [a for arg in args for a in self._atoms(arg)]
        if origin is typing.Literal:
            return [f"`{_value(v)}`" for v in args]
        if tp is type(None):
            return ["`None`"]
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return [f"`{_value(m)}`" for m in tp]
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return [f"[{tp.__name__}](#{self.anchor(tp)})"]
        if origin is not None:
            inner = ", ".join(_plain(a) for a in args)
            return [f"`{getattr(origin, '__name__', str(origin))}[{inner}]`"]
        return [f"`{_plain(tp)}`"]


def _plain(tp: Any) -> str:
    """A compact, link-free spelling of a type (inside a container)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _plain(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_plain(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(_value(v) for v in args)
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_plain(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _value(v: Any) -> str:
    if isinstance(v, enum.Enum):
        v = v.value
    return repr(v)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        fresh = type(value)()
        return "defaults" if value == fresh else f"`{value.model_dump(mode='json')!r}`"
    return f"`{_value(value)}`"


_BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "≤"),
)


def _constraints(field: FieldInfo) -> list[str]:
    """Bounds declared on the field or on the types it is built from (``PositiveInt``)."""
    metadata = list(field.metadata)
    stack = [field.annotation]
    while stack:
        tp = stack.pop()
        if typing.get_origin(tp) is typing.Annotated:
            metadata += typing.get_args(tp)[1:]
        stack += [a for a in typing.get_args(tp) if not isinstance(a, (str, int, float))]
    out: list[str] = []
    for m in metadata:
        for kind, attr, symbol in _BOUNDS:
            if isinstance(m, kind):
                out.append(f"{symbol} {getattr(m, attr)}")
        if isinstance(m, annotated_types.MinLen):
            out.append(f"at least {m.min_length} items")
        if isinstance(m, annotated_types.MaxLen):
            out.append(f"at most {m.max_length} items")
    return list(dict.fromkeys(out))


def _nested_models(fields: Iterable[FieldInfo]) -> list[type[BaseModel]]:
    found: list[type[BaseModel]] = []
    stack = [f.annotation for f in fields]
    while stack:
        tp = stack.pop(0)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp not in found:
                found.append(tp)
        else:
            stack += list(typing.get_args(tp))
    return found


def _own_fields(config: type[BaseModel], base: type[BaseModel]) -> list[str]:
    """Fields ``config`` adds to ``base`` or declares differently."""
    inherited = base.model_fields
    return [
        name
        for name, field in config.model_fields.items()
        if name not in inherited or repr(field) != repr(inherited[name])
    ]


def _by_config(
    specs: list[BackendSpec], kind: BackendKind
) -> list[tuple[type[BaseModel], list[BackendSpec]]]:
    """The backends of ``kind`` grouped by config class, in name order."""
    groups: dict[str, tuple[type[BaseModel], list[BackendSpec]]] = {}
    for spec in sorted((s for s in specs if s.kind is kind), key=lambda s: s.name):
        groups.setdefault(spec.config, (spec.load_config_class(), []))[1].append(spec)
    return list(groups.values())


def _backend_intro(
    specs: list[BackendSpec], base: type[BaseModel], base_anchor: str, own: bool
) -> str:
    lines = []
    for s in specs:
        caps = ", ".join(f"`{c}`" for c in sorted(map(str, s.capabilities))) or "none"
        where = f"plugin `{s.plugin}` ({s.distribution or 'engine-core'})"
        lines.append(f"- `{s.name}`, from {where}: {s.description} Capabilities: {caps}.")
    common = f"the common fields of [{base.__name__}](#{base_anchor})"
    lines += ["", f"Takes {common}, plus:" if own else f"Takes only {common}."]
    return "\n".join(lines)


def config_reference(specs: list[BackendSpec]) -> str:
    """The generated part of ``config.md``: jobs, roles, then every backend in ``specs``."""
    engines = _by_config(specs, BackendKind.ENGINE)
    rollouts = _by_config(specs, BackendKind.ROLLOUT)
    planned: list[type[BaseModel]] = [
        RLJobConfig,
        SFTJobConfig,
        TaskConfig,
        ActorConfig,
        CriticConfig,
        EngineConfig,
        RolloutConfig,
        SamplingParams,
    ]
    planned += [cls for cls, _ in engines + rollouts]
    r = _Renderer(planned)

    r.lines += ["## Jobs", ""]
    recipe = "`engine-core {}` (default recipe: `roles/engine_core_roles/recipes/{}`)."
    r.section(RLJobConfig, intro=recipe.format("run", DEFAULT_RL_RECIPE))
    r.section(SFTJobConfig, intro=recipe.format("train", DEFAULT_TRAIN_RECIPE))
    r.section(TaskConfig)

    r.lines += ["## Roles", ""]
    r.section(ActorConfig)
    r.section(CriticConfig, intro="The value function's update settings.")

    r.lines += ["## Engines", ""]
    r.section(EngineConfig, anchor="engineconfig")
    for cls, group in engines:
        _backend_section(r, cls, group, EngineConfig, "engine")

    r.lines += ["## Rollouts", ""]
    r.section(RolloutConfig, anchor="rolloutconfig")
    r.section(SamplingParams, intro="Passed to `BaseRollout.generate` with each call.")
    for cls, group in rollouts:
        _backend_section(r, cls, group, RolloutConfig, "rollout")
    return "\n".join(r.lines).rstrip("\n")


def _backend_section(
    r: _Renderer,
    cls: type[BaseModel],
    specs: list[BackendSpec],
    base: type[BaseModel],
    kind: str,
) -> None:
    names = ", ".join(f"`{s.name}`" for s in specs)
    own = _own_fields(cls, base)
    r.section(
        cls,
        title=f"{kind.capitalize()} {names}: {cls.__name__}",
        anchor=_anchor(specs[0]),
        intro=_backend_intro(specs, base, r.anchor(base), bool(own)),
        only=own,
    )


def _anchor(spec: BackendSpec) -> str:
    return f"{spec.kind}-{spec.name}"


# -- per-plugin backend tables -----------------------------------------------------------------


def backends_table(specs: list[BackendSpec], plugin: str, to_config: str) -> str:
    """The backends ``plugin`` registers: kind, name, capabilities, config, description.

    ``specs`` are all the backends the reference documents (its anchors are named after the
    first backend of each config class); ``to_config`` is the link to ``config.md``.
    """
    own = [s for s in specs if s.plugin == plugin]
    if not own:
        raise ValueError(
            f"plugin {plugin!r} registers no backends; plugins: {sorted({s.plugin for s in specs})}"
        )
    rows = [
        "| backend | kind | capabilities | config | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in own:
        caps = ", ".join(f"`{c}`" for c in sorted(map(str, s.capabilities)))
        config = s.config.rpartition(":")[2]
        first = min(
            (o for o in specs if o.kind is s.kind and o.config == s.config), key=lambda o: o.name
        )
        rows.append(
            f"| `{s.name}` | {s.kind} | {caps} | [{config}]({to_config}#{_anchor(first)}) "
            f"| {s.description} |"
        )
    return "\n".join(rows)
