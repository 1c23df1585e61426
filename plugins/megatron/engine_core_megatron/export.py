"""The megatron engine's weight export: :class:`MegatronExport`, a mixin of
:class:`~engine_core_megatron.engine.MegatronEngine`.

It owns :meth:`~MegatronExport.named_full_params`: every HF tensor, full, on every rank, each
parameter gathered from its TP ranks (experts from their expert-parallel ranks) on the stage
that holds it and broadcast over the pipeline group, a bucket at a time, in HF order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from engine_core.backend import (
    BUCKET_BYTES,
    DTYPES,
    model_weight_shapes,
)
from engine_core_megatron.convert import hf_from_shards, layer_parts, megatron_to_hf_names

__all__ = ["TIED_SOURCE", "MegatronExport"]

TIED_SOURCE = "model.embed_tokens.weight"  # a tied model's head is this tensor
# the export names standing for every expert of a layer (the stacked HF tensors)
_STACKED_EXPERTS = ("mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight")


class MegatronExport:
    """The engine's parameters under their HF names, gathered whole."""

    def named_full_params(
        self, bucket_bytes: int = BUCKET_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor, full, on every rank, a bucket of megatron parameters at a time.

        Collective over the whole engine: each parameter is gathered from its TP ranks on the
        stage that holds it, then broadcast over the pipeline group. The parameters whose HF
        tensors fit in ``bucket_bytes`` together are gathered, then yielded; a parameter bigger
        than that is a bucket of its own. At most one bucket is held here at a time.
        """
        assert self.layout is not None
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}.")
        shapes, layout = self._hf_shapes(), self.layout
        itemsize = torch.empty((), dtype=DTYPES[self.config.model.dtype]).element_size()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for megatron_name, owner in self._export_plan():
            nbytes = itemsize * sum(
                math.prod(shapes[n]) for n in megatron_to_hf_names(megatron_name, 0, layout)
            )
            if bucket and size + nbytes > bucket_bytes:
                yield from bucket
                bucket, size = [], 0
            with self._device_context():
                gathered = self._gather_param(megatron_name, owner)
            if layout.tied and not layout.value_head:
                # transformers' state_dict() holds a tied head under its own name as well:
                # the same tensor (a rollout's expected weights list both)
                gathered += [("lm_head.weight", t) for n, t in gathered if n == TIED_SOURCE]
            bucket += gathered
            size += nbytes
        yield from bucket

    def _export_plan(self) -> list[tuple[str, tuple[int, int, str]]]:
        """(global megatron name, (owning pp rank, chunk, local name)) in HF order."""
        assert self.layout is not None
        ps = self._ps
        last = ps.get_pipeline_model_parallel_world_size() - 1
        last_chunk = len(self.chunks) - 1
        plan: list[tuple[str, tuple[int, int, str]]] = [
            ("embedding.word_embeddings.weight", (0, 0, "embedding.word_embeddings.weight"))
        ]
        parts = layer_parts(self.layout)
        for layer, (pp_rank, chunk, local) in enumerate(self._layer_owner):
            for part in parts:
                plan.append(
                    (
                        f"decoder.layers.{layer}.{part}",
                        (pp_rank, chunk, f"decoder.layers.{local}.{part}"),
                    )
                )
        plan.append(
            ("decoder.final_layernorm.weight", (last, last_chunk, "decoder.final_layernorm.weight"))
        )
        if self.layout.value_head:
            plan += [
                ("output_layer.weight", (last, last_chunk, "output_layer.weight")),
                ("output_layer.bias", (last, last_chunk, "output_layer.bias")),
            ]
        elif not self.layout.tied:
            plan.append(("output_layer.weight", (last, last_chunk, "output_layer.weight")))
        return plan

    def _gather_param(
        self, name: str, owner: tuple[int, int, str]
    ) -> list[tuple[str, torch.Tensor]]:
        assert self.layout is not None
        ps = self._ps
        pp_rank, chunk, local = owner
        hf_names = megatron_to_hf_names(name, 0, self.layout)
        mine = ps.get_pipeline_model_parallel_rank() == pp_rank
        tensors: tuple[torch.Tensor, ...] = ()
        if mine and name.endswith(_STACKED_EXPERTS):
            tensors = (self._gather_experts(chunk, local),)
        elif mine:
            param = dict(self.chunks[chunk].module.named_parameters())[local].detach()
            tp = ps.get_tensor_model_parallel_world_size()
            if tp > 1:
                shards = [torch.empty_like(param) for _ in range(tp)]
                dist.all_gather(
                    shards, param.contiguous(), group=ps.get_tensor_model_parallel_group()
                )
            else:
                shards = [param]
            tensors = hf_from_shards(name, shards, self.layout)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            group = ps.get_pipeline_model_parallel_group()
            src = dist.get_process_group_ranks(group)[pp_rank]
            shapes = self._hf_shapes()
            dtype = DTYPES[self.config.model.dtype]
            if not mine:
                tensors = tuple(
                    torch.empty(shapes[n], dtype=dtype, device=self.device) for n in hf_names
                )
            for t in tensors:
                dist.broadcast(t, src=src, group=group)
        return [(n, t.cpu()) for n, t in zip(hf_names, tensors, strict=True)]

    def _gather_experts(self, chunk: int, local: str) -> torch.Tensor:
        """A layer's stacked HF expert tensor (``[experts, ...]``) from the local experts of every
        expert-parallel rank (each expert whole there: no expert TP). ``local`` is the export
        name ``decoder.layers.<local>.mlp.experts.linear_fc<1|2>.weight`` of this stage."""
        assert self.layout is not None
        params = dict(self.chunks[chunk].module.named_parameters())
        prefix, part = local.rsplit(".experts.", 1)
        mine = []
        for i in range(self.layout.experts_per_rank):
            name = f"{prefix}.experts.local_experts.{i}.{part}"
            param = params[name].detach().contiguous()
            mine.append(torch.cat(hf_from_shards(name, [param], self.layout)))
        stacked = torch.stack(mine)
        if self.layout.expert_parallel == 1:
            return stacked
        every = [torch.empty_like(stacked) for _ in range(self.layout.expert_parallel)]
        dist.all_gather(every, stacked, group=self._ps.get_expert_model_parallel_group())
        return torch.cat(every)

    @functools.cached_property
    def _hf_shape_table(self) -> dict[str, tuple[int, ...]]:

        return dict(model_weight_shapes(self.config.model))

    def _hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return self._hf_shape_table
