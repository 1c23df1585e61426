"""Reward functions over text: named by import path, called per sample or per batch, checked.

A reward function scores one sample as ``fn(prompt, response, **row) -> float | dict``:

- ``prompt``: the prompt as the model read it, ``tokenizer.decode(prompt_ids)`` with special
  tokens kept (a chat prompt shows its template's markers);
- ``response``: what the model wrote, ``tokenizer.decode(response_ids,
  skip_special_tokens=True)`` of the sampled tokens, the stop token excluded;
- ``row``: the dataset row's other columns (the prompt column aside), plus ``prompt_ids`` and
  ``response_ids`` (lists of ints, the response's without padding).

It returns a float, or a dict of named numbers: its ``score`` when it has one, else the sum of
its entries; each entry is logged as ``reward/<name>``. With ``batched: true`` the function
takes lists instead (``fn(prompts, responses, **columns)``, every keyword a list with one entry
per sample) and returns a list. :data:`BUILTINS` names the shipped ones (``exact_match``,
``math_answer``, ``format``); :func:`load_function` resolves ``"pkg.module:function"`` or
``"path/to/file.py:function"``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from engine_core.config import FrozenModel
from engine_core.errors import ConfigError

__all__ = [
    "BUILTINS",
    "RewardConfig",
    "RewardError",
    "Scored",
    "exact_match",
    "extract_answer",
    "format_reward",
    "load_function",
    "math_answer",
    "normalize_answer",
    "score_samples",
]


class RewardError(RuntimeError):
    """A reward function failed on a sample (raised, returned NaN, the wrong type or count)."""


class RewardConfig(FrozenModel):
    """Which function scores the samples, and how it is called."""

    fn: str = Field(
        "math_answer",
        description="A built-in (exact_match, math_answer, format) or an import path: "
        "'pkg.module:function', or 'path/to/file.py:function'.",
    )
    batched: bool = Field(
        False, description="Call fn once per step with lists (one entry per sample)."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments passed on every call."
    )
    success_threshold: float = Field(
        1.0,
        description="A sample counts as solved (pass@k) when its score is at least this.",
    )

    @field_validator("fn")
    @classmethod
    def _spec_shape(cls, v: str) -> str:
        if v not in BUILTINS and ":" not in v:
            raise ValueError(
                f"reward.fn={v!r} is neither a built-in ({', '.join(sorted(BUILTINS))}) nor an "
                f"import path; write 'pkg.module:function' or 'path/to/file.py:function'."
            )
        return v


# -- resolving a function ------------------------------------------------------------------------


def load_function(spec: str, *, what: str = "reward.fn") -> Callable[..., Any]:
    """The callable ``spec`` names: a built-in, ``"pkg.module:function"`` or
    ``"path/to/file.py:function"``; a :class:`ConfigError` saying which part did not resolve."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ConfigError(
            f"{what}={spec!r}: write 'pkg.module:function' or 'path/to/file.py:function'."
        )
    if target.endswith(".py") or "/" in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise ConfigError(f"{what}={spec!r}: no file {path}; give an existing .py file.")
        module_name = f"_engine_core_reward_{abs(hash(str(path.resolve())))}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ConfigError(f"{what}={spec!r}: {path} cannot be imported as a Python module.")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(module_name, None)
            raise ConfigError(
                f"{what}={spec!r}: importing {path} failed: {type(e).__name__}: {e}"
            ) from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ConfigError(
                f"{what}={spec!r}: module {target!r} cannot be imported ({e}); install it or "
                f"put its folder on PYTHONPATH, or give 'path/to/file.py:{name}'."
            ) from e
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(
            f"{what}={spec!r}: {target} has no {name!r}; its functions: "
            f"{', '.join(public[:12]) or 'none'}."
        )
    if not callable(fn):
        raise ConfigError(
            f"{what}={spec!r}: {target}.{name} is a {type(fn).__name__}, not a function."
        )
    return fn  # type: ignore[no-any-return]


# -- calling it ----------------------------------------------------------------------------------


@dataclass
class Scored:
    """One step's scores: one per sample, the logged components (means over the samples that
    returned them), and the reason of each sample that failed (empty when none did)."""

    scores: list[float]
    components: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def _as_score(value: Any) -> tuple[float, dict[str, float]]:
    """A float, or a dict of numbers (its ``score``, else the sum); TypeError otherwise."""
    if isinstance(value, Mapping):
        parts: dict[str, float] = {}
        for key, v in value.items():
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise TypeError(f"returned a dict whose {key!r} is {type(v).__name__}")
            parts[str(key)] = float(v)
        if not parts:
            raise TypeError("returned an empty dict")
        score = parts["score"] if "score" in parts else sum(parts.values())
        return score, {k: v for k, v in parts.items() if k != "score"}
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:  # numpy and torch scalars
            import numbers

            if isinstance(value, numbers.Real) or hasattr(value, "item"):
                return float(value), {}
        except (TypeError, ValueError):
            pass
        raise TypeError(f"returned {type(value).__name__} ({str(value)[:40]!r})")
    return float(value), {}


def score_samples(
    fn: Callable[..., Any],
    name: str,
    prompts: Sequence[str],
    responses: Sequence[str],
    columns: Mapping[str, Sequence[Any]],
    *,
    batched: bool = False,
    kwargs: Mapping[str, Any] | None = None,
) -> Scored:
    """Call ``fn`` on every sample (or once with lists) and check what it returns.

    ``columns`` holds one list per keyword (a value per sample). A sample whose call raises,
    or that scores NaN/inf or a non-number, is a failure naming the sample and ``name``; a
    batched call returning the wrong count fails every sample.
    """
    n = len(prompts)
    extra = dict(kwargs or {})
    scores = [math.nan] * n
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    failures: list[str] = []

    def take(i: int, value: Any) -> None:
        if type(value) is float and math.isfinite(value):  # the common case, checked cheaply
            scores[i] = value
            return
        try:
            score, parts = _as_score(value)
        except TypeError as e:
            failures.append(
                f"reward function {name} {e} for sample {i}; return a float, or a dict of "
                f"numbers (every entry a number)"
            )
            return
        if not math.isfinite(score):
            failures.append(
                f"reward function {name} returned {score} for sample {i} (response "
                f"{responses[i][:60]!r}); return a finite number"
            )
            return
        scores[i] = score
        for k, v in parts.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1

    if batched:
        try:
            out = fn(
                list(prompts), list(responses), **{k: list(v) for k, v in columns.items()}, **extra
            )
        except Exception as e:
            failures.append(f"reward function {name} raised {type(e).__name__}: {e} (batched call)")
            return Scored(scores, {}, failures)
        if isinstance(out, str | bytes | Mapping) or not hasattr(out, "__len__") or len(out) != n:
            got = (
                len(out)
                if hasattr(out, "__len__") and not isinstance(out, str | bytes)
                else type(out).__name__
            )
            failures.append(
                f"reward function {name} (batched) returned {got} for {n} samples; return a "
                f"list with one score per sample"
            )
            return Scored(scores, {}, failures)
        for i, value in enumerate(out):
            take(i, value)
    else:
        names = list(columns)
        for i, values in enumerate(zip(*columns.values(), strict=True) if names else [()] * n):
            try:
                value = fn(
                    prompts[i], responses[i], **dict(zip(names, values, strict=True)), **extra
                )
            except Exception as e:
                failures.append(
                    f"reward function {name} raised {type(e).__name__}: {e} on sample {i} "
                    f"(response {responses[i][:60]!r})"
                )
                continue
            take(i, value)
    return Scored(scores, {k: sums[k] / counts[k] for k in sums}, failures)


def accepts(fn: Callable[..., Any], keywords: Sequence[str]) -> list[str]:
    """The ``keywords`` that ``fn``'s signature cannot take (empty when it takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return []
    names = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return [k for k in keywords if k not in names]


# -- built-ins -----------------------------------------------------------------------------------

_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced; None when there is none."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: no answer


def extract_answer(text: str) -> str | None:
    """The final answer of ``text``: the last ``\\boxed{}``'s content, else its last number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    """A canonical form for comparing answers: spaces, ``$``, a trailing period, thousands
    separators, ``\\text{}``/``\\left``/``\\right`` and ``\\dfrac`` dropped; numbers written
    as their exact value (``0.50`` and ``1/2`` and ``\\frac{1}{2}`` are ``1/2``)."""
    s = answer.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac")
    s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = s.replace(" ", "").rstrip(".")
    plain = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    plain = re.sub(r"^\((-?\d+)\)/\((\d+)\)$", r"\1/\2", plain)
    try:
        value = Fraction(plain)
    except (ValueError, ZeroDivisionError):
        return s.lower()
    return str(value)


def exact_match(prompt: str, response: str, answer: Any = None, **_: Any) -> float:
    """1.0 when the response, stripped, equals the row's ``answer`` (stripped), else 0.0."""
    del prompt
    if answer is None:
        raise ValueError("exact_match needs an 'answer' column in the dataset")
    return float(response.strip() == str(answer).strip())


def math_answer(prompt: str, response: str, answer: Any = None, **_: Any) -> float:
    """1.0 when the response's final answer (its last ``\\boxed{}``, else its last number)
    equals the row's ``answer`` after :func:`normalize_answer`, else 0.0."""
    del prompt
    if answer is None:
        raise ValueError("math_answer needs an 'answer' column in the dataset")
    got = extract_answer(response)
    if got is None:
        return 0.0
    want = (_last_boxed(str(answer)) if _BOXED.search(str(answer)) else None) or str(answer)
    return float(normalize_answer(got) == normalize_answer(want))


def format_reward(prompt: str, response: str, pattern: str = r"\\boxed\{.+\}", **_: Any) -> float:
    """1.0 when the response matches ``pattern`` (a regular expression searched anywhere;
    default: it contains a ``\\boxed{}`` answer), else 0.0. Set the pattern with
    ``reward.kwargs.pattern``; ``^...$`` anchors a whole-response format."""
    del prompt
    return float(re.search(pattern, response, flags=re.DOTALL) is not None)


BUILTINS: dict[str, Callable[..., Any]] = {
    "exact_match": exact_match,
    "math_answer": math_answer,
    "format": format_reward,
}
