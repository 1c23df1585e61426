"""``HFRollout``: generation with transformers ``generate`` (KV cache on), batched.

Log-probs of sampled tokens come from the model's raw logits at each step, divided by the
sampling temperature (1 for greedy) and log-softmaxed over the whole vocabulary — the same
quantity a trainer computes with ``BatchMeta(temperature=T)``, so the two can be compared
token by token. Top-k / top-p change which tokens can be sampled, not these log-probs.

The config's seed (for building the model) applies to a fork of the process's RNG, restored
afterwards: seeding a rollout never changes the random stream of the trainer or anything else
sharing the process. A seeded request (``SamplingParams.seed``, or the prompts' ``prompt_seed``
column) samples each row from a generator of its own, seeded with
``derive_seed(prompt_seeds[i], j)`` for sample ``j`` of prompt ``i``: temperature, top-k and
top-p are applied here and the token drawn with Gumbel noise from that generator, so a row's
sample does not depend on the other rows of the batch (transformers' own sampling draws the
whole batch from one global generator). Unseeded requests sample as transformers does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from pydantic import Field, PositiveInt
from tensordict import NonTensorStack, TensorDict
from transformers import LogitsProcessor, LogitsProcessorList

from engine_core.backend import (
    FINISH_REASON,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    BaseRollout,
    Capability,
    RolloutConfig,
    SamplingParams,
    build_model,
    prompt_tensors,
    sample_seeds,
    tensor_checksum,
)
from engine_core_hf.capabilities import HF_CAPABILITIES

__all__ = ["HFRollout", "HFRolloutConfig"]


class HFRolloutConfig(RolloutConfig):
    """The HF rollout: the common fields plus generation batching."""

    generation_batch_size: PositiveInt = Field(
        64, description="Prompts per generate() call (each with its n samples)."
    )
    pad_token_id: int = Field(0, ge=0, description="Used when the model config names none.")


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
        self.pad_token_id = int(pad) if pad is not None else config.pad_token_id
        # names and shapes are fixed once built: asked at every sync, read once
        self._shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}

    # -- generation -----------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        ids, mask = prompt_tensors(prompts, "HFRollout.generate")
        row_seeds = None if params.greedy else sample_seeds(prompts, params)
        ids, mask = ids.repeat_interleave(params.n, dim=0), mask.repeat_interleave(params.n, dim=0)
        rows = self.cfg.generation_batch_size * params.n  # every sample of a prompt in one call
        parts = [
            self._generate_chunk(
                ids[i : i + rows],
                mask[i : i + rows],
                params,
                None if row_seeds is None else row_seeds[i : i + rows],
            )
            for i in range(0, ids.shape[0], rows)
        ]
        width = max(p[0].shape[1] for p in parts)
        resp = torch.cat([_pad_right(p[0], width, self.pad_token_id) for p in parts])
        resp_mask = torch.cat([_pad_right(p[1], width, 0) for p in parts])
        logps = torch.cat([_pad_right(p[2], width, 0.0) for p in parts])
        reasons = [r for p in parts for r in p[3]]
        out = TensorDict(
            {
                PROMPT_IDS: ids,
                PROMPT_MASK: mask,
                RESPONSE_IDS: resp,
                RESPONSE_MASK: resp_mask,
                ROLLOUT_LOG_PROBS: logps,
            },
            batch_size=[ids.shape[0]],
        )
        out[FINISH_REASON] = NonTensorStack.from_list(reasons)
        return out

    def _generate_chunk(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        params: SamplingParams,
        row_seeds: list[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
        stop = list(params.stop_token_ids)
        kwargs: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "do_sample": not params.greedy and row_seeds is None,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": stop or None,
            "return_dict_in_generate": True,
            "output_logits": True,
        }
        if row_seeds is not None:  # our sampler picks each row's token; generate takes argmax
            kwargs.update(temperature=None, top_p=None, top_k=None)
            kwargs["logits_processor"] = LogitsProcessorList([_RowSampler(row_seeds, params)])
        elif not params.greedy:
            kwargs.update(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else None,
            )
        else:  # neutralise sampling defaults a checkpoint's generation_config may carry
            kwargs.update(temperature=None, top_p=None, top_k=None)
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kwargs
        )
        resp = out.sequences[:, ids.shape[1] :].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu() / params.log_prob_temperature
        logps = torch.log_softmax(logits, -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        # valid up to and including the first stop token
        is_stop = torch.zeros_like(resp, dtype=torch.bool)
        for s in stop:
            is_stop |= resp == s
        after_stop = (is_stop.long().cumsum(-1) - is_stop.long()) > 0
        resp_mask = (~after_stop).long()
        resp = resp.masked_fill(after_stop, self.pad_token_id)
        logps = logps.masked_fill(after_stop, 0.0)
        reasons = ["stop" if stopped else "length" for stopped in is_stop.any(-1).tolist()]
        return resp, resp_mask, logps, reasons

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


class _RowSampler(LogitsProcessor):
    """Samples each row's next token from that row's own generator: temperature, top-k and
    top-p as transformers' warpers apply them, then the Gumbel-max draw; the scores handed back
    keep only the drawn token, which generate's greedy choice then takes."""

    def __init__(self, row_seeds: list[int], params: SamplingParams) -> None:
        self.generators = [torch.Generator().manual_seed(s) for s in row_seeds]
        self.temperature, self.top_k, self.top_p = params.temperature, params.top_k, params.top_p

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
        noise = torch.stack([torch.rand(vocab, generator=g) for g in self.generators])
        gumbel = -torch.log(-torch.log(noise.clamp_min(torch.finfo(noise.dtype).tiny)))
        choice = (logits + gumbel.to(logits.device)).argmax(-1, keepdim=True)
        picked = torch.full_like(scores, float("-inf"))
        return picked.scatter(-1, choice, 0.0)


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


def _pad_right(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)
