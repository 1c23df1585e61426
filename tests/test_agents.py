"""Multi-turn episodes: environments, tools, and training on only what the model wrote.

The episode loop runs on real rollouts (hf, vllm) with a tiny Qwen2 built from the shipped tool
task's config and tokenizer; the trainer's log-probs come from a real fsdp2 actor.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from engine_core import BaseRollout, ConfigError, SamplingParams, load_plugins
from engine_core.batch import ROUTED_EXPERTS
from engine_core.configio import load_yaml
from engine_core.resolve import resolve_rollout_config
from engine_core.rollout import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_LOSS_MASK,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TRUNCATED,
    sent_buckets,
)
from engine_core.testing.moe import AS_QWEN3_MOE
from engine_core_roles import Actor, ActorConfig, training_batch
from engine_core_roles.batch.keys import EPISODE, ROW
from engine_core_roles.data.datasets.tokenizer import load_tokenizer
from engine_core_roles.data.tasks.tiny_agent import (
    LOOKUP_SCHEMA,
    demonstration,
    lookup,
    value_of,
    write_files,
)
from engine_core_roles.episodes.config import EnvConfig, load_environment
from engine_core_roles.episodes.demos import demo_batch
from engine_core_roles.episodes.metrics import episode_metrics
from engine_core_roles.episodes.protocol import Environment, StepResult
from engine_core_roles.episodes.rollout import EpisodeRollout
from engine_core_roles.episodes.template import _Template
from engine_core_roles.episodes.tools import ToolEnvironment, check_tool_schema, hermes_tool_calls
from engine_core_roles.jobs.cli import RECIPES, load_recipe
from tests.test_trainer import build_engine

RECIPE = RECIPES / "agent_tiny.yaml"
RAW = load_recipe(RECIPE)
MODEL = RAW["engine"]["model"]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from engine_core.config import ModelConfig

    return load_tokenizer(ModelConfig.model_validate(MODEL), 80)


def test_shipped_files_are_what_the_module_writes(tmp_path: Path) -> None:
    write_files(tmp_path)
    shipped = RECIPES / "tiny_agent"
    for name in ("train.jsonl", "val.jsonl", "demos.jsonl"):
        assert (tmp_path / name).read_text() == (shipped / name).read_text(), name
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "tokenizer" / name).read_text() == (
            shipped / "tokenizer" / name
        ).read_text(), name
    # nothing in a prompt gives its answer away: train and val keys are apart
    keys = [json.loads(x)["key"] for x in (shipped / "val.jsonl").read_text().splitlines()]
    train = {json.loads(x)["key"] for x in (shipped / "train.jsonl").read_text().splitlines()}
    assert not set(keys) & train


# -- tools ---------------------------------------------------------------------------------------


def test_hermes_tool_calls_hand_cases() -> None:
    calls = hermes_tool_calls(
        'let me see <tool_call>{"name": "lookup", "arguments": {"key": "ab"}}</tool_call>'
        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    )
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("lookup", {"key": "ab"}, ""),
        ("add", {"a": 1}, ""),  # arguments given as a JSON string
    ]
    assert hermes_tool_calls("the answer is 42") == []
    assert "is not JSON" in hermes_tool_calls("<tool_call>{oops</tool_call>")[0].error
    assert "no string 'name'" in hermes_tool_calls('<tool_call>{"x": 1}</tool_call>')[0].error
    assert "never closed" in hermes_tool_calls('<tool_call>{"name": "a"')[0].error
    assert (
        "not an object"
        in hermes_tool_calls('<tool_call>{"name": "a", "arguments": [1]}</tool_call>')[0].error
    )


def _raises(key: str) -> str:
    """Always fails.

    Args:
        key: anything
    """
    raise RuntimeError("the backend is down")


def _number(key: str) -> str:
    """Returns a number, not text.

    Args:
        key: anything
    """
    return 7  # type: ignore[return-value]


def _hangs(key: str) -> str:
    """Never answers in time.

    Args:
        key: anything
    """
    time.sleep(3)
    return "late"


def _pid(key: str) -> str:
    """The process the tool runs in.

    Args:
        key: anything
    """
    return str(os.getpid())


def _exits(key: str) -> str:
    """Ends the process it runs in (only ever called in a tool process).

    Args:
        key: anything
    """
    os._exit(3)


def _call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.mark.parametrize("processes", [0, 2], ids=["threads", "processes"])
def test_tools_that_misbehave_become_error_observations(processes: int) -> None:
    env = ToolEnvironment(
        [lookup, _raises, _number, _hangs, _pid, _exits], tool_timeout_s=0.3, processes=processes
    )
    assert [t["function"]["name"] for t in env.tools or []] == [
        "lookup",
        "_raises",
        "_number",
        "_hangs",
        "_pid",
        "_exits",
    ]
    assert env.reset({"prompt": "qe"}) == [{"role": "user", "content": "qe"}]

    def answer(text: str) -> tuple[list[str], dict[str, float], bool]:
        res = env.step({"role": "assistant", "content": text})
        return [m["content"] for m in res.messages], res.counts, res.done

    assert answer(_call("lookup", key="qe")) == (
        [value_of("qe")],
        {"tool_calls": 1, "tool_errors": 0},
        False,
    )
    assert answer("417") == ([], {"tool_calls": 0, "tool_errors": 0}, True)  # no call: the answer
    cases = {
        _call("_raises", key="x"): "error: tool '_raises' raised RuntimeError: the backend is down",
        _call("_number", key="x"): "error: tool '_number' returned int, not text",
        _call(
            "nope"
        ): "error: no tool 'nope'; the tools are lookup, _raises, _number, _hangs, _pid, _exits",
        _call("lookup", key=3): "error: bad arguments for 'lookup': 3 is not of type 'string'",
        _call("lookup"): "error: bad arguments for 'lookup': 'key' is a required property",
        "<tool_call>{not json</tool_call>": "error: the tool call '{not json' is not JSON",
        _call("lookup", key="QQQ"): "error: tool 'lookup' raised KeyError",
    }
    for text, start in cases.items():
        out, counts, done = answer(text)
        assert out[0].startswith(start), (text, out)
        assert counts == {"tool_calls": 1, "tool_errors": 1} and not done
    t0 = time.monotonic()
    out, counts, _ = answer(_call("_hangs", key="x") + _call("lookup", key="ab"))
    assert time.monotonic() - t0 < 2.0  # the timeout fired; the hung call was left behind
    assert out == ["error: tool '_hangs' did not answer within 0.3 s", value_of("ab")]
    assert counts == {"tool_calls": 2, "tool_errors": 1}
    (pid,), _, _ = answer(_call("_pid", key="x"))
    assert (int(pid) != os.getpid()) == bool(processes)  # a worker process ran it
    if processes:
        # the hung call's process was killed, not left running; a fresh one took its place
        alive = {p.pid for p in multiprocessing.active_children() if p.name == "engine-core-tool"}
        assert int(pid) in alive and len(alive) <= processes
        # a tool that ends its own process: an error observation, and the pool goes on
        (died,), counts, _ = answer(_call("_exits", key="x"))
        assert died == "error: tool '_exits' ended its process (exit code 3)"
        assert counts == {"tool_calls": 1, "tool_errors": 1}
        from engine_core_roles.episodes.tool_processes import TOOL_PROCESSES

        deadline = time.monotonic() + 120  # replacements start in the background
        while TOOL_PROCESSES._idle.qsize() < processes and time.monotonic() < deadline:
            time.sleep(0.1)
        assert answer(_call("lookup", key="ab"))[0] == [value_of("ab")]
        with pytest.raises(ConfigError, match="cannot run in a tool process"):
            ToolEnvironment([lambda key: key], processes=1)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"name": "f"}, 'must be a dict with "type": "function"'),
        ({"type": "function", "function": {"description": "x"}}, "needs function.name"),
        (
            {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}},
            'must be a JSON schema of type "object"',
        ),
        (
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"a": {"type": "integr"}}},
                },
            },
            "is not a valid JSON schema",
        ),
    ],
)
def test_tool_schemas_are_checked(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_tool_schema(schema, "f")


def test_a_tool_without_a_derivable_schema_is_refused() -> None:
    def undocumented(key):  # type: ignore[no-untyped-def]
        return key

    with pytest.raises(ConfigError, match="no schema could be derived"):
        ToolEnvironment([undocumented])
    with pytest.raises(ConfigError, match="env.tools='no_such_mod:fn'"):
        ToolEnvironment(["no_such_mod:fn"])


# -- the episode loop ----------------------------------------------------------------------------


class Chatter(Environment):
    """Answers every assistant message with a user message and never ends an episode: each
    episode runs until max_turns (or another limit) stops it."""

    def reset(self, row: Any) -> list[dict[str, Any]]:
        return [{"role": "user", "content": row["key"]}]

    def step(self, message: dict[str, Any]) -> StepResult:
        return StepResult([{"role": "user", "content": "go on"}], reward=0.25)


class Recorder(BaseRollout):
    """Hands each generate call to a real rollout and keeps what it sampled, per call."""

    def __init__(self, inner: BaseRollout) -> None:
        super().__init__(inner.config)
        self.inner, self.calls = inner, []
        self.pad_token_id = inner.pad_token_id

    def generate(self, prompts: Any, params: SamplingParams) -> Any:
        out = self.inner.generate(prompts, params)
        self.calls.append((prompts.clone(), out.clone()))
        return out

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return self.inner.expected_weights()

    def load_weights(self, buckets: Any) -> Any:
        return self.inner.load_weights(buckets)


def _rollout(backend: str) -> BaseRollout:
    raw: dict[str, Any] = {"backend": backend, "model": MODEL}
    if backend == "vllm":
        pytest.importorskip("vllm", reason="make setup installs the vllm plugin")
        raw["max_model_len"] = 256
    spec, cfg = resolve_rollout_config(raw, load_plugins())
    rollout: BaseRollout = spec.load_class()(cfg)
    return rollout


def _prompts(keys: list[str]) -> Any:
    from tensordict import NonTensorStack

    from engine_core_roles import prompt_batch

    batch = prompt_batch([[1]] * len(keys))  # the loop renders each episode's own prompt
    batch[ROW] = NonTensorStack.from_list([{"key": k, "answer": value_of(k)} for k in keys])
    return batch


@pytest.fixture(scope="module")
def actor() -> Actor:
    return Actor(ActorConfig(), build_engine(model=MODEL))


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_three_turn_episodes_keep_exact_tokens_and_log_probs(
    backend: str, tokenizer: Any, actor: Actor
) -> None:
    inner = _rollout(backend)
    inner.load_weights(sent_buckets(actor.engine.named_full_params()))
    recorder = Recorder(inner)
    episodes = EpisodeRollout(recorder, Chatter, tokenizer, max_turns=3, max_episode_tokens=256)
    # half the vocabulary stops a turn: turns of a few tokens, nearly all ending with a stop
    params = SamplingParams(
        temperature=1.0, max_new_tokens=8, n=2, seed=5, stop_token_ids=list(range(0, 80, 2))
    )
    gen = episodes.generate(_prompts(["qe", "ab", "zz"]), params)
    assert gen.batch_size[0] == 6
    records = gen[EPISODE].tolist()
    assert [r["turns"] for r in records] == [3] * 6, records
    assert {r["end"] for r in records} == {"max_turns"}
    assert gen[TRUNCATED].tolist() == [True] * 6  # ended by a limit, not by the model
    assert [r["reward"] for r in records] == [0.75] * 6  # each turn answered, the last too
    template = _Template(tokenizer, None)
    for k, rec in enumerate(records):
        # the response is, token for token, what each turn sampled, then what the environment
        # appended: the template's rendering of its messages after that turn
        expected: list[int] = []
        trained: list[int] = []
        for turn, (_, out) in enumerate(recorder.calls):
            row = sum(1 for r in records[:k] if r["turns"] > turn)
            sampled = out[RESPONSE_IDS][row][out[RESPONSE_MASK][row].bool()].tolist()
            expected += sampled
            trained += [1] * len(sampled)
            if turn < 2:
                text = tokenizer.decode(sampled, skip_special_tokens=False)
                obs = template.after_turn(text, [{"role": "user", "content": "go on"}])
                expected += obs
                trained += [0] * len(obs)
        mask = gen[RESPONSE_MASK][k].bool()
        assert gen[RESPONSE_IDS][k][mask].tolist() == expected
        assert gen[RESPONSE_LOSS_MASK][k][mask].tolist() == trained
        prompt = gen[PROMPT_IDS][k][gen[PROMPT_MASK][k].bool()].tolist()
        first = [{"role": "user", "content": rec["messages"][0]["content"]}]
        assert prompt == list(
            tokenizer.apply_chat_template(
                first, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    # the training batch trains on the sampled tokens only, and the trainer's log-probs of
    # them equal the rollout's
    batch = training_batch(gen, params)
    width = gen[PROMPT_IDS].shape[1]
    assert torch.equal(batch["loss_mask"][:, width:], gen[RESPONSE_LOSS_MASK])
    assert torch.equal(
        batch["input_ids"][:, width:][gen[RESPONSE_MASK].bool()],
        gen[RESPONSE_IDS][gen[RESPONSE_MASK].bool()],
    )
    trainer_lp = actor.compute_log_prob(batch)["old_log_probs"][:, width:]
    model = gen[RESPONSE_LOSS_MASK].bool()
    gap = (trainer_lp - gen[ROLLOUT_LOG_PROBS]).abs()[model]
    assert float(gap.max()) <= 1e-5
    assert float(gen[ROLLOUT_LOG_PROBS][~model].abs().max()) == 0.0
    metrics = episode_metrics(gen)
    assert metrics["episode/turns"] == 3.0 and metrics["episode/end_max_turns"] == 1.0
    share = float(model.sum()) / float(gen[RESPONSE_MASK].sum())
    assert metrics["episode/trained_token_share"] == pytest.approx(share)


def test_the_gradient_on_environment_tokens_is_exactly_zero(tokenizer: Any) -> None:
    """Hand-checkable: one episode [prompt | model 2 tokens | env 3 tokens | model 1 token];
    the PPO loss's gradient reaches the logits of the three model tokens and none other."""
    from transformers import AutoModelForCausalLM

    from engine_core.config import ModelConfig
    from engine_core.loss import GlobalBatchContext
    from engine_core.models import build_hf_config
    from engine_core_roles.algorithms.losses import policy_loss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_hf_config(ModelConfig.model_validate(MODEL)))
    from tensordict import TensorDict

    gen = TensorDict(
        {
            PROMPT_IDS: torch.tensor([[5, 6]]),
            PROMPT_MASK: torch.tensor([[1, 1]]),
            RESPONSE_IDS: torch.tensor([[10, 11, 20, 21, 22, 12]]),
            RESPONSE_MASK: torch.tensor([[1, 1, 1, 1, 1, 1]]),
            RESPONSE_LOSS_MASK: torch.tensor([[1, 1, 0, 0, 0, 1]]),
            ROLLOUT_LOG_PROBS: torch.zeros(1, 6),
        },
        batch_size=[1],
    )
    batch = training_batch(gen, SamplingParams())
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 1]]
    logits = model(input_ids=batch["input_ids"]).logits.detach().requires_grad_(True)
    # the log-prob of token t is read from the logits at t - 1
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(1, 1), lp], 1)
    mask = batch["loss_mask"]
    ctx = GlobalBatchContext(global_num_tokens=int(mask.sum()), global_num_samples=1)
    adv = torch.ones_like(lp) * mask
    clip = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    loss = policy_loss(lp, lp.detach(), adv, mask, ctx, **clip)["pg_loss"]
    loss.backward()
    assert logits.grad is not None
    reaches = logits.grad.abs().sum(-1)[0]
    # logits at position t predict token t + 1: model tokens sit at 2, 3 and 7
    assert [bool(v > 0) for v in reaches] == [False, True, True, False, False, False, True, False]
    assert float(reaches[[0, 3, 4, 5, 7]].abs().max()) == 0.0


def test_episode_limits_and_environment_failures(tokenizer: Any, actor: Actor) -> None:
    inner = _rollout("hf")
    inner.load_weights(sent_buckets(actor.engine.named_full_params()))

    class Broken(Chatter):
        def step(self, message: dict[str, Any]) -> Any:
            if message["content"].startswith(("1", "3")):
                raise RuntimeError("cannot")
            return "not a StepResult"

    params = SamplingParams(max_new_tokens=8, n=4, seed=1, stop_token_ids=list(range(0, 80, 2)))
    # a token budget smaller than one more turn ends every episode after its first
    tight = EpisodeRollout(inner, Chatter, tokenizer, max_turns=5, max_episode_tokens=40)
    gen = tight.generate(_prompts(["ab"]), params)
    assert {r["end"] for r in gen[EPISODE].tolist()} <= {"token_budget", "max_new_tokens"}
    assert max(r["turns"] for r in gen[EPISODE].tolist()) <= 2
    # an environment that raises or answers with something else ends that episode only
    broken = EpisodeRollout(inner, Broken, tokenizer, max_turns=5, max_episode_tokens=256)
    gen = broken.generate(_prompts(["ab", "cd"]), params)
    records = gen[EPISODE].tolist()
    assert all(r["end"] in ("env_error", "max_new_tokens") for r in records)
    # the turn's token limit truncates an episode; an environment's failure does not
    assert gen[TRUNCATED].tolist() == [r["end"] == "max_new_tokens" for r in records]
    errors = [m["content"] for r in records for m in r["messages"] if m["role"] == "error"]
    assert errors and all(
        "Broken.step raised RuntimeError: cannot" in e or "returned str" in e for e in errors
    )
    # a prompt batch without rows is refused, naming the field
    with pytest.raises(ConfigError, match="dataset row, from the 'row' field"):
        broken.generate(_prompts(["ab"]).exclude(ROW), params)


def test_demonstrations_tokenize_as_the_template_renders_them(tokenizer: Any) -> None:
    env = ToolEnvironment([lookup])
    demo = demonstration("qe")
    batch = demo_batch(tokenizer, env.tools, [demo])
    ids = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    whole = tokenizer.apply_chat_template(demo, tools=env.tools, tokenize=True, return_dict=False)
    assert ids == list(whole)[:-1]  # all but the template's newline after the last turn
    trained = tokenizer.decode(batch["input_ids"][0][batch["loss_mask"][0].bool()])
    call = _call("lookup", key="qe")
    assert trained == f"{call}<|im_end|>{value_of('qe')}<|im_end|>"


def test_a_demonstrations_own_tools_render_in_place_of_the_environments(tokenizer: Any) -> None:
    """A demonstration file's line may name the tools its episode was played with (an agent
    job has no environment to give them): they render as the environment's would, and a
    line's bad ``tools`` are refused naming the line."""
    from engine_core_roles.jobs.rl.warmup import _line_tools

    env = ToolEnvironment([lookup])
    # the shipped demonstrations name the schema the environment derives (its return type aside)
    derived = {k: v for k, v in env.tools[0]["function"].items() if k != "return"}
    assert derived == LOOKUP_SCHEMA["function"]
    demos = [demonstration("qe"), demonstration("ab")]
    with_env = demo_batch(tokenizer, env.tools, demos)
    own = demo_batch(tokenizer, None, demos, episode_tools=[[LOOKUP_SCHEMA], [LOOKUP_SCHEMA]])
    bare = demo_batch(tokenizer, None, demos)
    assert torch.equal(own["input_ids"], with_env["input_ids"])
    assert torch.equal(own["loss_mask"], with_env["loss_mask"])
    assert own["input_ids"].shape[1] > bare["input_ids"].shape[1]  # the tools' system turn
    mixed = demo_batch(tokenizer, None, demos, episode_tools=[[LOOKUP_SCHEMA], None])
    assert torch.equal(mixed["input_ids"][0], with_env["input_ids"][0])
    n = int(bare["attention_mask"][1].sum())
    assert torch.equal(mixed["input_ids"][1][:n], bare["input_ids"][1][:n])
    assert _line_tools(None, "line 1") is None
    with pytest.raises(ConfigError, match="line 3: 'tools' must be a list"):
        _line_tools({"type": "function"}, "line 3")
    with pytest.raises(ConfigError, match="line 4: tool 0: its schema needs function.name"):
        _line_tools([{"type": "function", "function": {}}], "line 4")


def test_environment_config_errors() -> None:
    with pytest.raises(ConfigError, match="env.cls='no_such_pkg.envs:Env'"):
        load_environment(EnvConfig(cls="no_such_pkg.envs:Env"), prompt_key="prompt")
    with pytest.raises(
        ConfigError, match="env.tools, env.parser and env.tool_processes configure the built-in"
    ):
        load_environment(
            EnvConfig(cls="tests.test_agents:Chatter", tools=["x:y"]), prompt_key="prompt"
        )
    with pytest.raises(ConfigError, match="raised TypeError"):
        load_environment(
            EnvConfig(cls="tests.test_agents:Chatter", kwargs={"bad": 1}), prompt_key="prompt"
        )
    make = load_environment(EnvConfig(cls="tests.test_agents:Chatter"), prompt_key="prompt")
    assert type(make()).__name__ == "Chatter"


def test_recipe_loads() -> None:
    assert load_yaml(RECIPE)["env"]["tools"] == ["engine_core_roles.data.tasks.tiny_agent:lookup"]


# -- the job -------------------------------------------------------------------------------------


def _job(out: Path, *overrides: str) -> dict[str, Any]:
    from engine_core.configio import apply_overrides

    base = [
        f"output_dir={out}",
        "steps=3",
        "prompts_per_step=2",
        "trainer.samples_per_prompt=2",
        "warmup_sft_steps=2",
        "warmup_batch_size=4",
        "eval.every=2",
        "eval.max_prompts=2",
        "log_every=1",
        "save_every=1",
    ]
    return apply_overrides(load_recipe(RECIPE), [*base, *overrides])


def _rows(out: Path) -> list[dict[str, Any]]:
    from engine_core_roles.trainer.metrics import TIMING_KEYS

    volatile = set(TIMING_KEYS)
    return [
        {k: v for k, v in json.loads(line).items() if k not in volatile}
        for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


def test_the_agent_recipe_trains_logs_episodes_and_resumes_exactly(tmp_path: Path) -> None:
    from engine_core_roles.jobs.rl.run import run_rl_job

    straight = tmp_path / "straight"
    run_rl_job(_job(straight), load_plugins())
    rows = _rows(straight)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/logprob_diff_max"] <= 1e-5  # on the model's tokens
        assert 1.0 <= r["episode/turns"] <= 3.0
        assert 0.0 < r["episode/trained_token_share"] <= 1.0
        ends = sum(
            r[f"episode/end_{x}"]
            for x in ("done", "max_turns", "token_budget", "max_new_tokens", "env_error")
        )
        assert ends == pytest.approx(1.0)
    assert "val/pass@1" in rows[2]
    samples = [json.loads(x) for x in (straight / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["episode"][0]["role"] == "user" for s in samples)
    assert all(
        m["role"] in ("user", "assistant", "tool", "error") for s in samples for m in s["episode"]
    )
    # the tool in worker processes: the same step as on threads (enough warm-up that the
    # model calls the tool)
    called = ["steps=1", "warmup_sft_steps=30"]
    run_rl_job(_job(tmp_path / "threads", *called), load_plugins())
    run_rl_job(_job(tmp_path / "procs", *called, "env.tool_processes=2"), load_plugins())
    (on_threads,), (in_procs,) = _rows(tmp_path / "threads"), _rows(tmp_path / "procs")
    assert on_threads["episode/tool_calls"] > 0
    assert in_procs == on_threads
    # stopped after step 2 and resumed: the same episodes, the same metrics
    resumed = tmp_path / "resumed"
    run_rl_job(_job(resumed, "steps=2"), load_plugins())
    run_rl_job(_job(resumed), load_plugins(), resume=True)
    assert _rows(resumed) == rows


def test_episodes_under_dp2_with_replicas_and_async_equal_the_colocated_run(
    tmp_path: Path,
) -> None:
    """Two rollout processes, each running its prompts' episodes whole, one step ahead of the
    actor: the actor as two data-parallel processes logs the same metrics, step by step, as
    the actor in this process (the same episodes; the update equal up to float rounding); and
    step 1, which both generate from the initial weights, is the colocated synchronous run's
    step 1 (an episode's turns draw from its own seed, not its replica's or its batch's)."""
    from engine_core_roles.jobs.rl.run import run_rl_job

    modes = [
        "steps=2",
        "warmup_sft_steps=0",
        "eval.every=0",
        "rollout_placement=process",
        "rollout_replicas=2",
        "trainer.max_staleness=1",
    ]
    run_rl_job(_job(tmp_path / "one", *modes), load_plugins())
    run_rl_job(
        _job(tmp_path / "dp2", *modes, "placement.executor=local", "placement.actor.dp=2"),
        load_plugins(),
    )
    one, dp2 = _rows(tmp_path / "one"), _rows(tmp_path / "dp2")
    assert [r["step"] for r in one] == [1, 2]
    assert [r["rollout/staleness"] for r in one] == [0.0, 1.0]
    assert one[0]["rollout/replica0/logprob_diff_max"] <= 1e-5  # fresh weights: float noise
    assert one[0]["rollout/replica1/logprob_diff_max"] <= 1e-5
    assert all(r["episode/turns"] >= 1.0 for r in one)
    assert len(one) == len(dp2)
    for a, b in zip(one, dp2, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["step"], k)
    run_rl_job(
        _job(tmp_path / "colo", "steps=1", "warmup_sft_steps=0", "eval.every=0"), load_plugins()
    )
    (colo,) = _rows(tmp_path / "colo")
    shared = {k for k in colo.keys() & dp2[0].keys() if not k.startswith("rollout/replica")}
    assert {"reward", "episode/turns", "episode/tool_calls", "actor/pg_loss"} <= shared
    for k in sorted(shared):
        assert dp2[0][k] == pytest.approx(colo[k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize(
    "overrides",
    [["trainer.algorithm=ppo"], ["rollout.backend=vllm", "rollout.max_model_len=256"]],
    ids=["ppo", "vllm"],
)
def test_episodes_with_ppo_and_vllm(tmp_path: Path, overrides: list[str]) -> None:
    from engine_core_roles.jobs.rl.run import run_rl_job

    if "rollout.backend=vllm" in overrides:
        pytest.importorskip("vllm", reason="make setup installs the vllm plugin")
    out = tmp_path / "run"
    run_rl_job(_job(out, "steps=2", "eval.every=0", *overrides), load_plugins())
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert max(r["rollout/logprob_diff_max"] for r in rows) <= 1e-4
    assert all(r["episode/turns"] >= 1.0 for r in rows)
    if "trainer.algorithm=ppo" in overrides:
        assert all("critic/vf_loss" in r for r in rows)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["env.cls=no_such_pkg.envs:Env", "env.tools=[]"],
            "env.cls='no_such_pkg.envs:Env': module",
        ),
        (["env.tools=[tests.test_agents:_untyped]"], "tool _untyped: no schema could be derived"),
        (["env.cls=tests.test_agents:NotMessages", "env.tools=[]"], "return a list of messages"),
        (["env.max_episode_tokens=1000"], "more than the model's context (256 tokens)"),
        (["trainer.filter_groups=true"], "not built for episodes yet"),
    ],
)
def test_bad_agent_input_is_refused_before_anything_trains(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    from engine_core_roles.jobs.rl.run import run_rl_job

    out = tmp_path / "run"
    with pytest.raises((ConfigError, ValueError)) as e:
        run_rl_job(_job(out, *overrides), load_plugins())
    assert message in str(e.value), str(e.value)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def _untyped(key):  # type: ignore[no-untyped-def]
    return key


class NotMessages(Chatter):
    def reset(self, row: Any) -> Any:
        return "hello"


def test_episodes_pad_as_the_rollout_they_wrap(tokenizer: Any) -> None:
    """One pad id from the rollout outwards: the rollout config's where the model's config names
    none, and the episode loop pads as the rollout it wraps (in this process or a replica's)
    whatever the tokenizer's own pad is."""
    from engine_core.remote_rollout import RolloutWorker

    raw: dict[str, Any] = {"backend": "hf", "model": MODEL, "pad_token_id": 7}
    spec, cfg = resolve_rollout_config(raw, load_plugins())
    inner: BaseRollout = spec.load_class()(cfg)
    own = getattr(inner.model.config, "pad_token_id", None)  # type: ignore[attr-defined]
    assert inner.pad_token_id == (7 if own is None else own)
    episodes = EpisodeRollout(inner, Chatter, tokenizer, max_turns=2, max_episode_tokens=64)
    assert episodes.pad_token_id == inner.pad_token_id
    worker = RolloutWorker.__new__(RolloutWorker)  # the replica's probe, on the same rollout
    worker.rollout = inner
    assert worker.pad_id() == inner.pad_token_id


# -- routes across turns (mixtures of experts) ---------------------------------------------------

MOE_MODEL = {**MODEL, "config": {**MODEL["config"], **AS_QWEN3_MOE}}


@pytest.mark.parametrize("budget", [256, 52], ids=["max-turns", "token-budget"])
def test_episode_routes_are_each_tokens_experts_across_turns(tokenizer: Any, budget: int) -> None:
    """An MoE episode's routes, stitched from its turns, are on every token the experts its
    model's routers choose in one forward over the whole episode (fp32; the last token, fed to
    no forward, aside): three-turn episodes, and episodes that end on environment tokens after
    their budget ran out (fed once more for those routes, the token drawn then dropped)."""
    from engine_core.moe import RouteRecorder

    spec, cfg = resolve_rollout_config({"backend": "hf", "model": MOE_MODEL}, load_plugins())
    inner: BaseRollout = spec.load_class()(cfg)
    episodes = EpisodeRollout(inner, Chatter, tokenizer, max_turns=3, max_episode_tokens=budget)
    stops = list(range(0, 80, 2))  # a turn ends soon, on any even token
    params = SamplingParams(max_new_tokens=8, n=4, seed=3, return_routes=True, stop_token_ids=stops)
    out = episodes.generate(_prompts(["ab", "cd"]), params)
    routes = out[ROUTED_EXPERTS]
    width = out[PROMPT_IDS].shape[1]
    assert routes.shape[:2] == (8, width + out[RESPONSE_IDS].shape[1])
    records = out[EPISODE].tolist()
    if budget == 256:
        assert max(r["turns"] for r in records) == 3
    else:  # the path that feeds an episode once more: it ended on the environment's tokens
        ended_on_env = [
            k
            for k, r in enumerate(records)
            if r["end"] == "token_budget"
            and out[RESPONSE_LOSS_MASK][k][out[RESPONSE_MASK][k].bool()][-1] == 0
        ]
        assert ended_on_env, [r["end"] for r in records]
    model = cast(Any, inner).model
    for k in range(out.batch_size[0]):
        p, r = out[PROMPT_MASK][k].bool(), out[RESPONSE_MASK][k].bool()
        ids = torch.cat([out[PROMPT_IDS][k][p], out[RESPONSE_IDS][k][r]])
        with torch.no_grad(), RouteRecorder(model) as rec:
            model(ids[None])
        want = rec.routes().permute(1, 0, 2)  # [tokens, layers, top_k]
        got = torch.cat([routes[k, :width][p], routes[k, width:][r]])
        same = (got.sort(-1).values == want.sort(-1).values).all(-1).all(-1)
        assert bool(same[:-1].all()), f"episode {k}: tokens {(~same[:-1]).nonzero().flatten()}"
