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

What the trainer takes: a :class:`RewardFn` over token ids, or a :class:`SampleReward` over the
prompts' batch and the samples, which returns :class:`Rewards` (scores, parts to log, failures).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import Field, field_validator
from tensordict import TensorDict

from engine_core.config import FrozenModel
from engine_core.errors import ConfigError
from engine_core_roles.data.rewards.answers import BUILTINS

__all__ = [
    "RewardError",
    "RewardConfig",
    "load_function",
    "Scored",
    "score_samples",
    "accepts",
    "RewardFn",
    "Rewards",
    "SampleReward",
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


class RewardFn(Protocol):
    """Scores one step's samples: ``[B*n]`` floats (a sample's reward sits on its last token).

    ``prompt_ids`` ``[B*n, P]`` is left-padded (the ``n`` samples of a prompt are adjacent);
    ``response_ids`` ``[B*n, R]`` is right-padded where ``response_mask`` is 0.
    """

    def __call__(
        self,
        prompt_ids: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        /,
    ) -> torch.Tensor: ...


@dataclass
class Rewards:
    """What a :class:`SampleReward` returns for one step's samples.

    ``scores`` ``[B*n]`` (any value where the sample failed); ``metrics``: means to log (e.g.
    ``reward/<component>``); ``failures``: one sentence per sample that could not be scored,
    naming it and the function (a step with any is not trained on); ``samples``: a few decoded
    samples for people to read (dicts of plain values), passed on in the step's row.
    """

    scores: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)


class SampleReward(ABC):
    """A reward that reads the prompts' batch as well as the samples (a text reward looks up
    each prompt's dataset row through extra fields of the prompt batch). The trainer computes it
    on a thread of its own while the reference's log-probs are computed."""

    @abstractmethod
    def __call__(self, prompts: TensorDict, samples: TensorDict) -> Rewards:
        """Score ``samples`` (``n`` adjacent samples per row of ``prompts``)."""
