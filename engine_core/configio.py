"""Reading configs: YAML files, dotted command-line overrides, and nested validation errors.

Owns :func:`load_yaml` (a local path or an fsspec URL to a plain mapping), :func:`apply_overrides`
(``a.b.c=value`` strings applied to a copy), :func:`prefix_validation_error` (a nested model's
pydantic errors re-raised with their full field path, e.g. ``engine.micro_batch_size``) and
:func:`explain_unknown_keys` (a refused key's error names the close matches and the valid keys)
and :func:`describe_validation_error` (the errors as the command line prints them: one line each,
``path: message``).
Validation itself belongs to the config models; this module only moves plain data around.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError, PydanticKnownError
from pydantic_core.core_schema import ErrorType

from engine_core.errors import ConfigError

__all__ = [
    "load_yaml",
    "apply_overrides",
    "prefix_validation_error",
    "explain_unknown_keys",
    "describe_validation_error",
]

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
    details = [_rebuild(e, (*prefix, *e["loc"])) for e in err.errors()]
    return ValidationError.from_exception_data(title or err.title, details)


def explain_unknown_keys(err: ValidationError, valid: Sequence[str]) -> ValidationError:
    """Return ``err`` with each unknown top-level key's error naming close matches in ``valid``.

    A config model calls this on its own validation error with its field names: an
    ``extra_forbidden`` error one level deep (a key of that model) gets a message like "unknown
    key; did you mean 'steps'? Valid keys here: ...". Keys of nested models are explained by
    those models, so their errors pass through unchanged. ``err`` itself is returned when it
    refuses no key.
    """
    errors = err.errors()
    if not any(_is_plain_unknown_key(e) for e in errors):
        return err
    details: list[InitErrorDetails] = []
    for e in errors:
        if _is_plain_unknown_key(e):
            message = _unknown_key_message(e["loc"][0], e["input"], valid)
            details.append(
                {
                    "type": PydanticCustomError(
                        "extra_forbidden", "{message}", {"message": message}
                    ),
                    "loc": e["loc"],
                    "input": e["input"],
                }
            )
        else:
            details.append(_rebuild(e, e["loc"]))
    return ValidationError.from_exception_data(err.title, details)


def _is_plain_unknown_key(e: ErrorDetails) -> bool:
    return e["type"] == "extra_forbidden" and len(e["loc"]) == 1 and _is_builtin_message(e)


def _unknown_key_message(key: str | int, value: Any, valid: Sequence[str]) -> str:
    # A mistyped section ("trainer.total_steps") is matched by its leaves too: the user meant a
    # key somewhere, and its last component is the likeliest to be right.
    wanted: list[tuple[str, str | None]] = [(str(key), None)]
    if isinstance(value, Mapping):
        wanted += [(path[-1], ".".join((str(key), *path))) for path in _leaf_paths(value)]
    hints: dict[str, str | None] = {}
    for name, written in wanted:
        for part in dict.fromkeys((name, name.rsplit(".", 1)[-1])):
            for match in difflib.get_close_matches(part, valid, n=3, cutoff=0.6):
                hints.setdefault(match, written)
    message = "Unknown key."
    if hints:
        options = " or ".join(
            repr(m) if written is None else f"{m!r} (for {written!r})"
            for m, written in hints.items()
        )
        message = f"Unknown key; did you mean {options}?"
    return f"{message} Valid keys here: {', '.join(valid) or '(none)'}."


def _leaf_paths(mapping: Mapping[Any, Any], limit: int = 20) -> list[tuple[str, ...]]:
    def walk(node: Mapping[Any, Any], path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
        for k, v in node.items():
            if isinstance(v, Mapping) and v:
                yield from walk(v, (*path, str(k)))
            else:
                yield (*path, str(k))

    return list(itertools.islice(walk(mapping, ()), limit))  # of a whole section, the first few


def _is_builtin_message(e: ErrorDetails) -> bool:
    """Whether ``e`` is a pydantic error type with pydantic's own message (rebuildable by name)."""
    if e["type"] not in _BUILTIN_ERROR_TYPES:
        return False
    try:
        return PydanticKnownError(e["type"], e.get("ctx")).message() == e["msg"]  # type: ignore[arg-type]
    except Exception:  # a context the type does not take: not pydantic's own error
        return False


def _rebuild(e: ErrorDetails, loc: tuple[str | int, ...]) -> InitErrorDetails:
    detail: InitErrorDetails
    if _is_builtin_message(e):
        detail = {"type": e["type"], "loc": loc, "input": e["input"]}
        if "ctx" in e:
            detail["ctx"] = e["ctx"]
    else:
        # A custom type or message cannot be rebuilt by name; carry its rendered message verbatim.
        detail = {
            "type": PydanticCustomError(e["type"], "{message}", {"message": e["msg"]}),
            "loc": loc,
            "input": e["input"],
        }
    return detail


# pydantic's prefixes on a validator's own message; the message itself is the sentence to show
_MESSAGE_PREFIXES = ("Value error, ", "Assertion failed, ")


def describe_validation_error(err: ValidationError) -> str:
    """The problems of ``err`` as a person reads them: one line per error, ``path: message``.

    pydantic's own rendering frames each message with the model's name, the error type, the
    whole input mapping and a link; this keeps the field's dotted path, the message, and the
    received value where the message does not already say it (a scalar, shortened).
    """
    lines = [_error_line(e) for e in err.errors()]
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} problems:\n" + "\n".join(f"  - {line}" for line in lines)


def _error_line(e: ErrorDetails) -> str:
    message = e["msg"]
    for prefix in _MESSAGE_PREFIXES:
        if message.startswith(prefix):
            message = message[len(prefix) :]
            break
    received = e.get("input")
    if (
        e["type"] not in ("value_error", "assertion_error", "extra_forbidden", "missing")
        and _is_builtin_message(e)
        and isinstance(received, (str, int, float, bool))
    ):
        shown = repr(received)
        message += f" (received {shown if len(shown) <= 60 else shown[:57] + '...'})"
    path = ".".join(str(part) for part in e["loc"])
    return f"{path}: {message}" if path else message
