"""The benchmarks keep up with the code they time: each script imports, and every call the
step benchmark times by name is still there (a rename would otherwise surface only when the
benchmark is run)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture(autouse=True)
def _on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))


@pytest.mark.parametrize("script", sorted(p.stem for p in BENCHMARKS.glob("*.py")))
def test_every_benchmark_imports(script: str) -> None:
    module = importlib.import_module(script)
    assert module.__doc__, f"benchmarks/{script}.py says what it measures in its docstring"
    sys.modules.pop(script, None)


def test_the_step_breakdown_times_calls_that_exist() -> None:
    grpo_step = importlib.import_module("grpo_step")
    calls = grpo_step.timed_calls()
    for owner, name, label in calls:
        assert callable(getattr(owner, name, None)), f"{label}: {owner.__name__}.{name} is gone"
    assert {label for _, _, label in calls} >= {"generation", "update", "weight_sync"}


def test_the_interleaved_steps_pair_each_job_step_with_a_minimal_one() -> None:
    # the step benchmark's step-by-step comparison: one minimal step after each of the job's,
    # outside its time_s, and the trainer's step as it was afterwards
    from engine_core_roles.jobs.cli import RECIPES, load_recipe
    from engine_core_roles.trainer.loop import RLTrainer

    grpo_step = importlib.import_module("grpo_step")
    recipe = RECIPES / "grpo_tiny.yaml"
    small = ["prompts_per_step=2", "trainer.samples_per_prompt=2"]
    loop = importlib.import_module("_minimal").MinimalGRPO(load_recipe(recipe, small))
    step, minimal = RLTrainer.step, []
    rows, times = grpo_step._engine_core(3, recipe, small, lambda: minimal.append(loop.step()))
    assert RLTrainer.step is step
    assert len(rows) == len(minimal) == 3 and len(times["update"]) == 3
    assert all(t > 0 and 0.0 <= r <= 1.0 for t, r in rows + minimal)


def test_trls_side_of_the_learning_comparison_sees_the_tasks_ids_and_reward() -> None:
    """TRL's prompts tokenize to the job's ids, and its reward is the task's score."""
    import torch

    from engine_core_roles.data.tasks.digits import BOS, EOS, PAD, SEP, DigitTask, TaskConfig

    trl_side = importlib.import_module("_trl")
    tok = trl_side.tokenizer()
    assert tok(["<s> 1 2 3 |"])["input_ids"] == [[BOS, 5, 6, 7, SEP]]
    assert (tok.eos_token_id, tok.pad_token_id) == (EOS, PAD)
    task = DigitTask(TaskConfig(name="reverse", num_digits=3))
    reward = trl_side.task_reward(task)
    assert reward([[7, 6, 5, EOS], [7, EOS], [], [7, 6, 5, 4]], digits=[[1, 2, 3]] * 4) == [
        1.0,
        0.25,
        0.0,
        0.75,
    ]
    digits = task.sample_digits(3)
    ids = task.target_ids(digits)
    assert reward(ids.tolist(), digits=digits.tolist()) == [1.0] * 3
    assert torch.equal(task.prompt_ids(digits)[:, 0], torch.full((3,), BOS))


def test_the_learning_figures_count_a_seed_that_never_arrives_as_the_worst() -> None:
    learning = importlib.import_module("learning")
    rewards = [0.0] * 9 + [1.0] * 11
    assert learning._first_step_at(rewards, 0.5) == 14  # the 10-step mean: 5/10 at step 14
    assert learning._first_step_at(rewards, 1.01) is None
    assert learning._median([200, None, 300]) == 300
    assert learning._median([200, None, None]) is None
    assert learning._median([100, 200, 300, 400]) == 250


def test_the_serving_load_checks_pass_on_a_served_rollout_and_catch_mixed_records(
    tmp_path: Path,
) -> None:
    """The load benchmark's sessions and checks, small, against the endpoint in front of the hf
    rollout in this process (its full run starts two vLLM servers, minutes on a CPU host): every
    record matches, and a record swapped, cut short or changed is caught."""
    pytest.importorskip("openai", reason="make setup installs the test extra (openai)")
    pytest.importorskip("starlette", reason="make setup installs the roles' serve extra")
    import asyncio

    from transformers import AutoTokenizer

    from engine_core.plugins import load_plugins
    from engine_core_roles.serving import BackgroundServer, ServeConfig, served_rollout

    load_bench = importlib.import_module("serving_load")
    tiny = {**load_bench.MODEL, "hidden_size": 64, "intermediate_size": 128}
    tiny.update(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    folder = load_bench.build_model_folder(tmp_path, tiny)
    served = served_rollout({"backend": "hf", "model": {"path": str(folder)}}, load_plugins())
    config = ServeConfig(port=0, model_name=load_bench.NAME)
    try:
        with BackgroundServer(config, served) as server:
            load = asyncio.run(
                load_bench.run_load(
                    server.url, sessions=3, seconds=0.5, turns=2, max_tokens=4, prefix="t"
                )
            )
            records = load_bench.session_records(server.root, list(load.sessions))
    finally:
        served.close()
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert load.calls and len(load.sessions) >= 3
    assert load_bench.check_complete(load, 4) == []
    assert load_bench.check_records(load, records, tok) == []
    figures = load_bench.figures(load, [], "checked")
    assert figures["calls"] == len(load.calls) and figures["check"]["ok"]

    one, two = sorted(s for s, n in load.sessions.items() if n)[:2]
    swapped = {**records, one: records[two], two: records[one]}
    assert {
        p.split(":")[0].split(" ")[0] for p in load_bench.check_records(load, swapped, tok)
    } >= {
        one,
        two,
    }
    cut = {**records, one: {**records[one], "calls": records[one]["calls"][:-1]}}
    assert any("recorded" in p for p in load_bench.check_records(load, cut, tok))
    first = records[one]["calls"][0]
    other = [{**first["choices"][0], "token_ids": first["choices"][0]["token_ids"][:-1]}]
    changed = {**records, one: {**records[one], "calls": [{**first, "choices": other}]}}
    changed[one]["calls"] += records[one]["calls"][1:]
    assert any("other ids" in p for p in load_bench.check_records(load, changed, tok))
