"""``SGLangRollout``: generation with SGLang's offline ``Engine`` (CUDA GPUs, or SGLang's CPU engine).

What has run and what has not:

- The pure pieces run in ``plugins/sglang/tests`` on CPU hosts without SGLang:
  :func:`to_sglang_sampling_params` (our sampling parameters as one SGLang request's),
  :func:`build_requests` (left-padded prompts to token-id lists, one request per sample),
  :func:`parse_outputs` (SGLang's output dicts to the batch the rollout contract requires),
  and :func:`check_result` (SGLang's success reports). The checks around each weight bucket are
  the core's :func:`engine_core.rollout.checked_buckets` / :func:`~engine_core.rollout.confirm_bucket`.
- :class:`SGLangRollout` hands these to a live ``sglang.Engine``. With ``device: cpu`` it has run
  on this machine's CPU in SGLang's own environment (``make sglang-env``), reached through
  ``rollout_python``: generation, seeds, log-probs against a trainer, verified weight updates.
  On a GPU it has never been executed.

Semantics of SGLang 0.5.23 that the code relies on:

- Log-probs: with ``return_logprob=True`` each sampled token comes with log softmax(logits / T)
  over the whole vocabulary (T = 1 for greedy). Top-k / top-p restrict which tokens can be drawn
  but are not renormalised into the reported value. That is the quantity a trainer computes
  with ``BatchMeta(temperature=T)``. The environment variable
  ``SGLANG_RETURN_ORIGINAL_LOGPROB`` switches SGLang to log_softmax(logits) (temperature
  ignored); leave it unset.
- Samples: a prompt's ``n`` samples go out as ``n`` one-sample requests, prompt-major, and
  SGLang answers a batch in request order. SGLang's own ``n`` also answers prompt-major, but gives
  every sample of a prompt the same seed, and its seeded sampler draws the same noise for the
  same (seed, position): the seeded samples of a prompt would all be identical.
- Seeds: SGLang applies a request's ``sampling_seed`` only with deterministic inference on;
  otherwise a seeded request is refused rather than sampled unseeded.
- Stops: a sample ends at one of ``stop_token_ids`` or at the model's EOS token (from its
  config); the stop token is kept. With ``skip_tokenizer_init`` SGLang returns ids untrimmed.
- Stop strings: SGLang matches ``stop`` strings in the text its own detokenizer keeps, which
  ``skip_tokenizer_init`` turns off. The rollout cuts each response instead, after SGLang has
  answered, at the first token whose prefix text holds a string
  (:func:`engine_core.stop_strings.stop_string_end`, the model's tokenizer), keeping that token
  and marking the sample not truncated. The tokens kept are the ones stopping there would have
  given (each token is sampled from the ones before it, a seeded sample's noise from its seed and
  position); the tokens past the cut are computed and dropped.
- Weights: ``update_weights_from_tensor`` must run inside a weight-update session
  (``begin_weight_update`` / ``end_weight_update``); buckets are loaded one call each and the
  prefix cache is flushed once at the end.
- Images: a vision-language model's prompts with images (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) go
  to SGLang's own vision tower as the image processor's patches, with SGLang's cache of
  encoded images off and the sync's names checked (:mod:`engine_core_sglang.vision` says how
  and why); each sample keeps its prompt's images, for the trainer. A sampled vision token
  ends its sample before it, unfinished. Run on CPU; never on a GPU.
- LoRA: with ``model.lora`` SGLang is started on the base model with LoRA on (its
  ``torch_native`` LoRA backend on CPU); the rollout's expected weights are the peft model's, so
  the weight link sends the peft tensors once (the base through the weight update under the base
  names, the adapters into a folder, ``AdapterFolders``) and then the adapters alone. Each
  version is loaded under a new adapter name (``load_lora_adapter``) and every request generates
  with the newest; the previous one is unloaded.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, PositiveInt
from tensordict import TensorDict

from engine_core.backend import (
    IMAGE_GRID_THW,
    PIXEL_VALUES,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_MASK,
    ROLLOUT_TOP_IDS,
    ROLLOUT_TOP_LOG_PROBS,
    ROUTED_EXPERTS,
    AdapterFolders,
    BaseRollout,
    BatchError,
    Capability,
    ConfigError,
    RolloutConfig,
    SamplingParams,
    SentBucket,
    WeightBucket,
    WeightSyncError,
    adapted_modules,
    build_hf_config,
    checked_buckets,
    checkpoint_tensors,
    confirm_bucket,
    is_vision_config,
    load_stop_tokenizer,
    meta_model,
    model_weight_shapes,
    place_routes,
    prompt_images,
    prompt_tensors,
    sample_seeds,
    saved_model_folder,
    set_for_process,
    split_peft_tensors,
    stop_string_end,
    vision_token_ids,
)
from engine_core_sglang.outputs import (
    moe_layers,
    parse_outputs,
    sglang_routes,
    sglang_top_logprobs,
)
from engine_core_sglang.plugin import SGLANG_CAPABILITIES
from engine_core_sglang.vision import (
    NO_IMAGE_CACHE,
    check_vision_model,
    image_data,
    processor_folder,
    sglang_weight_names,
)

__all__ = [
    "SGLangRollout",
    "SGLangRolloutConfig",
    "SGLangRequests",
    "to_sglang_sampling_params",
    "build_requests",
    "parse_outputs",
    "check_result",
]

# SGLang samples greedily below this temperature and then reports log-probs at T = 1.
GREEDY_BELOW = 1e-6
# internal: read on import by the sgl_kernel stand-in of SGLang's CPU environment (cpu/), which
# then skips deterministic inference's swap to batch-invariant Triton kernels
_CPU_SEEDS = "ENGINE_CORE_SGLANG_CPU_SEEDS"  # engine_core.settings.ENV_SGLANG_CPU_SEEDS


class SGLangRolloutConfig(RolloutConfig):
    """SGLang settings on top of the common rollout fields; each maps to one ``Engine`` argument."""

    context_length: PositiveInt | None = Field(
        None, description="Prompt + response tokens per sample; None: the model config's."
    )
    mem_fraction_static: float = Field(
        0.5, gt=0, lt=1, description="Share of GPU memory SGLang takes for weights and KV cache."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: model.dtype."
    )
    attention_backend: str | None = Field(
        None, description="SGLang attention kernels ('triton', 'flashinfer', 'fa3', ...)."
    )
    disable_cuda_graph: bool = False
    device: Literal["cuda", "cpu"] = Field(
        "cuda",
        description="cuda: GPU hosts. cpu: SGLang's CPU engine (SGLANG_USE_CPU_ENGINE), as the "
        "environment `make sglang-env` builds runs it: attention_backend defaults to "
        "torch_native, CUDA graphs and the memory saver are off.",
    )
    max_total_tokens: PositiveInt | None = Field(
        None,
        description="KV-cache capacity in tokens; None: SGLang sizes it from mem_fraction_static "
        "(of the host's memory on cpu: set this there).",
    )
    memory_saver: bool | None = Field(
        None,
        description="enable_memory_saver: release()/resume() free and re-take GPU memory. None: "
        "on for cuda, off for cpu (SGLang's memory saver needs CUDA).",
    )
    weights_cpu_backup: bool = Field(
        False,
        description="Keep a CPU copy of the weights across release(); without it the weights "
        "are gone after release() and must be synced again before generating.",
    )
    deterministic_inference: bool = Field(
        False,
        description="Batch-invariant kernels and per-sample seeds; needed for SamplingParams.seed.",
    )


# -- requests -------------------------------------------------------------------------------
def to_sglang_sampling_params(
    params: SamplingParams, *, deterministic: bool = False, cut: Iterable[int] = ()
) -> dict[str, Any]:
    """One sample's SGLang sampling parameters (``n`` is expanded by :func:`build_requests`).

    Refuses what SGLang would silently do differently: a seed without deterministic inference
    (ignored by SGLang) and a temperature in (0, 1e-6) (greedy in SGLang, with log-probs at T=1).
    ``cut``: more ids SGLang stops at (a vision-language model's vision tokens, which
    :func:`parse_outputs` then takes out of the sample).
    """
    if 0 < params.temperature < GREEDY_BELOW:
        raise ConfigError(
            f"temperature={params.temperature} is below {GREEDY_BELOW}: SGLang samples greedily "
            "there and reports log-probs at temperature 1. Use temperature=0 for greedy."
        )
    if params.seed is not None and not deterministic:
        raise ConfigError(
            f"SamplingParams.seed={params.seed} cannot be honoured: SGLang applies per-request "
            "seeds only with deterministic inference. Set deterministic_inference: true in the "
            "sglang rollout config, or leave the seed unset."
        )
    return {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,  # 0: greedy
        "top_p": params.top_p,
        "top_k": params.top_k,  # -1 disables top-k in both
        "n": 1,
        "stop_token_ids": [*params.stop_token_ids, *sorted(set(cut) - set(params.stop_token_ids))],
        "no_stop_trim": True,  # keep the matched stop token
    }


@dataclass(frozen=True)
class SGLangRequests:
    """Arguments of one ``Engine.generate`` call: ``B * n`` one-sample requests, prompt-major.

    ``image_data``: each request's images (one HF-processor-output entry, or none), None when no
    prompt has images; ``images``: the prompts' checked ``pixel_values`` and
    ``image_grid_thw`` (one row per prompt), which the samples carry on to the trainer.
    """

    input_ids: list[list[int]]
    sampling_params: list[dict[str, Any]]
    image_data: list[list[dict[str, Any]]] | None = None
    images: TensorDict | None = None


def build_requests(
    prompts: TensorDict,
    params: SamplingParams,
    *,
    deterministic: bool = False,
    vocab_size: int | None = None,
    model_config: Any = None,
) -> SGLangRequests:
    """Strip the left padding of each prompt and repeat it ``n`` times (its samples adjacent).

    With ``deterministic`` every sample gets its own ``sampling_seed``: sample ``j`` of prompt
    ``i`` ``derive_seed(prompt_seeds[i], j)`` (reproducible, and the same however the prompts
    are batched or split), or fresh randomness when no seed is set: SGLang's seeded sampler
    gives two requests with one seed the same noise at each position. Prompt ids are checked
    against ``vocab_size`` where given: an id outside it kills SGLang's scheduler (an
    ``IndexError`` in its embedding, every process of the engine gone).

    ``model_config``: the model's transformers config, which prompts with images are checked
    against (their image tokens against their grids; refused for a text model); each request
    of a vision-language model then has its prompt's images as
    :func:`engine_core_sglang.vision.image_data` gives them. Without it, images are refused.
    """
    who = "SGLangRollout.generate"
    ids, mask = prompt_tensors(prompts, who, vocab_size, images=model_config is not None)
    if ids.shape != mask.shape:
        raise BatchError(
            f"{PROMPT_IDS} {tuple(ids.shape)} and {PROMPT_MASK} {tuple(mask.shape)} differ."
        )
    cut = vision_token_ids(model_config) if model_config is not None else frozenset()
    base = to_sglang_sampling_params(params, deterministic=deterministic, cut=cut)
    rows: list[list[int]] = []
    for i, (row, m) in enumerate(zip(ids, mask, strict=True)):
        real = [int(t) for t in row[m.bool()].tolist()]
        if not real:
            raise BatchError(f"prompt {i} is empty ({PROMPT_MASK} is all zero).")
        rows.append(real)
    input_ids = [row for row in rows for _ in range(params.n)]
    seeds = sample_seeds(prompts, params)
    if deterministic and seeds is not None:
        sampling = [{**base, "sampling_seed": s} for s in seeds]
    elif deterministic:
        rng = random.Random()  # seeded from the OS
        sampling = [{**base, "sampling_seed": rng.getrandbits(63)} for _ in input_ids]
    else:
        sampling = [dict(base) for _ in input_ids]
    images = None if model_config is None else prompt_images(prompts, ids, mask, model_config)
    if images is None:
        return SGLangRequests(input_ids, sampling)
    entries = [image_data(images[i], i) for i in range(len(rows))]
    # a list per request (SGLang reads a flat list as one image per request)
    per_request = [[e] if e is not None else [] for e in entries for _ in range(params.n)]
    pictured = any(e is not None for e in entries)
    return SGLangRequests(input_ids, sampling, per_request if pictured else None, images)


# -- responses ------------------------------------------------------------------------------
def check_result(op: str, result: Any) -> None:
    """Raise :class:`WeightSyncError` unless SGLang's answer to ``op`` reports success.

    SGLang answers weight calls with ``(success, message)``, ``flush_cache`` with an object
    carrying ``success`` / ``message`` and the LoRA calls with ``success`` / ``error_message``.
    """
    if isinstance(result, tuple) and len(result) == 2:
        success, message = result
    else:
        success = getattr(result, "success", None)
        message = getattr(result, "message", "") or getattr(result, "error_message", "")
    if success is None or not bool(success):
        raise WeightSyncError(f"SGLang {op} failed: {message or repr(result)}")


# -- the rollout ----------------------------------------------------------------------------
class SGLangRollout(BaseRollout):
    """An in-process ``sglang.Engine`` (it starts its own scheduler subprocesses).

    Executed on CPU (``device: cpu``, in ``make sglang-env``'s environment); never on a GPU.
    """

    capabilities: ClassVar[frozenset[Capability]] = SGLANG_CAPABILITIES
    routes_from_start: ClassVar[bool] = True
    config_class: ClassVar[type[RolloutConfig]] = SGLangRolloutConfig

    def __init__(self, config: RolloutConfig) -> None:
        if not isinstance(config, SGLangRolloutConfig):
            raise TypeError(
                f"SGLangRollout needs an SGLangRolloutConfig, got {type(config).__name__}."
            )
        super().__init__(config)
        self.cfg = config
        self._memory_saver = (
            config.memory_saver if config.memory_saver is not None else config.device == "cuda"
        )
        hf_config = build_hf_config(config.model)
        self._hf_config = hf_config
        self._vision = hf_config if is_vision_config(hf_config) else None
        processor: dict[str, Any] = {}
        if self._vision is not None:  # prompts' patches to SGLang's tower (vision.py)
            check_vision_model(hf_config)
            processor = processor_folder(config.model)
            set_for_process(NO_IMAGE_CACHE)  # read by SGLang's processes when they start
        if config.device == "cpu":  # read when SGLang is imported, here and in its processes
            set_for_process({"SGLANG_USE_CPU_ENGINE": "1"})
            if config.deterministic_inference:
                set_for_process({_CPU_SEEDS: "1"})
        try:
            import sglang
        except ImportError as e:
            raise ImportError(
                "rollout.backend=sglang needs SGLang: pip install 'engine-core-sglang[gpu]' on a "
                "host with a CUDA GPU, or build its CPU environment with `make sglang-env` and "
                "run the rollout there (rollout_placement=process rollout_python="
                ".venv-sglang/bin/python rollout.device=cpu)."
            ) from e
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                "rollout.backend=sglang with device=cuda needs a CUDA GPU and none is visible; "
                "on a CPU host set rollout.device=cpu in an environment built by `make "
                "sglang-env`, or use the 'hf' or 'vllm' rollout."
            )
        if config.device == "cpu" and config.memory_saver:
            raise ConfigError(
                "rollout.memory_saver=true needs CUDA (SGLang's memory saver); on device=cpu "
                "leave it unset or false."
            )
        lora = config.model.lora
        self._expected = model_weight_shapes(config.model, adapters=lora is not None)
        # the layout synced tensors are converted from into the checkpoint names SGLang takes
        self._layout = meta_model(config.model)
        self._vocab_size = int(self._layout.get_input_embeddings().weight.shape[0])
        self._adapters: AdapterFolders | None = None
        self._lora: str | None = None  # the name of the adapter version served now
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        path = config.model.path
        if path is None:  # SGLang loads from a folder
            self._tmp = saved_model_folder(config.model, config.seed, "engine-core-sglang-")
            path = self._tmp.name
        kwargs: dict[str, Any] = {
            "model_path": path,
            "skip_tokenizer_init": True,  # token ids in, token ids out
            "dtype": config.model.dtype if config.dtype == "auto" else config.dtype,
            "random_seed": config.seed,
            "mem_fraction_static": config.mem_fraction_static,
            "disable_cuda_graph": config.disable_cuda_graph or config.device == "cpu",
            "enable_memory_saver": self._memory_saver,
            "enable_weights_cpu_backup": config.weights_cpu_backup,
            "enable_deterministic_inference": config.deterministic_inference,
            "trust_remote_code": config.model.trust_remote_code,
        }
        kwargs.update(processor)
        if config.context_length is not None:
            kwargs["context_length"] = config.context_length
        if config.attention_backend is not None:
            kwargs["attention_backend"] = config.attention_backend
        if config.max_total_tokens is not None:
            kwargs["max_total_tokens"] = config.max_total_tokens
        if config.device == "cpu":
            kwargs["device"] = "cpu"
            kwargs.setdefault("attention_backend", "torch_native")
            if config.deterministic_inference:  # per-request seeds (see sgl_kernel_shim)
                from sglang.srt.arg_groups.choices import (
                    add_deterministic_attention_backend_choices,
                )

                add_deterministic_attention_backend_choices([kwargs["attention_backend"]])
        if lora is not None:  # the base in the model, each adapter version from a folder
            self._adapters = AdapterFolders(lora, "engine-core-sglang-lora-")
            kwargs.update(
                enable_lora=True,
                max_lora_rank=lora.rank,
                lora_target_modules=adapted_modules(self._expected),
                max_loras_per_batch=1,
                max_loaded_loras=2,  # the version served and the one replacing it
            )
            if config.device == "cpu":
                kwargs["lora_backend"] = "torch_native"
        # SGLang captures every decoder layer's routes; ours are the MoE layers'
        self._routes_layout: tuple[int, int, list[int]] | None = None
        if config.return_routes:
            layers, top_k = int(hf_config.num_hidden_layers), int(hf_config.num_experts_per_tok)
            self._routes_layout = (layers, top_k, moe_layers(self._expected))
            kwargs["enable_return_routed_experts"] = True
        self.engine: Any = sglang.Engine(**kwargs)
        self._stale: str | None = None  # why generate() refuses; None while weights are current
        self._tokenizer: Any = None  # read on the first request with stop_strings
        self._released = False

    @property
    def stale(self) -> bool:
        """True while the engine's weights cannot be trusted (a failed sync, or released)."""
        return self._stale is not None

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        if self._stale is not None:
            raise WeightSyncError(
                f"{self._stale} load the full weights again (load_weights) before generating."
            )
        if self._released:
            raise WeightSyncError("the SGLang rollout's memory is released; resume() first.")
        self.check_params(params)
        if params.stop_strings and self._tokenizer is None:
            self._tokenizer = load_stop_tokenizer(self.cfg.model, "SGLangRollout")
        requests = build_requests(
            prompts,
            params,
            deterministic=self.cfg.deterministic_inference,
            vocab_size=self._vocab_size,
            model_config=self._hf_config,
        )
        outputs = self.engine.generate(
            input_ids=requests.input_ids,
            sampling_params=requests.sampling_params,
            image_data=requests.image_data,
            return_logprob=True,
            lora_path=None if self._lora is None else [self._lora] * len(requests.input_ids),
            **({"return_routed_experts": True} if params.return_routes else {}),
            **({"top_logprobs_num": params.top_logprobs} if params.top_logprobs else {}),
        )
        stop_at: Callable[[list[int]], int | None] | None = None
        if params.stop_strings:
            decode = partial(self._tokenizer.decode, skip_special_tokens=True)
            stop_at = partial(stop_string_end, decode, strings=list(params.stop_strings))
        cut = vision_token_ids(self._vision) if self._vision is not None else frozenset()
        result = parse_outputs(
            outputs, prompts, params.n, pad_token_id=self.pad_token_id, stop_at=stop_at, cut=cut
        )
        if params.return_routes:
            assert self._routes_layout is not None
            kept = (result[PROMPT_MASK].sum(-1) + result[RESPONSE_MASK].sum(-1)).tolist()
            routes = [  # a response cut at a stop string keeps its tokens' rows only
                sglang_routes(k, out, *self._routes_layout)[: int(kept[k])]
                for k, out in enumerate(outputs)
            ]
            result[ROUTED_EXPERTS] = place_routes(result, routes)
        if params.top_logprobs:
            result[ROLLOUT_TOP_IDS], result[ROLLOUT_TOP_LOG_PROBS] = sglang_top_logprobs(
                outputs, result[RESPONSE_MASK].sum(-1).tolist(), params.top_logprobs
            )
        if requests.images is not None:  # each sample keeps its prompt's images, for the trainer
            for key in (PIXEL_VALUES, IMAGE_GRID_THW):
                result[key] = requests.images[key].repeat_interleave(params.n, dim=0)
        return result

    # -- weights ----------------------------------------------------------------------------
    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return dict(self._expected)

    def load_weights(self, buckets: Iterable[SentBucket]) -> list[WeightBucket]:
        """Load every bucket in one weight-update session, verifying each; flush the cache."""
        if self._released:
            raise WeightSyncError("the SGLang rollout's memory is released; resume() first.")
        self._stale = (
            "the last weight sync into the SGLang rollout did not complete, so its weights are "
            "inconsistent:"
        )
        check_result("begin_weight_update", self.engine.begin_weight_update())
        done: list[WeightBucket] = []
        adapters: dict[str, torch.Tensor] = {}
        try:
            for handed, sent in checked_buckets(buckets, self._expected):
                base = (
                    handed if self._adapters is None else list(split_peft_tensors(handed, adapters))
                )
                # SGLang's loader takes checkpoint names (a mixture of experts' stacked experts
                # written out per expert)
                base = checkpoint_tensors(self._layout, base)
                if self._vision is not None:  # every name as SGLang's loader knows it
                    base = sglang_weight_names(base)
                if base:
                    result = self.engine.update_weights_from_tensor(
                        named_tensors=base, load_format=None, flush_cache=False
                    )
                    check_result("update_weights_from_tensor", result)
                done.append(confirm_bucket(handed, sent))
        finally:
            ended = self.engine.end_weight_update()  # always close the session
        check_result("end_weight_update", ended)
        if self._adapters is not None:
            self._serve(adapters)
        check_result("flush_cache", self.engine.flush_cache())  # cached KV used old weights
        self._stale = None
        return done

    def _serve(self, adapters: dict[str, torch.Tensor]) -> None:
        """Load ``adapters`` into SGLang under a new name and unload the previous version."""
        assert self._adapters is not None
        folder = self._adapters.write(adapters)
        name = f"policy-v{self._adapters.version}"
        check_result("load_lora_adapter", self.engine.load_lora_adapter(name, str(folder)))
        if self._lora is not None:
            check_result("unload_lora_adapter", self.engine.unload_lora_adapter(self._lora))
        self._lora = name

    def release(self) -> None:
        """Free GPU weights, KV cache and CUDA graphs (no-op with ``memory_saver`` off).

        Without ``weights_cpu_backup`` the weights are discarded: generate() refuses until the
        next full load_weights(), which must come after resume().
        """
        if not self._memory_saver:
            return
        self.engine.release_memory_occupation()
        self._released = True
        if not self.cfg.weights_cpu_backup:
            self._stale = (
                "release() discarded the SGLang rollout's weights (no CPU backup): resume() and"
            )

    def resume(self) -> None:
        """Re-take the GPU memory release() freed (weights come back only with a CPU backup)."""
        if self._memory_saver:
            self.engine.resume_memory_occupation()
            self._released = False

    def shutdown(self) -> None:
        """Stop SGLang's subprocesses and remove the temporary model folder, if any."""
        self.engine.shutdown()
        if self._adapters is not None:
            self._adapters.cleanup()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
