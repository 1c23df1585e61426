"""An agent written with the OpenAI Agents SDK, trained by the RL job (``agent:``).

The shipped ``agent_sdk_tiny`` recipe, shortened: the supervised warm-up on the tool task's
demonstrations, then RL steps whose episodes are Agents SDK runs
(:mod:`engine_core_roles.data.tasks.tiny_agent_sdk`) against the job's endpoint in front of the
real hf rollout. What each step trained is checked against the endpoint's own record of every
session, token for token, and against what the SDK sent (its messages, rendered again by the
template, are the prompts the rollout sampled from); the SDK's tool calls reached the task's
tool and its answers reached the model."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tensordict import TensorDict

pytest.importorskip("agents", reason="make setup installs the roles' agents extra (openai-agents)")

from engine_core import load_plugins  # noqa: E402
from engine_core.config import ModelConfig  # noqa: E402
from engine_core.configio import apply_overrides  # noqa: E402
from engine_core.rollout import (  # noqa: E402
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_LOSS_MASK,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
)
from engine_core_roles.batch.keys import EPISODE  # noqa: E402
from engine_core_roles.data.datasets.tokenizer import load_tokenizer  # noqa: E402
from engine_core_roles.data.tasks.tiny_agent import value_of  # noqa: E402
from engine_core_roles.data.tasks.tiny_agent_sdk import lookup_tool  # noqa: E402
from engine_core_roles.jobs.cli import RECIPES, load_recipe  # noqa: E402
from engine_core_roles.jobs.rl.run import run_rl_job  # noqa: E402
from engine_core_roles.serving.agents import AgentRollout  # noqa: E402

RECIPE = RECIPES / "agent_sdk_tiny.yaml"
TOKENIZER = load_tokenizer(ModelConfig.model_validate(load_recipe(RECIPE)["engine"]["model"]), 80)
# the tool as the SDK sends it (the template renders its name)
TOOLS = [{"type": "function", "function": {"name": lookup_tool.name}}]
STEPS, PROMPTS, N = 2, 4, 2


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[TensorDict]]:
    """The job's metrics, and what its agent rollout handed the trainer each step."""
    out = tmp_path_factory.mktemp("sdk") / "run"
    handed: list[TensorDict] = []
    generate = AgentRollout.generate

    def recorded(self: AgentRollout, prompts: TensorDict, params: Any) -> TensorDict:
        result = generate(self, prompts, params)
        handed.append(result.clone())
        return result

    raw = apply_overrides(
        load_recipe(RECIPE),
        [
            f"output_dir={out}",
            f"steps={STEPS}",
            f"prompts_per_step={PROMPTS}",
            f"trainer.samples_per_prompt={N}",
            "warmup_sft_steps=150",  # enough for tool calls on every step (100 gives some, 60 none)
            "log_every=1",
            "save_every=0",
        ],
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AgentRollout, "generate", recorded)
        run_rl_job(raw, load_plugins())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, handed


def _expected(session: dict[str, Any]) -> tuple[list[int], list[int], list[int], list[float]]:
    """A session's one row, from its record alone: the first prompt, then each call's added
    ids (its prompt past everything before it; not trained) and its sampled ids (trained)."""
    calls = session["calls"]
    prompt = list(calls[0]["prompt_ids"])
    tokens: list[int] = []
    trained: list[int] = []
    logps: list[float] = []
    for call in calls:
        added = call["prompt_ids"][len(prompt) + len(tokens) :]
        assert call["prompt_ids"] == prompt + tokens + added  # it extends the row so far
        choice = call["choices"][0]
        tokens += [*added, *choice["token_ids"]]
        trained += [0] * len(added) + [1] * len(choice["token_ids"])
        logps += [0.0] * len(added) + list(choice["logprobs"])
    return prompt, tokens, trained, logps


def test_the_rows_trained_are_the_endpoints_record_token_for_token(
    job: tuple[list[dict[str, Any]], list[TensorDict]],
) -> None:
    _, handed = job
    assert len(handed) == STEPS
    one_row = 0
    for out in handed:
        records = out[EPISODE].tolist()
        sessions = {r["session"]["id"]: r["session"] for r in records}
        assert len(sessions) == PROMPTS * N  # every episode ran, one session each
        seen: set[str] = set()
        for i, record in enumerate(records):
            session = record["session"]
            keep = out[RESPONSE_MASK][i].bool()
            if session["drift"]:
                continue  # a drifted session has rows of its own (tests/test_agent_job.py)
            if session["id"] in seen:  # a later row slot (another session drifted): empty
                assert out[RESPONSE_LOSS_MASK][i][keep].sum() == 0
                continue
            seen.add(session["id"])
            one_row += 1
            prompt, tokens, trained, logps = _expected(session)
            assert out[PROMPT_IDS][i][out[PROMPT_MASK][i].bool()].tolist() == prompt
            assert out[RESPONSE_IDS][i][keep].tolist() == tokens
            assert out[RESPONSE_LOSS_MASK][i][keep].tolist() == trained
            assert out[ROLLOUT_LOG_PROBS][i][keep].tolist() == pytest.approx(logps, abs=0)
            for call in session["calls"]:
                # the prompt sampled from is what the SDK sent, rendered by the template
                text = TOKENIZER.apply_chat_template(
                    call["messages"], tools=TOOLS, add_generation_prompt=True, tokenize=False
                )
                assert TOKENIZER(text, add_special_tokens=False)["input_ids"] == call["prompt_ids"]
    assert one_row >= PROMPTS * N  # at least a step's worth of sessions checked in full


def test_the_sdks_tool_calls_reached_the_tool(
    job: tuple[list[dict[str, Any]], list[TensorDict]],
) -> None:
    rows, handed = job
    answered = 0
    for out in handed:
        for record in out[EPISODE].tolist():
            for call in record["session"]["calls"]:
                messages = call["messages"]
                for asked, answer in zip(messages, messages[1:], strict=False):
                    for tool_call in asked.get("tool_calls") or []:
                        fn = tool_call["function"]
                        if fn["name"] == "lookup" and isinstance(fn["arguments"], dict):
                            key = fn["arguments"].get("key")
                            if answer["role"] == "tool" and not answer["content"].startswith(
                                "error:"
                            ):
                                assert answer["content"] == value_of(key)
                                answered += 1
    assert answered > 0  # the warmed-up model called the tool, and the SDK ran it
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-5  # the trainer's log-probs on these rows
        assert r["agent/errors"] == 0.0 and r["agent/tool_calls"] > 0
        assert r["agent/drift_calls"] == 0.0 or r["agent/rows"] > 1.0
    assert [r["agent/weight_version"] for r in rows] == [0.0, 1.0]
