"""The text side of a job: the tokenizer, prompt datasets read from files, and scoring decoded
samples with a reward function.

- :func:`load_tokenizer` reads the actor's tokenizer (``model.tokenizer``, else ``model.path``)
  and refuses one whose vocabulary does not fit the model's.
- :class:`PromptData` reads JSONL, Parquet or saved ``datasets`` folders with the ``datasets``
  library (memory-mapped Arrow), renders each prompt — chat messages through the tokenizer's
  chat template with the generation prompt, text as it is — drops prompts too long for the
  model (counted), and hands out batches in a seeded order, epoch after epoch; its position is
  a small dict the job's checkpoint keeps.
- :class:`TextReward` decodes each sample and calls the reward function on it
  (:mod:`engine_core_roles.rewards`), with the row's other columns.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, PositiveInt, field_validator
from tensordict import NonTensorStack, TensorDict

from engine_core.config import FrozenModel, ModelConfig
from engine_core.errors import ConfigError
from engine_core.rollout import PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK
from engine_core_roles.agents import EPISODE, ROW
from engine_core_roles.batches import prompt_batch
from engine_core_roles.rewards import RewardConfig, Scored, accepts, load_function, score_samples
from engine_core_roles.trainer import Rewards, SampleReward

__all__ = [
    "DataConfig",
    "PromptData",
    "ROW_INDEX",
    "StopStrings",
    "TextReward",
    "load_tokenizer",
    "multi_token_stop_strings",
    "stop_token_ids",
]

ROW_INDEX = "row_index"
"""The field of a prompt batch holding each prompt's row in its dataset ``[B]``."""

_IDS_COLUMN = "_engine_core_prompt_ids"


class DataConfig(FrozenModel):
    """Where the prompts come from and how they are drawn."""

    train_files: list[str] = Field(
        ..., description="JSONL/JSON, Parquet files, or folders saved with datasets' save_to_disk."
    )
    val_files: list[str] = Field(default_factory=list, description="Validation prompts (eval).")
    prompt_key: str = Field(
        "prompt",
        description="The prompt column: a list of {role, content} messages (rendered with the "
        "chat template and its generation prompt) or a string (used as it is).",
    )
    chat_template: bool | None = Field(
        None,
        description="None: messages through the template, strings as they are; true: a string "
        "prompt becomes one user message; false: strings only.",
    )
    max_prompt_length: PositiveInt | None = Field(
        None,
        description="Longer prompts are dropped (counted); default: the model's context minus "
        "the response length.",
    )
    shuffle: bool = True
    seed: int = Field(0, description="Seed of the shuffled order (epoch e uses seed + e).")
    stop_strings: list[str] = Field(
        default_factory=list,
        description="Responses also end at these strings: one that is one token of the "
        "tokenizer is a stop token id of the rollout; a longer one ends the response after the "
        "token that completes it (the rollout generates on; what follows is not trained on).",
    )

    demos: list[str] = Field(
        default_factory=list,
        description="JSONL files of demonstrations ({'messages': [...]} ending with the "
        "assistant's answer) for the supervised warm-up (warmup_sft_steps): tokenized as the "
        "rollout samples (the prompt with the generation prompt, then the answer and its end "
        "of turn), trained on the answer's tokens only.",
    )

    @field_validator("train_files", "val_files", "demos", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("train_files")
    @classmethod
    def _some(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("data.train_files is empty; give at least one file or folder.")
        return v


# -- the tokenizer -------------------------------------------------------------------------------


def load_tokenizer(model: ModelConfig, vocab_size: int | None) -> Any:
    """The actor's tokenizer: ``model.tokenizer`` (a folder), else the model folder's own.

    Refused, with what to fix, when there is none or it holds more tokens than the model's
    ``vocab_size`` (its ids would index past the embedding).
    """
    from transformers import AutoTokenizer

    where = model.tokenizer or model.path
    if not where:
        raise ConfigError(
            "a text job needs a tokenizer, and a model built from a config has none; set "
            "engine.model.tokenizer to a folder holding one (saved with save_pretrained)."
        )
    if not Path(where).is_dir():
        raise ConfigError(f"tokenizer folder {where} does not exist; set engine.model.tokenizer.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=model.trust_remote_code)
    except Exception as e:
        raise ConfigError(
            f"no tokenizer could be read from {where}: {type(e).__name__}: {e}"
        ) from e
    vocab = vocab_size
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError(
            f"the tokenizer in {where} has {len(tokenizer)} tokens but the model's vocabulary "
            f"has {vocab}: its ids would index past the embedding. Use the model's own "
            f"tokenizer (engine.model.tokenizer), or a model with vocab_size >= {len(tokenizer)}."
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(tokenizer: Any, strings: Sequence[str] = ()) -> list[int]:
    """The tokenizer's EOS (and the chat template's end of turn, when it has one), plus the
    token of each of ``strings`` that is one token (the rollouts stop on those themselves;
    :class:`StopStrings` ends responses at the others)."""
    extra = [ids[0] for ids in (_token_ids(tokenizer, t) for t in strings) if len(ids) == 1]
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        tid = tokenizer.convert_tokens_to_ids(name) if name in tokenizer.get_vocab() else None
        if tid is not None and tid not in ids:
            ids.append(tid)
    return ids + [t for t in extra if t not in ids]


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def multi_token_stop_strings(tokenizer: Any, strings: Sequence[str]) -> list[str]:
    """Those of ``strings`` that are more than one token of ``tokenizer``."""
    return [t for t in strings if len(_token_ids(tokenizer, t)) != 1]


class StopStrings:
    """Ends each response at the first of ``strings`` its text holds: the tokens after the one
    that completes the string get ``response_mask`` 0, as if generation had stopped there (the
    string stays in the response). For stop strings of several tokens, which the rollouts,
    stopping on token ids, cannot stop at themselves: they generate on to another stop or
    ``max_new_tokens``, and what they write past the string is dropped, never trained on or
    scored. The rollout's log-probs of the kept tokens are those it sampled them with."""

    def __init__(self, tokenizer: Any, strings: Sequence[str]) -> None:
        if not strings or any(not s for s in strings):
            raise ValueError(f"stop strings must be non-empty strings; got {list(strings)!r}.")
        self.tokenizer = tokenizer
        self.strings = list(strings)

    def _holds(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in self.strings)

    def __call__(self, samples: TensorDict) -> TensorDict:
        mask = samples[RESPONSE_MASK]
        cut = mask.clone()
        for i in range(mask.shape[0]):
            where = mask[i].nonzero().squeeze(-1)
            ids = samples[RESPONSE_IDS][i][where].tolist()
            if not self._holds(ids):
                continue
            # the shortest prefix that holds a stop string (holding one is monotone in length)
            lo, hi = 1, len(ids)
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if self._holds(ids[:mid]) else (mid + 1, hi)
            cut[i, where[lo:]] = 0
        samples[RESPONSE_MASK] = cut
        return samples


# -- datasets ------------------------------------------------------------------------------------


def _read(files: Sequence[str], what: str) -> Any:
    """One ``datasets.Dataset`` of every file/folder in ``files`` (concatenated)."""
    import datasets

    datasets.disable_progress_bars()
    parts = []
    for name in files:
        path = Path(name).expanduser()
        if not path.exists():
            raise ConfigError(f"{what}: {path} does not exist; give existing files or folders.")
        if path.is_file() and path.stat().st_size == 0:
            raise ConfigError(
                f"{what}: {path} is empty: it holds no rows; give a file with prompts."
            )
        try:
            if path.is_dir():
                loaded = datasets.load_from_disk(str(path))
                if isinstance(loaded, datasets.DatasetDict):
                    split = "train" if "train" in loaded else next(iter(loaded))
                    loaded = loaded[split]
            elif path.suffix in (".jsonl", ".json"):
                loaded = datasets.load_dataset("json", data_files=str(path), split="train")
            elif path.suffix == ".parquet":
                loaded = datasets.load_dataset("parquet", data_files=str(path), split="train")
            else:
                raise ConfigError(
                    f"{what}: {path} is neither .jsonl/.json, .parquet nor a saved datasets "
                    f"folder; convert it to one of those."
                )
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"{what}: {path} could not be read: {type(e).__name__}: {e}") from e
        parts.append(loaded)
    data = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    if len(data) == 0:
        raise ConfigError(f"{what}: {', '.join(files)} holds no rows; give a file with prompts.")
    return data


class PromptData:
    """Rendered, length-filtered prompts of one dataset, drawn in a seeded order.

    ``rows`` of the file keep every column; the rendered token ids sit beside them. Batches
    are drawn epoch after epoch, each epoch a new permutation (``seed + epoch``) when
    shuffling; :meth:`state_dict` / :meth:`load_state_dict` are the position (epoch, index).
    """

    def __init__(
        self,
        files: Sequence[str],
        tokenizer: Any,
        cfg: DataConfig,
        *,
        max_length: int,
        what: str = "data.train_files",
        tools: list[dict[str, Any]] | None = None,
        rows: bool = False,
    ) -> None:
        self.cfg, self.tokenizer, self.what, self.tools = cfg, tokenizer, what, tools
        self.with_rows = rows
        data = _read(files, what)
        if cfg.prompt_key not in data.column_names:
            raise ConfigError(
                f"{what}: no {cfg.prompt_key!r} column; the columns are "
                f"{', '.join(data.column_names)}. Set data.prompt_key to the prompt column."
            )
        fingerprint = hashlib.sha256(
            json.dumps(
                [
                    data._fingerprint,
                    cfg.prompt_key,
                    cfg.chat_template,
                    len(tokenizer),
                    tokenizer.chat_template,
                    tokenizer.name_or_path,
                    tools,
                ]
            ).encode()
        ).hexdigest()[:16]
        rendered = data.map(
            self._render_batch, batched=True, new_fingerprint=fingerprint, desc="rendering prompts"
        )
        lengths = rendered.with_format(None)[_IDS_COLUMN]
        keep = [i for i, ids in enumerate(lengths) if len(ids) <= max_length]
        self.total, self.dropped, self.max_length = (
            len(rendered),
            len(rendered) - len(keep),
            max_length,
        )
        if not keep:
            raise ConfigError(
                f"{what}: all {self.total} prompts are longer than {max_length} tokens (the "
                f"model's context minus the response length); shorten the prompts, raise "
                f"data.max_prompt_length, or use a model with a longer context."
            )
        self.data = rendered if not self.dropped else rendered.select(keep)
        self.columns = [c for c in data.column_names if c != cfg.prompt_key]
        # views, selected once: a step reads its rows' ids and other columns through them
        self._ids = self.data.select_columns([_IDS_COLUMN])
        self._other = self.data.select_columns(self.columns) if self.columns else None
        self._whole = self.data.select_columns(list(data.column_names))
        self._epoch, self._index = 0, 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        return len(self.data)

    def render(self, prompt: Any) -> list[int]:
        """One prompt's token ids: messages through the chat template (generation prompt
        added), a string as it is."""
        use_template = self.cfg.chat_template
        if isinstance(prompt, str) and use_template:
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if use_template is False:
            raise ConfigError(
                f"{self.what}: a prompt is a list of messages but data.chat_template=false; "
                f"set it to null or true."
            )
        if not isinstance(prompt, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt
        ):
            raise ConfigError(
                f"{self.what}: a {self.cfg.prompt_key!r} value is {str(prompt)[:80]!r}; a prompt "
                f"is a string or a list of {{'role', 'content'}} messages."
            )
        if not self.tokenizer.chat_template:
            raise ConfigError(
                f"{self.what}: prompts are chat messages but the tokenizer has no chat "
                f"template; save one with the tokenizer, or give text prompts."
            )
        ids = self.tokenizer.apply_chat_template(
            prompt, tools=self.tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def _render_batch(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return {_IDS_COLUMN: [self.render(p) for p in batch[self.cfg.prompt_key]]}

    def _permutation(self, epoch: int) -> list[int]:
        if not self.cfg.shuffle:
            return list(range(len(self.data)))
        gen = torch.Generator().manual_seed(self.cfg.seed + epoch)
        return torch.randperm(len(self.data), generator=gen).tolist()

    def next_indices(self, n: int) -> list[int]:
        """The next ``n`` rows in draw order (into the next epoch when this one runs out)."""
        out: list[int] = []
        while len(out) < n:
            if self._index >= len(self._order):
                self._epoch, self._index = self._epoch + 1, 0
                self._order = self._permutation(self._epoch)
            take = self._order[self._index : self._index + n - len(out)]
            out += take
            self._index += len(take)
        return out

    @property
    def epoch(self) -> int:
        return self._epoch

    def batch(self, indices: Sequence[int]) -> TensorDict:
        """The prompt batch of these rows: left-padded ids, mask and ``row_index``; built with
        ``rows=True``, each whole row too (a dict per prompt under
        :data:`~engine_core_roles.agents.ROW`, which an episode's environment starts from)."""
        ids = self._ids[list(indices)][_IDS_COLUMN]
        out = prompt_batch(ids, pad_token_id=int(self.tokenizer.pad_token_id))
        out[ROW_INDEX] = torch.tensor(list(indices), dtype=torch.long)
        if self.with_rows:
            table = self._whole[list(indices)]
            out[ROW] = NonTensorStack.from_list(
                [{c: table[c][i] for c in table} for i in range(len(indices))]
            )
        return out

    def next_batch(self, n: int) -> TensorDict:
        return self.batch(self.next_indices(n))

    def batches(self, n: int) -> Iterator[TensorDict]:
        """Every row once, in file order, ``n`` at a time (the last batch may be short)."""
        for start in range(0, len(self.data), n):
            yield self.batch(range(start, min(start + n, len(self.data))))

    def rows(self, indices: Sequence[int]) -> dict[str, list[Any]]:
        """The other columns of these rows, one list per column."""
        if self._other is None:
            return {}
        return self._other[list(indices)]  # type: ignore[no-any-return]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "index": self._index, "rows": len(self.data)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("rows", len(self.data))) != len(self.data):
            raise ConfigError(
                f"the checkpoint's dataset position is for {state['rows']} prompts, but "
                f"{self.what} now holds {len(self.data)}; resume with the same files and "
                f"data settings, or start a new run."
            )
        self._epoch, self._index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self._epoch)


# -- scoring decoded samples ---------------------------------------------------------------------


def _unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's ids where ``mask`` is 1: one boolean gather and one conversion to a list for
    the whole batch, then a slice per row."""
    keep = mask.bool()
    flat = ids[keep].tolist()
    out, start = [], 0
    for n in keep.sum(dim=1).tolist():
        out.append(flat[start : start + n])
        start += n
    return out


class _Decoder:
    """``tokenizer.decode`` of many sequences, each distinct one decoded once.

    A fast tokenizer that cleans up no spaces (the transformers default for BPE tokenizers,
    Qwen's among them) decodes straight through its Rust backend's ``decode_batch``: the same
    text as ``tokenizer.decode`` without transformers' per-token checks and per-sequence
    calls. Any other tokenizer goes through ``tokenizer.batch_decode``."""

    def __init__(self, tokenizer: Any) -> None:
        from transformers import PreTrainedTokenizerFast

        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        cleans = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.backend = backend if backend is not None and plain and not cleans else None

    def __call__(self, sequences: list[list[int]], *, skip_special_tokens: bool) -> list[str]:
        index: dict[tuple[int, ...], int] = {}
        distinct: list[list[int]] = []
        where = []
        for ids in sequences:
            key = tuple(ids)
            if key not in index:
                index[key] = len(distinct)
                distinct.append(ids)
            where.append(index[key])
        if self.backend is not None:
            texts = self.backend.decode_batch(distinct, skip_special_tokens=skip_special_tokens)
        else:
            texts = self.tokenizer.batch_decode(distinct, skip_special_tokens=skip_special_tokens)
        return [texts[i] for i in where]


class TextReward(SampleReward):
    """Scores a step's samples with a reward function over decoded text (see
    :mod:`engine_core_roles.rewards`): each sample's prompt and response decoded, its row's
    other columns, ``prompt_ids`` and ``response_ids`` as keywords. The prompt batch's
    ``row_index`` names each prompt's row in ``data``; ``show`` decoded samples of each step
    are handed back for the samples log."""

    def __init__(
        self, cfg: RewardConfig | None, tokenizer: Any, data: PromptData, *, show: int = 4
    ) -> None:
        self.cfg, self.tokenizer, self.data, self.show = cfg, tokenizer, data, show
        self._decode = _Decoder(tokenizer)
        self.fn: Any = None
        self.name = "the environment"
        if cfg is None:  # an episode job scored by its environment alone
            return
        self.fn = load_function(cfg.fn)
        self.name = cfg.fn
        keywords = [*data.columns, "prompt_ids", "response_ids", *cfg.kwargs]
        missing = accepts(self.fn, keywords)
        if missing:
            raise ConfigError(
                f"reward.fn={cfg.fn!r} cannot take the keyword(s) {', '.join(missing)} it is "
                f"called with (the dataset's other columns, prompt_ids, response_ids and "
                f"reward.kwargs); add them to its signature, or a **kwargs."
            )

    def decode(
        self, samples: TensorDict
    ) -> tuple[list[str], list[str], list[list[int]], list[list[int]]]:
        """Each sample's prompt (special tokens kept) and response (special tokens skipped;
        an episode's: the model's last message, which the episode already holds as text), and
        their ids without padding."""
        p_ids = _unpadded(samples[PROMPT_IDS], samples[PROMPT_MASK])
        r_ids = _unpadded(samples[RESPONSE_IDS], samples[RESPONSE_MASK])
        prompts = self._decode(p_ids, skip_special_tokens=False)
        if EPISODE in samples.keys():
            responses = [str(e["final"]) for e in samples[EPISODE].tolist()]
        else:
            responses = self._decode(r_ids, skip_special_tokens=True)
        return prompts, responses, p_ids, r_ids

    def score(
        self, rows: Sequence[int], samples: TensorDict
    ) -> tuple[Scored, list[str], list[str]]:
        """Scores of ``samples`` whose dataset rows are ``rows`` (one per sample), and the
        decoded prompts and responses."""
        prompts, responses, p_ids, r_ids = self.decode(samples)
        episodes = samples[EPISODE].tolist() if EPISODE in samples.keys() else None
        if self.fn is None or self.cfg is None:
            scored = Scored([0.0] * len(rows))
        else:
            unique = sorted(set(rows))
            table = self.data.rows(unique)
            where = {r: i for i, r in enumerate(unique)}
            columns = {c: [table[c][where[r]] for r in rows] for c in table}
            columns["prompt_ids"], columns["response_ids"] = p_ids, r_ids  # type: ignore[assignment]
            scored = score_samples(
                self.fn,
                self.name,
                prompts,
                responses,
                columns,
                batched=self.cfg.batched,
                kwargs=self.cfg.kwargs,
            )
        if episodes is not None:  # plus what the environment gave
            env = [float(e["reward"]) for e in episodes]
            scored.scores = [a + b for a, b in zip(scored.scores, env, strict=True)]
            scored.components["env"] = sum(env) / max(len(env), 1)
        return scored, prompts, responses

    def __call__(self, prompts: TensorDict, samples: TensorDict) -> Rewards:
        n = int(samples.batch_size[0]) // int(prompts.batch_size[0])
        rows = prompts[ROW_INDEX].repeat_interleave(n).tolist()
        scored, texts, responses = self.score(rows, samples)
        scores = torch.tensor(scored.scores, dtype=torch.float32)
        episodes = samples[EPISODE].tolist() if EPISODE in samples.keys() else None
        shown = [
            {
                "row": rows[i],
                "prompt": texts[i],
                "response": responses[i],
                "reward": scored.scores[i],
                **({"episode": episodes[i]["messages"]} if episodes is not None else {}),
            }
            for i in range(min(self.show, len(rows)))
        ]
        metrics = {f"reward/{k}": v for k, v in scored.components.items()}
        return Rewards(scores, metrics, scored.failures, shown)

    def check(self) -> None:
        """Call the function on the first two rows with empty responses, before training: a
        wrong return type or count is an error now rather than at the first step."""
        rows = list(range(min(2, len(self.data))))
        batch = self.data.batch(rows)
        n = len(rows)
        sample = TensorDict(
            {
                PROMPT_IDS: batch[PROMPT_IDS],
                PROMPT_MASK: batch[PROMPT_MASK],
                RESPONSE_IDS: torch.zeros((n, 1), dtype=torch.long),
                RESPONSE_MASK: torch.zeros((n, 1), dtype=torch.long),
            },
            batch_size=[n],
        )
        scored, _, _ = self.score(rows, sample)
        if scored.failures:
            raise ConfigError(
                f"{scored.failures[0]}; checked on the first prompts with an empty response "
                f"before training (a reward function must score any response, the empty one "
                f"included)."
            )
