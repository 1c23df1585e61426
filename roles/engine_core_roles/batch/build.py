"""The batches an RL step passes around: prompts into a rollout, rollout output into the roles;
and the batches of supervised steps.

:func:`prompt_batch` builds the ``generate`` input of :class:`engine_core.BaseRollout` from
token ids; :func:`training_batch` turns a ``generate`` result (prompt + response) into the batch
the roles take, with ``loss_mask`` on the response tokens; :func:`turns_batch` is the ``generate``
result of whole episodes or sessions (what was sampled trained, what was added between turns
not); :func:`sequence_batch` makes whole
token sequences with their loss masks (tokenized conversations) one batch. The roles then add their fields to it
under the names exported from :mod:`engine_core_roles` (``OLD_LOG_PROBS``, ``ADVANTAGES``, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from engine_core import BatchError, BatchMeta, ConfigError, SamplingParams, make_batch
from engine_core.batch import IMAGE_GRID_THW, INPUT_IDS, ROUTED_EXPERTS
from engine_core.rollout import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_LOSS_MASK,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    response_batch,
)
from engine_core.vision import PIXEL_VALUES
from engine_core_roles.batch.keys import ROW

__all__ = ["dataset_rows", "prompt_batch", "training_batch", "sequence_batch", "turns_batch"]


def dataset_rows(prompts: TensorDict, needs: str) -> list[dict[str, Any]]:
    """Each prompt's dataset row, from the :data:`ROW` field of a prompt batch, for a rollout
    that starts from rows (``needs`` says which and what for, e.g. "an agent rollout hands each
    agent its dataset row"); refused, before anything runs, where the batch has none."""
    if ROW not in prompts.keys():
        raise ConfigError(
            f"{needs}, from the {ROW!r} field of the prompt batch, which has none (its fields: "
            f"{sorted(prompts.keys())}); build the prompts with "
            f"engine_core_roles.data.datasets.prompts.PromptData(..., rows=True)."
        )
    return [dict(r) for r in prompts[ROW].tolist()] if prompts.batch_size[0] else []


def turns_batch(
    prompts: TensorDict,
    samples: Sequence[tuple[Sequence[int], Sequence[int], Sequence[float], bool]],
    *,
    pad_token_id: int,
) -> TensorDict:
    """The ``generate`` result of whole episodes or sessions, one per prompt of ``prompts``
    (a :func:`prompt_batch`, whose other fields, images among them, are kept): each sample's
    response tokens (the model's and what was added between its turns), which of them the
    model sampled (:data:`RESPONSE_LOSS_MASK` 1), their rollout log-probs (0 on added ones),
    and whether a limit cut it."""
    out = response_batch(
        prompts[PROMPT_IDS],
        prompts[PROMPT_MASK],
        1,
        [(tokens, log_probs, cut) for tokens, _, log_probs, cut in samples],
        int(pad_token_id),
    )
    trained = torch.zeros_like(out[RESPONSE_MASK])
    for k, (_, sampled, _, _) in enumerate(samples):
        trained[k, : len(sampled)] = torch.tensor(list(sampled), dtype=torch.long)
    out[RESPONSE_LOSS_MASK] = trained
    out.update({k: v for k, v in prompts.items() if k not in (PROMPT_IDS, PROMPT_MASK)})
    return out


def prompt_batch(
    prompt_ids: torch.Tensor | Sequence[Sequence[int]],
    prompt_mask: torch.Tensor | None = None,
    *,
    pad_token_id: int = 0,
) -> TensorDict:
    """The input of ``rollout.generate``: left-padded ``prompt_ids`` and ``prompt_mask`` ``[B, P]``.

    ``prompt_ids`` is a ``[B, P]`` integer tensor (every token real unless ``prompt_mask`` says
    otherwise, in which case the padding must be on the left), or one list of token ids per
    prompt, of any lengths, which are left-padded with ``pad_token_id``.
    """
    if not isinstance(prompt_ids, torch.Tensor):
        if prompt_mask is not None:
            raise BatchError(
                "prompt_mask is only taken with a [B, P] tensor of prompt_ids; lists of token "
                "ids are padded (and masked) here, so drop prompt_mask."
            )
        prompt_ids, prompt_mask = _left_pad([list(p) for p in prompt_ids], pad_token_id)
    if prompt_ids.dim() != 2 or prompt_ids.is_floating_point():
        raise BatchError(
            f"prompt_ids must be an integer tensor [batch, prompt_len]; got dtype "
            f"{prompt_ids.dtype} with shape {tuple(prompt_ids.shape)}."
        )
    if prompt_mask is None:
        prompt_mask = torch.ones_like(prompt_ids)
    if prompt_mask.shape != prompt_ids.shape:
        raise BatchError(
            f"prompt_mask has shape {tuple(prompt_mask.shape)} but prompt_ids has "
            f"{tuple(prompt_ids.shape)}; they must match."
        )
    mask = prompt_mask.long()
    if mask.shape[1] and bool((mask[:, -1] == 0).any()):
        raise BatchError(
            "prompts must be left-padded (a rollout appends the response after the last "
            "column), but some prompt_mask rows end in 0; pad on the left."
        )
    return TensorDict(
        {PROMPT_IDS: prompt_ids.long(), PROMPT_MASK: mask}, batch_size=[prompt_ids.shape[0]]
    )


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not rows or any(not r for r in rows):
        raise BatchError("every prompt needs at least one token, and there must be one prompt.")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


def training_batch(rollout_output: TensorDict, params: SamplingParams) -> TensorDict:
    """Prompt + response as one batch, ``loss_mask`` set on the response tokens only (on the
    ones ``response_loss_mask`` marks when the output has it: an episode's model tokens).

    ``rollout_output`` is what ``rollout.generate(prompts, params)`` returned (``prompt_ids``,
    ``prompt_mask``, ``response_ids``, ``response_mask``); the result has ``input_ids``,
    ``attention_mask``, ``position_ids`` and ``loss_mask`` ``[B, P + R]``, ready for
    ``Actor.compute_log_prob``. Its metadata carries the temperature the samples were drawn at
    (``params.log_prob_temperature``): the actor and the reference compute their log-probs at
    that one, so they are log-probs of the distribution that was sampled.
    When the rollout output holds ``rollout_log_probs`` ``[B, R]``, the result holds it too,
    aligned to ``input_ids`` like ``old_log_probs`` (0 on the prompt): the actor's mismatch
    correction reads it; so does ``routed_experts`` ``[B, P + R, layers, top_k]`` (a mixture of
    experts' routes, replayed by the engines), and ``pixel_values`` / ``image_grid_thw`` (the
    images of each sample's prompt, :mod:`engine_core.vision`).
    """
    missing = [
        k
        for k in (PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK)
        if k not in rollout_output.keys()
    ]
    if missing:
        raise BatchError(
            f"training_batch needs a rollout.generate result; missing {missing}, got "
            f"{sorted(rollout_output.keys())}."
        )
    prompt, pmask = rollout_output[PROMPT_IDS], rollout_output[PROMPT_MASK]
    resp, rmask = rollout_output[RESPONSE_IDS], rollout_output[RESPONSE_MASK]
    trained = rmask
    if RESPONSE_LOSS_MASK in rollout_output.keys():
        trained = rollout_output[RESPONSE_LOSS_MASK]
        if trained.shape != rmask.shape or bool((trained.bool() & ~rmask.bool()).any()):
            raise BatchError(
                f"{RESPONSE_LOSS_MASK} {tuple(trained.shape)} must have response_mask's shape "
                f"{tuple(rmask.shape)} and be 1 only where response_mask is."
            )
    batch = make_batch(
        torch.cat([prompt, resp], 1),
        torch.cat([pmask, rmask], 1),
        loss_mask=torch.cat([torch.zeros_like(pmask), trained.long()], 1),
        meta=BatchMeta(temperature=params.log_prob_temperature),
    )
    if ROLLOUT_LOG_PROBS in rollout_output.keys():
        lp = rollout_output[ROLLOUT_LOG_PROBS]
        if lp.shape != resp.shape:
            raise BatchError(
                f"{ROLLOUT_LOG_PROBS} has shape {tuple(lp.shape)} but response_ids "
                f"{tuple(resp.shape)}; a rollout returns one log-prob per response token."
            )
        prompt_zeros = torch.zeros(pmask.shape, dtype=lp.dtype, device=lp.device)
        batch[ROLLOUT_LOG_PROBS] = torch.cat([prompt_zeros, lp], 1)
    if ROUTED_EXPERTS in rollout_output.keys():
        routes = rollout_output[ROUTED_EXPERTS]
        want = tuple(batch[INPUT_IDS].shape)
        if routes.dim() != 4 or tuple(routes.shape[:2]) != want:
            raise BatchError(
                f"{ROUTED_EXPERTS} has shape {tuple(routes.shape)}; a rollout returns it as "
                f"[B*n, P+R, layers, top_k] with [B*n, P+R] = {want}, one row of experts per "
                f"prompt and response token."
            )
        batch[ROUTED_EXPERTS] = routes
    for key in (PIXEL_VALUES, IMAGE_GRID_THW):  # each sample's prompt's images
        if key in rollout_output.keys():
            batch[key] = rollout_output[key]
    return batch


def sequence_batch(
    rows: Sequence[tuple[Sequence[int], Sequence[int]]], *, pad_token_id: int = 0
) -> TensorDict:
    """Token sequences and their loss masks, ``(ids, loss_mask)`` per row, as one right-padded
    batch: ``input_ids``, ``attention_mask``, ``position_ids`` (from 0 in each row) and
    ``loss_mask`` ``[B, L]``, ``L`` the longest row."""
    if not rows or any(not ids for ids, _ in rows):
        raise BatchError("every sequence needs at least one token, and there must be one.")
    if any(len(ids) != len(mask) for ids, mask in rows):
        raise BatchError("each sequence's loss mask must have one entry per token.")
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(input_ids)
    loss = torch.zeros_like(input_ids)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        attn[i, : len(ids)] = 1
        loss[i, : len(ids)] = torch.tensor(list(mask), dtype=torch.long)
    return make_batch(input_ids, attn, loss_mask=loss)
