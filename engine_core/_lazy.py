"""Names a package exports, imported on first use (PEP 562): the package's ``__getattr__`` and
``__dir__``, made once here for every lazy package of the project."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any], hint: str = ""
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose public ``exports`` map each name to
    the module defining it; a name looked up once is kept in ``namespace`` (the package's
    ``globals()``), so later lookups skip ``__getattr__``. ``hint`` ends the message of an
    unknown name."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}{hint}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(namespace["__all__"])

    return __getattr__, __dir__
