"""Errors raised in a worker, carried to the driver as plain data and raised there again.

A worker never sends an exception object (nothing this project reads from a pipe or a socket
is unpickled as an exception): it sends :func:`error_payload`, a dict of strings, numbers and
lists: the exception's qualified class name, its message, its args when they are plain, and
its formatted traceback. The driver turns the failures of one call into one exception with
:func:`worker_failure`:

* a class of the engine-core error hierarchy (:mod:`engine_core.errors`) or a Python builtin
  exception is looked up by name in an allow-list, never imported, and the error is raised as
  that class: ``except ValueError`` / ``except WeightSyncError`` catch it, and its ``args``
  are the worker's. It is also a :class:`DispatchError` (as every worker failure was before),
  and its message is the executor's, naming the worker: ``worker 1 raised in 'sync':
  WeightSyncError: checksum mismatch ...``;
* any other class (one defined by the worker's code, a third-party library's), or one whose
  constructor takes other arguments, arrives as a plain :class:`DispatchError` with the same
  message, which names the remote type.

In both cases ``__cause__`` is a :class:`RemoteTraceback` whose text is the worker's
traceback, so Python prints it above the error ("The above exception was the direct cause
...").
"""

from __future__ import annotations

import builtins
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_core.errors import DispatchError, EngineCoreError

__all__ = [
    "RemoteTraceback",
    "WorkerErrorInfo",
    "error_payload",
    "rebuild_error",
    "worker_failure",
]

_PLAIN = (str, int, float, type(None))  # bool is an int


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, as text (its ``str``); the
    ``__cause__`` of the error the driver raises for it."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def error_payload(exc: BaseException) -> dict[str, Any]:
    """What a worker sends for ``exc``: plain, JSON-able data only (never the object)."""
    try:
        message = str(exc)
    except Exception:  # a __str__ that raises
        message = f"<unprintable {type(exc).__name__}>"
    args = list(exc.args) if all(isinstance(a, _PLAIN) for a in exc.args) else None
    if isinstance(exc, OSError) and exc.filename is not None and args is not None:
        # the file names are not in args; OSError(errno, strerror, filename, winerror, filename2)
        names = [exc.filename] + ([None, exc.filename2] if exc.filename2 is not None else [])
        if all(isinstance(a, _PLAIN) for a in names):
            args = [exc.errno, exc.strerror, *names]
    try:
        text = "".join(traceback.format_exception(exc))
    except Exception:
        text = f"{type(exc).__name__}: {message}\n(its traceback could not be formatted)\n"
    return {"type": _qualified_name(type(exc)), "message": message, "args": args, "traceback": text}


@dataclass(frozen=True)
class WorkerErrorInfo:
    """A worker's :func:`error_payload`, checked field by field (it came from another process)."""

    type: str
    message: str
    args: tuple[str | int | float | None, ...] | None
    traceback: str

    @classmethod
    def parse(cls, payload: object) -> WorkerErrorInfo:
        if not isinstance(payload, Mapping):  # not a payload: keep its text, type unknown
            return cls("", str(payload), None, str(payload))
        name, message, tb = (payload.get(k) for k in ("type", "message", "traceback"))
        args = payload.get("args")
        plain_args = (
            tuple(args)
            if isinstance(args, (list, tuple)) and all(isinstance(a, _PLAIN) for a in args)
            else None
        )
        return cls(
            name if isinstance(name, str) else "",
            message if isinstance(message, str) else "",
            plain_args,
            tb if isinstance(tb, str) else "",
        )

    def describe(self) -> str:
        """``Type: message``, as a traceback's last line says it (builtins unqualified)."""
        name = self.type.removeprefix("builtins.") or "an exception of unknown type"
        return f"{name}: {self.message}" if self.message else name


def _allowed_classes() -> dict[str, type[Exception]]:
    """The classes a worker's error may be raised as, by qualified name: Python's builtin
    exceptions, and the engine-core hierarchy's classes defined in engine_core (as far as this
    process has imported them; nothing is imported here)."""
    allowed: dict[str, type[Exception]] = {}
    for value in vars(builtins).values():
        if isinstance(value, type) and issubclass(value, Exception):
            allowed[_qualified_name(value)] = value
    stack: list[type] = [EngineCoreError]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if getattr(cls, "_worker_error_of", None) is not None:  # one made by _typed_class
            continue
        if cls.__module__ == "engine_core" or cls.__module__.startswith("engine_core."):
            allowed[_qualified_name(cls)] = cls
    return allowed


class _WorkerErrorMixin:
    """The part of a rebuilt worker error that is not its remote class's."""

    _worker_error_of: type[Exception]  # the remote class
    summary: str  # the executor's message, naming the worker
    worker: int  # the index of the worker whose error this is
    remote_type: str  # the remote class's qualified name
    remote_message: str  # str() of the exception in the worker

    def __str__(self) -> str:
        summary = self.__dict__.get("summary")
        return summary if isinstance(summary, str) else super().__str__()

    def __reduce__(self) -> tuple[Any, ...]:  # picklable by value, like the remote class
        args = self.args  # type: ignore[attr-defined]
        return (
            _reraised,
            (self._worker_error_of, args, self.summary, self.worker, self.remote_message),
        )


_TYPED: dict[type[Exception], type[Exception]] = {}


def _typed_class(cls: type[Exception]) -> type[Exception]:
    """``cls`` as a worker error: a subclass of both ``cls`` and :class:`DispatchError`, named
    like ``cls`` (tracebacks and ``type(e).__name__`` say ``ValueError``, not a new name)."""
    if cls not in _TYPED:
        bases = (_WorkerErrorMixin, cls) + (
            () if issubclass(cls, DispatchError) else (DispatchError,)
        )
        typed = type(cls.__name__, bases, {"_worker_error_of": cls, "__module__": cls.__module__})
        typed.__qualname__ = cls.__qualname__
        typed.__doc__ = f"{cls.__qualname__} raised in a worker (also a DispatchError)."
        _TYPED[cls] = typed
    return _TYPED[cls]


def _reraised(
    cls: type[Exception], args: tuple[Any, ...], summary: str, worker: int, message: str
) -> Exception:
    error = _typed_class(cls)(*args)
    _label(error, summary, worker, _qualified_name(cls), message)
    return error


def _label(error: BaseException, summary: str, worker: int, remote_type: str, message: str) -> None:
    error.summary = summary  # type: ignore[attr-defined]
    error.worker = worker  # type: ignore[attr-defined]
    error.remote_type = remote_type  # type: ignore[attr-defined]
    error.remote_message = message  # type: ignore[attr-defined]


def rebuild_error(info: WorkerErrorInfo, summary: str, worker: int) -> Exception:
    """The driver's exception for worker ``worker``'s error ``info``; ``summary`` is its message.

    Raised as the remote class when that class is allow-listed and, built from the worker's
    args (or else from its message alone), says the same message; else a DispatchError.
    Neither the name nor anything else in ``info`` is ever imported or evaluated.
    """
    cls = _allowed_classes().get(info.type)
    if cls is not None:
        for args in ([info.args] if info.args is not None else []) + [(info.message,)]:
            try:
                error = _typed_class(cls)(*args)
                # the remote class's own str() of these args: the worker's message, or no match
                same = cls.__str__(error) == info.message
            except Exception:  # a constructor with other arguments, an MRO it cannot join, ...
                continue
            if same:
                _label(error, summary, worker, info.type, info.message)
                return error
    generic = DispatchError(summary)
    _label(generic, summary, worker, info.type, info.message)
    return generic


def worker_failure(
    summary: str,
    raised: Mapping[int, object],
    *,
    method: str,
    typed: bool = True,
) -> BaseException:
    """The one exception for a call that failed on some workers.

    ``summary``: the executor's message (every failure of the call, one per worker).
    ``raised``: each worker's :func:`error_payload`, by worker index, first to arrive first;
    the first is raised as its class (see :func:`rebuild_error`) when ``typed`` (False when a
    worker died: that death, not what its peers raised waiting for it, is the failure).
    Every remote traceback becomes the ``__cause__``.
    """
    infos = {i: WorkerErrorInfo.parse(p) for i, p in raised.items()}
    if not infos:
        return DispatchError(summary)
    first = next(iter(infos))
    if typed:
        error: BaseException = rebuild_error(infos[first], summary, first)
    else:
        error = DispatchError(summary)
    error.__cause__ = RemoteTraceback(
        "\n".join(
            f"worker {i}, in {method!r}:\n{info.traceback.rstrip()}\n" for i, info in infos.items()
        )
    )
    return error
