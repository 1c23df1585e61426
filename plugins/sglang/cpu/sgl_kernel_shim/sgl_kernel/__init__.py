"""The ``sgl_kernel`` operations SGLang's CPU engine imports, in plain PyTorch, for CPUs without
AMX/AVX-512 (SGLang's own CPU kernels are built for those and are not on PyPI).

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang 0.5.23 imports a few ``*_cpu`` helpers whatever the CPU
(the KV-cache index update of every decode step, and the hash its seeded sampler draws from);
every layer (norms, activations, rotary, attention with ``attention_backend=torch_native``)
checks for AMX first and, without it, runs its plain PyTorch form. This package provides those
helpers and nothing else: it has no ``convert_weight_packed``, so SGLang's AMX check stays
false. Any other name raises ``NotImplementedError`` naming it when called, as do the few
operators SGLang looks up in ``torch.ops.sgl_kernel`` when a module is imported.

``ENGINE_CORE_SGLANG_CPU_SEEDS=1``: SGLang applies a request's ``sampling_seed`` only with
deterministic inference, whose start swaps aten kernels for batch-invariant Triton ones and
refuses a host without CUDA/XPU. Set, that swap is skipped (on a CPU, one process's matmuls do
not depend on the batch around them the way GPU split-K kernels do), so seeded requests run.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import torch

__version__ = "0.1.0"
_M32 = 0xFFFFFFFF


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Row ``req_pool_indices[i]`` of ``req_to_token``, columns ``[start_i, end_i)``, takes the
    next ``end_i - start_i`` entries of ``out_cache_loc``."""
    del pool_len
    taken = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        count = end - start
        if count > 0:
            req_to_token[row, start:end] = out_cache_loc[taken : taken + count].to(
                req_to_token.dtype
            )
        taken += count


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _round(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _rotl((k * 0xCC9E2D51) & _M32, 15)
    k = (k * 0x1B873593) & _M32
    return (_rotl(h ^ k, 13) * 5 + 0xE6546B64) & _M32


def _finish(h: torch.Tensor) -> torch.Tensor:
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & _M32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


@torch.library.custom_op("sgl_kernel::murmur_hash32_cpu", mutates_args=())
def murmur_hash32_cpu(
    seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor
) -> torch.Tensor:
    """MurmurHash3 (32-bit) of the words (seed low, seed high, position, column) for every row's
    seed and position and every column: ``[rows, columns]`` uint32, in int64 arithmetic."""
    s = seed.view(torch.int64) if seed.dtype == torch.uint64 else seed.to(torch.int64)
    h = torch.zeros_like(s)[:, None]
    for word in ((s & _M32)[:, None], ((s >> 32) & _M32)[:, None]):
        h = _round(h, word)
    h = _round(h, (positions.to(torch.int64) & _M32)[:, None])
    h = _round(h, (col_indices.to(torch.int64) & _M32)[None, :])
    return _finish(h ^ 16).to(torch.uint32)


@murmur_hash32_cpu.register_fake
def _(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    return seed.new_empty((seed.shape[0], col_indices.shape[0]), dtype=torch.uint32)


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} has no plain-PyTorch form in engine-core's CPU stand-in; "
            "this SGLang path needs SGLang's own CPU kernels (AMX hosts)."
        )

    missing.__name__ = name
    return missing


# Operators SGLang's modules look up on import (``torch.ops.sgl_kernel.<name>``) on a CPU host,
# for models not served from here: SGLang's Qwen-VL multimodal processor imports its Qwen3.5
# model module, which looks these up. Each raises as a missing name does when called.
_LOOKED_UP_ON_IMPORT = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)
for _name in _LOOKED_UP_ON_IMPORT:
    setattr(torch.ops.sgl_kernel, _name, __getattr__(_name))


_BATCH_INVARIANT = "sglang.srt.batch_invariant_ops.batch_invariant_ops"


def _skip_batch_invariant(module: Any) -> None:
    module.enable_batch_invariant_mode = lambda *args, **kwargs: None


class _SkipBatchInvariant(importlib.abc.MetaPathFinder):
    """Makes ``enable_batch_invariant_mode`` a no-op once its module is imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _BATCH_INVARIANT:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _skip_batch_invariant(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


from engine_core.settings import sglang_cpu_seeds  # noqa: E402  (installed beside this stand-in)

if sglang_cpu_seeds():
    if _BATCH_INVARIANT in sys.modules:
        _skip_batch_invariant(sys.modules[_BATCH_INVARIANT])
        _skip_batch_invariant(sys.modules["sglang.srt.batch_invariant_ops"])
    else:
        sys.meta_path.insert(0, _SkipBatchInvariant())
