"""Routing replay in the RL job: the shipped ``moe_tiny`` recipe (a Qwen3-MoE on the text task,
fsdp2 and the hf rollout) with each ``trainer.routing_replay`` mode, and the refusals before
anything is built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from engine_core.batch import ROUTED_EXPERTS
from engine_core.errors import CapabilityError
from engine_core.moe import route_mismatch
from engine_core.plugins import load_plugins
from engine_core.rollout import PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK
from engine_core.testing.moe import AS_QWEN3_MOE
from engine_core_roles.jobs.cli import RECIPES, load_recipe
from engine_core_roles.jobs.rl.run import run_rl_job
from engine_core_roles.trainer.dynamic_sampling import _cat_left_padded
from engine_core_roles.trainer.routing import counted_tokens

RECIPE = RECIPES / "moe_tiny.yaml"


def _run(out: Path, *overrides: str) -> list[dict[str, Any]]:
    base = [f"output_dir={out}", "steps=2"]
    base += ["warmup_sft_steps=0", "eval.every=0", "log_every=1"]
    raw = load_recipe(RECIPE, [*base, *overrides])
    run_rl_job(raw, load_plugins())
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# the engine computes in bf16, the rollout in fp32: their routers disagree on some tokens
BF16 = ["engine.compute_dtype=bfloat16", "trainer.logprob_gap_limit=null"]


def test_the_moe_recipe_replays_the_rollouts_routes(tmp_path: Path) -> None:
    """fp32 on both sides: replayed routes are the trainer's own (mismatch 0) and the log-probs
    agree. A bf16 trainer: ``measure`` logs the routers' disagreement, and replaying the
    rollout's routes shrinks the largest log-prob gap of the same first step's samples."""
    rows = _run(tmp_path / "fp32")
    assert [r["rollout/route_mismatch"] for r in rows] == [0.0, 0.0]
    # the routers' balance loss of the recipe: top-k (2.0) when perfectly balanced, more if not
    assert all(2.0 <= r["actor/moe_aux_loss"] < 8.0 for r in rows)
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-5
    measured = _run(tmp_path / "measure", "trainer.routing_replay=measure", *BF16)
    replayed = _run(tmp_path / "replay", *BF16)
    assert measured[0]["rollout/route_mismatch"] > 0  # bf16 against fp32 routers
    # the first step samples the same tokens in both runs (same weights, same seed)
    assert measured[0]["response_length"] == replayed[0]["response_length"]
    assert replayed[0]["rollout/logprob_diff_max"] < measured[0]["rollout/logprob_diff_max"]


def test_trainer_side_replay_and_off_run_without_the_rollouts_routes(tmp_path: Path) -> None:
    """``trainer``: the update replays the old-log-prob pass's routes (two epochs, so the second
    epoch routes as the old policy did, not as the updated one); ``off`` logs no mismatch and
    the rollout samples as the actor scores. (The experts' sync into vLLM, stacked in the actor
    and per expert in vLLM's loader, is ``plugins/vllm/tests``'
    ``test_a_mixture_of_experts_syncs_its_stacked_experts_into_vllm``.)"""
    rows = _run(
        tmp_path / "trainer",
        "trainer.routing_replay=trainer",
        "actor.old_log_probs=recompute",
        "actor.ppo_epochs=2",
    )
    assert len(rows) == 2 and all("rollout/route_mismatch" not in r for r in rows)
    assert all(r["actor/num_optimizer_steps"] == 2 for r in rows)
    off = _run(tmp_path / "off", "trainer.routing_replay=off")
    assert all("rollout/route_mismatch" not in r for r in off)
    assert max(r["rollout/logprob_diff_max"] for r in off) < 1e-5


@pytest.mark.parametrize(
    ("overrides", "error", "phrase"),
    [
        (["engine.backend=example"], CapabilityError, "engine: backend .example."),
        (["trainer.routing_replay=trainer"], ValueError, "nothing to replay"),
        (["trainer.routing_replay=true"], ValueError, "takes a mode, not true"),
    ],
    ids=["engine", "trainer-on-policy", "true"],
)
def test_routing_replay_is_refused_before_anything_is_built(
    tmp_path: Path, overrides: list[str], error: type[Exception], phrase: str
) -> None:
    raw = load_recipe(RECIPE, [f"output_dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(error, match=phrase):
        run_rl_job(raw, load_plugins())
    assert not (tmp_path / "run").exists()


def test_multi_turn_episodes_replay_the_rollouts_routes(tmp_path: Path) -> None:
    """The shipped agent recipe on a Qwen3-MoE (fp32): each episode's routes, stitched across
    its turns, are the trainer's own on every counted token, and the log-probs agree."""
    overrides = [f"engine.model.config.{k}={str(v).lower()}" for k, v in AS_QWEN3_MOE.items()]
    out = tmp_path / "agent"
    raw = load_recipe(
        RECIPES / "agent_tiny.yaml",
        [
            f"output_dir={out}",
            "steps=2",
            "prompts_per_step=2",
            "trainer.samples_per_prompt=4",
            "warmup_sft_steps=1",
            "eval.every=0",
            "log_every=1",
            "trainer.routing_replay=rollout",
            *overrides,
        ],
    )
    run_rl_job(raw, load_plugins())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/route_mismatch"] for r in rows] == [0.0, 0.0]
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-5
    assert max(r["episode/turns"] for r in rows) > 1  # turns were stitched


def test_counted_tokens_leave_out_padding_and_each_rows_last_token() -> None:
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]])
    want = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]]).bool()
    assert torch.equal(counted_tokens(mask), want)


def test_draws_of_different_widths_keep_their_routes_aligned() -> None:
    """Dynamic sampling joins generations of different prompt and response widths: each one's
    routes are padded at the prompt's left and the response's right, like its tokens."""

    def draw(prompt: int, response: int, seed: int) -> TensorDict:
        g = torch.Generator().manual_seed(seed)
        width = prompt + response
        return TensorDict(
            {
                PROMPT_IDS: torch.randint(1, 9, (2, prompt), generator=g),
                PROMPT_MASK: torch.ones(2, prompt, dtype=torch.long),
                RESPONSE_IDS: torch.randint(1, 9, (2, response), generator=g),
                RESPONSE_MASK: torch.ones(2, response, dtype=torch.long),
                ROUTED_EXPERTS: torch.randint(0, 8, (2, width, 3, 2), generator=g),
            },
            batch_size=[2],
        )

    a, b = draw(3, 5, 0), draw(5, 2, 1)
    joined = _cat_left_padded([a, b])
    assert joined[ROUTED_EXPERTS].shape == (4, 10, 3, 2)
    for part, rows in ((a, slice(0, 2)), (b, slice(2, 4))):
        prompt = part[PROMPT_IDS].shape[1]
        response = part[RESPONSE_IDS].shape[1]
        got = joined[ROUTED_EXPERTS][rows]
        assert torch.equal(got[:, 5 - prompt : 5], part[ROUTED_EXPERTS][:, :prompt])
        assert torch.equal(got[:, 5 : 5 + response], part[ROUTED_EXPERTS][:, prompt:])
        assert route_mismatch(got[:, 5 - prompt : 5 + response], part[ROUTED_EXPERTS]) == 0.0
