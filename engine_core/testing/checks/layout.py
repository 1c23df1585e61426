"""Layout and processes: the DP layout's properties against the process group (one collect
rank per DP rank, one writer of the full params, ``dp_group``, ``is_distributed``),
``shard_data`` and ``global_context`` over DP ranks, and the engine in a plain process with no
process group, as a script or ``engine-core run`` builds it.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine_core.batch import LOG_PROBS
from engine_core.capabilities import Capability
from engine_core.engine import loss_mask_of
from engine_core.testing.checks.registry import Check, Context, Layout
from engine_core.testing.checks.verdict import assert_outputs, check_step, described, is_, result
from engine_core.testing.drive import build, first_step, forward, params, raised_by
from engine_core.testing.models import random_batch
from engine_core.testing.oracle import Baseline, eval_batch, masked_batch, train_batch

__all__ = [
    "CHECKS",
    "test_dp_group_holds_the_dp_ranks",
    "test_global_context_counts_every_dp_rank",
    "test_is_distributed_follows_the_default_process_group",
    "test_one_collect_rank_per_dp_rank",
    "test_one_rank_writes_the_full_params",
    "test_runs_without_a_process_group",
    "test_shard_data_refuses_a_batch_that_does_not_split",
]


def _layout(c: Context) -> dict[str, Any]:
    import torch.distributed as dist

    from engine_core.dispatch import Worker

    engine = build(c.backend, model=c.policy)
    worker = Worker()
    worker.register_mesh(
        "kit", dp_rank=engine.dp_rank, dp_size=engine.dp_size, is_collect=engine.is_collect_rank
    )
    return {
        "rank": dist.get_rank(),
        "dp_rank": engine.dp_rank,
        "dp_size": engine.dp_size,
        "collect": engine.is_collect_rank,
        "registered": worker.mesh_rank("kit").dp_rank == engine.dp_rank,
    }


LAYOUT = Check("layout", Layout.TWO, _layout)


def _ranks(c: Context) -> dict[str, Any]:
    """The layout properties against the process group, ``shard_data`` of a batch that does
    not split over the DP ranks, and ``global_context`` of this rank's share of a batch."""
    import torch.distributed as dist

    engine = build(c.backend, model=c.policy)
    group = engine.dp_group
    ctx = engine.global_context(engine.shard_data(masked_batch(0)), 1)
    return {
        "rank": dist.get_rank(),
        "dp": (engine.dp_rank, engine.dp_size),
        "group": (dist.get_rank(group), dist.get_world_size(group)),
        "collect": engine.is_collect_rank,
        "writes": engine.writes_full_params,
        "is_distributed": (engine.is_distributed, dist.is_initialized()),
        "uneven": raised_by(lambda: engine.shard_data(random_batch(engine.dp_size + 1))),
        "counts": (ctx.global_num_tokens, ctx.global_num_samples),
    }


RANKS = Check("ranks", Layout.TWO, _ranks)


def _had_group(c: Context) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


# whether the plain process had a group before any check built an engine (runs whatever
# --engine-core-kit-only selects: it is a fact about the process the others rely on)
HAD_GROUP = Check("had_group", Layout.PLAIN, _had_group, always=True)


def _lifecycle(c: Context) -> dict[str, Any]:
    """The engine as a script or ``engine-core run`` uses it: one plain process, no process
    group beforehand. Build, forward, train, checkpoint round trip and export must all work."""
    import torch.distributed as dist

    policy = c.policy
    engine = build(c.backend, model=policy, optim={"lr": 1e-3, "clip_grad": None})
    # whether a default process group exists, as the engine says and as torch says
    distributed = (engine.is_distributed, dist.is_available() and dist.is_initialized())
    out = forward(engine, eval_batch())
    step = first_step(engine, train_batch())
    folder = engine.save_checkpoint(c.root, step=1)
    loaded = build(c.backend, model=policy).load_checkpoint(folder)
    exported = len(params(engine))
    return {
        "log_probs": out[LOG_PROBS],
        "step": step,
        "loaded": loaded,
        "exported": exported,
        "is_distributed": distributed,
    }


LIFECYCLE = Check("lifecycle", Layout.PLAIN, _lifecycle)

CHECKS = (LAYOUT, RANKS, HAD_GROUP, LIFECYCLE)


def test_one_collect_rank_per_dp_rank(double: list) -> None:
    layout = [result(r, LAYOUT, "collect") for r in double]
    sizes = {r["dp_size"] for r in layout}
    if len(sizes) != 1:
        pytest.fail(f"[collect] ranks disagree on dp_size: {sorted(sizes)}")
    (dp_size,) = sizes
    for dp_rank in range(dp_size):
        collect = [r["rank"] for r in layout if r["dp_rank"] == dp_rank and r["collect"]]
        if len(collect) != 1:
            pytest.fail(
                f"[collect] DP rank {dp_rank} has {len(collect)} collect ranks (global ranks "
                f"{collect}); is_collect_rank must be True on exactly one rank per DP rank, or "
                f"dispatch/collect returns {'nothing' if not collect else 'duplicates'}."
            )
    if not all(r["registered"] for r in layout):
        pytest.fail("[collect] register_mesh did not record the engine's dp_rank")


def test_runs_without_a_process_group(plain: dict, caps: frozenset, kit_baseline: Baseline) -> None:
    assert not plain[HAD_GROUP.name], "[no process group] the kit's plain process had a group"
    got = result(plain, LIFECYCLE, "no process group")
    assert_outputs(got["log_probs"], kit_baseline.log_probs, "log_probs", "no process group")
    check_step(got["step"], kit_baseline, "no process group")
    assert got["loaded"] == 1, f"[no process group] load_checkpoint returned {got['loaded']}"
    if Capability.WEIGHT_EXPORT in caps:
        assert got["exported"] == len(kit_baseline.state_dict), (
            f"[no process group] named_full_params() gave {got['exported']} tensors, want "
            f"{len(kit_baseline.state_dict)}"
        )


def test_dp_group_holds_the_dp_ranks(double: list) -> None:
    for r in double:
        got = result(r, RANKS, "layout")
        if tuple(got["group"]) != tuple(got["dp"]):
            pytest.fail(
                f"[layout] rank {got['rank']}: dp_group has this rank at {got['group'][0]} of "
                f"{got['group'][1]}, but dp_rank, dp_size = {tuple(got['dp'])}: dp_rank and "
                f"dp_size are this rank's place in dp_group."
            )


def test_one_rank_writes_the_full_params(double: list) -> None:
    layout = [result(r, RANKS, "layout") for r in double]
    writers = [r["rank"] for r in layout if r["writes"]]
    want = [r["rank"] for r in layout if r["dp"][0] == 0 and r["collect"]]
    if writers != want or len(writers) != 1:
        pytest.fail(
            f"[layout] writes_full_params is True on ranks {writers}; want exactly the collect "
            f"rank of DP rank 0 ({want}): one rank writes the export and sends the weights."
        )


def test_is_distributed_follows_the_default_process_group(double: list, plain: dict) -> None:
    seen = [
        ("dp=2, rank " + str(i), result(r, RANKS, "layout")["is_distributed"])
        for i, r in enumerate(double)
    ]
    seen.append(
        ("no process group", result(plain, LIFECYCLE, "no process group")["is_distributed"])
    )
    for where, (says, initialized) in seen:
        if says != initialized:
            pytest.fail(
                f"[layout] {where}: is_distributed is {says}, but a default process group "
                f"{'is' if initialized else 'is not'} initialized."
            )


def test_shard_data_refuses_a_batch_that_does_not_split(double: list) -> None:
    for rank, r in enumerate(double):
        raised = result(r, RANKS, "layout")["uneven"]
        if not is_(raised, "EngineCoreError", "dp_size"):
            pytest.fail(
                f"[layout] rank {rank}: shard_data() of 3 samples on 2 DP ranks raised "
                f"{described(raised)}; want an EngineCoreError saying it does not divide by dp_size."
            )


def test_global_context_counts_every_dp_rank(double: list) -> None:
    mask = loss_mask_of(masked_batch(0))
    want = (int(mask.sum()), int(mask.any(-1).sum()))
    for rank, r in enumerate(double):
        got = tuple(result(r, RANKS, "layout")["counts"])
        if got != want:
            pytest.fail(
                f"[loss contract] rank {rank}: global_context() of this rank's half of a batch "
                f"counts (loss tokens, samples) = {got}, the whole batch has {want}: sum the "
                f"counts over the DP group."
            )
