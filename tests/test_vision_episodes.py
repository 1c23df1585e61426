"""Episodes of several turns with a vision-language model: images in the first messages and in
a tool's answers travel with the episode, every turn generates with them, and the trainer's
log-probs of the sampled tokens, taken on the same images, equal the rollout's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from tensordict import NonTensorStack

from engine_core import SamplingParams
from engine_core.batch import LOG_PROBS
from engine_core.plugins import load_plugins
from engine_core.reference_engine import ReferenceEngine, ReferenceEngineConfig
from engine_core.rollout import RESPONSE_IDS, RESPONSE_LOSS_MASK, RESPONSE_MASK, ROLLOUT_LOG_PROBS
from engine_core.testing.models import engine_config
from engine_core.vision import IMAGE_GRID_THW, PIXEL_VALUES
from engine_core_roles.batch.build import prompt_batch, training_batch
from engine_core_roles.batch.keys import EPISODE, ROW
from engine_core_roles.data.datasets.images import ImagePromptRenderer
from engine_core_roles.episodes.protocol import Environment, Message, StepResult
from engine_core_roles.episodes.rollout import EpisodeRollout


def _image(size: tuple[int, int], colour: tuple[int, int, int]) -> Any:
    from PIL import Image

    return Image.new("RGB", size, colour)


class Looker(Environment):
    """Shows an image with the question; each answer is met by a tool's answer holding another
    image of its own size, until the third turn."""

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        part = {"type": "image", "image": _image((16, 16), (200, 10, 10))}
        return [{"role": "user", "content": [part, {"type": "text", "text": str(row["q"])}]}]

    def step(self, message: Message) -> StepResult:
        part = {"type": "image", "image": _image((24, 16), (10, 10, 200))}
        shown = [{"role": "tool", "content": [{"type": "text", "text": "1"}, part]}]
        return StepResult(messages=shown, reward=0.25)


class TextLooker(Looker):
    """Asks in words only, and answers with an image."""

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        return [{"role": "user", "content": str(row["q"])}]


def _prompts(n: int) -> Any:
    batch = prompt_batch([[1]] * n)  # the loop renders each episode's own prompt
    batch[ROW] = NonTensorStack.from_list([{"q": str(k)} for k in range(n)])
    return batch


def _params(tok: Any, *, n: int, seed: int) -> SamplingParams:
    """Half the vocabulary (the vision tokens aside) ends a turn: turns of a few tokens."""
    vision = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
    stops = [i for i in range(0, 128, 2) if i not in vision]
    return SamplingParams(temperature=1.0, max_new_tokens=8, n=n, seed=seed, stop_token_ids=stops)


@pytest.fixture(scope="module")
def inner(vl_chat_folder: tuple[str, Any]) -> Any:
    from engine_core.resolve import resolve_rollout_config

    folder, _ = vl_chat_folder
    spec, cfg = resolve_rollout_config({"backend": "hf", "model": {"path": folder}}, load_plugins())
    return spec.load_class()(cfg)


@pytest.mark.parametrize("env", [Looker, TextLooker])
def test_a_tools_images_reach_every_later_turn_and_the_trainer(
    vl_chat_folder: tuple[str, Any], inner: Any, env: type[Environment]
) -> None:
    folder, tok = vl_chat_folder
    renderer = ImagePromptRenderer(folder, tok)
    episodes = EpisodeRollout(inner, env, tok, max_turns=3, max_episode_tokens=400, images=renderer)
    params = _params(tok, n=2, seed=3)
    gen = episodes.generate(_prompts(2), params)
    records = gen[EPISODE].tolist()
    assert [r["turns"] for r in records] == [3] * 4, records
    # two tool answers (and the question's image): each image's grid, in the order they stand
    first = [[1, 4, 4]] if env is Looker else []
    for k in range(4):
        grids = gen[IMAGE_GRID_THW][k]
        assert grids[grids.prod(-1) > 0].tolist() == first + [[1, 4, 6]] * 2
        # the images' tokens are the environment's: never trained on
        ids, mask = gen[RESPONSE_IDS][k], gen[RESPONSE_MASK][k].bool()
        image_tokens = (ids == renderer.image_token_id) & mask
        assert int(image_tokens.sum()) == 2 * 6
        assert not bool(gen[RESPONSE_LOSS_MASK][k][image_tokens].any())
    # the record is plain data: the images named, not held
    shown = records[0]["messages"][2]["content"][1]["image"]
    assert shown == "<image 24 x 16>"
    # the trainer, given the result, computes the sampled tokens' log-probs on the same images
    engine = ReferenceEngine(ReferenceEngineConfig(**engine_config(model={"path": folder})))
    engine.init_model()
    batch = training_batch(gen, params)
    assert torch.equal(batch[PIXEL_VALUES], gen[PIXEL_VALUES])
    with torch.no_grad():
        got = engine.forward_backward_step(batch, forward_only=True).outputs[LOG_PROBS]
    trained = batch["loss_mask"].bool()
    assert int(trained.sum()) > 0
    assert float((got - batch[ROLLOUT_LOG_PROBS])[trained].abs().max()) < 1e-5


def test_images_from_an_environment_of_a_text_model_end_that_episode(
    vl_chat_folder: tuple[str, Any], inner: Any
) -> None:
    """Without an image renderer (a text model) a tool's image is not silently dropped: the
    episode ends as the environment's error, saying why; the first messages' images likewise."""
    _, tok = vl_chat_folder
    for env, turns in ((TextLooker, 1), (Looker, 0)):
        episodes = EpisodeRollout(inner, env, tok, max_turns=3, max_episode_tokens=400)
        gen = episodes.generate(_prompts(1), _params(tok, n=1, seed=1))
        record = gen[EPISODE].tolist()[0]
        assert record["end"] == "env_error" and record["turns"] == turns
        assert "no vision tower" in record["messages"][-1]["content"]
        assert PIXEL_VALUES not in gen.keys()


def test_an_unreadable_image_from_a_tool_ends_that_episode_with_its_reason(
    vl_chat_folder: tuple[str, Any], inner: Any
) -> None:
    folder, tok = vl_chat_folder

    class Broken(TextLooker):
        def step(self, message: Message) -> StepResult:
            part = {"type": "image", "image": b"\x89PNG not an image"}
            return StepResult(messages=[{"role": "tool", "content": [part]}])

    renderer = ImagePromptRenderer(folder, tok)
    episodes = EpisodeRollout(
        inner, Broken, tok, max_turns=3, max_episode_tokens=400, images=renderer
    )
    gen = episodes.generate(_prompts(1), _params(tok, n=1, seed=1))
    record = gen[EPISODE].tolist()[0]
    assert record["end"] == "env_error"
    assert "Broken.step" in record["messages"][-1]["content"]
    assert "cannot be read" in record["messages"][-1]["content"]


ENVS = """
from PIL import Image

from engine_core_roles.episodes.protocol import Environment, StepResult


class Looker(Environment):
    def reset(self, row):
        image = {"type": "image", "image": Image.new("RGB", (16, 16), (200, 10, 10))}
        return [{"role": "user", "content": [image, {"type": "text", "text": row["prompt"]}]}]

    def step(self, message):
        image = {"type": "image", "image": Image.new("RGB", (24, 16), (10, 10, 200))}
        return StepResult([{"role": "tool", "content": [image]}], reward=float(len(message["content"]) % 2))
"""


@pytest.mark.parametrize(("placement", "steps"), [("colocated", 1), ("process", 2)])
def test_an_agent_job_trains_on_episodes_whose_tools_show_images(
    vl_chat_folder: tuple[str, Any], tmp_path: Any, placement: str, steps: int
) -> None:
    """`engine-core run` with an environment on a vision-language model, the episodes run in
    this process or in the rollout's own (which builds its image renderer from the model's
    folder): the trainer's log-probs, taken on the episodes' images, equal the rollout's at
    every step."""
    import json

    from engine_core.configio import apply_overrides, load_yaml
    from engine_core_roles.jobs.cli import RECIPES
    from engine_core_roles.jobs.rl.run import run_rl_job

    folder, tok = vl_chat_folder
    (tmp_path / "envs.py").write_text(ENVS)
    (tmp_path / "train.jsonl").write_text("".join(f'{{"prompt": "{k}"}}\n' for k in range(4)))
    raw = load_yaml(RECIPES / "grpo_tiny.yaml")
    raw.pop("task")
    raw["engine"]["model"] = {"path": folder}
    raw["data"] = {"train_files": [str(tmp_path / "train.jsonl")]}
    raw["env"] = {"cls": f"{tmp_path / 'envs.py'}:Looker", "max_turns": 2}
    stops = _params(tok, n=1, seed=0).stop_token_ids  # turns of a few tokens
    raw["trainer"].update(
        {
            "max_new_tokens": 8,
            "samples_per_prompt": 2,
            "stop_token_ids": stops,
            "filter_groups": False,  # the recipe's dynamic sampling is not built for episodes
        }
    )
    out = tmp_path / "run"
    raw = apply_overrides(
        raw,
        [
            f"output_dir={out}",
            f"steps={steps}",
            "prompts_per_step=2",
            "log_every=1",
            "engine.backend=reference",
            f"rollout_placement={placement}",
        ],
    )
    run_rl_job(raw, load_plugins())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps
    assert all(r["rollout/logprob_diff_max"] < 1e-5 for r in rows), rows
    # episodes went on after a tool's image (whose tokens the trained share leaves out)
    assert all(r["episode/turns"] > 1 and r["episode/trained_token_share"] < 1 for r in rows)
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    shown = [m for s in samples for m in s["episode"] if m["role"] == "tool"]
    assert shown and shown[0]["content"] == [{"type": "image", "image": "<image 24 x 16>"}]


def zoom(colour: str) -> Any:
    """Shows a square of the colour asked for.

    Args:
        colour: red or blue.
    """
    return _image((16, 16), (200, 10, 10) if colour == "red" else (10, 10, 200))


def caption(colour: str) -> Any:
    """Shows a square and names it; or returns what is neither text nor an image.

    Args:
        colour: red, or anything else.
    """
    if colour != "red":
        return [{"type": "image", "image": None}]
    return [{"type": "text", "text": "a red square"}, {"type": "image", "image": zoom("red")}]


def test_a_built_in_tool_shows_an_image_by_returning_one() -> None:
    import json

    from engine_core_roles.episodes.tools import ToolEnvironment

    env = ToolEnvironment([zoom, caption])

    def answer(name: str, colour: str) -> Any:
        call = json.dumps({"name": name, "arguments": {"colour": colour}})
        res = env.step({"role": "assistant", "content": f"<tool_call>{call}</tool_call>"})
        return res.messages[0]["content"], res.counts["tool_errors"]

    (shown,), errors = answer("zoom", "blue")
    assert shown["type"] == "image" and shown["image"].getpixel((0, 0)) == (10, 10, 200)
    assert errors == 0
    content, errors = answer("caption", "red")
    assert [p["type"] for p in content] == ["text", "image"] and errors == 0
    content, errors = answer("caption", "green")
    assert content.startswith("error: tool 'caption' returned list, not text") and errors == 1
