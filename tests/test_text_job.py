"""The text job: a user's model folder (Qwen2 tokenizer and chat template), JSONL and Parquet
prompt files, and a reward function given by a path outside the repository."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.backend import BackendRegistry, Capability, hookimpl
from engine_core.configio import apply_overrides, load_yaml
from engine_core.errors import ConfigError
from engine_core.plugins import load_plugins
from engine_core_roles.jobs.cli import RECIPES
from engine_core_roles.jobs.rl.run import run_rl_job
from engine_core_roles.trainer.metrics import TIMING_KEYS
from tests.fixtures.text_model import build_model_folder

REWARD_MODULE = '''
def ends_with_answer(prompt, response, answer, **row):
    """1 when the response contains the answer; a component per check."""
    assert isinstance(row["prompt_ids"], list) and isinstance(row["response_ids"], list)
    return {"score": float(str(answer) in response), "nonempty": float(bool(response))}

def wrong_type(prompt, response, **row):
    return "high"

def wrong_count(prompts, responses, **columns):
    return [0.0]

def fails_on_long(prompt, response, **row):
    if len(row["response_ids"]) > 2:
        raise ValueError("too long to score")
    return 0.0
'''


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The files a user brings: a model folder, prompt files, a reward module."""
    root = tmp_path_factory.mktemp("user")
    model = build_model_folder(root / "model")
    rows = [
        {"prompt": [{"role": "user", "content": f"add {a} and {b}"}], "answer": str(a + b)}
        for a in range(6)
        for b in range(4)
    ]
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    import datasets

    val = root / "val.parquet"
    datasets.Dataset.from_list(
        [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(5)]
    ).to_parquet(str(val))
    reward = root / "my_rewards.py"
    reward.write_text(REWARD_MODULE)
    return {"root": root, "model": model, "train": train, "val": val, "reward": reward}


def _raw(user: dict[str, Path], out: Path, *overrides: str) -> dict[str, Any]:
    raw = load_yaml(RECIPES / "grpo_tiny.yaml")
    raw.pop("task")
    raw["engine"]["model"] = {"path": str(user["model"])}
    raw["data"] = {"train_files": [str(user["train"])]}
    raw["reward"] = {"fn": f"{user['reward']}:ends_with_answer"}
    raw["trainer"].update({"max_new_tokens": 6, "samples_per_prompt": 4})
    base = [f"output_dir={out}", "steps=4", "prompts_per_step=4", "log_every=1", "save_every=2"]
    return apply_overrides(raw, [*base, *overrides])


def _rows(out: Path) -> list[dict[str, Any]]:
    volatile = set(TIMING_KEYS)
    return [
        {k: v for k, v in json.loads(line).items() if k not in volatile}
        for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


def test_a_users_files_train_evaluate_resume_and_export(
    user: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    val = [
        f"data.val_files=[{user['val']}]",
        "eval.every=2",
        "eval.greedy=false",
        "eval.samples_per_prompt=2",
    ]
    straight = tmp_path / "straight"
    summary = run_rl_job(_raw(user, straight, *val), load_plugins())
    rows = _rows(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert {"val/reward", "val/pass@1", "val/pass@2"} <= rows[1].keys()
    assert "val/pass@2" not in rows[0] and "reward/nonempty" in rows[0]
    assert "reward/zero_variance_groups" in rows[0]
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4
    assert summary["best_val_metric"] == "val/pass@2"
    # the samples log: what the reward function saw is the decode of the sampled ids
    tok = AutoTokenizer.from_pretrained(user["model"])
    shown = [json.loads(line) for line in (straight / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in shown} == {1, 2, 3, 4}
    assert all(s["prompt"].startswith("<|im_start|>user\nadd ") for s in shown)
    assert all(s["prompt"].endswith("<|im_start|>assistant\n") for s in shown)

    # interrupted after step 2, resumed: the same prompts and the same metrics
    resumed = tmp_path / "resumed"
    run_rl_job(_raw(user, resumed, *val, "steps=2"), load_plugins())
    run_rl_job(_raw(user, resumed, *val), load_plugins(), resume=True)
    assert _rows(resumed) == rows
    again = [json.loads(line) for line in (resumed / "samples.jsonl").read_text().splitlines()]
    assert again == shown

    # the export loads with transformers and chats through the tokenizer's template
    model = AutoModelForCausalLM.from_pretrained(summary["hf_export"])
    tok = AutoTokenizer.from_pretrained(summary["hf_export"])
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "add 1 and 2"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=False,
    )
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert isinstance(tok.decode(out[0, ids.shape[1] :]), str)


def test_prompts_render_like_the_chat_template_and_decode_like_the_tokenizer(
    user: dict[str, Path],
) -> None:
    from transformers import AutoTokenizer

    from engine_core.rollout import PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK
    from engine_core_roles.data.datasets.prompts import DataConfig, PromptData
    from engine_core_roles.data.rewards.functions import RewardConfig
    from engine_core_roles.data.rewards.text import TextReward

    tok = AutoTokenizer.from_pretrained(user["model"])
    data = PromptData(
        [str(user["train"])], tok, DataConfig(train_files=[str(user["train"])]), max_length=64
    )
    for i in range(3):
        messages = json.loads(user["train"].read_text().splitlines()[i])["prompt"]
        want = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert data.render(messages) == list(want)
    text_cfg = DataConfig(train_files=[str(user["val"])])
    val = PromptData([str(user["val"])], tok, text_cfg, max_length=64)
    assert val.render("3+3=") == tok("3+3=", add_special_tokens=False)["input_ids"]
    # a response with the stop token and padding decodes to the tokenizer's decode of its ids
    batch = val.batch([1, 2])
    sampled = torch.tensor([[51, 32, 256, 257], [52, 257, 257, 257]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    samples = batch.clone()
    samples[RESPONSE_IDS], samples[RESPONSE_MASK] = sampled, mask
    reward = TextReward(RewardConfig(fn="exact_match"), tok, val)
    prompts, responses, p_ids, r_ids = reward.decode(samples)
    assert responses == [tok.decode([51, 32, 256], skip_special_tokens=True), tok.decode([52])]
    assert responses == ["3 ", "4"]
    assert prompts[0] == tok.decode(batch[PROMPT_IDS][0][batch[PROMPT_MASK][0].bool()])
    # that was the Rust backend's path; transformers' own decode gives the very same text
    assert reward._decode.backend is not None
    reward._decode.backend = None
    assert reward.decode(samples)[:2] == (prompts, responses)
    scored = reward(batch, samples)
    assert scored.scores.tolist() == [0.0, 1.0]  # the rows' answers are "2" and "4"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.prompt_key=question"], "no 'question' column; the columns are prompt, answer"),
        (["reward.fn=no_such_module_here:fn"], "module 'no_such_module_here' cannot be imported"),
        (["reward.fn=REWARD:missing"], "has no 'missing'"),
        (["reward.fn=REWARD:wrong_type"], "returned str ('high') for sample 0; return a float"),
        (["reward.fn=REWARD:wrong_count", "reward.batched=true"], "returned 1 for 2 samples"),
        (["data.max_prompt_length=5"], "all 24 prompts are longer than 5 tokens"),
        (["data.train_files=[EMPTY]"], "holds no rows"),
        (["engine.model.tokenizer=SMALL"], "has 259 tokens but the model's vocabulary has 200"),
        (["warmup_sft_steps=2"], "give data.demos (or env.demos with env)"),
        (["warmup_sft_steps=2", "data.demos=[EMPTY]"], "hold no demonstration"),
    ],
)
def test_bad_text_input_is_refused_before_anything_trains(
    user: dict[str, Path], tmp_path: Path, overrides: list[str], message: str
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    small = tmp_path / "small"
    if any("SMALL" in o for o in overrides):
        build_model_folder(small, vocab_size=200)
        overrides = [*overrides, f"engine.model.path={small}"]
    subs = {"REWARD": str(user["reward"]), "EMPTY": str(empty), "SMALL": str(user["model"])}
    for key, value in subs.items():
        overrides = [o.replace(key, value) for o in overrides]
    out = tmp_path / "run"
    with pytest.raises((ConfigError, ValueError)) as e:  # ValueError: the config's validation
        run_rl_job(_raw(user, out, *overrides), load_plugins())
    assert message in str(e.value), str(e.value)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_a_warm_up_on_demonstrations_teaches_their_form(
    user: dict[str, Path], tmp_path: Path
) -> None:
    """data.demos: the training prompts answered (a number, then the end of turn). After the
    supervised warm-up, step 1's samples (drawn before any RL update) take that form: every
    response is a number and its stop token, where the cold model's run to max_new_tokens."""
    demos = tmp_path / "demos.jsonl"
    rows = [json.loads(line) for line in user["train"].read_text().splitlines()]
    demos.write_text(
        "".join(
            json.dumps({"messages": [*r["prompt"], {"role": "assistant", "content": r["answer"]}]})
            + "\n"
            for r in rows
        )
    )
    short = ["steps=1", "engine.optim.lr=1e-2"]
    # the cold run also ends its responses at a stop string of three tokens (the rollout's;
    # where it ends them is the rollout kit's to check)
    run_rl_job(_raw(user, tmp_path / "cold", *short, "trainer.stop_strings=[END]"), load_plugins())
    warm = [f"data.demos=[{demos}]", "warmup_sft_steps=40", "warmup_batch_size=8"]
    run_rl_job(_raw(user, tmp_path / "warm", *short, *warm), load_plugins())
    cold, warm_row = _rows(tmp_path / "cold")[0], _rows(tmp_path / "warm")[0]
    assert cold["response_length"] > 4.0, cold["response_length"]  # max_new_tokens: 6
    assert warm_row["response_length"] <= 3.0, warm_row["response_length"]
    samples = [
        json.loads(x) for x in (tmp_path / "warm" / "samples.jsonl").read_text().splitlines()
    ]
    assert samples and all(s["response"].isdigit() for s in samples), samples


def test_a_reward_that_fails_skips_the_step_and_then_stops_the_run(
    user: dict[str, Path], tmp_path: Path
) -> None:
    from engine_core.errors import RunFailed

    out = tmp_path / "run"
    raw = _raw(
        user,
        out,
        f"reward.fn={user['reward']}:fails_on_long",
        "trainer.max_consecutive_skipped_updates=2",
    )
    with pytest.raises(
        RunFailed,
        match="samples could not be scored; the last: reward function .*fails_on_long raised ValueError: too long to score on sample",
    ):
        run_rl_job(raw, load_plugins())
    rows = _rows(out)
    assert rows and all(r["actor/num_optimizer_steps"] == 0.0 for r in rows)
    assert all(r["reward/failed_samples"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.backend=vllm"],
        ["engine.backend=megatron"],
        [
            "placement.executor=local",
            "placement.actor.dp=2",
            "rollout_placement=process",
            "rollout_replicas=2",
        ],
    ],
    ids=["vllm", "megatron", "local-dp2-replicas2"],
)
def test_the_text_job_on_other_backends_and_placements(
    user: dict[str, Path], tmp_path: Path, overrides: list[str]
) -> None:
    """The same files through the vllm rollout, the megatron engine, and a dp=2 actor group
    with two rollout replicas: it trains, evaluates, and the rollout's log-probs match."""
    out = tmp_path / "run"
    val = [f"data.val_files=[{user['val']}]", "eval.every=2"]
    summary = run_rl_job(_raw(user, out, "steps=2", *val, *overrides), load_plugins())
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2] and "val/pass@1" in rows[1]
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4
    assert (Path(summary["hf_export"]) / "tokenizer_config.json").is_file()


def test_filter_groups_replaces_groups_that_all_scored_the_same(tmp_path: Path) -> None:
    """Dynamic sampling on the shipped digit recipe: early on most groups score alike; the
    trained batch holds fewer such groups than the first draw, from extra draws."""
    raw = apply_overrides(
        load_yaml(RECIPES / "grpo_tiny.yaml"),
        [
            f"output_dir={tmp_path}",
            "steps=3",
            "trainer.filter_groups=true",
            "trainer.max_extra_draws=2",
            "trainer.samples_per_prompt=4",
        ],
    )
    run_rl_job(raw, load_plugins())
    rows = _rows(tmp_path)
    assert all(r["filter/extra_draws"] >= 1 for r in rows)  # the first draws had alike groups
    for r in rows:
        assert r["reward/zero_variance_groups"] < r["filter/first_draw_zero_variance_groups"]
        assert r["filter/groups_that_differ"] == 1.0 - r["reward/zero_variance_groups"]
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4


class _IdsOnlyRolloutPlugin:
    """The example rollout registered as one that stops on token ids only."""

    @hookimpl
    def engine_core_register(self, registry: BackendRegistry) -> None:
        registry.register_rollout(
            "ids-only",
            "engine_core_example.rollout:ExampleRollout",
            config="engine_core.rollout:RolloutConfig",
            capabilities={Capability.CPU, Capability.LOGPROBS},
        )


def test_stop_strings_reach_the_rollout_and_are_refused_where_nothing_can_find_them(
    user: dict[str, Path], tmp_path: Path
) -> None:
    """trainer.stop_strings go into every generation's SamplingParams (training and
    evaluation) and the rollout stops on them (the rollout kit checks where); a job whose model
    has no tokenizer (the digit task) or whose rollout does not stop on strings is refused
    before anything is built, and data.stop_strings says where the setting lives."""
    from engine_core.errors import CapabilityError
    from engine_core_roles import TrainerConfig

    assert TrainerConfig(stop_strings=["END"]).sampling_params(3).stop_strings == ["END"]
    # the tokenizer's own stops: EOS (this one has no end-of-turn token)
    from transformers import AutoTokenizer

    from engine_core_roles.data.datasets.stop_strings import stop_token_ids

    tok = AutoTokenizer.from_pretrained(user["model"])
    assert stop_token_ids(tok) == [tok.eos_token_id]
    digits = apply_overrides(
        load_yaml(RECIPES / "grpo_tiny.yaml"),
        [f"output_dir={tmp_path / 'digits'}", "trainer.stop_strings=[END]"],
    )
    with pytest.raises(ConfigError, match="the model has no tokenizer"):
        run_rl_job(digits, load_plugins())
    raw = _raw(user, tmp_path / "ids", "trainer.stop_strings=[END]", "rollout.backend=ids-only")
    manager = load_plugins()
    manager.register(_IdsOnlyRolloutPlugin(), "ids-only-plugin")
    with pytest.raises(CapabilityError, match=r"trainer.stop_strings=\['END'\]: rollout: "):
        run_rl_job(raw, manager)
    with pytest.raises(ValueError, match="set trainer.stop_strings instead"):
        run_rl_job(_raw(user, tmp_path / "data", "data.stop_strings=[END]"), load_plugins())
    for out in ("digits", "ids", "data"):
        assert not (tmp_path / out).exists()


def test_the_three_override_command_runs_as_typed_and_says_what_it_dropped(
    user: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``engine-core run engine.model.path=M data.train_files=[T] reward.fn=R`` on the default
    recipe: the model folder replaces the shipped model's config and tokenizer, the training
    files the shipped task's validation files, demonstrations, warm-up and evaluation; one line
    says so, and the run trains (steps and output folder set so the test is short)."""
    from engine_core_roles.jobs.cli import main

    code = main(
        [
            "run",
            f"engine.model.path={user['model']}",
            f"data.train_files=[{user['train']}]",
            f"reward.fn={user['reward']}:ends_with_answer",
            "steps=1",
            f"output_dir={tmp_path}",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "dropped settings" in x)
    assert (
        "engine.model.path replaces the recipe's engine.model.config, engine.model.tokenizer"
        in line
    )
    assert (
        "data.train_files replaces the recipe's data.val_files, data.demos, warmup_sft_steps"
        in line
    )
    assert [r["step"] for r in _rows(tmp_path)] == [1]


def test_settings_given_beside_their_replacement_are_kept(user: dict[str, Path]) -> None:
    """Only what the overrides leave as the recipe had it goes; a setting given on the command
    line stays, and a recipe whose model has no config loses nothing."""
    from engine_core_roles.jobs.cli import load_recipe

    told: list[str] = []
    raw = load_recipe(
        RECIPES / "text_tiny.yaml",
        [f"data.train_files=[{user['train']}]", "warmup_sft_steps=5", "eval.every=50"],
        on_drop=told.append,
    )
    assert raw["warmup_sft_steps"] == 5 and raw["eval"]["every"] == 50
    assert "demos" not in raw["data"] and "val_files" not in raw["data"]
    assert raw["engine"]["model"]["config"]["vocab_size"] == 72  # the model was not replaced
    assert told == [
        "text_tiny.yaml: dropped settings of the recipe that the overrides replace: "
        "data.train_files replaces the recipe's data.val_files, data.demos."
    ]
    told.clear()
    assert load_recipe(RECIPES / "text_tiny.yaml", ["steps=3"], on_drop=told.append)["steps"] == 3
    assert told == []
