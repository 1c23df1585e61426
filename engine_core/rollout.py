"""``BaseRollout``: the contract every generation backend implements.

A rollout turns a batch of prompts into responses with per-token log-probs of the sampled
tokens, accepts fresh weights from a trainer as (HF name, tensor) pairs, and can release and
resume its memory. Every weight update goes through :meth:`BaseRollout.load_weights`, verified
(names, shapes and a checksum per bucket) — never silent; a job's weights reach it through one
link (``engine_core_roles.WeightLink``). Every layer above the core takes this one type and reads
what a rollout can do from its declared capabilities; the rollout kit
(``pytest --engine-core-rollout=NAME``, :mod:`engine_core.testing.rollout_kit`) checks every
promise made here against a plain transformers oracle.

Over 700 lines on purpose: it is the whole generation contract a backend author reads in one
place (the fields of a result, the sampling settings, seeds, routes and top log-probs laid
into a result and taken back out, the verified weight stream, and the base class whose
defaults call them); each part is short, and a plugin imports them all
through :mod:`engine_core.backend`.
"""

from __future__ import annotations

import abc
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import xxhash
from pydantic import Field, PositiveInt, ValidationError, field_validator, model_validator
from tensordict import TensorDict

from engine_core.batch import ROUTED_EXPERTS
from engine_core.capabilities import Capability
from engine_core.config import BUCKET_BYTES, FrozenModel, ModelConfig, Seeded
from engine_core.errors import BatchError, CapabilityError, WeightSyncError
from engine_core.models import is_adapter_name

__all__ = [
    "SamplingSettings",
    "SamplingParams",
    "RolloutConfig",
    "BaseRollout",
    "Pending",
    "DRIVER_ROLLOUT",
    "WeightBucket",
    "iter_buckets",
    "BUCKET_BYTES",
    "tensor_checksum",
    "check_bucket_shapes",
    "base_model",
    "gather_bytes",
    "check_complete",
    "verified_buckets",
    "CutBuckets",
    "run_through",
    "sent_buckets",
    "checked_buckets",
    "SentBucket",
    "confirm_bucket",
    "model_weight_shapes",
    "saved_model_folder",
    "prompt_tensors",
    "prompt_seeds",
    "sample_seeds",
    "derive_seed",
    "response_batch",
    "PROMPT_IDS",
    "PROMPT_MASK",
    "RESPONSE_IDS",
    "RESPONSE_MASK",
    "RESPONSE_LOSS_MASK",
    "ROLLOUT_LOG_PROBS",
    "ROLLOUT_TOP_IDS",
    "ROLLOUT_TOP_LOG_PROBS",
    "TRUNCATED",
    "ROUTED_EXPERTS",
    "ROLLOUT_REPLICA",
    "PROMPT_SEED",
]

PROMPT_IDS = "prompt_ids"
PROMPT_MASK = "prompt_mask"
RESPONSE_IDS = "response_ids"
RESPONSE_MASK = "response_mask"
# optional: 1 on the response tokens the model sampled, 0 on tokens something else appended (an
# environment's turns in an episode); the core names it because merging replicas pads it
RESPONSE_LOSS_MASK = "response_loss_mask"
ROLLOUT_LOG_PROBS = "rollout_log_probs"
#: with ``SamplingParams.top_logprobs = k``: each response position's ``k`` most likely token ids
#: ``[B*n, R, k]`` (most likely first) and their log-probs, in the distribution
#: ``rollout_log_probs`` are taken in; 0 at padding
ROLLOUT_TOP_IDS = "rollout_top_ids"
ROLLOUT_TOP_LOG_PROBS = "rollout_top_log_probs"
# bool [N]: True where a sample ended at its token limit, False where it ended on a stop token
TRUNCATED = "truncated"
ROLLOUT_REPLICA = "rollout_replica"  # which replica of a multi-process rollout generated a row
# optional int64 column of a prompt batch: the prompt's own sampling seed (see prompt_seeds)
PROMPT_SEED = "prompt_seed"


class SamplingSettings(FrozenModel):
    """The sampling settings a run sets once and every generation reads: declared here only.

    :class:`SamplingParams` (one generate call's) and the RL trainer's config
    (``engine_core_roles.TrainerConfig``, ``trainer.temperature`` in a recipe) both inherit
    them, so the trainer's values are the rollout's, never a second copy to keep in step.
    """

    temperature: float = Field(
        1.0,
        ge=0,
        description="Sampling temperature (the trainer computes its log-probs at it too); 0 "
        "means greedy, which a trainer refuses.",
    )
    max_new_tokens: PositiveInt = Field(32, description="The most tokens a response may have.")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Token ids that end a response."
    )
    stop_strings: list[str] = Field(
        default_factory=list,
        description="Strings that end a response: it ends after the first token at which its "
        "text (decoded by the model's tokenizer, special tokens skipped) holds one of them; the "
        "string stays in the response and the sample is not truncated. Needs a rollout that "
        "declares stop_strings and a tokenizer (model.tokenizer or the model folder's own).",
    )

    @field_validator("stop_strings")
    @classmethod
    def _stop_strings_nonempty(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError(
                f"stop strings must be non-empty (an empty one would end every response at its "
                f"first token); got {v!r}."
            )
        return v


class SamplingParams(SamplingSettings):
    """Sampling parameters every rollout honours (or refuses when it cannot)."""

    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 disables top-k.")
    n: PositiveInt = Field(1, description="Samples per prompt.")
    seed: int | None = Field(
        None,
        description="Prompt i's samples draw from streams of derive_seed(seed, i), whatever "
        "else is in the batch: the same prompts give the same samples however they are "
        "batched or split between replicas. None: unseeded.",
    )
    top_logprobs: int = Field(
        0,
        ge=0,
        le=20,
        description="Also return, at each response position, the top_logprobs most likely "
        "tokens of the distribution rollout_log_probs are taken in, and their log-probs: "
        "rollout_top_ids and rollout_top_log_probs [B*n, R, top_logprobs], most likely first, "
        "0 at padding (rollouts that declare top_logprobs; others refuse). 0: none.",
    )
    return_routes: bool = Field(
        False,
        description="Also return routed_experts [B*n, P+R, layers, top_k]: the experts each "
        "prompt and response token went to in each MoE layer (rollouts that declare "
        "routing_replay; others refuse).",
    )

    @model_validator(mode="after")
    def _top_k_nonzero(self) -> SamplingParams:
        if self.top_k == 0:
            raise ValueError("top_k=0 keeps no token; use -1 to disable top-k or a positive k.")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def log_prob_temperature(self) -> float:
        """The temperature of the log-probs a rollout reports for these samples, and so the one
        a trainer must compute its own at: the sampling temperature, or 1 when greedy."""
        return 1.0 if self.greedy else self.temperature


class RolloutConfig(Seeded):
    """Fields every rollout understands. Backends subclass this with their own.

    ``seed``: the generation backend's own random state (each request's samples draw from
    :attr:`SamplingParams.seed`, which a trainer derives per step)."""

    backend: str = Field(..., description="Registered rollout name, e.g. 'hf' or 'vllm'.")
    model: ModelConfig
    pad_token_id: int = Field(
        0,
        ge=0,
        description="The id response_ids are right-padded with, where the backend reads none "
        "from the model's config.",
    )
    return_routes: bool = Field(
        False,
        description="Start able to return routed_experts (SamplingParams.return_routes): a "
        "mixture of experts' choice per token and MoE layer, for routing replay. Asks for the "
        "routing_replay capability; vllm must know it when it starts.",
    )

    def required_capabilities(self) -> set[Capability]:
        """Capabilities this config asks of its rollout; checked when the config is resolved:
        routes with ``return_routes``, adapters served unmerged with ``model.lora``."""
        need: set[Capability] = set()
        if self.return_routes:
            need.add(Capability.ROUTING_REPLAY)
        if self.model.lora is not None:
            need.add(Capability.LORA)
        return need


@dataclass(frozen=True)
class WeightBucket:
    """A bounded group of (name, tensor) pairs with the checksum both sides compare."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    checksum: str


def check_bucket_shapes(
    bucket: list[tuple[str, torch.Tensor]], expected: dict[str, tuple[int, ...]]
) -> None:
    """Refuse a bucket holding an unknown parameter or a wrong shape, naming each one."""
    wrong = [
        f"{n}: got {tuple(t.shape)}, expected {expected.get(n, 'no such parameter')}"
        for n, t in bucket
        if tuple(t.shape) != expected.get(n)
    ]
    if wrong:
        raise WeightSyncError("weight sync refused, mismatched parameters: " + "; ".join(wrong))


def check_complete(expected: dict[str, tuple[int, ...]], seen: set[str]) -> None:
    """Refuse a sync that never sent some of the rollout's parameters, naming them.

    A rollout that serves LoRA adapters (its weights include adapter tensors) takes a stream of
    adapter tensors alone as complete when it holds every adapter: the frozen base it was sent
    once stays as loaded.
    """
    wanted = set(expected)
    adapters = {name for name in wanted if is_adapter_name(name)}
    if adapters and seen and seen <= adapters:
        wanted = adapters
    missing = sorted(wanted - seen)
    if missing:
        raise WeightSyncError(
            f"weight sync incomplete: {len(missing)} parameter(s) never sent: {missing[:10]}"
            + (" ..." if len(missing) > 10 else "")
        )


def prompt_tensors(
    prompts: TensorDict, who: str, vocab_size: int | None = None, *, images: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompt_ids`` and ``prompt_mask`` of a ``generate`` input, checked before anything is
    generated: both present, integer ``[B, P]`` of one shape, the mask 0/1 and left-padded,
    no prompt empty, and (given the model's ``vocab_size``) every prompt token an id of the
    vocabulary. What is wrong is named, with the prompt it is in. Prompts with images
    (``pixel_values``, ``image_grid_thw``: :mod:`engine_core.vision`) are refused unless the
    rollout takes them (``images``: it declares ``vision``)."""
    from engine_core.vision import VISION_KEYS, has_images

    if has_images(prompts) and not images:
        found = [k for k in VISION_KEYS if k in prompts.keys()]
        raise CapabilityError(
            f"{who}: the prompts carry images ({', '.join(found)}), and this rollout generates "
            f"from token ids alone (it does not declare vision); use a rollout that declares "
            f"it (engine-core plugins lists each rollout's), or drop the images."
        )
    for key in (PROMPT_IDS, PROMPT_MASK):
        if key not in prompts.keys():
            raise BatchError(
                f"{who} needs {key!r} (left-padded [B, P]); got {sorted(prompts.keys())}."
            )
    ids, mask = prompts[PROMPT_IDS], prompts[PROMPT_MASK]
    for key, t in ((PROMPT_IDS, ids), (PROMPT_MASK, mask)):
        if not isinstance(t, torch.Tensor) or t.ndim != 2 or t.is_floating_point():
            raise BatchError(
                f"{who}: {key!r} must be an integer tensor [B, P]; got "
                f"{getattr(t, 'dtype', type(t).__name__)} of shape "
                f"{tuple(getattr(t, 'shape', ()))}."
            )
    if ids.shape != mask.shape:
        raise BatchError(
            f"{who}: prompt_ids {tuple(ids.shape)} and prompt_mask {tuple(mask.shape)} must have "
            "one shape."
        )
    if not ids.numel():
        return ids, mask
    if not ((mask == 0) | (mask == 1)).all():
        raise BatchError(f"{who}: prompt_mask holds values other than 0 and 1.")
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise BatchError(
            f"{who}: prompt(s) {empty[:8]} are empty (no 1 in prompt_mask); every prompt needs "
            "at least one token. Drop empty prompts before generating."
        )
    right = (mask[:, 1:] < mask[:, :-1]).any(-1).nonzero().flatten().tolist()
    if right:
        raise BatchError(
            f"{who}: prompt(s) {right[:8]} are not left-padded (a 0 in prompt_mask after a 1); "
            "pad prompts on the left (engine_core_roles.batch.build.prompt_batch does)."
        )
    real = ids[mask.bool()]
    if vocab_size is not None and ((real < 0) | (real >= vocab_size)).any():
        bad = sorted({int(x) for x in real[(real < 0) | (real >= vocab_size)].tolist()})
        rows = ((ids < 0) | (ids >= vocab_size)).logical_and(mask.bool()).any(-1)
        raise BatchError(
            f"{who}: token id(s) {bad[:8]} in prompt(s) {rows.nonzero().flatten().tolist()[:8]} "
            f"are outside the model's vocabulary [0, {vocab_size}); tokenize with the model's "
            "own tokenizer."
        )
    return ids, mask


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, index: int) -> int:
    """The seed of stream ``index`` under ``seed``, in ``[0, 2**63)``: prompt ``i``'s seed under
    a request's seed, sample ``j``'s under its prompt's, an episode turn's under its episode's."""
    return _mix64(_mix64(seed & _MASK64) ^ (index & _MASK64)) >> 1


def prompt_seeds(prompts: TensorDict, params: SamplingParams) -> list[int] | None:
    """Each prompt's sampling seed: the ``prompt_seed`` column where the batch carries one (a
    share of a larger batch keeps the seeds its prompts had there), else
    ``derive_seed(params.seed, i)`` for prompt ``i``; None when neither is set (unseeded).

    A rollout samples prompt ``i``'s sample ``j`` from a stream seeded with
    ``derive_seed(prompt_seeds[i], j)`` and nothing else, so a prompt's samples do not depend on
    the other prompts of the call, their order, or how the prompts were split between calls."""
    count = prompts.batch_size[0] if prompts.batch_dims else 0
    if PROMPT_SEED in prompts.keys():
        seeds = prompts[PROMPT_SEED]
        if not isinstance(seeds, torch.Tensor) or seeds.dtype != torch.int64 or seeds.ndim != 1:
            raise BatchError(
                f"{PROMPT_SEED!r} holds one int64 seed per prompt; got "
                f"{getattr(seeds, 'dtype', type(seeds).__name__)} of shape "
                f"{tuple(getattr(seeds, 'shape', ()))}."
            )
        return [int(x) for x in seeds.tolist()]
    if params.seed is None:
        return None
    return [derive_seed(params.seed, i) for i in range(count)]


def sample_seeds(prompts: TensorDict, params: SamplingParams) -> list[int] | None:
    """Each sample's seed, a prompt's ``params.n`` samples adjacent: sample ``j`` of prompt
    ``i`` is ``derive_seed(prompt_seeds[i], j)``; None when unseeded."""
    seeds = prompt_seeds(prompts, params)
    if seeds is None:
        return None
    return [derive_seed(s, j) for s in seeds for j in range(params.n)]


def response_batch(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    n: int,
    samples: Sequence[tuple[Sequence[int], Sequence[float], bool]],
    pad_token_id: int,
) -> TensorDict:
    """The ``generate`` result from per-sample (token ids, log-probs, truncated).

    ``samples[k]`` is sample ``k % n`` of prompt ``k // n``; responses are right-padded with
    ``pad_token_id`` (log-prob 0 there) to the longest one (at least 1 column).
    """
    total = len(samples)
    width = max((len(toks) for toks, _, _ in samples), default=0) or 1
    resp = torch.full((total, width), pad_token_id, dtype=torch.long)
    resp_mask = torch.zeros((total, width), dtype=torch.long)
    logps = torch.zeros((total, width), dtype=torch.float32)
    for k, (toks, lps, _) in enumerate(samples):
        resp[k, : len(toks)] = torch.tensor(list(toks), dtype=torch.long)
        resp_mask[k, : len(toks)] = 1
        logps[k, : len(toks)] = torch.tensor(list(lps), dtype=torch.float32)
    out = TensorDict(
        {
            PROMPT_IDS: prompt_ids.repeat_interleave(n, dim=0),
            PROMPT_MASK: prompt_mask.repeat_interleave(n, dim=0),
            RESPONSE_IDS: resp,
            RESPONSE_MASK: resp_mask,
            ROLLOUT_LOG_PROBS: logps,
            TRUNCATED: torch.tensor([bool(cut) for _, _, cut in samples], dtype=torch.bool),
        },
        batch_size=[total],
    )
    return out


def place_routes(out: TensorDict, routes: Sequence[torch.Tensor]) -> torch.Tensor:
    """``routed_experts`` ``[N, P + R, layers, top_k]`` of a :func:`response_batch` result from
    each sample's routes: one row per real prompt token, then per response token, in order
    (``[P_k + R_k, layers, top_k]``, or one row fewer: an engine never feeds the last sampled
    token back). Rows are placed under their tokens (the prompt left-padded, the response
    right-padded); padding and an absent last row hold expert 0 (never scored)."""
    prompt_mask, response_mask = out[PROMPT_MASK].bool(), out[RESPONSE_MASK].bool()
    if len(routes) != prompt_mask.shape[0]:
        raise BatchError(f"routes of {len(routes)} samples for {prompt_mask.shape[0]} samples.")
    width = prompt_mask.shape[1]
    placed: torch.Tensor | None = None
    for k, rows in enumerate(routes):
        prompt, response = int(prompt_mask[k].sum()), int(response_mask[k].sum())
        if rows.dim() != 3 or rows.shape[0] not in (prompt + response - 1, prompt + response):
            raise BatchError(
                f"sample {k}: routes of shape {tuple(rows.shape)}; want [tokens, layers, top_k] "
                f"with tokens {prompt + response} (its {prompt} prompt and {response} response "
                f"tokens) or one fewer."
            )
        if placed is None:
            placed = torch.zeros(
                (*response_mask.shape[:1], width + response_mask.shape[1], *rows.shape[1:]),
                dtype=torch.int64,
            )
        rows = rows.to(torch.int64)
        placed[k, width - prompt : width] = rows[:prompt]
        placed[k, width : width + rows.shape[0] - prompt] = rows[prompt:]
    assert placed is not None
    return placed


def unplace_routes(
    out: TensorDict, prompts: Sequence[int], responses: Sequence[int]
) -> list[torch.Tensor]:
    """Each sample's rows of ``out``'s ``routed_experts``, placed as :func:`place_routes` places
    them: sample ``k``'s ``prompts[k]`` rows before the prompt's right edge, then its first
    ``responses[k]`` response rows (``[prompts[k] + responses[k], layers, top_k]``). Each is a
    copy, which keeps none of the batch's other rows alive."""
    placed, width = out[ROUTED_EXPERTS], out[PROMPT_MASK].shape[1]
    return [
        placed[k, width - int(prompt) : width + int(response)].clone()
        for k, (prompt, response) in enumerate(zip(prompts, responses, strict=True))
    ]


def stitch_routes(held: torch.Tensor | None, rows: torch.Tensor, fed: int) -> torch.Tensor:
    """The routes of a sequence that grows from one forward to the next, each token's from the
    forward that first fed it: ``held``, those of its first ``len(held)`` tokens (None: none
    yet), then the rows past them of a later forward's ``rows`` (its routes of the sequence from
    the start, of which the first ``fed`` rows belong to tokens it fed)."""
    if held is None:
        return rows[:fed]
    if fed <= held.shape[0]:
        return held
    return torch.cat([held, rows[held.shape[0] : fed]])


def top_log_prob_tensors(
    ranked: Sequence[Sequence[Sequence[tuple[int, float]]]], k: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:data:`ROLLOUT_TOP_IDS` and :data:`ROLLOUT_TOP_LOG_PROBS` ``[len(ranked), width, k]``
    from ``ranked[j][pos]``, sample ``j``'s most likely tokens at response position ``pos`` as
    (id, log-prob) pairs, most likely first, at most ``k``; 0 wherever none is given."""
    ids = torch.zeros(len(ranked), width, k, dtype=torch.long)
    values = torch.zeros(len(ranked), width, k)
    for j, positions in enumerate(ranked):
        for pos, top in enumerate(positions):
            ids[j, pos, : len(top)] = torch.tensor([t for t, _ in top])
            values[j, pos, : len(top)] = torch.tensor([v for _, v in top])
    return ids, values


SentBucket = tuple[list[tuple[str, torch.Tensor]], str]
"""One bucket of (HF name, tensor) pairs and the checksum its sender computed of it."""


class WeightLoader(Protocol):
    """What a weight stream is loaded into: a :class:`BaseRollout`, or replicas that this
    process relays the stream to (:class:`engine_core.remote_rollout.ProcessRollout` in another
    interpreter)."""

    def load_weights(self, buckets: Iterable[SentBucket]) -> list[WeightBucket]: ...


class CutBuckets:
    """Buckets of (name, tensor) pairs already cut by whoever gathered them (an engine's
    :meth:`~engine_core.engine.BaseEngine.weight_buckets`): :func:`sent_buckets` passes them
    on as they are. Counts in :attr:`bytes` the bytes of the tensors that went by."""

    def __init__(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        self._buckets = buckets
        self.bytes = 0

    def __iter__(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for bucket in self._buckets:
            self.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            yield bucket
            del bucket  # not held while the next bucket is gathered


def run_through(items: Iterable[Any]) -> None:
    """Consume ``items`` (a rank's part of an engine's gathers, which every rank must take),
    holding no item past its turn: a ``for`` loop's variable would keep the previous bucket
    alive while the next one is gathered."""
    it = iter(items)
    while next(it, None) is not None:
        pass


def gather_bytes(bucket_bytes: int) -> int:
    """What a sender asks its engine to gather at a time for buckets of ``bucket_bytes``: a
    quarter bucket. A bucket is cut when the next tensor does not fit, so the next gather is
    already held while a bucket is sent; gathering a quarter at a time keeps that extra to a
    quarter bucket (or one tensor, when a tensor is bigger), not a whole one."""
    return max(1, bucket_bytes // 4)


def sent_buckets(
    named: Iterable[tuple[str, torch.Tensor]] | CutBuckets, bucket_bytes: int = BUCKET_BYTES
) -> Iterator[SentBucket]:
    """The sending side of a weight stream: bounded buckets, each with its checksum (computed
    once, here). The tensors are detached and contiguous, on the device they came on.
    ``named`` is cut into buckets of ``bucket_bytes``, unless it is :class:`CutBuckets`."""
    cut = named if isinstance(named, CutBuckets) else iter_buckets(named, bucket_bytes)
    for bucket in cut:
        handed = [(name, t.detach().contiguous()) for name, t in bucket]
        del bucket
        yield handed, tensor_checksum(handed)
        # let go of this bucket before the next one is gathered: one bucket held, not two
        del handed


def checked_buckets(
    buckets: Iterable[SentBucket], expected: dict[str, tuple[int, ...]]
) -> Iterator[SentBucket]:
    """The receiving side: each bucket with an unknown name or a wrong shape is refused before it
    is yielded (so before anything of it is loaded); once the last bucket has been consumed, a
    stream that left parameters out is refused, naming them."""
    seen: set[str] = set()
    for bucket, sent in buckets:
        check_bucket_shapes(bucket, expected)
        seen.update(name for name, _ in bucket)
        yield bucket, sent
        del bucket  # not held while the next bucket arrives
    check_complete(expected, seen)


def verified_buckets(
    named: Iterable[tuple[str, torch.Tensor]],
    expected: dict[str, tuple[int, ...]],
    bucket_bytes: int = BUCKET_BYTES,
) -> Iterator[SentBucket]:
    """Both sides in one process: :func:`sent_buckets` of ``named``, :func:`checked_buckets`
    against ``expected``."""
    return checked_buckets(sent_buckets(named, bucket_bytes), expected)


def confirm_bucket(
    loaded: list[tuple[str, torch.Tensor]], sent: str, got: str | None = None
) -> WeightBucket:
    """Compare ``got`` (default: the checksum of ``loaded``) with the trainer's ``sent``."""
    names = tuple(name for name, _ in loaded)
    if (tensor_checksum(loaded) if got is None else got) != sent:
        raise WeightSyncError(
            f"checksum mismatch in bucket [{', '.join(names)}]: what the rollout loaded differs "
            "from what the trainer sent (a failed load, bytes corrupted on the way, or a sender "
            "reusing its buffer?)."
        )
    return WeightBucket(names, tuple(tuple(t.shape) for _, t in loaded), sent)


def meta_model(model: ModelConfig, adapters: bool = False) -> Any:
    """``model`` built empty, on the meta device (its names, shapes and layout, no storage): the
    base model, or with ``adapters`` (a rollout that serves ``model.lora``'s adapters) the peft
    model."""
    from engine_core.models import build_model

    with torch.device("meta"):
        return build_model(model if adapters else base_model(model), load_weights=False)


def model_weight_shapes(model: ModelConfig, adapters: bool = False) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of ``model``'s weights (:func:`meta_model`'s)."""
    module = meta_model(model, adapters)
    return {name: tuple(t.shape) for name, t in module.state_dict().items()}


def base_model(model: ModelConfig) -> ModelConfig:
    """``model`` without ``lora``: what a rollout that takes merged weights builds (the merged
    model has the base architecture; only a rollout that serves the adapters builds them)."""
    return model if model.lora is None else model.validated_copy(lora=None)


def saved_model_folder(
    model: ModelConfig, seed: int, prefix: str
) -> tempfile.TemporaryDirectory[str]:
    """For backends that load from a folder: ``model.config`` built (seeded) and saved there.

    The seed applies to a fork of the CPU RNG: the process's global RNG state is left as it was.
    """
    from engine_core.models import build_model

    folder = tempfile.TemporaryDirectory(prefix=prefix)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module: Any = build_model(base_model(model))  # a transformers PreTrainedModel
    module.save_pretrained(folder.name)
    return folder


def tensor_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A deterministic digest of names, shapes, dtypes and the tensors' own bytes.

    XXH3-128 over each tensor's memory as it is (no copy on CPU, no float32 cast): it detects a
    failed, partial or corrupted load (any flipped bit), at memory speed (40 times blake2b's,
    measured); it is not meant to resist a forger, and nothing else here is sent between
    processes that do not trust each other. Sender and receiver agree only when the tensors
    have the same dtype, which a weight sync keeps.
    """
    h = xxhash.xxh3_128()
    for name, t in named:
        data = t.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        h.update(name.encode())
        h.update(f"{tuple(data.shape)}{data.dtype}".encode())
        h.update(data.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most ``bucket_bytes`` (one big tensor alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}.")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class Pending(Protocol):
    """The result of a call still running elsewhere (a rollout's replicas): ``result()`` waits
    for it and returns it, or raises what the call raised."""

    def result(self) -> Any: ...


#: how a weight sync names a rollout that loads its weights in the trainer's driver process
DRIVER_ROLLOUT = "the rollout in the driver"


class BaseRollout(abc.ABC):
    """A generation backend: the one rollout type every layer above the core takes.

    Subclasses set :attr:`capabilities` and implement the abstract methods. What a rollout
    can do beyond ``generate`` and a verified ``load_weights`` it declares as capabilities, and
    a trainer reads them, never the rollout's class: ``async_generation`` (``generate_async``),
    ``weight_sync_group`` (its own processes receive the weights: ``join_weight_sync``,
    ``receive_weights``, ``leave_weight_sync``), ``sleep`` (``release`` / ``resume``),
    ``routing_replay`` (``SamplingParams.return_routes``), ``lora`` (adapters-only syncs),
    ``continuous_batching`` (``submit`` / ``advance`` / ``collect``: calls that join a running
    batch).
    The calls of an undeclared capability refuse with :class:`CapabilityError`.
    """

    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    config_class: ClassVar[type[RolloutConfig]] = RolloutConfig
    #: the engine records routes only when told so at start (``RolloutConfig.return_routes``)
    routes_from_start: ClassVar[bool] = False

    def __init__(self, config: RolloutConfig) -> None:
        self.config = config
        # what response_ids are right-padded with: the config's, unless the backend reads its
        # own from the model (set after this); wrappers and replicas take the one they wrap
        self.pad_token_id: int = config.pad_token_id

    @abc.abstractmethod
    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        """Generate ``params.n`` responses per prompt.

        ``prompts`` holds left-padded ``prompt_ids`` / ``prompt_mask`` ``[B, P]``. The result has
        ``B * n`` samples (the ``n`` samples of a prompt adjacent) with ``prompt_ids``,
        ``prompt_mask``, right-padded ``response_ids`` / ``response_mask`` ``[B*n, R]``,
        ``rollout_log_probs`` ``[B*n, R]`` (log-prob of each sampled token, 0 at padding) and a
        per-sample ``truncated`` ``[B*n]`` (bool: True where the sample reached
        ``max_new_tokens`` without a stop token, False where a stop token ended it). With ``params.return_routes`` (a
        rollout that declares ``routing_replay``; :meth:`check_params` refuses it otherwise),
        also ``routed_experts`` ``[B*n, P+R, layers, top_k]``: the experts each token of
        ``prompt_ids`` followed by ``response_ids`` went to in each MoE layer.
        """

    def check_params(self, params: SamplingParams) -> None:
        """Refuse what this rollout cannot honour in ``params``, and params that skipped
        validation (``model_construct``); ``generate`` calls it first."""
        try:
            type(params).model_validate(params.model_dump())
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "params"
            raise BatchError(
                f"{type(self).__name__}.generate refused {type(params).__name__}: {where}: "
                f"{first['msg']} (got {params.model_dump()})."
            ) from None
        if params.return_routes and Capability.ROUTING_REPLAY not in self.capabilities:
            raise CapabilityError(
                f"SamplingParams(return_routes=True): {type(self).__name__} does not return "
                f"the experts it routed tokens to (it does not declare routing_replay); turn "
                f"routing replay off or use a rollout that declares it (hf)."
            )
        if params.top_logprobs and Capability.TOP_LOGPROBS not in self.capabilities:
            raise CapabilityError(
                f"SamplingParams(top_logprobs={params.top_logprobs}): {type(self).__name__} "
                f"returns the sampled tokens' log-probs only (it does not declare "
                f"top_logprobs); leave top_logprobs at 0 or use a rollout that declares it (hf, "
                f"vllm, sglang)."
            )
        if params.stop_strings and Capability.STOP_STRINGS not in self.capabilities:
            raise CapabilityError(
                f"SamplingParams(stop_strings={params.stop_strings!r}): {type(self).__name__} "
                f"stops on token ids only (it does not declare stop_strings); give stop tokens "
                f"as stop_token_ids or use a rollout that declares it (hf, vllm, sglang)."
            )
        if params.return_routes and self.routes_from_start and not self.config.return_routes:
            raise CapabilityError(
                f"SamplingParams(return_routes=True): this {type(self).__name__} was started "
                f"without rollout.return_routes, and its engine only records routes when told "
                f"so at start; set rollout.return_routes=true."
            )

    @abc.abstractmethod
    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        """The HF parameter names and shapes this rollout's model takes."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if (
            not any(
                getattr(getattr(cls, m, None), "__isabstractmethod__", False)
                for m in ("generate", "expected_weights")
            )
            and cls.load_weights is BaseRollout.load_weights
            and cls.load_weight_bucket is BaseRollout.load_weight_bucket
        ):
            raise TypeError(
                f"{cls.__name__} loads no weights: implement load_weight_bucket() (one bucket at "
                f"a time) or load_weights() (the whole stream in one pass), see BaseRollout."
            )

    def load_weight_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> str:
        """Load one bucket into the model and return :func:`tensor_checksum` of what was loaded.

        Implement this, or :meth:`load_weights` for a backend that loads a whole stream in one
        pass (the default :meth:`load_weights` calls this once per bucket).
        """
        raise NotImplementedError  # __init_subclass__ refuses a class that implements neither

    def load_weights(self, buckets: Iterable[SentBucket]) -> list[WeightBucket]:
        """Load a weight stream: ``(bucket, the sender's checksum of it)`` pairs, from this
        process (``load_weights(sent_buckets(named))``) or from another one (a weight-sync
        group).

        Every bucket's names and shapes are checked before it is loaded, a stream that leaves a
        parameter out is refused, and each bucket's checksum of what was loaded must equal the
        sender's: one comparison, end to end.
        """
        done = []
        for bucket, sent in checked_buckets(buckets, self.expected_weights()):
            done.append(confirm_bucket(bucket, sent, self.load_weight_bucket(bucket)))
            del bucket  # not held while the next bucket arrives
        return done

    def generate_async(self, prompts: TensorDict, params: SamplingParams) -> Pending:
        """:meth:`generate` without waiting: a pending result, while the generation runs
        elsewhere. Only a rollout that declares ``async_generation`` has it."""
        raise self._undeclared(Capability.ASYNC_GENERATION, "generate_async()")

    # -- calls that join a running batch (continuous_batching)
    def submit(self, prompts: TensorDict, params: SamplingParams) -> int:
        """Queue the call ``generate(prompts, params)`` and return its ticket at once; it runs
        beside every call submitted and not finished, one engine step per :meth:`advance`.
        What ``generate`` refuses, ``submit`` refuses. Only a rollout that declares
        ``continuous_batching`` has it."""
        raise self._undeclared(Capability.CONTINUOUS_BATCHING, "submit()")

    def advance(self) -> list[int]:
        """One engine step of every call submitted and not finished (none: nothing); the
        tickets of the calls it finished (``continuous_batching``)."""
        raise self._undeclared(Capability.CONTINUOUS_BATCHING, "advance()")

    def collect(self, ticket: int) -> TensorDict:
        """A finished call's result, once: what ``generate`` returns for the same call (the
        same samples for a seeded one), or what assembling it raised
        (``continuous_batching``)."""
        raise self._undeclared(Capability.CONTINUOUS_BATCHING, "collect()")

    # -- the weight path of a rollout whose own processes receive its weights
    @property
    def receiver_names(self) -> list[str]:
        """How a weight sync names each receiver of this rollout's weights in its errors."""
        return [DRIVER_ROLLOUT]

    @property
    def may_span_nodes(self) -> bool:
        """Whether the processes that receive this rollout's weights may be on other nodes."""
        return False

    def join_weight_sync(self, host: str, port: int, first_rank: int, world_size: int) -> Pending:
        """The rollout's processes join the weight-sync group at ``host:port``, the ``i``-th
        receiver as rank ``first_rank + i``; pending while the group's rank 0 joins. Only a
        rollout that declares ``weight_sync_group`` has it (others load through
        :meth:`load_weights`)."""
        raise self._undeclared(Capability.WEIGHT_SYNC_GROUP, "join_weight_sync()")

    def receive_weights(self) -> Pending:
        """Every receiver takes one weight stream from rank 0 of its group, verified; pending
        while the sender streams (``weight_sync_group``)."""
        raise self._undeclared(Capability.WEIGHT_SYNC_GROUP, "receive_weights()")

    def leave_weight_sync(self) -> None:
        """Leave the weight-sync group joined by :meth:`join_weight_sync` (none: nothing)."""

    def _undeclared(self, capability: Capability, call: str) -> CapabilityError:
        return CapabilityError(
            f"{type(self).__name__}.{call} needs the {capability} capability, which this "
            f"rollout does not declare (it declares: "
            f"{', '.join(sorted(str(c) for c in self.capabilities)) or 'nothing'})."
        )

    def release(self) -> None:
        """Free weights and KV cache (no-op where the backend cannot)."""

    def resume(self) -> None:
        """Re-allocate what :meth:`release` freed."""

    def shutdown(self) -> None:
        """Stop what the backend runs beside this object (engine processes, its distributed
        state), now rather than whenever it is garbage-collected: a backend whose teardown
        resets process-wide state must not run it after a newer instance started. The default
        does nothing; a job calls it when it ends."""
