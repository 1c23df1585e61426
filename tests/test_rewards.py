"""The built-in reward functions on hand cases, and how a reward function's answers are checked."""

from __future__ import annotations

import math

import pytest

from engine_core.errors import ConfigError
from engine_core_roles.data.rewards.answers import (
    exact_match,
    extract_answer,
    format_reward,
    math_answer,
    normalize_answer,
)
from engine_core_roles.data.rewards.functions import load_function, score_samples


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("we get 3 apples and 7 pears", "7"),
        ("total: 1,234.5 dollars", "1,234.5"),
        ("no number here", None),
        ("\\boxed{unbalanced", None),
    ],
)
def test_extract_answer(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("0.5", "1/2"),
        ("\\frac{1}{2}", "0.50"),
        ("1,000", "1000"),
        ("$7$", "7."),
        ("\\text{ 5 }", "5"),
    ],
)
def test_normalize_answer_equates_forms_of_one_value(a: str, b: str) -> None:
    assert normalize_answer(a) == normalize_answer(b)


def test_math_answer_exact_match_and_format_on_hand_cases() -> None:
    assert math_answer("", "thus \\boxed{0.5}", answer="1/2") == 1.0
    assert math_answer("", "it is 12", answer="\\boxed{12}") == 1.0
    assert math_answer("", "it is 13", answer="12") == 0.0
    assert math_answer("", "no idea", answer="12") == 0.0
    assert exact_match("", "  Paris\n", answer="Paris") == 1.0
    assert exact_match("", "paris", answer="Paris") == 0.0
    assert format_reward("", "x \\boxed{3}") == 1.0
    assert format_reward("", "x 3") == 0.0
    assert format_reward("", "<think>a</think>b", pattern=r"^<think>.*</think>.+$") == 1.0
    with pytest.raises(ValueError, match="needs an 'answer' column"):
        math_answer("", "1")


def test_score_samples_names_each_failure() -> None:
    def fn(prompt: str, response: str, **row: object) -> object:
        return (
            {"a": 1.0, "b": 0.0} if response == "ok" else {"nan": math.nan, "raise": None}[response]
        )

    def raises(prompt: str, response: str, **row: object) -> float:
        raise KeyError(response)

    scored = score_samples(fn, "m:fn", ["p"] * 3, ["ok", "nan", "raise"], {})
    assert scored.scores[0] == 1.0 and scored.components == {"a": 1.0, "b": 0.0}
    assert "returned nan for sample 1" in scored.failures[0]
    assert "m:fn returned NoneType" in scored.failures[1] and "sample 2" in scored.failures[1]
    assert "raised KeyError" in score_samples(raises, "m:r", ["p"], ["x"], {}).failures[0]
    batched = score_samples(lambda ps, rs: [1.0], "m:b", ["p"] * 2, ["a", "b"], {}, batched=True)
    assert "returned 1 for 2 samples" in batched.failures[0]


def test_load_function_says_what_did_not_resolve(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert load_function("math_answer") is math_answer
    assert load_function("engine_core_roles.data.rewards.answers:exact_match") is exact_match
    with pytest.raises(ConfigError, match="no file"):
        load_function(f"{tmp_path}/none.py:f")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ConfigError, match="importing .*broken.py failed: ModuleNotFoundError"):
        load_function(f"{broken}:f")
