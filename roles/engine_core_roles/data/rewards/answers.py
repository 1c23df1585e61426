"""Built-in reward functions over text: the final answer (the last ``\\boxed{...}``, else the last
number) extracted and normalized, exact or mathematical match, and a format check.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

__all__ = [
    "extract_answer",
    "normalize_answer",
    "exact_match",
    "math_answer",
    "format_reward",
    "BUILTINS",
]

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
