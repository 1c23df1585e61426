"""Reading configs: YAML files, dotted command-line overrides, and nested validation errors.

Owns :func:`load_yaml` (a local path or an fsspec URL to a plain mapping), :func:`apply_overrides`
(``a.b.c=value`` strings applied to a copy) and :func:`prefix_validation_error` (a nested model's
pydantic errors re-raised with their full field path, e.g. ``engine.micro_batch_size``).
Validation itself belongs to the config models; this module only moves plain data around.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_core.core_schema import ErrorType

from engine_core.errors import ConfigError

__all__ = ["load_yaml", "apply_overrides", "prefix_validation_error"]

_BUILTIN_ERROR_TYPES = frozenset(get_args(ErrorType))


class _SafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads ``1e-4`` as a float, as YAML 1.2 does, not as a string."""


# YAML 1.1 floats need a dot ("1.0e-4"); learning rates are usually written "1e-4".
_SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _parse(text: str) -> Any:
    return yaml.load(text, Loader=_SafeLoader)  # safe: constructs plain data only


_OVERRIDE_FORM = "'dotted.key=value', e.g. 'engine.micro_batch_size=4'"


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a YAML file whose top level is a mapping; an empty file gives ``{}``.

    ``path`` is a local path or any URL fsspec understands (``s3://``, ``gs://``, ...).
    """
    text = _read_text(os.fspath(path))
    try:
        data = _parse(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of keys to values, got a "
            f"{type(data).__name__}; write the config as 'key: value' lines."
        )
    return data


def _read_text(path: str) -> str:
    if "://" in path:
        import fsspec  # only URLs need it

        try:
            with fsspec.open(path, "r", encoding="utf-8") as f:
                return str(f.read())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
    local = Path(path)
    if not local.is_file():
        what = "is a directory, not a file" if local.is_dir() else "not found"
        raise ConfigError(
            f"config file {what}: {path} (resolved to {local.resolve()}); pass the path of a "
            "YAML file."
        )
    return local.read_text(encoding="utf-8")


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b.c=value`` override applied in order.

    Values are parsed as YAML (safe loader): ``4`` is an int, ``1e-4`` a float, ``true`` a bool,
    ``[1,2]`` a list, ``null`` (or nothing after ``=``) is None; quote to force a string
    (``name='007'``). Missing intermediate
    mappings are created.
    """
    result: dict[str, Any] = copy.deepcopy(dict(data))
    for item in overrides:
        keys, value = _parse_override(item)
        node: dict[str, Any] = result
        for depth, key in enumerate(keys[:-1]):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                where = ".".join(keys[: depth + 1])
                raise ConfigError(
                    f"override {item!r}: {where!r} is a {type(child).__name__} "
                    f"({child!r}), not a mapping, so it has no key {keys[depth + 1]!r}. "
                    f"Set {where!r} itself, or fix the key."
                )
            node = child
        node[keys[-1]] = value
    return result


def _parse_override(item: str) -> tuple[list[str], Any]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r} has no '='; expected {_OVERRIDE_FORM}.")
    key, _, raw = item.partition("=")
    keys = key.strip().split(".")
    if not all(k.strip() for k in keys):
        raise ConfigError(
            f"override {item!r} has an empty key or key part; expected {_OVERRIDE_FORM}."
        )
    try:
        value = _parse(raw)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"override {item!r}: the value {raw!r} is not valid YAML ({e.__class__.__name__}); "
            "quote it, e.g. key='text'."
        ) from None
    return [k.strip() for k in keys], value


def prefix_validation_error(
    err: ValidationError, prefix: tuple[str | int, ...], title: str | None = None
) -> ValidationError:
    """Return ``err`` with every error location prefixed, e.g. ``engine.micro_batch_size``.

    A nested config validated on its own reports paths relative to itself; this restores the
    path the user wrote in the YAML file or on the command line.
    """
    details: list[InitErrorDetails] = []
    for e in err.errors():
        detail: InitErrorDetails
        if e["type"] in _BUILTIN_ERROR_TYPES:
            detail = {"type": e["type"], "loc": (*prefix, *e["loc"]), "input": e["input"]}
            if "ctx" in e:
                detail["ctx"] = e["ctx"]
        else:
            # A custom type cannot be rebuilt by name; carry its rendered message verbatim.
            detail = {
                "type": PydanticCustomError(e["type"], "{message}", {"message": e["msg"]}),
                "loc": (*prefix, *e["loc"]),
                "input": e["input"],
            }
        details.append(detail)
    return ValidationError.from_exception_data(title or err.title, details)
