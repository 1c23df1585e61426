"""``HFRollout``: generation with transformers ``generate`` (KV cache on), batched.

Log-probs of sampled tokens come from the model's raw logits at each step, divided by the
sampling temperature (1 for greedy) and log-softmaxed over the whole vocabulary — the same
quantity a trainer computes with ``BatchMeta(temperature=T)``, so the two can be compared
token by token. Top-k / top-p change which tokens can be sampled, not these log-probs.

The config's seed (for building the model) applies to a fork of the process's RNG, restored
afterwards: seeding a rollout never changes the random stream of the trainer or anything else
sharing the process. A seeded request (``SamplingParams.seed``, or the prompts' ``prompt_seed``
column) samples each row from a stream of its own, keyed by ``derive_seed(prompt_seeds[i], j)``
for sample ``j`` of prompt ``i``: temperature, top-k and top-p are applied here and the token
drawn with Gumbel noise that is a hash of the row's seed, the position in the response and the
vocabulary index (splitmix64, computed for all rows at once on the logits' device; no
``torch.Generator``), so a row's sample does not depend on the other rows of the batch, their
order or padding (transformers' own sampling draws the whole batch from one global generator).
Unseeded requests sample as transformers does.

With ``SamplingParams.return_routes`` (a mixture-of-experts model) the routers' choices are
recorded during ``generate``: the prompt's forward gives the prompt tokens' experts, each
decoding step the experts of the token it feeds back. The last sampled token is never fed back,
so its row holds experts ``0..top_k-1`` (it is never scored: a log-prob is read at the position
before its token); so do positions after a stop.

A vision-language model's response is text: a sampled vision token (an image or video
placeholder, or their start and end) could not be given back to the model, which would look for
an image it does not have (transformers' "image features and image tokens do not match"), so
the sample ends before it, unfinished (``truncated``), and the token is not part of it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, cast

import numpy as np
import torch
from pydantic import Field, PositiveInt
from tensordict import TensorDict
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from engine_core.backend import (
    IMAGE_GRID_THW,
    PIXEL_VALUES,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ROLLOUT_TOP_IDS,
    ROLLOUT_TOP_LOG_PROBS,
    ROUTED_EXPERTS,
    TRUNCATED,
    BaseRollout,
    Capability,
    RolloutConfig,
    RouteRecorder,
    SamplingParams,
    build_model,
    holds_stop_string,
    images_in_order,
    load_stop_tokenizer,
    prompt_images,
    prompt_seeds,
    prompt_tensors,
    tensor_checksum,
    vision_token_ids,
)
from engine_core_hf.capabilities import HF_CAPABILITIES

__all__ = ["HFRollout", "HFRolloutConfig"]


class HFRolloutConfig(RolloutConfig):
    """The HF rollout: the common fields plus generation batching."""

    generation_batch_size: PositiveInt = Field(
        64, description="Prompts per generate() call (each with its n samples)."
    )


class HFRollout(BaseRollout):
    capabilities: ClassVar[frozenset[Capability]] = HF_CAPABILITIES
    config_class: ClassVar[type[RolloutConfig]] = HFRolloutConfig

    def __init__(self, config: RolloutConfig) -> None:
        if not isinstance(config, HFRolloutConfig):
            raise TypeError(f"HFRollout needs an HFRolloutConfig, got {type(config).__name__}.")
        super().__init__(config)
        self.cfg = config
        self.device = torch.device("cpu")
        with _seeded(config.seed, self.device):
            self.model: Any = build_model(config.model).eval()
        pad = getattr(self.model.config, "pad_token_id", None)
        if pad is not None:  # the model's own, else the config's (set by BaseRollout)
            self.pad_token_id = int(pad)
        # names and shapes are fixed once built: asked at every sync, read once
        self._shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        self._generation_configs: dict[tuple[Any, ...], GenerationConfig] = {}
        self._vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self._tokenizer: Any = None  # read on the first request with stop_strings
        vision = sorted(vision_token_ids(self.model.config))
        self._vision_ids = torch.tensor(vision, dtype=torch.long) if vision else None

    # -- generation -----------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        ids, mask = prompt_tensors(prompts, "HFRollout.generate", self._vocab_size, images=True)
        self.check_params(params)
        pictured = prompt_images(prompts, ids, mask, self.model.config)
        if params.stop_strings and self._tokenizer is None:
            self._tokenizer = load_stop_tokenizer(self.cfg.model, "HFRollout")
        row_seeds = None if params.greedy else _sample_seeds(prompts, params)
        ids, mask = ids.repeat_interleave(params.n, dim=0), mask.repeat_interleave(params.n, dim=0)
        rows = self.cfg.generation_batch_size * params.n  # every sample of a prompt in one call
        parts = [
            self._generate_chunk(
                ids[i : i + rows],
                mask[i : i + rows],
                params,
                None if row_seeds is None else row_seeds[i : i + rows],
                None if pictured is None else pictured[i // params.n : (i + rows) // params.n],
            )
            for i in range(0, ids.shape[0], rows)
        ]
        width = max(p[0].shape[1] for p in parts)
        resp = torch.cat([_pad_right(p[0], width, self.pad_token_id) for p in parts])
        resp_mask = torch.cat([_pad_right(p[1], width, 0) for p in parts])
        logps = torch.cat([_pad_right(p[2], width, 0.0) for p in parts])
        routed = None
        if params.return_routes:  # [rows, P + R, layers, top_k], the response part padded
            routed = torch.cat(
                [torch.cat([p[4][0], _pad_right(p[4][1], width, 0)], 1) for p in parts]
            )
        out = TensorDict(
            {
                PROMPT_IDS: ids,
                PROMPT_MASK: mask,
                RESPONSE_IDS: resp,
                RESPONSE_MASK: resp_mask,
                ROLLOUT_LOG_PROBS: logps,
                TRUNCATED: torch.cat([p[3] for p in parts]),
            },
            batch_size=[ids.shape[0]],
        )
        if routed is not None:
            out[ROUTED_EXPERTS] = routed
        if params.top_logprobs:  # [rows, R, k], padded on R
            for key, at in ((ROLLOUT_TOP_IDS, 0), (ROLLOUT_TOP_LOG_PROBS, 1)):
                out[key] = torch.cat([_pad_right(p[5][at], width, 0) for p in parts])
        if pictured is not None:  # each sample keeps its prompt's images, for the trainer
            for key in (PIXEL_VALUES, IMAGE_GRID_THW):
                out[key] = pictured[key].repeat_interleave(params.n, dim=0)
        return out

    def _generation_config(self, params: SamplingParams, sample: bool) -> GenerationConfig:
        """``generate``'s whole ``GenerationConfig`` for ``params``, made once per setting
        (given none, ``generate`` rebuilds the model's config on every call to look for stray
        generation settings in it: about a millisecond a call here).

        ``sample``: ``generate`` samples itself (unseeded prompts) at the params' temperature,
        top-p and top-k. Otherwise it takes the argmax (greedy, or after ``_RowSampler`` has
        kept only each row's drawn token). Every sampling setting is given (the defaults, which
        transformers does not warn about, where ``generate`` does not sample; ``top_k`` 0 is
        off), so that nothing of a checkpoint's ``generation_config.json`` (its temperature,
        top-k, ...) is merged in."""
        stop = tuple(params.stop_token_ids)
        top_k = max(params.top_k, 0)  # ours -1, transformers' 0: off
        warpers = (params.temperature, params.top_p, top_k) if sample else (1.0, 1.0, 50)
        key = (params.max_new_tokens, stop, self.pad_token_id, sample, warpers)
        config = self._generation_configs.get(key)
        if config is None:
            temperature, top_p, top_k = warpers
            config = GenerationConfig(
                max_new_tokens=params.max_new_tokens,
                do_sample=sample,
                pad_token_id=self.pad_token_id,
                eos_token_id=list(stop) or None,
                return_dict_in_generate=True,
                output_logits=True,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
            )
            self._generation_configs[key] = config
        return config

    def _generate_chunk(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        params: SamplingParams,
        row_seeds: torch.Tensor | None,
        images: TensorDict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any, Any]:
        sample = not params.greedy and row_seeds is None
        kwargs: dict[str, Any] = {"generation_config": self._generation_config(params, sample)}
        if images is not None:  # the chunk's prompts' images, each once per sample row
            kwargs.update(_vision_kwargs(images, ids, params.n, self.model, self.device))
        if row_seeds is not None:  # our sampler picks each row's token; generate takes argmax
            kwargs["logits_processor"] = LogitsProcessorList([_RowSampler(row_seeds, params)])
        strings = None
        if params.stop_strings:
            strings = _StopAtStrings(self._tokenizer, params.stop_strings, ids.shape[1])
            kwargs["stopping_criteria"] = StoppingCriteriaList([strings])
        recorder = RouteRecorder(self.model) if params.return_routes else contextlib.nullcontext()
        with recorder:
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kwargs
            )
        stop = list(params.stop_token_ids)
        resp = out.sequences[:, ids.shape[1] :].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu() / params.log_prob_temperature
        every = torch.log_softmax(logits, -1)
        logps = every.gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        top = None
        if params.top_logprobs:  # the most likely tokens of the same distribution
            k = min(params.top_logprobs, every.shape[-1])
            top = every.topk(k, -1)
        # valid up to and including the first stop token
        is_stop = torch.zeros_like(resp, dtype=torch.bool)
        for s in stop:
            is_stop |= resp == s
        after_stop = (is_stop.long().cumsum(-1) - is_stop.long()) > 0
        ended = is_stop.any(-1)
        if strings is not None and strings.ends is not None:  # past the token ending a string
            at = strings.ends[:, None]
            after_stop |= (at > 0) & (torch.arange(resp.shape[1])[None, :] >= at)
            ended |= strings.ends > 0
        if self._vision_ids is not None:  # a vision token ends the sample before it, unfinished
            cut = torch.isin(resp, self._vision_ids).long().cumsum(-1) > 0
            ended &= ~(cut & ~after_stop).any(-1)
            after_stop |= cut
        resp_mask = (~after_stop).long()
        resp = resp.masked_fill(after_stop, self.pad_token_id)
        logps = logps.masked_fill(after_stop, 0.0)
        truncated = ~ended
        routes = None
        if isinstance(recorder, RouteRecorder):
            routes = _generation_routes(recorder.forwards(), ids.shape, resp.shape[1])
            routes[1][after_stop] = torch.arange(routes[1].shape[-1])
        tops = None
        if top is not None:
            gone = after_stop.unsqueeze(-1)
            tops = (top.indices.masked_fill(gone, 0), top.values.masked_fill(gone, 0.0))
        return resp, resp_mask, logps, truncated, routes, tops

    # -- weights --------------------------------------------------------------------------
    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    @torch.no_grad()
    def load_weight_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> str:
        state = self.model.state_dict()
        for name, tensor in bucket:
            state[name].copy_(tensor.to(state[name].device, state[name].dtype))
        return tensor_checksum((name, state[name]) for name, _ in bucket)

    def release(self) -> None:
        """Weights to CPU (a no-op on a CPU-only host)."""
        self.model.to("cpu")

    def resume(self) -> None:
        self.model.to(self.device)


class _StopAtStrings(StoppingCriteria):
    """Ends each row after the token at which its response's text holds one of ``strings``
    (:mod:`engine_core.stop_strings`' definition); ``ends[i]`` is then row i's response length
    (0 while it has not ended on a string). Each step decodes the rows still going, once."""

    def __init__(self, tokenizer: Any, strings: list[str], prompt_len: int) -> None:
        self.tokenizer, self.strings, self.start = tokenizer, strings, prompt_len
        self.ends: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> Any:
        resp = input_ids[:, self.start :].cpu()
        if self.ends is None:
            self.ends = torch.zeros(resp.shape[0], dtype=torch.long)
        going = (self.ends == 0).nonzero().squeeze(-1).tolist()
        texts = self.tokenizer.batch_decode(resp[going].tolist(), skip_special_tokens=True)
        for i, text in zip(going, texts, strict=True):
            if holds_stop_string(text, self.strings):
                self.ends[i] = resp.shape[1]
        return (self.ends > 0).to(input_ids.device)


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 torch holds it (two's complement)."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GAMMA = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` keeps the sign bit), a new tensor."""
    return (x >> k).bitwise_and_((1 << (64 - k)) - 1)


def _finalize_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on an int64 tensor, in place: torch's int64 arithmetic
    wraps modulo 2**64 as the masked Python version does."""
    x ^= _shr(x, 30)
    x *= _MUL1
    x ^= _shr(x, 27)
    x *= _MUL2
    x ^= _shr(x, 31)
    return x


_U_GAMMA, _U_MUL1, _U_MUL2 = (
    np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)


def _mix64_np(x: np.ndarray) -> np.ndarray:
    """``engine_core.rollout._mix64`` on a uint64 array, as a new array: numpy's uint64
    arithmetic wraps modulo 2**64 and shifts logically, as the masked Python version does."""
    x = x + _U_GAMMA
    x ^= x >> np.uint64(30)
    x *= _U_MUL1
    x ^= x >> np.uint64(27)
    x *= _U_MUL2
    x ^= x >> np.uint64(31)
    return x


def _derive_seeds(seeds: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``engine_core.rollout.derive_seed`` on uint64 arrays (broadcast), bit for bit. On the
    host in numpy, not in torch: a call derives a few hundred seeds, where each of torch's 30
    operations would cost more in overhead than in arithmetic."""
    return _mix64_np(_mix64_np(seeds) ^ index) >> np.uint64(1)


def _sample_seeds(prompts: TensorDict, params: SamplingParams) -> torch.Tensor | None:
    """``engine_core.rollout.sample_seeds`` as an int64 tensor ``[B * n]``, the ``n`` seeds of
    a prompt derived at once; None when unseeded."""
    seeds = prompt_seeds(prompts, params)
    if seeds is None:
        return None
    # derive_seed masks a seed to 64 bits: a negative one (an int64 column's) by its bit pattern
    column = np.array([s & ((1 << 64) - 1) for s in seeds], dtype=np.uint64)
    rows = _derive_seeds(column[:, None], np.arange(params.n, dtype=np.uint64)).reshape(-1)
    return torch.from_numpy(rows.astype(np.int64))  # derived seeds are below 2**63


_NOISE_BLOCK = 1 << 20
"""Noise values drawn at once: several positions' for small batches (fewer tensor ops per token),
one position's at a time once a position alone is this large."""


class _RowSampler(LogitsProcessor):
    """Samples each row's next token by its seed alone: temperature, top-k and top-p as
    transformers' warpers apply them, then the Gumbel-max draw; the scores handed back keep
    only the drawn token, which generate's greedy choice then takes.

    The noise is counter-based, drawn for all rows at once on the logits' device: at position
    ``t`` of the response (the ``t``-th call of this processor; not ``input_ids``' width, which
    depends on the batch's left padding) the uniform of vocabulary entry ``v`` in the row with
    seed ``s`` is the ``v + 1``-th output of splitmix64 started at ``derive_seed(s, t)``, its
    top 52 bits ``m`` as ``(m + 0.5) / 2**52`` in float64: never 0 or 1. The Gumbel noise
    ``-log(-log(u))`` of several positions is drawn in one go while it stays under
    ``_NOISE_BLOCK`` values."""

    def __init__(self, row_seeds: torch.Tensor, params: SamplingParams) -> None:
        # every position's start, derive_seed(s, t), at once: [max_new_tokens, rows]
        positions = np.arange(params.max_new_tokens, dtype=np.uint64)[:, None]
        rows = row_seeds.numpy().astype(np.uint64)[None, :]  # seeds from _sample_seeds: >= 0
        self.starts = torch.from_numpy(_derive_seeds(rows, positions).astype(np.int64))
        self.offsets = torch.empty(0, dtype=torch.int64)  # (v + 1) * gamma, made when first used
        self.position = 0  # of the next call
        self.noise = torch.empty(0)  # Gumbel noise of positions [noise_from, noise_from + len)
        self.noise_from = 0
        self.temperature, self.top_k, self.top_p = params.temperature, params.top_k, params.top_p

    def uniforms(self, first: int, count: int, vocab: int, device: torch.device) -> torch.Tensor:
        """The uniforms ``[count, rows, vocab]`` (float64 in (0, 1)) of positions ``first`` to
        ``first + count - 1``."""
        if self.offsets.shape[0] != vocab or self.offsets.device != device:
            self.starts = self.starts.to(device)
            self.offsets = torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _GAMMA
        # splitmix64's state after v + 1 steps from start, then its output function
        bits = _finalize_(self.starts[first : first + count].unsqueeze(-1) + self.offsets)
        return _shr(bits, 12).double().add_(0.5).mul_(2.0**-52)

    def gumbel(self, vocab: int, device: torch.device) -> torch.Tensor:
        """The next position's Gumbel noise ``[rows, vocab]`` (float32); advances it."""
        at = self.position - self.noise_from
        if at >= self.noise.shape[0] or self.noise.shape[-1] != vocab:
            rows = self.starts.shape[1]
            left = self.starts.shape[0] - self.position
            count = max(1, min(left, _NOISE_BLOCK // max(1, rows * vocab)))
            u = self.uniforms(self.position, count, vocab, device)
            # -log(E) with E = -log(u) exponential, taken in float64 where u is near 1
            self.noise = u.log_().neg_().float().log_().neg_()
            self.noise_from, at = self.position, 0
        self.position += 1
        return self.noise[at]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logits = scores.float() / self.temperature
        vocab = logits.shape[-1]
        if 0 < self.top_k < vocab:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = torch.sort(logits, descending=True, dim=-1)
            probs = ordered.softmax(-1)
            beyond = probs.cumsum(-1) - probs >= self.top_p  # the mass ahead already reaches p
            drop = torch.zeros_like(beyond).scatter(-1, order, beyond)
            logits = logits.masked_fill(drop, float("-inf"))
        choice = (logits + self.gumbel(vocab, logits.device)).argmax(-1, keepdim=True)
        picked = torch.full_like(scores, float("-inf"))
        return cast(torch.FloatTensor, picked.scatter(-1, choice, 0.0))


# transformers' LogitsProcessorList reads each processor's signature at every token: stored
# once, reading it is a lookup (a third of parsing the function's each time)
setattr(_RowSampler.__call__, "__signature__", inspect.signature(_RowSampler.__call__))  # noqa: B010


@contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Run the body on a fork of the RNG of ``device`` (and the CPU) seeded with ``seed``.

    transformers' ``generate`` samples from the global generator and takes no generator of its
    own, so the global state is forked and restored on exit. ``torch.manual_seed`` is avoided: it
    would also reseed every CUDA device, outside the fork. ``seed`` None: the body runs as is.
    """
    if seed is None:
        yield
        return
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


def _generation_routes(
    forwards: list[torch.Tensor], prompt_shape: torch.Size, generated: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt routes ``[rows, P, layers, top_k]``, response routes ``[rows, R, layers,
    top_k]``) from the forwards of one ``generate``: the prompt's, then one per fed-back token."""
    rows, width = prompt_shape
    if len(forwards) != generated:
        raise RuntimeError(
            f"recording routes: generate made {len(forwards)} forwards for {generated} new "
            f"tokens; expected one for the prompt and one per token fed back."
        )
    prompt = forwards[0].reshape(forwards[0].shape[0], rows, width, -1).permute(1, 2, 0, 3)
    layers, top_k = prompt.shape[2], prompt.shape[3]
    response = torch.empty(rows, generated, layers, top_k, dtype=torch.int64)
    for j, step in enumerate(forwards[1:]):  # the experts of response token j
        response[:, j] = step.permute(1, 0, 2)
    response[:, generated - 1] = torch.arange(top_k)  # the last token is never fed back
    return prompt.contiguous(), response


def _pad_right(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """``t`` (``[rows, R, ...]``) padded along its second dimension to ``width``."""
    if t.shape[1] == width:
        return t
    trailing = (0, 0) * (t.dim() - 2)  # F.pad's pairs run from the last dimension back
    return torch.nn.functional.pad(t, (*trailing, 0, width - t.shape[1]), value=value)


def _vision_kwargs(
    images: TensorDict, ids: torch.Tensor, n: int, model: Any, device: torch.device
) -> dict[str, Any]:
    """``generate``'s vision inputs for a chunk whose rows are its prompts' ``n`` samples
    each: every row's images in row order, their grids, and the image tokens' type ids (from
    which transformers computes the 3-D positions of the prompt and of each new token)."""
    prompt_of_row = torch.arange(ids.shape[0]) // n
    pixels, grids = images_in_order(
        images[PIXEL_VALUES][prompt_of_row], images[IMAGE_GRID_THW][prompt_of_row]
    )
    kinds = (ids == model.config.image_token_id).int()
    return {
        "pixel_values": pixels.to(device),
        "image_grid_thw": grids.to(device),
        "mm_token_type_ids": kinds.to(device),
    }
