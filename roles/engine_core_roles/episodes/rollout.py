"""The turn loop: :class:`EpisodeRollout` runs episodes on any :class:`engine_core.BaseRollout`.

Each turn generates for every unfinished episode in one ``generate`` call, appends the tokens of
what the environment answered, and goes on until every episode is over or stopped by a limit
(``max_turns``, the episode's token budget, a turn that hits ``max_new_tokens``). Its result is a
``generate`` result whose response holds the model's and the environment's tokens, exactly as
sampled and appended (never a re-tokenization of the decoded conversation), with
:data:`~engine_core.rollout.RESPONSE_LOSS_MASK` 1 on the model's tokens only.
:class:`EpisodeWorker` is a rollout replica that runs whole episodes.

Asked for routes (``SamplingParams.return_routes``, an inner rollout that declares
``routing_replay``), an episode's :data:`~engine_core.batch.ROUTED_EXPERTS` are stitched from its
turns: each token's experts are those of the forward that first fed it to the model (the turn
that sampled it; the next turn's prompt for a turn's last token and for the environment's
tokens). An episode that ends on environment tokens no turn has fed (its token budget reached
after a tool's answer) is fed once more, for those routes only (the one token drawn is dropped).

With a vision-language model (``images``: the folder's
:class:`~engine_core_roles.data.datasets.images.ImagePromptRenderer`), the first messages and
every tool's answer may hold image parts: each is rendered through the chat template and the
image processor as a prompt's images are (its placeholder expanded to its image tokens, which
are the environment's, so never trained on), the episode keeps its images in the order their
tokens stand, every turn generates with all of them, and the result carries them
(``pixel_values``, ``image_grid_thw``) so the trainer's log-probs are taken on the same images.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from engine_core import BaseRollout, SamplingParams
from engine_core.batch import ROUTED_EXPERTS
from engine_core.capabilities import Capability
from engine_core.errors import ConfigError
from engine_core.models import build_hf_config
from engine_core.remote_rollout import RolloutWorker
from engine_core.rollout import (
    PROMPT_SEED,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TRUNCATED,
    WeightBucket,
    derive_seed,
    place_routes,
    sample_seeds,
    stitch_routes,
    unplace_routes,
)
from engine_core.vision import vision_fields
from engine_core_roles.batch.build import dataset_rows, prompt_batch, turns_batch
from engine_core_roles.batch.keys import EPISODE
from engine_core_roles.data.datasets.images import (
    ImagePromptRenderer,
    image_parts,
    image_renderer,
)
from engine_core_roles.data.datasets.tokenizer import load_tokenizer
from engine_core_roles.episodes.config import EnvConfig, load_environment
from engine_core_roles.episodes.protocol import Environment, Episode, Message, StepResult
from engine_core_roles.episodes.template import _Template, check_messages
from engine_core_roles.episodes.threads import _STEP_THREADS

__all__ = ["EpisodeRollout", "EpisodeWorker"]


@dataclass
class _Running:
    env: Environment | None
    episode: Episode
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    truncated: bool = False  # ended at a token limit (its turn's, the budget, the turns')
    seed: int | None = None
    # with routes asked for: the experts of positions 0 .. routed - 1 of prompt + tokens, each
    # from the forward that first fed that token to the model; and those a turn gave its last
    # sampled token, which that turn did not feed back (its rollout's filler)
    routes: torch.Tensor | None = None
    last_route: torch.Tensor | None = None
    # the episode's images in the order their tokens stand: pixel patches [p, D], grids [n, 3]
    pixels: list[torch.Tensor] = field(default_factory=list)
    grids: list[torch.Tensor] = field(default_factory=list)

    def append(self, ids: Sequence[int], lps: Sequence[float] | None) -> None:
        self.tokens += ids
        self.trained += [1 if lps is not None else 0] * len(ids)
        self.log_probs += list(lps) if lps is not None else [0.0] * len(ids)

    def images(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.grids:
            return None, None
        return torch.cat(self.pixels), torch.cat(self.grids)

    def add_routes(self, rows: torch.Tensor, fed: int) -> None:
        """``rows``: a ``generate`` call's routes of this episode's input and sampled tokens, of
        which the first ``fed`` were fed to the model."""
        self.routes = stitch_routes(self.routes, rows, fed)
        self.last_route = rows[fed] if fed < rows.shape[0] else None

    @property
    def routed(self) -> int:
        """How many of the episode's first tokens have routes from a forward that fed them."""
        return 0 if self.routes is None else self.routes.shape[0]

    def all_routes(self) -> torch.Tensor:
        """``[length, layers, top_k]``."""
        parts = [] if self.routes is None else [self.routes]
        if self.last_route is not None:
            parts.append(self.last_route[None])
        return torch.cat(parts)[: self.length]

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)


class EpisodeRollout(BaseRollout):
    """Episodes over ``inner`` (any :class:`BaseRollout`): a ``generate`` whose prompts carry
    their dataset rows (:data:`ROW`) and whose result is each episode as one sample.

    ``environment`` makes one :class:`Environment` per episode; ``tokenizer`` is the actor's
    (with the chat template); ``max_turns``, ``max_episode_tokens`` and the sampling params'
    ``max_new_tokens`` (per turn) bound an episode. The result's ``prompt_ids`` are the
    rendered first messages (with the environment's tools), its response every token after
    them, :data:`RESPONSE_LOSS_MASK` 1 on the model's tokens, ``rollout_log_probs`` the
    model's log-probs there (0 on the environment's), and :data:`EPISODE` the record of each.
    Weights, release and resume go to ``inner``. ``images``: the renderer of a vision-language
    model's images (None: a text model, whose episodes refuse messages with images).
    """

    def __init__(
        self,
        inner: BaseRollout,
        environment: Callable[[], Environment],
        tokenizer: Any,
        *,
        max_turns: int = 4,
        max_episode_tokens: int,
        step_timeout_s: float = 60.0,
        images: ImagePromptRenderer | None = None,
    ) -> None:
        super().__init__(inner.config)
        self.images = images
        self.inner, self.environment, self.tokenizer = inner, environment, tokenizer
        # what the inner rollout does in this process (episodes run here: neither generation
        # elsewhere nor weights received by processes of its own)
        self.capabilities = frozenset(inner.capabilities) - {  # type: ignore[misc]
            Capability.ASYNC_GENERATION,
            Capability.WEIGHT_SYNC_GROUP,
        }
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.step_timeout_s = step_timeout_s
        self.pad_token_id = inner.pad_token_id  # responses padded as the inner rollout pads
        self._templates: dict[str, _Template] = {}

    # weights and memory: the inner rollout's
    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        return self.inner.expected_weights()

    def load_weights(self, buckets: Any) -> list[WeightBucket]:
        return self.inner.load_weights(buckets)

    def release(self) -> None:
        self.inner.release()

    def resume(self) -> None:
        self.inner.resume()

    def _template(self, tools: list[dict[str, Any]] | None) -> _Template:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._templates:
            self._templates[key] = _Template(self.tokenizer, tools)
        return self._templates[key]

    def generate(self, prompts: TensorDict, params: SamplingParams) -> TensorDict:
        rows = dataset_rows(prompts, "an episode rollout starts each episode from its dataset row")
        n = params.n
        t_env = 0.0
        # a prompt's n episodes adjacent, as a rollout's n samples are
        running = [self._start(dict(row)) for row in rows for _ in range(n)]
        # episode j of prompt i samples its turns from streams of its own seed, so an episode
        # does not depend on which others share a turn's batch (or a replica)
        seeds = sample_seeds(prompts, params) if rows else None
        if seeds is not None:
            for r, seed in zip(running, seeds, strict=True):
                r.seed = seed
        active = [r for r in running if r.env is not None]
        turn = 0
        while active:
            turn += 1
            # episodes that cannot fit another full turn end on the budget
            fits = []
            for r in active:
                if r.length + params.max_new_tokens > self.max_episode_tokens:
                    r.episode.end, r.truncated = "token_budget", True
                else:
                    fits.append(r)
            active = fits
            if not active:
                break
            turn_params = params.validated_copy(n=1)
            ids = [r.prompt + r.tokens for r in active]
            batch = self._prompts(active, ids)
            if seeds is not None:
                turn_seeds = [derive_seed(r.seed, turn) for r in active]  # type: ignore[arg-type]
                batch[PROMPT_SEED] = torch.tensor(turn_seeds, dtype=torch.int64)
            out = self.inner.generate(batch, turn_params)
            resp, mask = out[RESPONSE_IDS], out[RESPONSE_MASK]
            lps = out[ROLLOUT_LOG_PROBS]
            cut = out[TRUNCATED].tolist() if TRUNCATED in out.keys() else [False] * len(active)
            if params.return_routes:
                _take_routes(active, out, mask)
            stepping = []
            for j, r in enumerate(active):
                keep = mask[j].bool()
                sampled = resp[j][keep].tolist()
                r.append(sampled, lps[j][keep].tolist())
                r.episode.turns += 1
                text = self.tokenizer.decode(sampled, skip_special_tokens=False)
                content = str(self.tokenizer.decode(sampled, skip_special_tokens=True))
                r.episode.messages.append({"role": "assistant", "content": content})
                if cut[j]:
                    r.episode.end, r.truncated = "max_new_tokens", True
                    continue
                stepping.append((r, text))
            t1 = time.perf_counter()
            results = self._step_all([(r, dict(r.episode.messages[-1])) for r, _ in stepping])
            t_env += time.perf_counter() - t1
            active = []
            for (r, text), res in zip(stepping, results, strict=True):
                if isinstance(res, str):  # the environment failed on this episode
                    r.episode.end = "env_error"
                    r.episode.counts["env_errors"] = r.episode.counts.get("env_errors", 0) + 1
                    r.episode.messages.append({"role": "error", "content": res})
                    continue
                r.episode.reward += float(res.reward)
                for key, v in res.counts.items():
                    r.episode.counts[key] = r.episode.counts.get(key, 0) + float(v)
                if res.done:
                    r.episode.end = "done"
                    continue
                if r.episode.turns >= self.max_turns:
                    r.episode.end, r.truncated = "max_turns", True
                    continue
                assert r.env is not None
                try:
                    obs_ids = self._tokens(
                        r,
                        self._template(r.env.tools).after_turn_text(text, res.messages),
                        res.messages,
                        f"{type(r.env).__name__}.step",
                    )
                except ConfigError as e:  # images it cannot take, or cannot read
                    r.episode.end = "env_error"
                    r.episode.counts["env_errors"] = r.episode.counts.get("env_errors", 0) + 1
                    r.episode.messages.append({"role": "error", "content": str(e)})
                    continue
                if r.length + len(obs_ids) + 1 > self.max_episode_tokens:
                    r.episode.end, r.truncated = "token_budget", True
                    continue
                r.episode.messages += res.messages
                r.append(obs_ids, None)
                active.append(r)
        for r in running:
            if r.env is not None:
                extra = _call_quietly(r.env.score, r.episode)
                if isinstance(extra, int | float) and not isinstance(extra, bool):
                    r.episode.reward += float(extra)
        out = self._result(running, t_env)
        if params.return_routes:
            out[ROUTED_EXPERTS] = self._routes(out, running, params, turn + 1)
        return out

    def _routes(
        self, out: TensorDict, running: list[_Running], params: SamplingParams, turn: int
    ) -> torch.Tensor:
        """Every episode's routes, placed as a ``generate`` result places them. Episodes with
        tokens no turn fed (and no filler for the last) are fed once more first, for the routes
        of their whole sequence (one token drawn and dropped)."""
        unfed = [r for r in running if r.routed + (r.last_route is not None) < r.length]
        if unfed:
            batch = self._prompts(unfed, [r.prompt + r.tokens for r in unfed])
            if all(r.seed is not None for r in unfed):
                seeds = [derive_seed(r.seed, turn) for r in unfed]  # type: ignore[arg-type]
                batch[PROMPT_SEED] = torch.tensor(seeds, dtype=torch.int64)
            once = params.validated_copy(n=1, max_new_tokens=1)
            fed = self.inner.generate(batch, once)
            _take_routes(unfed, fed, torch.zeros_like(fed[RESPONSE_MASK]))
        return place_routes(out, [r.all_routes() for r in running])

    def _start(self, row: dict[str, Any]) -> _Running:
        try:
            env = self.environment()
            first = env.reset(row)
            check_messages(first, f"{type(env).__name__}.reset")
            running = _Running(env, Episode(row, list(first)), [])
            text = self._template(env.tools).render(first, generation=True)
            running.prompt = self._tokens(running, text, first, f"{type(env).__name__}.reset")
        except Exception as e:
            episode = Episode(row, [{"role": "error", "content": f"{type(e).__name__}: {e}"}])
            episode.end = "env_error"
            episode.counts["env_errors"] = 1.0
            pad = [int(self.pad_token_id)]
            return _Running(None, episode, pad, truncated=True)
        return running

    def _tokens(self, r: _Running, text: str, messages: list[Message], where: str) -> list[int]:
        """The ids of ``text``, rendered from ``messages``; their images, if any, expanded to
        their image tokens and kept with the episode ``r``."""
        parts = image_parts(messages)
        if self.images is None:
            if parts:
                raise ConfigError(
                    f"{where} returned {len(parts)} image(s), but the model has no vision "
                    f"tower; train a vision-language model, or return text."
                )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        # image paths in an environment's messages are its own: relative to the working folder
        out = self.images.encode([text], parts, base=Path.cwd(), where=where)
        if out.grids is not None and out.pixel_values is not None:
            r.pixels.append(out.pixel_values)
            r.grids.append(out.grids)
        return out.ids[0]

    def _prompts(self, episodes: list[_Running], ids: list[list[int]]) -> TensorDict:
        """A generate call's prompts: ``ids``, with the episodes' images where any has one."""
        batch = prompt_batch(ids, pad_token_id=self.pad_token_id)
        if any(r.grids for r in episodes):
            pixels, grids = zip(*(r.images() for r in episodes), strict=True)
            batch.update(vision_fields(pixels, grids))
        return batch

    def _step_all(self, work: list[tuple[_Running, Message]]) -> list[StepResult | str]:
        futures = []
        for r, msg in work:
            assert r.env is not None
            futures.append(_STEP_THREADS.submit(r.env.step, msg))
        deadline = time.monotonic() + self.step_timeout_s
        out: list[StepResult | str] = []
        for (r, _), fut in zip(work, futures, strict=True):
            name = type(r.env).__name__
            try:
                res = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                _STEP_THREADS.abandoned()
                out.append(f"{name}.step did not answer within {self.step_timeout_s:g} s")
                continue
            except Exception as e:
                out.append(f"{name}.step raised {type(e).__name__}: {e}")
                continue
            if not isinstance(res, StepResult):
                out.append(
                    f"{name}.step returned {type(res).__name__}; return a "
                    f"engine_core_roles.episodes.protocol.StepResult"
                )
                continue
            if isinstance(res.reward, bool) or not isinstance(res.reward, int | float):
                out.append(f"{name}.step returned a reward of {res.reward!r}; give a number")
                continue
            try:
                check_messages(res.messages, f"{name}.step")
            except ConfigError as e:
                out.append(str(e))
                continue
            out.append(res)
        return out

    def _result(self, running: list[_Running], env_wait_s: float) -> TensorDict:
        prompts = self._prompts(running, [r.prompt for r in running])
        out = turns_batch(
            prompts,
            [(r.tokens, r.trained, r.log_probs, r.truncated) for r in running],
            pad_token_id=int(self.pad_token_id),
        )
        out[EPISODE] = NonTensorStack.from_list([_record(r.episode, env_wait_s) for r in running])
        return out


def _take_routes(episodes: list[_Running], out: TensorDict, sampled: torch.Tensor) -> None:
    """Give each episode its rows of ``out``'s routes (a ``generate`` call over ``episodes``,
    before their sampled tokens, ``sampled`` ``[rows, R]`` 1 where valid, are appended)."""
    if ROUTED_EXPERTS not in out.keys():
        raise ConfigError(
            f"the episode rollout asked its inner rollout for routes "
            f"(SamplingParams.return_routes) and got none; it returned {sorted(out.keys())}."
        )
    heads, tails = [r.length for r in episodes], [int(m) for m in sampled.sum(1).tolist()]
    rows = unplace_routes(out, heads, tails)
    for r, h, m, mine in zip(episodes, heads, tails, rows, strict=True):
        r.add_routes(mine, h + max(m - 1, 0))


def _record(ep: Episode, env_wait_s: float) -> dict[str, Any]:
    return {
        "env_wait_s": env_wait_s,
        "turns": ep.turns,
        "end": ep.end,
        "reward": ep.reward,
        "counts": dict(ep.counts),
        "final": ep.final,
        "messages": [_plain(m) for m in ep.messages],
    }


def _plain(message: Message) -> Message:
    """``message`` as plain data (the record is logged as JSON and crosses processes as it):
    an image part's image, unless a path, named by its size instead of held."""
    content = message.get("content")
    if not isinstance(content, list) or not image_parts([message]):
        return message
    parts = []
    for part in content:
        image = part.get("image") if isinstance(part, dict) else None
        if image is not None and part.get("type") == "image" and not isinstance(image, str):
            if isinstance(image, bytes | bytearray):
                image = f"<image of {len(image)} bytes>"
            elif hasattr(image, "width") and hasattr(image, "height"):  # a PIL image
                image = f"<image {image.width} x {image.height}>"
            else:
                image = f"<image: {type(image).__name__}>"
            part = {**part, "image": image}
        parts.append(part)
    return {**message, "content": parts}


def _call_quietly(fn: Callable[[Episode], Any], episode: Episode) -> Any:
    try:
        return fn(episode)
    except Exception as e:
        episode.counts["env_errors"] = episode.counts.get("env_errors", 0) + 1
        episode.messages.append({"role": "error", "content": f"score raised {e!r}"})
        return None


class EpisodeWorker(RolloutWorker):
    """A rollout replica that runs whole episodes (``ProcessRollout(worker_cls=EpisodeWorker,
    worker_args=(settings,))``): the backend it hosts is wrapped in an :class:`EpisodeRollout`
    built from ``settings`` (``env``: an :class:`EnvConfig` as a dict, ``prompt_key``,
    ``max_episode_tokens``), the tokenizer read from the rollout's model config as the job
    reads it. Every turn of an episode runs on the replica that started it."""

    def __init__(self, config: dict[str, Any], settings: dict[str, Any]) -> None:
        super().__init__(config)

        env = EnvConfig.model_validate(settings["env"])
        model = self.rollout.config.model
        tokenizer = load_tokenizer(model, None)
        images = image_renderer(
            model,
            build_hf_config(model),
            tokenizer,
            max_image_pixels=settings.get("max_image_pixels"),
        )
        self.rollout = EpisodeRollout(
            self.rollout,
            load_environment(env, prompt_key=str(settings["prompt_key"])),
            tokenizer,
            max_turns=env.max_turns,
            max_episode_tokens=int(settings["max_episode_tokens"]),
            step_timeout_s=env.step_timeout_s,
            images=images,
        )
