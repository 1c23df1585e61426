"""Weights out of the engine: ``named_full_params()`` against the HF state dict (names,
shapes, dtypes, values; a tied head under both names, through a checkpoint round trip), every
other way out (buckets, ``named_weights``, ``weight_buckets``, ``export_hf``) against it, the
engine's ``hf_config``, and ``named_lora_params`` refused without ``lora``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.capabilities import Capability
from engine_core.testing.checks.registry import Check, Context, Layout
from engine_core.testing.checks.verdict import described, is_, result
from engine_core.testing.drive import build, first_step, params, raised_by
from engine_core.testing.models import TINY_QWEN2
from engine_core.testing.oracle import Baseline, train_batch

__all__ = [
    "CHECKS",
    "test_export_hf_writes_replaces_and_survives_a_failure",
    "test_hf_config_is_the_models",
    "test_named_lora_params_refuses_without_lora",
    "test_tied_embeddings_export_and_checkpoint",
    "test_weight_export_matches_hf_state_dict",
    "test_weight_streams_give_the_full_params",
]

EXPORT_NEEDS = frozenset({Capability.WEIGHT_EXPORT})
EXPORT = Check(
    "export", Layout.SINGLE, lambda c: params(build(c.backend, model=c.policy)), needs=EXPORT_NEEDS
)


def _tied(c: Context) -> dict[str, Any]:
    """A model whose input embedding and output head are one tensor: the names its export
    gives (and whether the two are equal), and its weights after a step, a save and a load
    into a fresh engine against before the save."""
    model = {"config": {**TINY_QWEN2, "tie_word_embeddings": True}}
    engine = build(c.backend, model=model, optim={"lr": 1e-2})
    first_step(engine, train_batch())
    exported = params(engine)
    folder = engine.save_checkpoint(str(Path(c.root) / "tied"), step=1)
    resumed = build(c.backend, model=model, optim={"lr": 1e-2})
    resumed.load_checkpoint(folder)
    again = params(resumed)
    head, embed = exported.get("lm_head.weight"), exported.get("model.embed_tokens.weight")
    changed = [k for k in exported if k not in again or not torch.equal(exported[k], again[k])]
    return {
        "names": sorted(exported),
        "head_is_embedding": head is not None and embed is not None and torch.equal(head, embed),
        "round_trip": sorted(changed),
        "names_after": sorted(again),
    }


def _weight_stream(c: Context) -> dict[str, Any]:
    """What the export methods give against ``named_full_params()``: with a bucket smaller
    than any tensor, through ``named_weights("model")`` and ``weight_buckets`` (and the
    buckets' sizes), in an ``export_hf`` folder (written, replaced after a step, kept when an
    export fails), and ``named_lora_params`` of an engine without ``lora``."""
    import json

    from safetensors.torch import load_file

    from engine_core.config import BUCKET_BYTES

    engine = build(c.backend, model=c.policy, optim={"lr": 1e-2, "clip_grad": None})
    full = params(engine)

    def differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
        if got.keys() != want.keys():
            return sorted(got.keys() ^ want.keys())
        return sorted(k for k in want if not torch.equal(got[k], want[k]))

    bucket_bytes = 4096  # cuts the tiny model's weights into many buckets; the embedding alone
    buckets = [
        [(n, t.clone()) for n, t in bucket]
        for bucket in engine.weight_buckets("model", bucket_bytes)
    ]
    oversized = [
        [n for n, _ in b]
        for b in buckets
        if len(b) > 1 and sum(t.numel() * t.element_size() for _, t in b) > bucket_bytes
    ]
    out: dict[str, Any] = {
        "small_buckets": differ({n: t.clone() for n, t in engine.named_full_params(1)}, full),
        "named_weights": differ({n: t.clone() for n, t in engine.named_weights("model")}, full),
        "weight_buckets": differ({n: t for b in buckets for n, t in b}, full),
        "oversized": oversized,
        "bucket_bytes": bucket_bytes,
        "hf_config": {
            k: getattr(engine.hf_config, k, None)
            for k in ("model_type", "vocab_size", "max_position_embeddings")
        },
    }
    target = str(Path(c.root) / "hf-export")
    written = engine.export_hf(target)
    out["export_path"] = (target, written)
    out["export"] = differ(load_file(str(Path(written) / "model.safetensors")), full)
    out["export_config"] = json.loads((Path(written) / "config.json").read_text())["model_type"]
    first_step(engine, train_batch())
    stepped = params(engine)
    own = engine.named_full_params

    def failing(bucket_bytes: int = BUCKET_BYTES) -> Any:
        names = own(bucket_bytes)
        yield next(names)
        raise RuntimeError("kit: the export failed while gathering")

    engine.named_full_params = failing  # type: ignore[method-assign]
    out["failed_export"] = raised_by(lambda: engine.export_hf(target))
    del engine.named_full_params
    out["after_failed_export"] = differ(load_file(str(Path(written) / "model.safetensors")), full)
    engine.export_hf(target)
    out["replaced"] = differ(load_file(str(Path(written) / "model.safetensors")), stepped)
    if Capability.LORA not in c.caps:
        out["lora_refused"] = raised_by(lambda: next(iter(engine.named_lora_params())))
    return out


TIED = Check("tied", Layout.SINGLE, _tied, needs=EXPORT_NEEDS)
WEIGHT_STREAM = Check("weight_stream", Layout.SINGLE, _weight_stream, needs=EXPORT_NEEDS)

CHECKS = (TIED, EXPORT, WEIGHT_STREAM)


def test_weight_export_matches_hf_state_dict(
    single: dict, caps: frozenset, kit_baseline: Baseline
) -> None:
    if not EXPORT.applies(caps):
        pytest.skip("weight_export not declared")
    exported = result(single, EXPORT, "export")
    want = kit_baseline.state_dict
    missing, extra = sorted(want.keys() - exported.keys()), sorted(exported.keys() - want.keys())
    if missing or extra:
        pytest.fail(
            f"[export] names differ from the HF state dict: missing {missing[:5]}, extra "
            f"{extra[:5]}; named_full_params() must yield every Hugging Face name"
            f"{_export_hint(missing, extra)}"
        )
    for name, tensor in want.items():
        got = exported[name]
        assert got.shape == tensor.shape, (
            f"[export] {name}: shape {tuple(got.shape)}, want {tuple(tensor.shape)}: yield full "
            f"(unsharded) tensors in the HF layout"
        )
        assert got.dtype == tensor.dtype, (
            f"[export] {name}: dtype {got.dtype}, the model's is {tensor.dtype}: yield the "
            f"weights in the model's dtype (rollouts cast on their side)"
        )
        assert torch.equal(got, tensor), f"[export] {name}: values differ from the HF weights"


_WRAPPER_PREFIXES = (
    "module.",
    "_fsdp_wrapped_module.",
    "_orig_mod.",
    "_checkpoint_wrapped_module.",
)


def _export_hint(missing: list[str], extra: list[str]) -> str:
    """What usually explains the names: wrapper prefixes only when the extra names carry them."""
    wrapped = [n for n in extra if any(p in n for p in _WRAPPER_PREFIXES)]
    if wrapped:
        return (
            f": {wrapped[0]!r} carries a wrapper's prefix; strip 'module.', "
            f"'_fsdp_wrapped_module.', '_orig_mod.' and the like"
        )
    if missing and not extra:
        tied = [n for n in missing if n.endswith(("lm_head.weight", "embed_tokens.weight"))]
        if tied:
            return (
                f", a tied embedding and head under both names ({tied[0]!r} is missing), as "
                f"transformers' state_dict() gives them"
            )
        return ", none left out (a rank that holds only some of them gathers the rest)"
    return ": map the backend's own layout (fused or renamed weights) back to the HF names"


BF16_ATOL = 1e-2  # bf16 arithmetic, kernels and padding: the engines here differ by <= 2.2e-4


def test_tied_embeddings_export_and_checkpoint(single: dict, caps: frozenset) -> None:
    if not TIED.applies(caps):
        pytest.skip("weight_export not declared")
    got = result(single, TIED, "tied embeddings")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**TINY_QWEN2, "tie_word_embeddings": True}
    with torch.device("meta"):
        want = sorted(AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).state_dict())
    if got["names"] != want:
        missing = sorted(set(want) - set(got["names"]))
        extra = sorted(set(got["names"]) - set(want))
        pytest.fail(
            f"[tied embeddings] named_full_params() of a model with tie_word_embeddings: "
            f"missing {missing}, extra {extra}. Yield every name of transformers' state_dict(), "
            f"the tied head under 'lm_head.weight' too (a rollout's expected weights list it)."
        )
    if not got["head_is_embedding"]:
        pytest.fail("[tied embeddings] the exported lm_head.weight is not the input embedding")
    if got["round_trip"] or got["names_after"] != want:
        pytest.fail(
            f"[tied embeddings] after save_checkpoint and load_checkpoint into a fresh engine, "
            f"{got['round_trip'] or 'the names'} differ: save the shared tensor once per name "
            f"(safetensors refuses shared storage: engine_core.backend.save_safetensors copies) "
            f"and tie it again on load."
        )


def test_weight_streams_give_the_full_params(single: dict, caps: frozenset) -> None:
    if not WEIGHT_STREAM.applies(caps):
        pytest.skip("weight_export not declared")
    got = result(single, WEIGHT_STREAM, "export")
    calls = {
        "small_buckets": "named_full_params(bucket_bytes=1)",
        "named_weights": "named_weights('model')",
        "weight_buckets": f"weight_buckets('model', {got['bucket_bytes']}), joined",
    }
    for key, call in calls.items():
        if got[key]:
            pytest.fail(
                f"[export] {call} differs from named_full_params() in {got[key][:3]}: every "
                f"way out gives the same full tensors, whatever the bucket size."
            )
    if got["oversized"]:
        pytest.fail(
            f"[export] weight_buckets(bucket_bytes={got['bucket_bytes']}) gave a bucket of "
            f"{got['oversized'][0][:4]}, more bytes than that: cut before the tensor that does "
            f"not fit (a tensor bigger than the bucket goes alone)."
        )


def test_export_hf_writes_replaces_and_survives_a_failure(single: dict, caps: frozenset) -> None:
    if not WEIGHT_STREAM.applies(caps):
        pytest.skip("weight_export not declared")
    got = result(single, WEIGHT_STREAM, "export")
    target, written = got["export_path"]
    if written != target or got["export"] or got["export_config"] != "qwen2":
        pytest.fail(
            f"[export] export_hf({target!r}) returned {written!r}; its model.safetensors "
            f"differs from named_full_params() in {got['export'][:3]}, its config.json says "
            f"model_type {got['export_config']!r}: want the path, the same tensors and qwen2."
        )
    if (
        not is_(got["failed_export"], "RuntimeError", "kit: the export failed")
        or (got["after_failed_export"])
    ):
        pytest.fail(
            f"[export] an export whose gather failed raised {described(got['failed_export'])} and "
            f"left {got['after_failed_export'][:3]} changed in the previous export: let the "
            f"error through and leave an existing export whole (write aside, then swap)."
        )
    if got["replaced"]:
        pytest.fail(
            f"[export] exported again after a step, model.safetensors still differs from the "
            f"weights in {got['replaced'][:3]}: an existing export is replaced."
        )


def test_hf_config_is_the_models(single: dict, caps: frozenset) -> None:
    if not WEIGHT_STREAM.applies(caps):
        pytest.skip("weight_export not declared")
    got = result(single, WEIGHT_STREAM, "export")["hf_config"]
    want = {k: TINY_QWEN2[k] for k in got}
    assert got == want, f"[hf_config] the engine's hf_config gives {got}, the model is {want}"


def test_named_lora_params_refuses_without_lora(single: dict, caps: frozenset) -> None:
    if Capability.LORA in caps:
        pytest.skip("lora declared: test_lora_trains_adapters_only checks named_lora_params")
    if not WEIGHT_STREAM.applies(caps):
        pytest.skip("weight_export not declared")
    refused = result(single, WEIGHT_STREAM, "lora")["lora_refused"]
    if not is_(refused, "NotImplementedError"):
        pytest.fail(
            f"[lora] named_lora_params() of an engine without lora raised {described(refused)}; "
            f"want NotImplementedError (BaseEngine's default) saying what serves LoRA."
        )
