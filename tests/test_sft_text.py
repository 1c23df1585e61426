"""`engine-core train` on a user's conversations: a model folder with a Qwen2 tokenizer and chat
template, chat rows in JSONL, Parquet or a saved datasets folder. The loss mask against the
template's own rendering of each turn, a real run (loss, validation loss, exact resume, the
export chatting), and bad input refused before anything is built."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from engine_core.config import ModelConfig
from engine_core.errors import ConfigError
from engine_core.plugins import load_plugins
from engine_core_roles.episodes.demos import demo_batch
from engine_core_roles.jobs.cli import RECIPES, main
from engine_core_roles.jobs.sft import SFTJobConfig, chat_datasets, run_sft
from engine_core_roles.trainer.metrics import TIMING_KEYS
from tests.fixtures.text_model import build_model_folder

S = {"role": "system", "content": "add."}


def _u(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _a(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


# several multi-turn chats: a system message, two and three assistant turns, a tool message
# between turns, a user message after the last answer, words of the template in the content
CHATS = [
    [S, _u("add 2 and 3"), _a("5")],
    [_u("add 1 and 1"), _a("2"), _u("and 4 and 4?"), _a("8")],
    [S, _u("1+2"), _a("3"), _u("2+2"), _a("4"), _u("3+3"), _a("6")],
    [_u("add 9 and 9"), _a("18"), {"role": "tool", "content": "ok"}, _a("the user said 18")],
    [S, _u("7+1"), _a("8"), _u("thanks")],
]
# an assistant turn ends where the model stops: at the template's end of turn
END_OF_TURN = "<|im_end|>"

# a template of another shape: no newline after a turn, a colon after the role, and the
# assistant's turns rendered by a branch of their own
OTHER_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant: "
    "{{ m['content'] }}<|im_end|>{% else %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}"
)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sums(n: int, seed: int) -> list[dict[str, Any]]:
    """Chats of one or two sums, every third with a system message: lengths differ."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        msgs: list[dict[str, str]] = [S] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            a, b = rng.randrange(10), rng.randrange(10)
            msgs += [_u(f"{a}+{b}"), _a(str(a + b))]
        rows.append({"messages": msgs})
    return rows


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """What a user brings: a model folder (tokenizer and ChatML template), chat files."""
    root = tmp_path_factory.mktemp("sft_user")
    model = build_model_folder(root / "model")
    train = _write_jsonl(root / "train.jsonl", _sums(48, seed=0))
    val = _write_jsonl(root / "val.jsonl", _sums(8, seed=1))
    return {"root": root, "model": model, "train": train, "val": val}


def _job(user: dict[str, Path], **data: Any) -> SFTJobConfig:
    return SFTJobConfig.model_validate(
        {"engine": {"backend": "fsdp2", "model": {"path": str(user["model"])}}, "data": data}
    )


def _template_rendering(tok: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """The ids of the whole conversation and a mask of each assistant turn, from the template
    alone: a turn is what ``apply_chat_template`` of the conversation up to and including it
    adds to the rendering up to before it (with the generation prompt), up to and including
    the end of turn (what the template writes after it, a newline say, the model does not
    write: after the last turn it is left out)."""

    def ids(msgs: list[dict[str, Any]], gen: bool) -> list[int]:
        out = tok.apply_chat_template(
            msgs, add_generation_prompt=gen, tokenize=True, return_dict=False
        )
        return list(out)

    end = tok.convert_tokens_to_ids(END_OF_TURN)
    trained: list[int] = []
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = ids(messages[:j], True), ids(messages[: j + 1], False)
        assert through[: len(before)] == before, "the template renders earlier turns anew"
        turn = through[len(before) :]
        trained += range(len(before), len(before) + turn.index(end) + 1)
    whole = ids(messages, messages[-1]["role"] != "assistant")
    if messages[-1]["role"] == "assistant":  # it ends where the model stops
        whole = whole[: trained[-1] + 1]
    mask = [0] * len(whole)
    for p in trained:
        mask[p] = 1
    return whole, mask


@pytest.fixture(scope="module", params=["chatml", "other"])
def template_case(
    request: pytest.FixtureRequest, user: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Any, list[list[dict[str, Any]]]]:
    """The job's training set of CHATS (and one too long for the model) under a template."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp(f"chats_{request.param}")
    model: dict[str, Any] = {"path": str(user["model"])}
    if request.param == "other":
        tok = AutoTokenizer.from_pretrained(user["model"])
        tok.chat_template = OTHER_TEMPLATE
        tok.save_pretrained(root / "tokenizer")
        model["tokenizer"] = str(root / "tokenizer")
    too_long = [_u("x" * 200), _a("y")]
    rows = [{"messages": m} for m in [*CHATS, too_long]]
    files = _write_jsonl(root / "chats.jsonl", rows)
    job = SFTJobConfig.model_validate(
        {
            "engine": {"backend": "fsdp2", "model": model},
            "data": {"train_files": [str(files)], "shuffle": False},
        }
    )
    assert job.data is not None
    chats = chat_datasets(job.data, ModelConfig.model_validate(model))
    assert (len(chats.train), chats.train.dropped) == (len(CHATS), 1)  # too long: counted
    return chats.tokenizer, chats.train, CHATS


def test_the_loss_mask_is_exactly_the_assistants_tokens_as_the_template_renders_them(
    template_case: tuple[Any, Any, list[list[dict[str, Any]]]],
) -> None:
    tok, train, chats = template_case
    batch = train.batch(range(len(chats)))
    for i, messages in enumerate(chats):
        n = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i, :n].tolist()
        mask = batch["loss_mask"][i, :n].tolist()
        whole, expected = _template_rendering(tok, messages)
        assert ids == whole, f"chat {i}: the tokens differ from the template's"
        trained = [tok.decode(t) for t, m in zip(ids, mask, strict=True) if m]
        assert mask == expected, f"chat {i}: trained {trained}"
        # what is trained, read back: each answer and its end of turn, nothing else
        answers = [m["content"] + END_OF_TURN for m in messages if m["role"] == "assistant"]
        assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "".join(answers)
        assert int(batch["loss_mask"][i, n:].sum()) == 0  # padding
        assert batch["position_ids"][i, :n].tolist() == list(range(n))
    # the RL job's warm-up tokenizes the same conversations the same way
    warm = demo_batch(tok, None, chats)
    for key in ("input_ids", "attention_mask", "position_ids", "loss_mask"):
        assert torch.equal(warm[key], batch[key]), key


def test_parquet_and_saved_datasets_folders_read_like_jsonl(
    user: dict[str, Path], tmp_path: Path
) -> None:
    import datasets

    rows = [json.loads(line) for line in user["train"].read_text().splitlines()]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "train.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    batches = []
    for files in (user["train"], tmp_path / "train.parquet", tmp_path / "saved"):
        job = _job(user, train_files=[str(files)], shuffle=False)
        assert job.data is not None
        train = chat_datasets(job.data, ModelConfig.model_validate(job.engine["model"])).train
        batches.append(train.batch(range(len(rows))))
    for other in batches[1:]:
        assert torch.equal(other["input_ids"], batches[0]["input_ids"])
        assert torch.equal(other["loss_mask"], batches[0]["loss_mask"])


# -- a real run --------------------------------------------------------------------------------

STEPS, INTERRUPTED = 24, 12


def _args(user: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """`engine-core train` on the shipped chat recipe with the user's model and files."""
    return [
        "train",
        str(RECIPES / "sft_text_tiny.yaml"),
        f"engine.model.path={user['model']}",
        f"data.train_files=[{user['train']}]",
        f"data.val_files=[{user['val']}]",
        f"output_dir={out}",
        f"steps={STEPS}",
        "batch_size=8",
        "eval_every=6",
        "save_every=12",
        "log_every=6",
        f"engine.optim.total_steps={STEPS}",
        *extra,
    ]


def _rows(out: Path) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
        for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def runs(user: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A straight run, and one that stopped after step INTERRUPTED's checkpoint (its folder
    then: that checkpoint and the metrics up to it) and was resumed to the end."""
    root = tmp_path_factory.mktemp("sft_runs")
    straight, resumed = root / "straight", root / "resumed"
    assert main(_args(user, straight)) == 0
    step = f"global_step_{INTERRUPTED}"
    shutil.copytree(straight / "checkpoints" / step, resumed / "checkpoints" / step)
    rows = (straight / "metrics.jsonl").read_text().splitlines()[:INTERRUPTED]
    (resumed / "metrics.jsonl").write_text("".join(r + "\n" for r in rows))
    assert main([*_args(user, resumed), "--resume"]) == 0
    return {"straight": straight, "resumed": resumed}


def test_a_run_learns_validates_and_resumes_exactly(runs: dict[str, Path]) -> None:
    rows = _rows(runs["straight"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first, last = rows[0], rows[-1]
    assert last["loss"] < 0.5 * first["loss"], (first["loss"], last["loss"])
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    assert [r["step"] for r in rows if "val/loss" in r] == [6, 12, 18, 24]
    assert val[-1] < val[0]
    assert {"grad_norm", "lr", "target_prob", "loss_tokens"} <= first.keys()
    # stopped after step 12 and resumed: the same rows, step for step
    assert _rows(runs["resumed"]) == rows
    assert sorted(p.name for p in (runs["resumed"] / "checkpoints").iterdir()) == [
        "global_step_12",
        "global_step_24",
    ]
    saved = sorted(p.name for p in (runs["straight"] / "checkpoints").iterdir())
    assert saved == ["global_step_12", "global_step_24"]


def test_the_validation_loss_is_the_exports_loss_on_each_answer(
    runs: dict[str, Path], user: dict[str, Path]
) -> None:
    """val/loss at the last step, recomputed from the export with transformers one conversation
    at a time (no packing, no padding): the token-mean NLL of the assistant's tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = runs["straight"] / "hf_export"
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    tok = AutoTokenizer.from_pretrained(export)
    nll, count = 0.0, 0
    for line in user["val"].read_text().splitlines():
        ids, mask = _template_rendering(tok, json.loads(line)["messages"])
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        m = torch.tensor(mask[1:], dtype=torch.bool)
        nll, count = nll - float(lp[m].sum()), count + int(m.sum())
    assert _rows(runs["straight"])[-1]["val/loss"] == pytest.approx(nll / count, abs=1e-4)


def test_the_export_loads_and_chats(runs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = runs["straight"] / "hf_export"
    model = AutoModelForCausalLM.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    ids = tok.apply_chat_template(
        [S, _u("3+4")], add_generation_prompt=True, return_tensors="pt", return_dict=False
    )
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert isinstance(tok.decode(out[0, ids.shape[1] :]), str)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "overrides", "message"),
    [
        (
            [{"prompt": "1+1", "answer": "2"}],
            [],
            "no 'messages' column; the columns are prompt, answer. Set data.messages_key",
        ),
        (
            [{"messages": [_u("1+1"), _a("2")]}, {"messages": [S, _u("2+2")]}],
            [],
            "row 2 of BAD has no assistant message to learn from (its roles: system, user)",
        ),
        ([{"messages": "1+1=2"}], [], "row 1 of BAD is '1+1=2'; a conversation is a list"),
        ([], ["data.train_files=[MISSING]"], "MISSING does not exist"),
        ([], ["data.val_files=[MISSING]"], "data.val_files: MISSING does not exist"),
        ([], ["data.max_length=8"], "all 48 conversations are longer than 8 tokens"),
    ],
    ids=[
        "no-messages-column",
        "no-assistant-turn",
        "not-messages",
        "missing",
        "missing-val",
        "too-long",
    ],
)
def test_bad_input_is_refused_before_anything_is_built(
    user: dict[str, Path], tmp_path: Path, rows: list[Any], overrides: list[str], message: str
) -> None:
    bad = _write_jsonl(tmp_path / "bad.jsonl", rows) if rows else user["train"]
    missing = tmp_path / "missing.jsonl"
    out = tmp_path / "run"
    args = _args(user, out, f"data.train_files=[{bad}]", *overrides)
    args = [a.replace("MISSING", str(missing)) for a in args]
    from engine_core_roles.jobs.cli import load_recipe

    raw = load_recipe(args[1], args[2:])
    with pytest.raises(ConfigError) as e:
        run_sft(raw, load_plugins())
    expected = message.replace("BAD", str(bad)).replace("MISSING", str(missing))
    assert expected in str(e.value), str(e.value)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval_every=5", "data.val_files=[]"], "eval_every=5 measures the loss on data.val_files"),
        (["task.name=copy"], "both task (the built-in digit task) and data"),
    ],
)
def test_settings_that_contradict_each_other_are_refused(
    user: dict[str, Path], tmp_path: Path, overrides: list[str], message: str
) -> None:
    from engine_core_roles.jobs.cli import load_recipe

    args = _args(user, tmp_path / "run", *overrides)
    with pytest.raises(ValidationError, match=re.escape(message)):
        run_sft(load_recipe(args[1], args[2:]), load_plugins())
