"""The OpenAI-compatible endpoint (``engine_core_roles.serving``) with the real ``openai`` client,
sync and async, against one server in front of the real hf rollout on the shipped tool task's
tiny model: what each reply carries equals what the rollout itself samples for the same prompt
and seed, token for token; a session records those ids; a client that re-renders the history is
counted as drift; each bad request gets its status and OpenAI error object while a request in
flight completes; a non-loopback bind without a key is refused before anything starts."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

openai = pytest.importorskip("openai", reason="make setup installs the test extra (openai)")
httpx = pytest.importorskip("httpx2", reason="openai's own HTTP client, installed with it")
pytest.importorskip("starlette", reason="make setup installs the roles' serve extra")

from engine_core.capabilities import Capability  # noqa: E402
from engine_core.config import ModelConfig  # noqa: E402
from engine_core.errors import BatchError  # noqa: E402
from engine_core.models import build_model  # noqa: E402
from engine_core.plugins import load_plugins  # noqa: E402
from engine_core.rollout import (  # noqa: E402
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ROLLOUT_TOP_IDS,
    ROLLOUT_TOP_LOG_PROBS,
    BaseRollout,
    SamplingParams,
    sent_buckets,
)
from engine_core_roles.batch.build import prompt_batch  # noqa: E402
from engine_core_roles.jobs.cli import RECIPES, load_recipe, main, serve_rollout_config  # noqa: E402
from engine_core_roles.serving import (  # noqa: E402
    SESSION_HEADER,
    ApiError,
    BackgroundServer,
    Choice,
    ServeConfig,
    ServedRollout,
    Sessions,
    is_loopback,
    served_rollout,
)

MODEL = load_recipe(RECIPES / "agent_tiny.yaml")["engine"]["model"]
NAME = "tiny"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "the value of a key",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
]
LIMITS = {"max_tokens": 32, "default_max_tokens": 8, "max_n": 4, "max_prompt_tokens": 120}
USER = [{"role": "user", "content": "ky"}]


@pytest.fixture(scope="module")
def served() -> Iterator[ServedRollout]:
    rollout = served_rollout({"backend": "hf", "model": MODEL, "seed": 0}, load_plugins())
    yield rollout
    rollout.close()


@pytest.fixture(scope="module")
def server(served: ServedRollout) -> Iterator[BackgroundServer]:
    config = ServeConfig(port=0, model_name=NAME, max_body_bytes=1 << 16, **LIMITS)
    with BackgroundServer(config, served) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Any:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def rollout_samples(
    served: ServedRollout, ids: list[int], **params: Any
) -> list[tuple[list[int], list[float]]]:
    """What the rollout itself samples for ``ids``: each sample's ids and log-probs."""
    out = served.rollout.generate(
        prompt_batch([ids]), SamplingParams(stop_token_ids=served.stop_token_ids, **params)
    )
    mask = out[RESPONSE_MASK].bool()
    return [
        (out[RESPONSE_IDS][k][mask[k]].tolist(), out[ROLLOUT_LOG_PROBS][k][mask[k]].tolist())
        for k in range(mask.shape[0])
    ]


def rendered(served: ServedRollout, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    tok = served.tokenizer
    text = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return list(tok(text, add_special_tokens=False)["input_ids"])


def assert_same(choices: list[Any], samples: list[tuple[list[int], list[float]]]) -> None:
    assert [c.token_ids for c in choices] == [ids for ids, _ in samples]
    for c, (_, logps) in zip(choices, samples, strict=True):
        assert c.token_logprobs == pytest.approx(logps, abs=1e-6)


# -- replies ------------------------------------------------------------------------------------


def test_models_and_a_chat_completion_equal_to_the_rollouts_own_samples(
    client: Any, served: ServedRollout
) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    reply = client.chat.completions.create(
        model=NAME, messages=USER, n=2, seed=7, max_tokens=6, logprobs=True, top_logprobs=3
    )
    ids = rendered(served, USER)
    assert reply.prompt_token_ids == ids and reply.weight_version == served.weight_version
    samples = rollout_samples(served, ids, n=2, seed=7, max_new_tokens=6)
    assert_same(reply.choices, samples)
    # the rollout's own three most likely tokens at each position, as texts
    own = served.rollout.generate(
        prompt_batch([ids]),
        SamplingParams(
            n=2, seed=7, max_new_tokens=6, stop_token_ids=served.stop_token_ids, top_logprobs=3
        ),
    )
    for k, (choice, (sampled, logps)) in enumerate(zip(reply.choices, samples, strict=True)):
        text = served.tokenizer.decode(sampled, skip_special_tokens=True)
        assert choice.message.content == text
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(logps, abs=1e-6)
        assert choice.finish_reason == ("stop" if sampled[-1] == 61 else "length")
        for pos, token in enumerate(choice.logprobs.content):
            top = own[ROLLOUT_TOP_IDS][k][pos].tolist()
            assert [t.token for t in token.top_logprobs] == [
                served.tokenizer.decode([i]) for i in top
            ]
            values = [t.logprob for t in token.top_logprobs]
            assert values == pytest.approx(own[ROLLOUT_TOP_LOG_PROBS][k][pos].tolist(), abs=1e-6)
            assert values == sorted(values, reverse=True) and values[0] >= token.logprob - 1e-6
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == sum(len(s) for s, _ in samples)


def test_token_in_and_completions_give_the_same_ids(client: Any, served: ServedRollout) -> None:
    ids = rendered(served, USER)
    by_ids = client.chat.completions.create(
        model=NAME, messages=[], seed=3, max_tokens=5, extra_body={"prompt_token_ids": ids}
    )
    by_messages = client.chat.completions.create(model=NAME, messages=USER, seed=3, max_tokens=5)
    completion = client.completions.create(model=NAME, prompt=ids, seed=3, max_tokens=5, logprobs=2)
    samples = rollout_samples(served, ids, seed=3, max_new_tokens=5)
    assert_same(by_ids.choices, samples)
    assert_same(by_messages.choices, samples)
    assert_same(completion.choices, samples)
    # the legacy form: each position's two most likely tokens' texts and log-probs
    legacy = completion.choices[0].logprobs
    assert len(legacy.top_logprobs) == len(samples[0][0])
    for top, sampled in zip(legacy.top_logprobs, legacy.token_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) >= sampled - 1e-6
    # a stop string ends the sample where the rollout ends it; the text is cut before it
    stopped = client.chat.completions.create(
        model=NAME, messages=USER, seed=3, max_tokens=12, stop=["g", "o"]
    )
    samples = rollout_samples(served, ids, seed=3, max_new_tokens=12, stop_strings=["g", "o"])
    assert_same(stopped.choices, samples)
    text = served.tokenizer.decode(samples[0][0], skip_special_tokens=True)
    cut = min([text.index(s) for s in "go" if s in text], default=len(text))
    assert stopped.choices[0].message.content == text[:cut]
    # several prompts, text and ids, each sampled n times, choices in prompt order
    many = client.completions.create(model=NAME, prompt=["ab", "cd"], n=2, seed=4, max_tokens=3)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.prompt_token_ids == [
        served.tokenizer("ab")["input_ids"],
        served.tokenizer("cd")["input_ids"],
    ]


def test_streaming_sync_and_async_carries_the_whole_reply(
    client: Any, server: BackgroundServer, served: ServedRollout
) -> None:
    whole = client.chat.completions.create(model=NAME, messages=USER, n=2, seed=5, max_tokens=6)
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=USER,
            n=2,
            seed=5,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {0: "", 1: ""}
    finish = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    async def concurrent() -> list[Any]:
        aclient = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
        async with aclient:
            streamed = await aclient.completions.create(
                model=NAME, prompt="ab", seed=1, max_tokens=4, stream=True
            )
            text = "".join([c.choices[0].text async for c in streamed if c.choices])
            replies = await asyncio.gather(
                *(
                    aclient.chat.completions.create(model=NAME, messages=USER, seed=s, max_tokens=5)
                    for s in range(4)
                )
            )
            plain = await aclient.completions.create(model=NAME, prompt="ab", seed=1, max_tokens=4)
            assert text == plain.choices[0].text
            return replies

    replies = asyncio.run(asyncio.wait_for(concurrent(), 120))
    ids = rendered(served, USER)
    for seed, reply in enumerate(replies):  # served one at a time, each its own seed's samples
        assert_same(reply.choices, rollout_samples(served, ids, seed=seed, max_new_tokens=5))


def test_concurrent_requests_are_merged_without_changing_a_sample(
    server: BackgroundServer, served: ServedRollout
) -> None:
    gate = threading.Event()
    held = served.between_calls(lambda: gate.wait(60))  # the rollout busy while requests queue
    _wait_for(lambda: served.waiting() == 0)
    calls = served.generate_calls

    async def run() -> list[Any]:
        aclient = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
        async with aclient:
            asked = [
                aclient.chat.completions.create(
                    model=NAME, messages=USER, seed=seed, n=2, max_tokens=5
                )
                for seed in range(3)
            ]
            asked.append(
                aclient.completions.create(
                    model=NAME, prompt=["ab", "cd"], seed=9, n=2, max_tokens=5
                )
            )
            asked.append(  # unseeded: a call of its own
                aclient.chat.completions.create(model=NAME, messages=USER, n=2, max_tokens=5)
            )
            tasks = [asyncio.ensure_future(a) for a in asked]
            while served.waiting() < len(tasks):
                await asyncio.sleep(0.01)
            gate.set()
            return await asyncio.gather(*tasks)

    try:
        replies = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        gate.set()
    assert held.result() is True
    assert served.generate_calls == calls + 2  # the seeded requests merged, the unseeded alone
    ids = rendered(served, USER)
    for seed, reply in enumerate(replies[:3]):
        assert_same(reply.choices, rollout_samples(served, ids, n=2, seed=seed, max_new_tokens=5))
    alone = served.rollout.generate(
        prompt_batch(replies[3].prompt_token_ids),
        SamplingParams(stop_token_ids=served.stop_token_ids, n=2, seed=9, max_new_tokens=5),
    )
    mask = alone[RESPONSE_MASK].bool()
    assert [c.token_ids for c in replies[3].choices] == [
        alone[RESPONSE_IDS][k][mask[k]].tolist() for k in range(4)
    ]
    assert len(replies[4].choices) == 2


class OneCallAStep(BaseRollout):
    """A rollout that batches continuously, as vLLM's engine does, made of the hf rollout:
    each ``advance()`` finishes the oldest call submitted (generated alone); a call asking
    for 7 tokens is refused when submitted."""

    capabilities = frozenset({Capability.CPU, Capability.CONTINUOUS_BATCHING})

    def __init__(self, inner: BaseRollout) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.running: dict[int, tuple[Any, SamplingParams]] = {}
        self.finished: dict[int, Any] = {}
        self.tickets = itertools.count()

    def generate(self, prompts: Any, params: SamplingParams) -> Any:
        return self.inner.generate(prompts, params)

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return self.inner.expected_weights()

    def load_weights(self, buckets: Any) -> Any:
        return self.inner.load_weights(buckets)

    def submit(self, prompts: Any, params: SamplingParams) -> int:
        if params.max_new_tokens == 7:
            raise BatchError("OneCallAStep refuses 7 tokens.")
        ticket = next(self.tickets)
        self.running[ticket] = (prompts, params)
        return ticket

    def advance(self) -> list[int]:
        if not self.running:
            return []
        ticket = min(self.running)
        self.finished[ticket] = self.inner.generate(*self.running.pop(ticket))
        return [ticket]

    def collect(self, ticket: int) -> Any:
        return self.finished.pop(ticket)


def test_a_continuously_batching_rollout_takes_each_request_as_it_comes(
    served: ServedRollout,
) -> None:
    """Requests are submitted as they arrive, each sampled as the request alone would be; one
    the rollout refuses fails alone; work between calls waits for the requests running."""
    stepping = OneCallAStep(served.rollout)
    continuous = ServedRollout(stepping, served.tokenizer)
    config = ServeConfig(port=0, model_name=NAME, **LIMITS)
    gate = threading.Event()
    try:
        with BackgroundServer(config, continuous) as server:
            held = continuous.between_calls(lambda: gate.wait(60))
            _wait_for(lambda: continuous.waiting() == 0)

            async def run() -> list[Any]:
                aclient = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
                async with aclient:
                    asked = [
                        aclient.chat.completions.create(
                            model=NAME, messages=USER, seed=seed, n=2, max_tokens=5 + 2 * seed
                        )
                        for seed in range(3)
                    ]
                    tasks = [asyncio.ensure_future(a) for a in asked]
                    while continuous.waiting() < len(tasks):
                        await asyncio.sleep(0.01)
                    after = continuous.between_calls(lambda: dict(stepping.running))
                    gate.set()
                    replies = await asyncio.gather(*tasks, return_exceptions=True)
                    return [*replies, after.result(60)]

            *replies, running_then = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        gate.set()
        continuous.close()
    assert held.result() is True
    ids = rendered(served, USER)
    assert_same(replies[0].choices, rollout_samples(served, ids, n=2, seed=0, max_new_tokens=5))
    assert isinstance(replies[1], openai.BadRequestError) and "7 tokens" in str(replies[1])
    assert_same(replies[2].choices, rollout_samples(served, ids, n=2, seed=2, max_new_tokens=9))
    assert running_then == {}  # the barrier ran once the requests before it had finished
    assert continuous.generate_calls == continuous.requests == 2


def _wait_for(condition: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- sessions -----------------------------------------------------------------------------------


def test_a_session_records_the_sampled_ids_and_ends_for_good(
    client: Any, server: BackgroundServer, served: ServedRollout
) -> None:
    agent = openai.OpenAI(base_url=server.session_url("episode-1"), api_key="unused", max_retries=0)
    first = agent.chat.completions.create(model=NAME, messages=USER, n=2, seed=11, max_tokens=6)
    assert first.session_id == "episode-1" and first.call_index == 0
    # a token-in agent: the next prompt is the last one, a sampled choice, and the tool's turn
    tool_turn = served.tokenizer(
        "<|im_end|>\n<|im_start|>tool\n<tool_response>108</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
        add_special_tokens=False,
    )["input_ids"]
    second_prompt = first.prompt_token_ids + first.choices[1].token_ids + tool_turn
    second = client.chat.completions.create(
        model=NAME,
        messages=[],
        seed=12,
        max_tokens=4,
        extra_body={"prompt_token_ids": second_prompt},
        extra_headers={SESSION_HEADER: "episode-1"},
    )
    assert second.call_index == 1
    record = httpx.post(f"{server.url}/sessions/episode-1/end", timeout=30).json()
    assert record["ended"] and record["drift"] == 0
    calls = record["calls"]
    assert [c["prompt_ids"] for c in calls] == [first.prompt_token_ids, second_prompt]
    assert calls[1]["extends"] == {"call": 0, "choice": 1}
    assert calls[0]["messages"] == USER and calls[1]["messages"] is None
    for call, reply in zip(calls, (first, second), strict=True):
        assert [c["token_ids"] for c in call["choices"]] == [c.token_ids for c in reply.choices]
        assert call["weight_version"] == reply.weight_version
    # the record is the rollout's own samples of those prompts
    samples = rollout_samples(served, first.prompt_token_ids, n=2, seed=11, max_new_tokens=6)
    assert [c["token_ids"] for c in calls[0]["choices"]] == [ids for ids, _ in samples]
    for recorded, (_, logps) in zip(calls[0]["choices"], samples, strict=True):
        assert recorded["logprobs"] == pytest.approx(logps, abs=1e-6)
    # ended: the id is refused for good, by URL and by header, before anything is sampled
    with pytest.raises(openai.ConflictError) as info:
        agent.chat.completions.create(model=NAME, messages=USER, max_tokens=2)
    assert info.value.body["code"] == "session_ended"
    again = httpx.post(f"{server.url}/sessions/episode-1/end", timeout=30)
    assert again.status_code == 409 and again.json()["error"]["code"] == "session_ended"
    issued = httpx.post(f"{server.url}/sessions", timeout=30).json()["id"]
    assert httpx.get(f"{server.url}/sessions/{issued}", timeout=30).json()["calls"] == []


def test_session_bounds_and_which_choice_a_call_extends() -> None:
    sessions = Sessions(max_open=1, max_calls=3)

    def call(prompt: list[int], *choices: list[int]) -> Any:
        return sessions.record(
            "s",
            endpoint="completions",
            prompt_ids=prompt,
            choices=[Choice(c, [0.0] * len(c), "stop") for c in choices],
            weight_version=0,
            messages=None,
        )

    call([1, 2], [3], [4, 5])
    assert call([1, 2, 4, 5, 6], [7]).extends == {"call": 0, "choice": 1}
    # a branch from the first call, not the last: still an extension, of that call's choice
    assert call([1, 2, 3, 9], [8]).extends == {"call": 0, "choice": 0}
    with pytest.raises(ApiError) as info:
        sessions.check("s")
    assert (info.value.status, info.value.code) == (400, "session_too_long")
    with pytest.raises(ApiError) as info:
        sessions.check("another")
    assert (info.value.status, info.value.code) == (429, "too_many_sessions")
    record = sessions.end("s")
    assert record["drift"] == 0 and len(record["calls"]) == 3
    sessions.check("another")  # the ended one no longer counts
    with pytest.raises(ApiError) as info:
        sessions.get("s")
    assert (info.value.status, info.value.code) == (409, "session_ended")


def _overfit_to_a_tool_call(served: ServedRollout, prompt: list[int], target: list[int]) -> None:
    """Train a copy of the model until greedy decoding writes ``target`` after ``prompt``, and
    load it into the rollout as weight version 1."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(ModelConfig.model_validate(MODEL))
    ids = torch.tensor([prompt + target])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(200):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 9:
            with torch.no_grad():
                guess = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
            if guess.tolist() == target:
                break
    else:
        raise AssertionError("the tiny model did not learn the tool call in 200 steps")
    served.load_weights(sent_buckets(model.state_dict().items()), version=1)


def test_tool_calls_and_a_re_rendering_client_counted_as_drift(
    server: BackgroundServer, served: ServedRollout
) -> None:
    # the model writes its call as compact JSON; the template re-renders it with spaces
    call = '<tool_call>{"name":"lookup","arguments":{"key":"ky"}}</tool_call><|im_end|>'
    target = served.tokenizer(call, add_special_tokens=False)["input_ids"]
    _overfit_to_a_tool_call(served, rendered(served, USER, TOOLS), target)
    agent = openai.OpenAI(base_url=server.session_url("re-render"), api_key="unused", max_retries=0)
    history: list[Any] = list(USER)
    reply = agent.chat.completions.create(
        model=NAME, messages=history, tools=TOOLS, temperature=0, max_tokens=32
    )
    choice = reply.choices[0]
    assert choice.token_ids == target and reply.weight_version == 1
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "lookup"
    assert json.loads(tool_call.function.arguments) == {"key": "ky"}
    # what every OpenAI agent does: the history as messages, the tool's answer appended
    history += [
        choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": tool_call.id, "content": "108"},
    ]
    agent.chat.completions.create(
        model=NAME, messages=history, tools=TOOLS, temperature=0, max_tokens=4
    )
    record = httpx.get(f"{server.url}/sessions/re-render", timeout=30).json()
    assert record["drift"] == 1 and record["calls"][1]["extends"] is None
    assert record["calls"][0]["choices"][0]["token_ids"] == target  # the sampled ids, kept
    assert [c["weight_version"] for c in record["calls"]] == [1, 1]


# -- refusals -----------------------------------------------------------------------------------

BAD = [  # (what is wrong, the body or raw bytes, status, param, code)
    ("malformed JSON", b'{"model": "tiny", "messages": [', 400, None, None),
    ("not an object", b"[1, 2]", 400, None, None),
    ("unknown model", {"model": "gpt-9", "messages": USER}, 404, "model", "model_not_found"),
    ("n over the bound", {"model": NAME, "messages": USER, "n": 5}, 400, "n", None),
    ("too many choices", {"model": NAME, "prompt": ["a", "b", "c"], "n": 2}, 400, "prompt", None),
    (
        "max_tokens over",
        {"model": NAME, "messages": USER, "max_tokens": 33},
        400,
        "max_tokens",
        None,
    ),
    (
        "oversize prompt",
        {"model": NAME, "messages": [{"role": "user", "content": "ab" * 100}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "ids outside the vocabulary",
        {"model": NAME, "messages": [], "prompt_token_ids": [5, 80]},
        400,
        "prompt_token_ids",
        None,
    ),
    (
        "a penalty",
        {"model": NAME, "messages": USER, "presence_penalty": 1},
        400,
        "presence_penalty",
        "unsupported_parameter",
    ),
    (
        "top_logprobs without logprobs",
        {"model": NAME, "messages": USER, "top_logprobs": 2},
        400,
        "top_logprobs",
        None,
    ),
    (
        "a wrong type",
        {"model": NAME, "messages": USER, "temperature": "hot"},
        400,
        "temperature",
        "invalid_value",
    ),
    (
        "an image part",
        {"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages.0.content",
        None,
    ),
    (
        "oversize body",
        {"model": NAME, "messages": USER, "pad": "x" * (1 << 16)},
        413,
        None,
        "request_too_large",
    ),
]


def assert_error(
    response: httpx.Response, status: int, param: str | None, code: str | None, what: str = ""
) -> None:
    assert response.status_code == status, f"{what}: {response.text}"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param and (code is None or error["code"] == code)


def test_each_bad_request_is_refused_while_a_request_in_flight_completes(
    server: BackgroundServer, served: ServedRollout
) -> None:
    gate = threading.Event()
    held = served.between_calls(lambda: gate.wait(60))  # the rollout is busy until the gate opens

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            long = asyncio.ensure_future(
                http.post(
                    server.session_url("in-flight") + "/chat/completions",
                    json={"model": NAME, "messages": USER, "n": 4, "max_tokens": 32, "seed": 2},
                )
            )
            for what, body, status, param, code in BAD:
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                route = (
                    "/completions"
                    if isinstance(body, dict) and "prompt" in body
                    else "/chat/completions"
                )
                answer = await http.post(route, content=raw)
                assert_error(answer, status, param, code, what)
            ended = await http.post("/sessions/gone/end")
            assert ended.status_code == 200
            reused = await http.post(
                "/chat/completions",
                json={"model": NAME, "messages": USER},
                headers={SESSION_HEADER: "gone"},
            )
            assert_error(reused, 409, "session_id", "session_ended")
            assert_error(await http.get("/nowhere"), 404, None, None)
            assert_error(await http.get("/chat/completions"), 405, None, None)
            assert not long.done()  # every refusal answered while the request waits its turn
            gate.set()
            done = await long
            assert done.status_code == 200 and len(done.json()["choices"]) == 4
            record = (await http.get("/sessions/in-flight")).json()
            assert (
                record["calls"][0]["choices"][0]["token_ids"]
                == done.json()["choices"][0]["token_ids"]
            )

    try:
        asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        gate.set()
    assert held.result() is True
    # the openai client raises its own error for each
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=USER)
    with pytest.raises(openai.BadRequestError, match="at most 4"):
        client.chat.completions.create(model=NAME, messages=USER, n=5)


def test_a_client_gone_mid_stream_or_naming_two_sessions_leaves_the_server_unharmed(
    server: BackgroundServer,
) -> None:
    body = {"model": NAME, "messages": USER, "n": 4, "max_tokens": 16, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST", server.session_url("gone-away") + "/chat/completions", json=body
        ) as r:
            assert next(r.iter_lines()).startswith("data: {")
        # the connection closed after the first event; the server goes on serving
        two = http.post(
            server.session_url("one") + "/chat/completions",
            json={"model": NAME, "messages": USER},
            headers={SESSION_HEADER: "another"},
        )
        assert_error(two, 400, "session_id", None)
        bad_id = http.post(
            server.url + "/chat/completions", json=body, headers={SESSION_HEADER: "a b"}
        )
        assert_error(bad_id, 400, "session_id", "invalid_session_id")
        again = http.post(server.url + "/completions", json={"model": NAME, "prompt": "ab"})
        assert again.status_code == 200


def test_the_api_key_is_required_when_set(served: ServedRollout) -> None:
    config = ServeConfig(port=0, model_name=NAME, api_key="sesame", **LIMITS)
    with BackgroundServer(config, served) as keyed:
        for key in ("", "Bearer wrong", "sesame", "Basic sesame"):
            answer = httpx.get(f"{keyed.url}/models", headers={"Authorization": key}, timeout=30)
            assert_error(answer, 401, None, "invalid_api_key")
        good = openai.OpenAI(base_url=keyed.url, api_key="sesame", max_retries=0)
        assert [m.id for m in good.models.list().data] == [NAME]
        assert httpx.get(f"{keyed.root}/health", timeout=30).status_code == 200


def test_a_sessions_own_key_opens_that_session_alone_and_takes_its_reward_once(
    served: ServedRollout,
) -> None:
    """A session issued by a keyed server comes with a key of its own: it opens that session's
    routes (sampling, its reward, its record, its end) and no other route, nor another session's.
    The reward call takes one finite number, once; the record carries it; after the end the key
    still names its session, which is refused as ended."""
    config = ServeConfig(port=0, model_name=NAME, api_key="sesame", **LIMITS)

    def bearer(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    with BackgroundServer(config, served) as keyed:
        issued = [
            httpx.post(f"{keyed.url}/sessions", headers=bearer("sesame"), timeout=30).json()
            for _ in range(2)
        ]
        (sid, key), (other, _) = ((i["id"], i["api_key"]) for i in issued)
        agent = openai.OpenAI(base_url=keyed.session_url(sid), api_key=key, max_retries=0)
        reply = agent.chat.completions.create(model=NAME, messages=USER, max_tokens=2)
        assert reply.session_id == sid
        elsewhere = [
            ("GET", f"{keyed.session_url(other)}/models", {}),
            ("GET", f"{keyed.url}/models", {}),
            ("GET", f"{keyed.url}/models", {SESSION_HEADER: other}),
            ("POST", f"{keyed.url}/sessions", {}),
            ("GET", f"{keyed.url}/sessions/{other}", {}),
            ("POST", f"{keyed.url}/sessions/{other}/reward", {}),
            # two names for the session, or a malformed one: a key proves nothing about them
            ("GET", f"{keyed.session_url(sid)}/models", {SESSION_HEADER: other}),
            ("GET", f"{keyed.url}/models", {SESSION_HEADER: "no/such id"}),
        ]
        for method, url, headers in elsewhere:
            answer = httpx.request(
                method, url, headers={**bearer(key), **headers}, json={"reward": 1}, timeout=30
            )
            assert_error(answer, 401, None, "invalid_api_key", f"{method} {url}")
        reward = f"{keyed.session_url(sid)}/reward"
        for body in ({"reward": "high"}, {"reward": True}, {"score": 1}, {"reward": 1, "x": 2}):
            answer = httpx.post(reward, headers=bearer(key), json=body, timeout=30)
            assert_error(answer, 400, "reward", None, str(body))
        nan = httpx.post(reward, headers=bearer(key), content=b'{"reward": NaN}', timeout=30)
        assert_error(nan, 400, "reward", None, "NaN")
        given = httpx.post(reward, headers=bearer(key), json={"reward": 0.75}, timeout=30)
        assert given.json() == {"id": sid, "reward": 0.75}
        again = httpx.post(reward, headers=bearer(key), json={"reward": 0.5}, timeout=30)
        assert_error(again, 409, "reward", "reward_given")
        end = f"{keyed.url}/sessions/{sid}/end"
        record = httpx.post(end, headers=bearer(key), timeout=30).json()
        assert record["reward"] == 0.75 and len(record["calls"]) == 1
        late = httpx.post(reward, headers=bearer(key), json={"reward": 1}, timeout=30)
        assert_error(late, 409, "session_id", "session_ended")


def test_a_non_loopback_bind_without_a_key_is_refused_at_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert (
        not is_loopback("0.0.0.0")
        and not is_loopback("10.1.2.3")
        and not is_loopback("example.org")
    )
    with pytest.raises(ValidationError, match="without an API key"):
        ServeConfig(host="0.0.0.0")
    ServeConfig(host="0.0.0.0", api_key="k")  # with a key it may
    recipe = str(RECIPES / "agent_tiny.yaml")
    assert main(["serve", recipe, "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "without an API key" in err[0] and "--api-key" in err[0]
    raw, name = serve_rollout_config(recipe, None)
    assert (
        raw["model"] == MODEL
        and raw["backend"] == "hf"
        and raw["seed"] == 0
        and name == "agent_tiny"
    )
    raw, name = serve_rollout_config(str(tmp_path), "vllm")
    assert raw == {"backend": "vllm", "model": {"path": str(tmp_path)}} and name == str(tmp_path)
    assert main(["serve", recipe, "--port", "0", "--replicas", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--replicas 0; serve with 1 or more" in err[0]


def test_served_from_replicas_in_an_interpreter_of_their_own_as_from_one_rollout() -> None:
    """``engine-core serve RECIPE --replicas 2 --rollout-python PYTHON`` (here this interpreter,
    started by path as another environment's would be): seeded samples of two prompts, spread
    over the two replicas, equal the in-process rollout's; SIGTERM ends the server and its
    replicas."""
    import re
    import signal
    import subprocess
    import sys

    import psutil

    # the recipe's model as built (the module's served rollout has had other weights synced)
    served = served_rollout({"backend": "hf", "model": MODEL, "seed": 0}, load_plugins())
    recipe = str(RECIPES / "agent_tiny.yaml")
    argv = [sys.executable, "-m", "engine_core_roles.jobs.cli", "serve", recipe, "--port", "0"]
    argv += ["--served-model-name", NAME, "--replicas", "2", "--rollout-python", sys.executable]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"at (http://\S+/v1)", line)
        assert found, line
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2  # the two replicas
        prompts = [rendered(served, USER), rendered(served, [{"role": "user", "content": "kz"}])]
        client = openai.OpenAI(base_url=found.group(1), api_key="unused", max_retries=0)
        reply = client.completions.create(
            model=NAME, prompt=prompts, n=2, seed=3, max_tokens=5, temperature=1.0
        )
        got = [list(c.token_ids) for c in reply.choices]  # type: ignore[attr-defined]
        out = served.rollout.generate(
            prompt_batch(prompts),
            SamplingParams(n=2, seed=3, max_new_tokens=5, stop_token_ids=served.stop_token_ids),
        )
        mask = out[RESPONSE_MASK].bool()
        assert got == [out[RESPONSE_IDS][k][mask[k]].tolist() for k in range(4)]
    finally:
        served.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0  # stopped, its rollout's processes with it
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(c.cmdline(), proc.returncode) for c in alive]


# -- fuzz ---------------------------------------------------------------------------------------

_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 2**65)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system", "robot"]) | _JSON},
    optional={
        "content": st.text(alphabet="abk12 ", max_size=6)
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _JSON}), max_size=2)
        | _JSON,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {"function": st.fixed_dictionaries({"name": _JSON, "arguments": _JSON})}
            ),
            max_size=2,
        )
        | _JSON,
    },
)
_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([NAME, "other", ""]) | _JSON,
        "messages": st.just(USER) | st.lists(_MESSAGE, max_size=3) | _JSON,
        "prompt": st.sampled_from(["ab", [5, 6]]) | _JSON,
        "n": st.integers(-1, 6) | _JSON,
        "max_tokens": st.integers(-1, 40) | _JSON,
        "temperature": st.floats(-1, 3) | _JSON,
        "top_p": st.floats(-1, 2) | _JSON,
        "seed": _JSON,
        "stop": _JSON,
        "stream": st.booleans() | _JSON,
        "logprobs": _JSON,
        "tools": _JSON,
        "prompt_token_ids": st.lists(st.integers(-3, 90), max_size=4) | _JSON,
    },
)


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    route=st.sampled_from(["/chat/completions", "/completions"]),
    body=_FIELDS.map(lambda d: json.dumps(d).encode()) | st.binary(max_size=64),
)
def test_fuzzed_bodies_are_answered_or_refused_never_a_server_error(
    server: BackgroundServer, route: str, body: bytes
) -> None:
    answer = httpx.post(server.url + route, content=body, timeout=60)
    assert answer.status_code in (200, 400, 404, 413), answer.text
    if answer.status_code != 200:
        assert_error(answer, answer.status_code, answer.json()["error"]["param"], None)
