"""The text job's pieces (tokenizer, datasets, reward, stop strings, environment), built and
checked before any engine is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from rich.console import Console

from engine_core import (
    ModelConfig,
    prefix_validation_error,
)
from engine_core.errors import ConfigError
from engine_core.models import build_hf_config
from engine_core_roles.batch.keys import ROW
from engine_core_roles.data.datasets.images import ImagePromptRenderer, image_renderer
from engine_core_roles.data.datasets.prompts import PromptData
from engine_core_roles.data.datasets.stop_strings import stop_token_ids
from engine_core_roles.data.datasets.tokenizer import load_tokenizer
from engine_core_roles.data.rewards.functions import RewardConfig, SampleReward
from engine_core_roles.data.rewards.text import TextReward
from engine_core_roles.episodes.config import load_environment
from engine_core_roles.episodes.protocol import Environment
from engine_core_roles.episodes.template import check_messages, check_template
from engine_core_roles.jobs.rl.config import RLJobConfig
from engine_core_roles.serving.agent_function import AgentFn, AgentReward, load_agent


@dataclass
class TextParts:
    """The text job's pieces, built (and checked) before any engine is."""

    tokenizer: Any
    train: PromptData
    reward: TextReward
    stops: list[int]
    val: PromptData | None = None
    environment: Callable[[], Environment] | None = None
    tools: list[dict[str, Any]] | None = None
    context: int | None = None  # the model's context length
    val_reward: SampleReward | None = None  # agents: their sessions' rewards
    images: ImagePromptRenderer | None = None  # a vision-language model's image renderer
    agent: AgentFn | None = None  # the agent function run once per sample


def text_parts(job: RLJobConfig, console: Console) -> TextParts | None:
    """Tokenizer, datasets and reward of a job with ``data``; None for the digit task. Every
    input problem is refused here, before anything is built or trained."""
    if job.data is None:
        return None
    try:
        model = ModelConfig.model_validate(job.engine.get("model"))
    except ValidationError as e:
        raise prefix_validation_error(e, ("engine", "model"), "ModelConfig") from None
    whole = build_hf_config(model)
    hf_config = whole.get_text_config()  # a vision-language model's decoder
    tokenizer = load_tokenizer(model, getattr(hf_config, "vocab_size", None))
    context = getattr(hf_config, "max_position_embeddings", None)
    # prompts with images: the folder's image processor renders them
    images = image_renderer(model, whole, tokenizer, max_image_pixels=job.data.max_image_pixels)
    room = None if context is None else int(context) - job.trainer.max_new_tokens
    if room is not None and room < 1:
        raise ConfigError(
            f"trainer.max_new_tokens={job.trainer.max_new_tokens} leaves no room for a prompt "
            f"in the model's context ({context} tokens); lower it."
        )
    limits = [v for v in (job.data.max_prompt_length, room) if v is not None]
    limit = min(limits) if limits else 1 << 30
    episodes = job.env is not None or job.agent is not None
    # episodes are scored by their environment (or agent), plus reward.fn where it is set
    reward_cfg = job.reward or (None if episodes else RewardConfig())
    agent = None if job.agent is None else load_agent(job.agent)
    environment, probe, tools = None, None, None
    if job.env is not None:
        environment = load_environment(job.env, prompt_key=job.data.prompt_key)
        probe = environment()  # one instance for the tools and the check below
        tools = probe.tools
    rows = episodes  # each prompt's dataset row, for reset or the agent
    train = PromptData(
        job.data.train_files,
        tokenizer,
        job.data,
        max_length=limit,
        tools=tools,
        rows=rows,
        images=images,
    )
    stops = stop_token_ids(tokenizer)
    reward = TextReward(reward_cfg, tokenizer, train, show=job.log_samples)
    text = TextParts(
        tokenizer, train, reward, stops, environment=environment, tools=tools, agent=agent
    )
    text.context = None if context is None else int(context)
    text.images = images
    sets = [("data.train_files", train)]
    if job.data.val_files:
        text.val = PromptData(
            job.data.val_files,
            tokenizer,
            job.data,
            max_length=limit,
            what="data.val_files",
            tools=tools,
            rows=rows,
            images=images,
        )
        val_reward = TextReward(reward_cfg, tokenizer, text.val, show=0)
        text.val_reward = val_reward if agent is None else AgentReward(val_reward)
        sets.append(("data.val_files", text.val))
    for what, data in sets:
        dropped = f"; {data.dropped} longer than {limit} tokens dropped" if data.dropped else ""
        console.print(f"{what}: {len(data)} prompts{dropped}")
    text.reward.check()
    if probe is not None:
        _check_environment(probe, train)
    return text


def _check_environment(env: Environment, data: PromptData) -> None:
    """Start an episode on the first row before training: an environment whose ``reset``
    fails or returns something other than messages is an error now, not at the first step."""

    row = data.batch([0])[ROW].tolist()[0]
    try:
        first = env.reset(row)
    except Exception as e:
        raise ConfigError(
            f"env: {type(env).__name__}.reset raised {type(e).__name__}: {e} on the first row "
            f"of {data.what}; checked before training."
        ) from e
    check_messages(first, f"env: {type(env).__name__}.reset")
    # the chat template must render an observation after a turn the same way whatever came
    # before it: checked now rather than at the first observation
    check_template(data.tokenizer, env.tools)


def episode_settings(job: RLJobConfig, text: TextParts | None) -> dict[str, Any] | None:
    """What an episode rollout needs beside the rollout's config (None: no environment)."""
    if job.env is None or text is None or job.data is None:
        return None
    budget = job.env.max_episode_tokens or text.context
    if budget is None:
        raise ConfigError(
            "the model's config gives no context length (max_position_embeddings); set "
            "env.max_episode_tokens."
        )
    if text.context is not None and budget > text.context:
        raise ConfigError(
            f"env.max_episode_tokens={budget} is more than the model's context "
            f"({text.context} tokens); lower it."
        )
    return {
        "env": job.env.model_dump(),
        "prompt_key": job.data.prompt_key,
        "max_episode_tokens": int(budget),
        "max_image_pixels": job.data.max_image_pixels,
    }
