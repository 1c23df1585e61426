"""What the rollout kit's checks (:mod:`engine_core.testing.rollout_kit`) run on: the rollout
under test, started on a tiny Qwen2 saved to a folder; the oracle (plain transformers on the
same weights, one sequence at a time); the prompts the checks send; and how a check reports a
broken promise.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from engine_core.capabilities import Capability
from engine_core.config import ModelConfig
from engine_core.hookspecs import BackendKind
from engine_core.rollout import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    BaseRollout,
    SamplingParams,
)
from engine_core.testing.models import TINY_QWEN2

__all__ = [
    "PromiseBroken",
    "NotDeclared",
    "Oracle",
    "Subject",
    "start_rollout",
    "started",
    "runs_on_cpu",
    "PROCESS_PREFIX",
    "INTERPRETER_PREFIX",
]

PROCESS_PREFIX = "process:"
INTERPRETER_PREFIX = "interpreter:"
VOCAB = int(TINY_QWEN2["vocab_size"])
SEED = 1234


class NotDeclared(Exception):
    """The check is about a capability the rollout does not declare: nothing to check."""


class PromiseBroken(AssertionError):
    """A rollout broke promise :attr:`promise` of the contract."""

    def __init__(self, promise: str, detail: str, fix: str) -> None:
        self.promise = promise
        super().__init__(f"rollout promise '{promise}' broken: {detail} Fix: {fix}")


def expect(ok: object, promise: str, detail: str, fix: str) -> None:
    if not ok:
        raise PromiseBroken(promise, detail, fix)


# -- the oracle ---------------------------------------------------------------------------------


class Oracle:
    """Plain transformers on the weights the rollout should hold, one sequence at a time."""

    def __init__(self, folder: str, model: Any = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if model is None:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.model = model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)

    def decode(self, ids: list[int]) -> str:
        """The text a stop string is looked for in (:mod:`engine_core.stop_strings`)."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def state(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in self.model.state_dict().items()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    @torch.no_grad()
    def log_probs(self, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
        ids = torch.tensor([prompt + response])
        logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits / temperature, -1)
        return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)

    @torch.no_grad()
    def next_log_probs(self, prompt: list[int], response: list[int]) -> torch.Tensor:
        """``[len(response), vocab]``: the distribution (temperature 1) before each token."""
        ids = torch.tensor([prompt + response])
        logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits, -1)

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new: int, stop: tuple[int, ...] = ()) -> list[int]:
        seq = list(prompt)
        for _ in range(max_new):
            token = int(self.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(token)
            if token in stop:
                break
        return seq[len(prompt) :]


# -- the rollout under test -------------------------------------------------------------------


@dataclass
class Subject:
    """A rollout under test, the oracle on the weights it holds, and the kit's two weight sets."""

    name: str
    rollout: BaseRollout
    oracle: Oracle
    initial: dict[str, torch.Tensor]
    changed: dict[str, torch.Tensor]
    closers: list[Callable[[], None]] = field(default_factory=list)
    #: the capabilities the rollout's registration declares
    registered: frozenset[Capability] = frozenset()
    #: the folder the kit's model is saved in
    folder: str = ""
    #: another rollout of the same kind on ``model``, its config's other fields as given
    #: (the LoRA and routes checks')
    build: Callable[..., BaseRollout] | None = None

    @property
    def capabilities(self) -> frozenset[Capability]:
        return frozenset(self.rollout.capabilities)

    def close(self) -> None:
        for close in reversed(self.closers):
            with contextlib.suppress(Exception):
                close()


def kit_model_config() -> dict[str, Any]:
    """The tiny Qwen2 every check runs on: heads of 32 (the smallest vLLM's CPU attention
    takes), eos unset (a sample ends at a stop id or its budget)."""
    return {
        **TINY_QWEN2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": 0,
    }


def save_kit_model(folder: str, config: dict[str, Any]) -> None:
    """The kit's model of ``config`` (seeded weights) and its tokenizer, saved in ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        model.save_pretrained(folder)
    kit_tokenizer(VOCAB).save_pretrained(folder)


def kit_moe_config() -> dict[str, Any]:
    """The kit's model as a Qwen3 mixture of experts (4 experts, top-2): the routes check's."""
    return {
        **kit_model_config(),
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "head_dim": 32,
    }


def token_text(i: int) -> str:
    """Token ``i``'s text in the kit's tokenizer: id 0 the (special) pad, 1-26 one letter each,
    the rest two or three letters, so a stop string can end inside a token."""
    if i == 0:
        return "<pad>"
    if i <= 26:
        return chr(96 + i)
    return chr(97 + (i * 7) % 26) + chr(97 + (i * 11) % 26)


def kit_tokenizer(vocab: int) -> Any:
    """A tokenizer of ``vocab`` tokens whose decode concatenates the tokens' texts, saved with
    the kit's model: rollouts that stop on strings decode with it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    texts: dict[str, int] = {}
    for i in range(vocab):
        text = token_text(i)
        while text in texts:
            text += "z"
        texts[text] = i
    tokenizer = Tokenizer(models.WordLevel(texts, unk_token="<pad>"))
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>")


def runs_on_cpu(name: str, settings: Sequence[str] = ()) -> bool:
    """Whether rollout ``name`` (or ``process:NAME``) is registered as running on CPU, or is
    set up for it (``settings`` give its ``device``, e.g. SGLang's CPU engine in an
    environment of its own)."""
    if any(s.startswith("device=") for s in settings):
        return True
    from engine_core.plugins import load_plugins

    backend = name.removeprefix(PROCESS_PREFIX).removeprefix(INTERPRETER_PREFIX)
    spec = load_plugins().get_backend(BackendKind.ROLLOUT, backend)
    return Capability.CPU in {Capability(c) for c in spec.capabilities}


@contextlib.contextmanager
def started(
    name: str, python: str | None = None, settings: Sequence[str] = ()
) -> Iterator[Subject]:
    """:func:`start_rollout` of ``name``, closed (the rollout shut down, its folder removed) on
    exit."""
    subject = start_rollout(name, python, settings)
    try:
        yield subject
    finally:
        subject.close()


def start_rollout(name: str, python: str | None = None, settings: Sequence[str] = ()) -> Subject:
    """``name`` (a registered rollout, ``process:NAME`` for two replicas of one, or
    ``interpreter:NAME`` for two replicas in the interpreter ``python``, by default this one)
    started on the kit's tiny model, saved to a folder first; the oracle loads that folder.
    ``settings``: ``KEY=VALUE`` overrides of the rollout's config (say ``device=cpu``)."""
    from engine_core.configio import apply_overrides
    from engine_core.plugins import load_plugins
    from engine_core.remote_rollout import ProcessRollout
    from engine_core.resolve import resolve_rollout_config

    folder = tempfile.TemporaryDirectory(prefix="engine-core-rollout-kit-")
    closers: list[Callable[[], None]] = [folder.cleanup]
    save_kit_model(folder.name, kit_model_config())
    oracle = Oracle(folder.name)
    initial = oracle.state()
    g = torch.Generator().manual_seed(SEED + 1)
    changed = {n: t + 0.5 * t.std() * torch.randn(t.shape, generator=g) for n, t in initial.items()}
    replicas, interpreter = 0, None
    backend = name
    if name.startswith(PROCESS_PREFIX):
        backend, replicas = name[len(PROCESS_PREFIX) :], 2
    elif name.startswith(INTERPRETER_PREFIX):  # the interpreter transport
        backend, replicas = name[len(INTERPRETER_PREFIX) :], 2
        interpreter = python or sys.executable
    plugins = load_plugins()
    spec = plugins.get_backend(BackendKind.ROLLOUT, backend)

    def build(model: ModelConfig, **fields: Any) -> BaseRollout:
        raw = {"backend": backend, "model": model.model_dump(), "seed": 0, **fields}
        _, cfg = resolve_rollout_config(apply_overrides(raw, settings), plugins)
        if replicas:
            return ProcessRollout(cfg, replicas=replicas, python=interpreter)  # type: ignore[arg-type]
        built: BaseRollout = spec.load_class()(cfg)
        return built

    rollout = build(ModelConfig(path=folder.name))
    closers.append(rollout.shutdown)
    registered = frozenset(Capability(c) for c in spec.capabilities)
    return Subject(name, rollout, oracle, initial, changed, closers, registered, folder.name, build)


# -- what the checks send ---------------------------------------------------------------------

PROMPTS = ([9, 21, 33, 47, 12], [40, 17], [25, 8, 61], [13, 50, 29, 44, 36, 18, 11])


def prompt_batch(
    rows: tuple[list[int], ...] | list[list[int]] = PROMPTS, pad: int = 0
) -> TensorDict:
    """Left-padded prompts (``pad`` more columns of padding than the longest needs)."""
    width = max(len(r) for r in rows) + pad
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return TensorDict({PROMPT_IDS: ids, PROMPT_MASK: mask}, batch_size=[len(rows)])


def responses(out: TensorDict) -> list[list[int]]:
    ids, mask = out[RESPONSE_IDS], out[RESPONSE_MASK].bool()
    return [ids[k][mask[k]].tolist() for k in range(ids.shape[0])]


def generate(subject: Subject, prompts: TensorDict, params: SamplingParams) -> TensorDict:
    out: TensorDict = subject.rollout.generate(prompts, params)
    return out


def prompt_of(prompts: TensorDict, i: int) -> list[int]:
    return prompts[PROMPT_IDS][i][prompts[PROMPT_MASK][i].bool()].tolist()


def greedy_both(
    rollout: BaseRollout, oracle: Oracle, max_new: int
) -> tuple[list[list[int]], list[list[int]]]:
    """The kit's prompts continued greedily for ``max_new`` tokens by ``rollout`` and by
    ``oracle``."""
    out = rollout.generate(prompt_batch(), SamplingParams(temperature=0, max_new_tokens=max_new))
    return responses(out), [oracle.greedy(r, max_new) for r in PROMPTS]


def expect_follows(
    s: Subject, state: dict[str, torch.Tensor], promise: str, after: str, fix: str
) -> None:
    """The oracle takes ``state``; the rollout, sent it ``after`` something, must then continue
    the kit's prompts greedily as the oracle does."""
    s.oracle.load(state)
    got, want = greedy_both(s.rollout, s.oracle, 6)
    expect(
        got == want,
        promise,
        f"after {after}, greedy gives {got}; the sent weights give {want}.",
        fix,
    )
