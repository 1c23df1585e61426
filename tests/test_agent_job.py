"""Agents written against the real ``openai`` client, trained by the RL job (``agent:``).

Each agent gets a session's own base URL on the job's endpoint, in front of the real hf rollout
of the shipped tool task's tiny model, and makes two chat calls per session. What is trained is
checked against the endpoint's own record, token for token; the job's runs check the rollout's
log-probs against the trainer's, the weight version each step reports, drift, an agent that
raises, and asynchronous training (step t+1's agents running while step t trains, in front of
the rollout in a process of its own: staleness from the recorded versions)."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from tensordict import NonTensorStack, TensorDict

openai = pytest.importorskip("openai", reason="make setup installs the test extra (openai)")
pytest.importorskip("httpx2", reason="openai's own HTTP client, installed with it")
pytest.importorskip("starlette", reason="make setup installs the roles' serve extra")

from engine_core import ConfigError, EngineCoreError, load_plugins  # noqa: E402
from engine_core.checkpoint import JOB_STATE_FILE  # noqa: E402
from engine_core.config import ModelConfig  # noqa: E402
from engine_core.configio import apply_overrides  # noqa: E402
from engine_core.errors import CapabilityError  # noqa: E402
from engine_core.rollout import (  # noqa: E402
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_LOSS_MASK,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ROUTED_EXPERTS,
    SamplingParams,
)
from engine_core.testing.moe import AS_QWEN3_MOE  # noqa: E402
from engine_core_roles.batch.build import prompt_batch  # noqa: E402
from engine_core_roles.batch.keys import EPISODE, WEIGHT_VERSION  # noqa: E402
from engine_core_roles.data.datasets.prompts import DataConfig, PromptData  # noqa: E402
from engine_core_roles.data.datasets.tokenizer import load_tokenizer  # noqa: E402
from engine_core_roles.data.rewards.functions import Rewards, SampleReward  # noqa: E402
from engine_core_roles.jobs.cli import RECIPES, load_recipe  # noqa: E402
from engine_core_roles.jobs.rl.run import run_rl_job  # noqa: E402
from engine_core_roles.serving.agent_function import AgentReward, load_agent  # noqa: E402
from engine_core_roles.serving.agents import AgentRollout  # noqa: E402
from engine_core_roles.serving.rows import SessionRow, session_rows  # noqa: E402
from engine_core_roles.serving.server import served_rollout  # noqa: E402
from engine_core_roles.trainer.generation import sampled_version  # noqa: E402
from engine_core_roles.trainer.state import batch_of  # noqa: E402

RECIPE = RECIPES / "agent_tiny.yaml"
MODEL = load_recipe(RECIPE)["engine"]["model"]
TOKENIZER = load_tokenizer(ModelConfig.model_validate(MODEL), 80)
NAME = "engine-core"  # the model name the job's endpoint serves
# what the client adds between the two calls: the end of the assistant's turn and a user turn
AGAIN = "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
SEEN: dict[str, list[dict[str, Any]]] = {}  # what each session's client was answered
STARTED = itertools.count()  # sessions the re-rendering agent started
RUNNING = [0, 0]  # token agents running now, and the most at once
GRADED = itertools.count()  # sessions the grading agent started
KEYS: list[str] = []  # the keys the grading agent was given


def answered() -> dict[str, list[dict[str, Any]]]:
    """SEEN of this module as the job imports it (by its import path, which pytest may not)."""
    return importlib.import_module("tests.test_agent_job").SEEN  # type: ignore[no-any-return]


def _client(base_url: str, api_key: str) -> Any:
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)


def _seen(base_url: str, reply: Any) -> None:
    SEEN.setdefault(base_url, []).append(
        {
            "prompt": reply.prompt_token_ids,
            "ids": reply.choices[0].token_ids,
            "logprobs": reply.choices[0].token_logprobs,
            "version": reply.weight_version,
        }
    )


async def token_agent(base_url: str, api_key: str, sample: dict[str, Any]) -> None:
    """Two calls, the second sent as token ids: the first prompt, the reply's sampled ids, then
    the ids of what the client adds; never drifts. Returns None: reward.fn scores the reply."""
    RUNNING[0] += 1
    RUNNING[1] = max(RUNNING)
    try:
        return await _two_calls(base_url, api_key, sample)
    finally:
        RUNNING[0] -= 1


async def _two_calls(base_url: str, api_key: str, sample: dict[str, Any]) -> None:
    client = _client(base_url, api_key)
    first = await client.chat.completions.create(
        model=NAME, messages=sample["prompt"], max_tokens=6
    )
    _seen(base_url, first)
    added = TOKENIZER(AGAIN, add_special_tokens=False)["input_ids"]
    ids = [*first.prompt_token_ids, *first.choices[0].token_ids, *added]
    second = await client.chat.completions.create(
        model=NAME, messages=[], max_tokens=6, extra_body={"prompt_token_ids": ids}
    )
    _seen(base_url, second)
    return None


def parity(prompt: str, response: str, **_: Any) -> float:
    """A reward function for the untrained model's replies: 1 for a reply of even length."""
    return float(len(response) % 2 == 0)


async def rerendering_agent(base_url: str, api_key: str, sample: dict[str, Any]) -> dict:
    """Two calls with plain messages, the history re-rendered from the reply's text (which
    drops the special tokens the model sampled); every third session started raises after its
    first call. Names no seed: each session's calls draw from the session's own seed."""
    fails = next(STARTED) % 3 == 0  # before any await: sessions start in the order given
    client = _client(base_url, api_key)
    first = await client.chat.completions.create(
        model=NAME, messages=sample["prompt"], max_tokens=6
    )
    if fails:
        raise RuntimeError("the agent's own tool is down")
    history = [
        *sample["prompt"],
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "again"},
    ]
    second = await client.chat.completions.create(model=NAME, messages=history, max_tokens=6)
    return {"reward": float(len(second.choices[0].token_ids) % 2), "answered": 1.0}


async def grading_agent(base_url: str, api_key: str, sample: dict[str, Any]) -> float | None:
    """One call; the session's reward posted to its ``/reward`` with the agent's key, as a
    grader would. Sessions started second, fourth, ... also return a number (one too many)."""
    import httpx

    twice = next(GRADED) % 2 == 1  # before any await: sessions start in the order given
    importlib.import_module("tests.test_agent_job").KEYS.append(api_key)
    await _client(base_url, api_key).chat.completions.create(
        model=NAME, messages=sample["prompt"], max_tokens=4
    )
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(
            f"{base_url}/reward",
            json={"reward": 0.25},
            headers={"Authorization": f"Bearer {api_key}"},
        )
    answer.raise_for_status()
    return 1.0 if twice else None


def test_session_rows_follow_the_extends_links() -> None:
    """Hand-made record: one call extended twice (one row), a drifted call (a row of its own),
    a second choice (a row of its own) and a branch from an extended choice (a row of its own)."""

    def call(i: int, prompt: list[int], choices: list[list[int]], extends: Any) -> dict:
        return {
            "index": i,
            "prompt_ids": prompt,
            "extends": extends,
            "choices": [
                {"token_ids": c, "logprobs": [-0.5] * len(c), "finish_reason": "stop"}
                for c in choices
            ],
        }

    record = {
        "calls": [
            call(0, [1, 2], [[3, 4], [5]], None),
            call(1, [1, 2, 3, 4, 9], [[6]], {"call": 0, "choice": 0}),
            call(2, [7, 7], [[8]], None),  # drift
            call(3, [1, 2, 3, 4, 9, 6, 9], [[10, 11]], {"call": 1, "choice": 0}),
            call(4, [1, 2, 3, 4, 9, 6], [[12]], {"call": 1, "choice": 0}),  # a branch
        ]
    }
    rows = session_rows(record)
    assert [(r.prompt, r.tokens, r.trained, r.calls) for r in rows] == [
        ([1, 2], [3, 4, 9, 6, 9, 10, 11], [1, 1, 0, 1, 0, 1, 1], [0, 1, 3]),
        ([1, 2], [5], [1], [0]),
        ([7, 7], [8], [1], [2]),
        ([1, 2, 3, 4, 9, 6], [12], [1], [4]),
    ]
    assert rows[0].log_probs == [-0.5, -0.5, 0.0, -0.5, 0.0, -0.5, -0.5]
    # routes: choice j of call i routed position p to expert 1000 i + 100 j + p; each row
    # token's are the forward's that first fed it, the row's last token's none
    routes = {
        (c["index"], j): torch.tensor(
            [1000 * c["index"] + 100 * j + p for p in range(len(c["prompt_ids"]) + len(x) - 1)]
        ).view(-1, 1, 1)
        for c in record["calls"]
        for j, x in enumerate(ch["token_ids"] for ch in c["choices"])
    }
    routed = session_rows(record, routes)
    assert [r.routes.flatten().tolist() for r in routed] == [  # type: ignore[union-attr]
        [0, 1, 2, 1003, 1004, 3005, 3006, 3007],
        [100, 101],
        [2000, 2001],
        [4000 + p for p in range(6)],
    ]
    routes[(3, 0)] = routes[(3, 0)][:-1]  # a forward's routes one token short
    with pytest.raises(ValueError, match="call 3, choice 0: routes for 7 tokens, want 8"):
        session_rows(record, routes)


def test_a_steps_samples_count_as_their_oldest_recorded_weight_version() -> None:
    def samples(versions: list[int]) -> TensorDict:
        return TensorDict({WEIGHT_VERSION: torch.tensor(versions)}, batch_size=[len(versions)])

    assert sampled_version(samples([3, 2, 3]), synced=3) == 2  # one row of older tokens
    assert sampled_version(TensorDict({}, batch_size=[2]), synced=3) == 3  # none recorded
    # a version the trainer never synced: the staleness counted from it would be wrong
    with pytest.raises(EngineCoreError, match="AgentRollout.next_version"):
        sampled_version(samples([4, 3]), synced=3)


class _Constant(SampleReward):
    """The job's reward function's place: 0.7 for every row."""

    def __call__(self, prompts: TensorDict, samples: TensorDict) -> Rewards:
        n = int(samples.batch_size[0])
        return Rewards(torch.full((n,), 0.7), {"reward/env": 0.0}, [], [{"reward": 0.7}])


def test_a_rows_reward_is_its_agents_number_else_the_functions_and_0_on_failure() -> None:
    records = [
        {"end": "done", "agent_reward": 2.5},
        {"end": "done", "agent_reward": None},
        {"end": "env_error", "agent_reward": None},
    ]
    samples = TensorDict({EPISODE: NonTensorStack.from_list(records)}, batch_size=[3])
    out = AgentReward(_Constant())(TensorDict({}, batch_size=[3]), samples)
    assert out.scores.tolist() == pytest.approx([2.5, 0.7, 0.0])
    assert out.metrics == {"reward/agent": 2.5} and out.samples == [{"reward": 2.5}]


def _token_agents(raw: dict[str, Any], **options: Any) -> AgentRollout:
    """``token_agent`` sessions in front of the hf rollout ``raw`` describes."""
    return AgentRollout(
        served_rollout(raw, load_plugins()).rollout,
        load_agent("tests.test_agent_job:token_agent"),
        TOKENIZER,
        temperature=1.0,
        max_tokens=8,
        stop_token_ids=[TOKENIZER.eos_token_id],
        **options,
    )


@pytest.fixture(scope="module")
def agents() -> Iterator[AgentRollout]:
    rollout = _token_agents(
        {"backend": "hf", "model": MODEL, "seed": 0}, max_concurrency=3, scored_by_fn=True
    )
    yield rollout
    rollout.shutdown()


def test_rows_equal_the_endpoints_record_token_for_token(agents: AgentRollout) -> None:
    train = str(RECIPES / "tiny_agent" / "train.jsonl")
    data = PromptData([train], TOKENIZER, DataConfig(train_files=[train]), max_length=64, rows=True)
    answers = answered()
    answers.clear()
    running = importlib.import_module("tests.test_agent_job").RUNNING
    running[:] = [0, 0]
    out = agents.generate(data.batch([0, 1, 2]), SamplingParams(n=2, seed=5, temperature=1.0))
    assert len(out[EPISODE].tolist()) == 6 and len(answers) == 6  # one row per session: no drift
    assert running == [0, 3]  # six sessions, three at once (max_concurrency)
    _check_trained_as_recorded(out, answers)
    # asynchronous training needs the rollout in processes of its own (rollout_placement=process)
    with pytest.raises(CapabilityError, match="async_generation"):
        agents.generate_async(data.batch([0]), SamplingParams(n=2, seed=5, temperature=1.0))
    # a late call of an ended session is refused: its tokens cannot slip into another step
    url = next(iter(answers))
    late = openai.OpenAI(base_url=url, api_key=agents.api_key, max_retries=0)
    with pytest.raises(openai.ConflictError):
        late.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="samples at temperature 1.0 only"):
        openai.OpenAI(base_url=agents.server.url, api_key=agents.api_key).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "x"}], temperature=0.5
        )


def test_sessions_sample_at_the_temperature_generate_asks(agents: AgentRollout) -> None:
    """Evaluation's greedy sessions: every call at temperature 0 (a prompt's sessions sample the
    same ids, whatever their seeds), and a call naming another temperature is refused."""
    train = str(RECIPES / "tiny_agent" / "train.jsonl")
    data = PromptData([train], TOKENIZER, DataConfig(train_files=[train]), max_length=64, rows=True)
    answers = answered()
    answers.clear()
    out = agents.generate(data.batch([0, 1]), SamplingParams(n=3, seed=5, temperature=0.0))
    records = [r["session"] for r in out[EPISODE].tolist()]
    sampled = [[c["choices"][0]["token_ids"] for c in r["calls"]] for r in records]
    assert sampled[0] == sampled[1] == sampled[2] and sampled[3] == sampled[4] == sampled[5]
    assert sampled[0] != sampled[3]
    sid = agents.server.endpoint.sessions.issue()[0]
    agents.server.endpoint.sessions.pin_temperature(sid, 0.0)
    client = openai.OpenAI(base_url=agents.server.session_url(sid), api_key=agents.api_key)
    with pytest.raises(openai.BadRequestError, match=f"session '{sid}' samples at temperature 0"):
        client.chat.completions.create(model=NAME, messages=USER_X, temperature=1.0)
    reply = client.chat.completions.create(model=NAME, messages=USER_X, max_tokens=3)
    assert reply.choices[0].token_logprobs is not None


USER_X = [{"role": "user", "content": "x"}]


def _check_trained_as_recorded(out: TensorDict, answers: dict[str, list[dict[str, Any]]]) -> None:
    """Each row of ``out`` (token agents' sessions, one row each) is its session's record token
    for token, what its client was answered, with the weight version of its calls."""
    records = out[EPISODE].tolist()
    for i, record in enumerate(records):
        session = record["session"]
        assert session["drift"] == 0 and [c["extends"] for c in session["calls"]] == [
            None,
            {"call": 0, "choice": 0},
        ]
        first, second = session["calls"]
        prompt = out[PROMPT_IDS][i][out[PROMPT_MASK][i].bool()].tolist()
        keep = out[RESPONSE_MASK][i].bool()
        response = out[RESPONSE_IDS][i][keep].tolist()
        trained = out[RESPONSE_LOSS_MASK][i][keep].tolist()
        logps = out[ROLLOUT_LOG_PROBS][i][keep].tolist()
        a, b = first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]
        added = second["prompt_ids"][len(first["prompt_ids"]) + len(a) :]
        assert prompt == first["prompt_ids"]
        assert response == a + added + b  # the record's ids, in the order the model read them
        assert prompt + response[: len(a) + len(added)] == second["prompt_ids"]
        assert trained == [1] * len(a) + [0] * len(added) + [1] * len(b)
        want = (
            first["choices"][0]["logprobs"] + [0.0] * len(added) + second["choices"][0]["logprobs"]
        )
        assert logps == pytest.approx(want, abs=0)
        # what the client was answered is what was recorded
        seen = [
            s
            for s in answers.values()
            if s[0]["prompt"] == first["prompt_ids"] and s[0]["ids"] == a
        ]
        assert seen and seen[0][1]["ids"] == b and seen[0][1]["prompt"] == second["prompt_ids"]
        assert record["counts"]["agent/calls"] == 2.0 and record["end"] == "done"
        versions = [c["weight_version"] for c in session["calls"]]
        assert [c["version"] for c in seen[0]] == versions
        assert int(out[WEIGHT_VERSION][i]) == min(versions)


async def slow_agent(base_url: str, api_key: str, sample: dict[str, Any]) -> float:
    """One call, then a wait far past the test's agent timeout."""
    client = _client(base_url, api_key)
    await client.chat.completions.create(model=NAME, messages=sample["prompt"], max_tokens=4)
    await asyncio.sleep(60)
    return 1.0


def _sessions(rollout: AgentRollout, seed: int) -> tuple[list[dict[str, Any]], int]:
    """The step's sessions, one per sample, and the rows each has in the result (``k``), the
    layout checked: prompt by prompt, ``k`` blocks of its ``n`` sessions in one order, block
    ``r`` holding each session's ``r``-th row (or an empty one)."""
    module = importlib.import_module("tests.test_agent_job")
    module.STARTED = itertools.count()
    n, prompts = 2, 2
    out = rollout.generate(_data().batch([0, 1]), SamplingParams(n=n, seed=seed, temperature=1.0))
    records = out[EPISODE].tolist()
    k = len(records) // (n * prompts)
    assert k == max(len(session_rows(r["session"])) for r in records)
    sessions = []
    for p in range(prompts):
        first = records[p * k * n : p * k * n + n]
        sessions += [r["session"] for r in first]
        for r in range(k):
            at = (p * k + r) * n
            assert [x["session"]["id"] for x in records[at : at + n]] == [
                x["session"]["id"] for x in first
            ]
            for i in range(at, at + n):
                rows = session_rows(records[i]["session"])
                length = int(out[RESPONSE_MASK][i].sum())
                assert length == (len(rows[r].tokens) if r < len(rows) else 0)
    return sessions, k


def _data() -> PromptData:
    train = str(RECIPES / "tiny_agent" / "train.jsonl")
    return PromptData([train], TOKENIZER, DataConfig(train_files=[train]), max_length=64, rows=True)


def test_unseeded_agents_draw_from_their_sessions_seeds_and_slow_ones_time_out(
    agents: AgentRollout,
) -> None:
    def other(name: str, **settings: Any) -> AgentRollout:
        return AgentRollout(
            agents.inner,
            load_agent(f"tests.test_agent_job:{name}"),
            TOKENIZER,
            temperature=1.0,
            max_tokens=8,
            stop_token_ids=[TOKENIZER.eos_token_id],
            **settings,
        )

    rerendering = other("rerendering_agent")
    try:
        (first, k), (again, _), (other_seed, k_other) = (
            _sessions(rerendering, s) for s in (3, 3, 4)
        )
    finally:
        rerendering.shutdown()
    assert max(k, k_other) > 1  # a session drifted: more rows, laid out as checked

    def ids(sessions: list[dict[str, Any]]) -> list[Any]:
        return [
            [(c["prompt_ids"], [x["token_ids"] for x in c["choices"]]) for c in s["calls"]]
            for s in sessions
        ]

    def logprobs(sessions: list[dict[str, Any]]) -> list[float]:
        return [
            v for s in sessions for c in s["calls"] for x in c["choices"] for v in x["logprobs"]
        ]

    # the same step, the same sessions, token for token (the log-probs up to float rounding:
    # the calls shared their batches with others)
    assert ids(first) == ids(again)
    assert logprobs(first) == pytest.approx(logprobs(again), abs=1e-5)
    assert ids(first) != ids(other_seed)
    slow = other("slow_agent", timeout_s=1.0)
    try:
        t0 = time.perf_counter()
        out = slow.generate(_data().batch([0]), SamplingParams(n=2, seed=0, temperature=1.0))
        assert time.perf_counter() - t0 < 20
    finally:
        slow.shutdown()
    for record in out[EPISODE].tolist():
        assert record["end"] == "env_error" and record["counts"]["agent/errors"] == 1.0
        assert "past agent_timeout_s=1 s" in record["messages"][-1]["content"]
        assert len(record["session"]["calls"]) == 1  # its call is still trained on
    assert out[RESPONSE_LOSS_MASK].sum(-1).min() > 0


def test_a_session_is_rewarded_by_its_reward_call_under_its_own_key(
    agents: AgentRollout,
) -> None:
    """Each agent is given the key of its session alone (not the endpoint's); a reward posted
    to the session scores it where the agent returns None; an agent that returns a number for
    a session given one too is an error, counted (no reward.fn here to fall back on)."""
    module = importlib.import_module("tests.test_agent_job")
    module.GRADED = itertools.count()
    module.KEYS.clear()
    graded = AgentRollout(
        agents.inner,
        load_agent("tests.test_agent_job:grading_agent"),
        TOKENIZER,
        temperature=1.0,
        max_tokens=8,
        stop_token_ids=[TOKENIZER.eos_token_id],
    )
    try:
        out = graded.generate(_data().batch([0, 1]), SamplingParams(n=2, seed=0, temperature=1.0))
    finally:
        graded.shutdown()
    records = out[EPISODE].tolist()
    assert [r["agent_reward"] for r in records] == [0.25, None, 0.25, None]
    assert [r["session"]["reward"] for r in records] == [0.25] * 4
    assert [r["counts"]["agent/errors"] for r in records] == [0.0, 1.0, 0.0, 1.0]
    assert "give the reward one way" in records[1]["messages"][-1]["content"]
    assert len(set(module.KEYS)) == 4 and graded.api_key not in module.KEYS


def _job(out: Path, *overrides: str) -> dict[str, Any]:
    base = [
        f"output_dir={out}",
        "steps=2",
        "prompts_per_step=2",
        "trainer.samples_per_prompt=2",
        "trainer.max_new_tokens=8",
        "warmup_sft_steps=0",
        "eval.every=0",
        "log_every=1",
        "save_every=0",
        "env=null",
        "agent=tests.test_agent_job:token_agent",
        "agent_concurrency=3",
        "reward.fn=tests.test_agent_job:parity",
    ]
    return apply_overrides(load_recipe(RECIPE), [*base, *overrides])


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


# what differs between two runs of the same steps: timings
VOLATILE = ("time", "tokens_per_s", "agent/seconds", "episode/env_wait_s", "weight_sync/")


def test_the_job_trains_token_in_agents_with_exact_log_probs_and_bumps_the_version(
    tmp_path: Path,
) -> None:
    answers = answered()
    answers.clear()
    run_rl_job(_job(tmp_path / "run"), load_plugins())
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-5  # every trained token, every step
        assert r["agent/calls"] == 2.0 and r["agent/drift_calls"] == 0.0
        assert r["agent/rows"] == 1.0 and r["agent/errors"] == 0.0
        assert 0.0 < r["episode/trained_token_share"] < 1.0
        assert "reward/agent" not in r  # the agent returned None: reward.fn scored
    # step 1 updated the weights, and step 2's log-probs still match: the sync reached the
    # rollout behind the endpoint
    assert rows[0]["actor/grad_norm"] > 0 and rows[0]["reward/zero_variance_groups"] < 1
    assert [r["agent/weight_version"] for r in rows] == [0.0, 1.0]
    versions = sorted({c["version"] for calls in answers.values() for c in calls})
    assert versions == [0, 1]  # what the clients were told, step by step
    assert len(answers) == 8
    # stopped after step 1 and resumed: the same sessions (each draws from its own seed), the
    # same metrics, the weight version counted on from the step resumed
    resumed = tmp_path / "resumed"
    run_rl_job(_job(resumed, "steps=1", "save_every=1"), load_plugins())
    run_rl_job(_job(resumed), load_plugins(), resume=True)
    again = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in _rows(resumed)]
    want = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]
    # the endpoint merges the calls that wait together into one generate call, and which
    # calls do depends on timing: the same tokens, their log-probs to float rounding
    assert len(again) == len(want)
    for got, expected in zip(again, want, strict=True):
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_asynchronous_agents_run_while_the_actor_trains_staleness_from_recorded_versions(
    tmp_path: Path,
) -> None:
    """``trainer.max_staleness=1``, the rollout in a process of its own: step t+1's agents run
    through the endpoint while step t trains. A step's staleness is its rows' oldest recorded
    weight version's, TIS corrects the stale tokens, the gap is logged, and a run stopped and
    resumed equals a straight one."""
    answers = answered()
    answers.clear()
    asynchronous = ("rollout_placement=process", "trainer.max_staleness=1")
    run_rl_job(_job(tmp_path / "run", *asynchronous, "steps=3"), load_plugins())
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # step 1 generated with the initial weights, step 2 while step 1 trained (still those),
    # step 3 while step 2 trained (step 1's update): from step 2 on, one version behind
    assert [r["rollout/weight_version"] for r in rows] == [0.0, 0.0, 1.0]
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["agent/weight_version"] for r in rows] == [0.0, 0.0, 1.0]
    # every session called twice under one version: steps 1-3's, and step 4's, generated while
    # step 3 trained (never trained on)
    told = sorted(calls[0]["version"] for calls in answers.values() if len(calls) == 2)
    assert len(answers) == 16 and told == [0] * 8 + [1] * 4 + [2] * 4
    assert rows[0]["rollout/logprob_diff_max"] < 1e-5  # on-policy: the trainer's log-probs
    for r in rows:
        assert r["actor/num_optimizer_steps"] >= 1.0 and "actor/tis_truncated_frac" in r
        assert r["agent/calls"] == 2.0 and r["agent/errors"] == 0.0
    for r in rows[1:]:  # one update between the rollout's weights and the trainer's: measured
        assert 1e-6 < r["rollout/logprob_diff_mean"] <= r["rollout/logprob_diff_max"]
    # stopped after step 1, with step 2's sessions in flight: checkpointed as generated while
    # step 1 trained, each row its session's record token for token, with its version
    resumed = tmp_path / "resumed"
    run_rl_job(_job(resumed, *asynchronous, "steps=1", "save_every=1"), load_plugins())
    [saved] = (resumed / "checkpoints").glob(f"*/{JOB_STATE_FILE}")
    pending = torch.load(saved, weights_only=True)["trainer"]["pending"]
    in_flight = batch_of(pending["samples"])
    _check_trained_as_recorded(in_flight, answers)
    assert pending["version"] == 0 and in_flight[WEIGHT_VERSION].tolist() == [0] * 4
    run_rl_job(_job(resumed, *asynchronous, "steps=3"), load_plugins(), resume=True)
    again = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in _rows(resumed)]
    want = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]
    assert len(again) == len(want)
    for got, expected in zip(again, want, strict=True):
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_a_rerendering_client_drifts_and_a_raising_agent_is_counted(tmp_path: Path) -> None:
    importlib.import_module("tests.test_agent_job").STARTED = itertools.count()
    out = tmp_path / "run"
    agent = ["agent=tests.test_agent_job:rerendering_agent", "reward=null"]
    run_rl_job(_job(out, *agent, "eval.every=2", "eval.max_prompts=3"), load_plugins())
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    # evaluated through the agents too (greedy), scored by their sessions' rewards
    assert "val/reward" not in rows[0] and 0.0 <= rows[1]["val/reward"] <= 1.0
    assert rows[1]["val/pass@1"] == rows[1]["val/reward"]  # rewards of 0 or 1
    assert sum(r["agent/drift_calls"] for r in rows) > 0
    assert sum(r["agent/errors"] for r in rows) > 0
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-5
        # a session is one row, plus one for each call that drifted (every session calls)
        assert r["agent/rows"] == pytest.approx(1.0 + r["agent/drift_calls"])
        assert r["actor/num_optimizer_steps"] >= 1.0
        assert "reward/agent" in r


def test_dynamic_sampling_keeps_or_redraws_an_agents_prompt_with_all_its_row_slots(
    tmp_path: Path,
) -> None:
    """``filter_groups`` over agents whose client drifts (several row slots a session): a
    prompt whose sessions all scored alike is replaced by a redrawn one, all its slots with it;
    the step trains on whole prompts, and the log-probs still agree."""
    importlib.import_module("tests.test_agent_job").STARTED = itertools.count()
    out = tmp_path / "run"
    agent = ["agent=tests.test_agent_job:rerendering_agent", "reward=null"]
    run_rl_job(_job(out, *agent, "trainer.filter_groups=true"), load_plugins())
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert sum(r["filter/extra_draws"] for r in rows) > 0  # some prompt was redrawn
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-5
        assert 0.0 <= r["filter/groups_that_differ"] <= 1.0
        # a session is one row, plus one for each call that drifted, after the filter too
        assert r["agent/rows"] == pytest.approx(1.0 + r["agent/drift_calls"])


def test_a_row_without_routes_gets_the_inner_rollouts_route_shape_from_one_probe() -> None:
    """Before any call returned routes, a row with none (an empty slot) is filled to the shape
    one sampled token's routes have past their sample and token axes: [layers, top_k]."""
    config = {**MODEL["config"], **AS_QWEN3_MOE, "num_experts_per_tok": 3}  # layers 2, top-3
    raw = {"backend": "hf", "model": {**MODEL, "config": config}, "seed": 0, "return_routes": True}
    rollout = _token_agents(raw)
    inner = rollout.inner
    try:
        want = (config["num_hidden_layers"], 3)
        params = SamplingParams(max_new_tokens=2, return_routes=True)
        sampled = inner.generate(prompt_batch([[1, 2]]), params)
        assert tuple(sampled[ROUTED_EXPERTS].shape[2:]) == want
        assert rollout._probe_route_shape() == want
        empty = SessionRow([int(rollout.pad_token_id)])
        assert [tuple(r.shape) for r in rollout._routes([empty])] == [(1, *want)]
    finally:
        rollout.shutdown()


def test_a_mixture_of_experts_replays_the_routes_its_agents_calls_were_sampled_with(
    tmp_path: Path,
) -> None:
    """The tool task's model as a Qwen3-MoE (fp32), trained with ``routing_replay=rollout``
    through the endpoint, with a re-rendering client (rows split where it drifts, sessions that
    fail after one call, empty row slots): each row's routes, stitched from its calls, are the
    trainer's own on every counted token, and the log-probs agree."""
    importlib.import_module("tests.test_agent_job").STARTED = itertools.count()
    moe = [f"engine.model.config.{k}={str(v).lower()}" for k, v in AS_QWEN3_MOE.items()]
    out = tmp_path / "run"
    agent = ["agent=tests.test_agent_job:rerendering_agent", "reward=null"]
    run_rl_job(_job(out, *agent, "trainer.routing_replay=rollout", *moe), load_plugins())
    rows = _rows(out)
    assert [r["rollout/route_mismatch"] for r in rows] == [0.0, 0.0]
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-5
    assert sum(r["agent/drift_calls"] for r in rows) > 0 and sum(r["agent/errors"] for r in rows)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["env={cls: tools}"], "agent='tests.test_agent_job:token_agent' and env are both set"),
        (["trainer.max_staleness=1"], "needs the rollout in a process of its own"),
        (["agent=tests.test_agent_job:_not_async"], "not an async function"),
        (["agent=tests.test_agent_job:no_such"], "has no 'no_such'"),
        (["agent=null"], "agent_concurrency set, but no agent runs"),
    ],
)
def test_bad_agent_settings_are_refused_before_anything_runs(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    out = tmp_path / "run"
    with pytest.raises((ConfigError, ValidationError, ValueError)) as e:
        run_rl_job(_job(out, *overrides), load_plugins())
    assert message in str(e.value), str(e.value)
    assert not (out / "metrics.jsonl").exists()


async def down_agent(base_url: str, api_key: str, sample: dict[str, Any]) -> float:
    raise ConnectionError("the agent's sandbox is down")


def test_a_step_whose_agents_all_fail_first_trains_nothing_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    """Every agent fails before its first call: no token sampled, every row empty; the step is
    logged (errors 1, no log-prob gap to measure) and the run goes on."""
    out = tmp_path / "run"
    run_rl_job(_job(out, "agent=tests.test_agent_job:down_agent", "steps=2"), load_plugins())
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["agent/errors"] == 1.0 and r["agent/calls"] == 0.0 and r["reward"] == 0.0
        assert r["rollout/logprob_diff_max"] == 0.0


def _not_async(base_url: str, api_key: str, sample: dict[str, Any]) -> float:
    return 0.0
