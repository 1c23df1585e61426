"""SGLang's answers as the rollout contract's batch: each output's sampled ids, log-probs and
finish (:func:`parse_outputs`), the experts its tokens went to (:func:`sglang_routes`, in the
MoE layers :func:`moe_layers` finds), and each position's most likely tokens
(:func:`sglang_top_logprobs`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from engine_core.backend import (
    PROMPT_IDS,
    PROMPT_MASK,
    BatchError,
    ConfigError,
    response_batch,
    top_log_prob_tensors,
)

__all__ = ["moe_layers", "parse_outputs", "sglang_routes", "sglang_top_logprobs"]

_FINISHED = ("stop", "length")
_MOE_ROUTER = re.compile(r"layers\.(\d+)\.mlp\.gate\.weight$")


def moe_layers(expected: Mapping[str, tuple[int, ...]]) -> list[int]:
    """The decoder layers of a mixture of experts that route (their ``mlp.gate``), in order;
    refused for a model without one."""
    found = sorted({int(m.group(1)) for n in expected if (m := _MOE_ROUTER.search(n))})
    if not found:
        raise ConfigError(
            "rollout.return_routes asks for the experts each token went to, but the model has "
            "no mixture-of-experts layer (no layers.N.mlp.gate.weight); turn routing replay off."
        )
    return found


def sglang_routes(
    k: int, out: Mapping[str, Any], num_layers: int, top_k: int, moe: Sequence[int]
) -> torch.Tensor:
    """Output ``k``'s ``meta_info["routed_experts"]`` (base64 of int32 ``[tokens, layers,
    top_k]`` over every decoder layer, for its prompt and response tokens but the last) as
    ``[tokens, MoE layers, top_k]``."""
    import base64

    import numpy as np

    meta = out.get("meta_info")
    raw = meta.get("routed_experts") if isinstance(meta, Mapping) else None
    if raw is None:
        raise BatchError(
            f"SGLang output {k} has no 'routed_experts': the engine must start with "
            f"enable_return_routed_experts and be asked with return_routed_experts=True."
        )
    if isinstance(raw, str):
        flat = torch.from_numpy(np.frombuffer(base64.b64decode(raw), dtype=np.int32).copy())
    else:
        flat = torch.as_tensor(raw).to(torch.int32).reshape(-1)
    if flat.numel() % (num_layers * top_k):
        raise BatchError(
            f"SGLang output {k}: {flat.numel()} routed-expert ids do not split into rows of "
            f"{num_layers} layers x top_k={top_k}."
        )
    return flat.reshape(-1, num_layers, top_k)[:, list(moe)].to(torch.int64)


def parse_outputs(
    outputs: Sequence[Mapping[str, Any]],
    prompts: TensorDict,
    n: int,
    *,
    pad_token_id: int = 0,
    stop_at: Callable[[list[int]], int | None] | None = None,
    cut: frozenset[int] = frozenset(),
) -> TensorDict:
    """SGLang's answers to :func:`build_requests` as the rollout contract's batch.

    ``outputs[k]`` answers sample ``k % n`` of prompt ``k // n`` and looks like
    ``{"output_ids": [...], "meta_info": {"finish_reason": {"type": "stop" | "length", ...},
    "prompt_tokens": int, "output_token_logprobs": [(logprob, token_id, text), ...], ...}}``.
    Responses are right-padded with ``pad_token_id``; an aborted or unknown finish, or log-probs
    that do not line up with the tokens, raise :class:`BatchError`. ``stop_at(ids)``: how many
    of a response's ids a stop string lets it keep (None: all); a response cut there is not
    truncated. ``cut``: ids no response may hold (a vision-language model's vision tokens:
    fed back, one would ask the model for an image the sample does not have); a sample that
    drew one ends just before it, truncated.
    """
    ids, mask = prompts[PROMPT_IDS], prompts[PROMPT_MASK]
    total = ids.shape[0] * n
    if len(outputs) != total:
        raise BatchError(
            f"SGLang returned {len(outputs)} outputs for {ids.shape[0]} prompts x n={n} "
            f"(expected {total})."
        )
    prompt_lens = [int(x) for x in mask.sum(-1).tolist()]
    parsed = [_parse_one(k, out, prompt_lens[k // n]) for k, out in enumerate(outputs)]
    if cut:
        parsed = [_before(sample, cut) for sample in parsed]
    if stop_at is not None:
        parsed = [_cut(sample, stop_at(sample[0])) for sample in parsed]
    return response_batch(ids, mask, n, parsed, pad_token_id)


def _cut(
    sample: tuple[list[int], list[float], bool], keep: int | None
) -> tuple[list[int], list[float], bool]:
    toks, lps, truncated = sample
    return sample if keep is None else (toks[:keep], lps[:keep], False)


def _before(
    sample: tuple[list[int], list[float], bool], cut: frozenset[int]
) -> tuple[list[int], list[float], bool]:
    """``sample`` ended just before its first id in ``cut`` (truncated), if it holds one."""
    toks, lps, _ = sample
    end = next((j for j, t in enumerate(toks) if t in cut), None)
    return sample if end is None else (toks[:end], lps[:end], True)


def _parse_one(
    k: int, out: Mapping[str, Any], prompt_len: int
) -> tuple[list[int], list[float], bool]:
    meta = out.get("meta_info")
    if "output_ids" not in out or not isinstance(meta, Mapping):
        raise BatchError(
            f"SGLang output {k}: expected 'output_ids' and a 'meta_info' dict, got keys "
            f"{sorted(out)}."
        )
    truncated = _truncated(k, meta.get("finish_reason"))
    toks = [int(t) for t in out["output_ids"]]
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise BatchError(
            f"SGLang output {k} has no 'output_token_logprobs': generate() must be called with "
            "return_logprob=True."
        )
    if len(entries) != len(toks):
        raise BatchError(f"SGLang output {k}: {len(toks)} tokens but {len(entries)} log-probs.")
    lps: list[float] = []
    for pos, (t, entry) in enumerate(zip(toks, entries, strict=True)):
        logprob, token_id = entry[0], entry[1]
        if logprob is None or int(token_id) != t:
            raise BatchError(
                f"SGLang output {k}, token {pos}: log-prob entry {tuple(entry)!r} does not "
                f"belong to sampled token {t}."
            )
        lps.append(float(logprob))
    got = meta.get("prompt_tokens")
    if got is not None and int(got) != prompt_len:
        raise BatchError(
            f"SGLang output {k} answers a {got}-token prompt, but its slot belongs to a "
            f"{prompt_len}-token prompt: the outputs are not in request order."
        )
    return toks, lps, truncated


def sglang_top_logprobs(
    outputs: Sequence[Mapping[str, Any]], kept: Sequence[int], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rollout_top_ids`` and ``rollout_top_log_probs`` ``[N, R, k]`` from SGLang's
    ``meta_info["output_top_logprobs"]`` (per position, ``(logprob, token_id, text)`` most likely
    first), each output's first ``kept[j]`` positions (what its response keeps); 0 elsewhere."""
    ranked = []
    for j, out in enumerate(outputs):
        positions = out["meta_info"].get("output_top_logprobs")
        if positions is None or len(positions) < int(kept[j]):
            raise BatchError(
                f"SGLang output {j} has no 'output_top_logprobs' for its {kept[j]} tokens: "
                f"generate() must be called with top_logprobs_num."
            )
        ranked.append(
            [[(int(e[1]), float(e[0])) for e in positions[pos][:k]] for pos in range(int(kept[j]))]
        )
    return top_log_prob_tensors(ranked, k, max([int(x) for x in kept] + [0]))


def _truncated(k: int, reason: Any) -> bool:
    """Whether SGLang's ``finish_reason`` says the sample hit its token limit ("length"), not a
    stop token ("stop")."""
    kind = reason.get("type") if isinstance(reason, Mapping) else None
    if kind in _FINISHED:
        return kind == "length"
    if kind == "abort":
        raise BatchError(f"SGLang aborted sample {k}: {reason.get('message')}")
    raise BatchError(
        f"SGLang output {k}: unknown finish_reason {reason!r}; expected a dict with "
        f"type in {_FINISHED}."
    )


# -- weights --------------------------------------------------------------------------------
