"""The jobs' subcommands of the ``engine-core`` script: ``run``, ``train`` and ``serve``.

The jobs sit above the core and the roles (an RL job is :class:`engine_core_roles.RLTrainer`
plus recipes, checkpoints and plots). :data:`COMMANDS` reaches the core's script through the
``engine_core.commands`` entry point of this distribution, so the core's command line imports
nothing above it. :func:`main` runs the script with them whether or not the entry point is
installed (``python -m engine_core_roles.jobs.cli``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine_core import cli
from engine_core.cli import Command
from engine_core.configio import apply_overrides, load_yaml
from engine_core.errors import ConfigError
from engine_core.plugins import load_plugins
from engine_core.settings import Settings
from engine_core_roles.jobs.rl.run import run_rl_job
from engine_core_roles.jobs.sft import run_sft
from engine_core_roles.serving.config import ServeConfig
from engine_core_roles.serving.server import serve, served_rollout

__all__ = [
    "COMMANDS",
    "DEFAULT_RL_RECIPE",
    "RECIPES",
    "recipe_relative",
    "DEFAULT_TRAIN_RECIPE",
    "main",
    "serve_rollout_config",
]

RECIPES = Path(__file__).parents[1] / "recipes"  # package data, beside the layers
"""The shipped recipes."""
DEFAULT_RL_RECIPE = "text_tiny.yaml"
DEFAULT_TRAIN_RECIPE = "sft_tiny.yaml"


def _recipe_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "recipe", nargs="?", default=None, help=f"YAML recipe (default: the shipped {default})"
    )
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. engine.micro_batch_size=4 steps=50"
    )


def _recipe(args: argparse.Namespace, default: str) -> dict[str, Any]:
    """The recipe (or the shipped ``default``) with the command line's dotted overrides applied."""
    words = [args.recipe] if args.recipe is not None else []
    took = getattr(args, "resume_took", None)  # the word a bare --resume read: the first one
    words = ([took] if took is not None else []) + words + list(args.overrides)
    paths = [w for w in words if "=" not in w]  # the recipe: the one word that sets nothing
    recipe = paths[0] if paths else None
    overrides = [w for w in words if w is not recipe]
    return load_recipe(recipe or RECIPES / default, overrides, on_drop=print)


# A setting of a recipe that belongs to another: when a run gives the second a value of its own,
# the recipe's first goes with it (a model folder brings its config and tokenizer; new training
# files leave the shipped task's validation files, demonstrations, warm-up and evaluation)
REPLACES: dict[str, tuple[str, ...]] = {
    "engine.model.path": ("engine.model.config", "engine.model.tokenizer"),
    "data.train_files": (
        "task",
        "data.val_files",
        "data.demos",
        "warmup_sft_steps",
        "eval",
        "eval_every",
    ),
}


def load_recipe(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    on_drop: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The YAML recipe at ``path``, its ``./`` paths resolved beside it, with dotted
    ``overrides`` applied (what ``engine-core run PATH OVERRIDES...`` runs).

    Where the overrides replace a setting that others of the recipe belong to (:data:`REPLACES`),
    those others are dropped unless the overrides set them too; ``on_drop`` is told, in one
    line, what went."""
    path = Path(path)
    recipe = read_recipe(path)
    raw = apply_overrides(recipe, list(overrides))
    dropped: list[str] = []
    for key, belongs in REPLACES.items():
        if _get(raw, key) in (_MISSING, _get(recipe, key)):
            continue
        gone = [
            k
            for k in belongs
            if _get(recipe, k) is not _MISSING and _get(raw, k) == _get(recipe, k)
        ]
        for k in gone:
            _pop(raw, k)
        if gone:
            dropped.append(f"{key} replaces the recipe's {', '.join(gone)}")
    if dropped and on_drop is not None:
        on_drop(
            f"{path.name}: dropped settings of the recipe that the overrides replace: "
            + "; ".join(dropped)
            + "."
        )
    return raw


_MISSING = object()


def _get(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _pop(data: dict[str, Any], key: str) -> None:
    *parents, last = key.split(".")
    node = data
    for part in parents:
        node = node[part]
    del node[last]


def read_recipe(path: Path, _within: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The recipe at ``path``, its ``./`` paths resolved beside it; a recipe with ``base: PATH``
    (relative to its own folder) is that recipe with this one's settings merged over it, key by
    key (a mapping merges into the base's mapping, anything else replaces the base's value)."""
    recipe: dict[str, Any] = recipe_relative(load_yaml(path), path.parent)
    if "base" not in recipe:
        return recipe
    base = recipe.pop("base")
    if not isinstance(base, str) or not base:
        raise ConfigError(
            f"{path}: base must be the path of another recipe (e.g. base: ./text_tiny.yaml), "
            f"got {base!r}."
        )
    base_path = Path(base) if Path(base).is_absolute() else path.parent / base
    chain = (*_within, path.resolve())
    if base_path.resolve() in chain:
        names = " -> ".join(p.name for p in (*chain, base_path.resolve()))
        raise ConfigError(f"{path}: its base recipes form a cycle ({names}); break it.")
    if not base_path.is_file():
        raise ConfigError(f"{path}: its base recipe {base_path} does not exist; fix base.")
    return _merged(read_recipe(base_path, chain), recipe)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        mine = out.get(key)
        out[key] = (
            _merged(mine, value) if isinstance(mine, dict) and isinstance(value, dict) else value
        )
    return out


def recipe_relative(raw: Any, folder: Path) -> Any:
    """``raw`` with every string that starts with ``./`` or ``../`` made a path under
    ``folder`` (the recipe's own): a recipe names the files beside it wherever it is run from.
    Command-line overrides are taken as given (relative to the working directory)."""
    if isinstance(raw, dict):
        return {k: recipe_relative(v, folder) for k, v in raw.items()}
    if isinstance(raw, list):
        return [recipe_relative(v, folder) for v in raw]
    if isinstance(raw, str) and raw.startswith(("./", "../")):
        return str((folder / raw).resolve())
    return raw


class _Resume(argparse.Action):
    """``--resume`` alone (the latest checkpoint) or ``--resume auto``. A word after a bare
    ``--resume`` that is neither (``--resume steps=900``, ``--resume my.yaml``) is the command's
    own argument, handed back to the recipe and its overrides (:func:`_recipe`)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any, *_: Any
    ) -> None:
        if value in (None, "latest", "auto"):
            setattr(namespace, self.dest, value or "latest")
            return
        setattr(namespace, self.dest, "latest")
        namespace.resume_took = value


def _resume_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--resume",
        nargs="?",
        action=_Resume,
        default=None,
        help="continue from the latest checkpoint in output_dir (none: an error); --resume "
        "auto: continue from it when there is one, else start fresh (for restart loops); "
        "default: the recipe's `resume` setting (never)",
    )


# -- engine-core run -----------------------------------------------------------------------------


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    _recipe_arguments(parser, DEFAULT_RL_RECIPE)
    _resume_argument(parser)


def run_rl(args: argparse.Namespace, settings: Settings) -> int:
    """An RL run (any algorithm: trainer.algorithm): :class:`engine_core_roles.RLTrainer` built from a recipe."""

    run_rl_job(_recipe(args, DEFAULT_RL_RECIPE), load_plugins(settings), resume=args.resume)
    return 0


# -- engine-core train ---------------------------------------------------------------------------


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    _recipe_arguments(parser, DEFAULT_TRAIN_RECIPE)
    _resume_argument(parser)


def run_train(args: argparse.Namespace, settings: Settings) -> int:
    """Supervised training through the recipe's engine (see :mod:`engine_core_roles.jobs.sft`)."""

    run_sft(_recipe(args, DEFAULT_TRAIN_RECIPE), load_plugins(settings), resume=args.resume)
    return 0


# -- engine-core serve ---------------------------------------------------------------------------


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL_OR_RECIPE",
        help="a model folder (saved with save_pretrained, "
        "its tokenizer beside it) or a YAML recipe (its engine.model, rollout and seed)",
    )
    # spelled as `vllm serve` spells them
    parser.add_argument("--host", default="127.0.0.1", help="address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    parser.add_argument(
        "--api-key", default=None, help="key clients must send (required off the loopback)"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients name (default: the "
        "argument as given for a folder, the recipe's file name for a recipe)",
    )
    parser.add_argument(
        "--rollout", default=None, help="rollout backend (default: the recipe's, else hf)"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="rollout replicas in processes of their own, each request spread over them "
        "(default: the rollout in this process)",
    )
    parser.add_argument(
        "--rollout-python",
        default=None,
        help="the interpreter the replicas run in, an environment of their own with "
        "engine-core and the rollout's plugin (e.g. .venv-sglang/bin/python; one replica "
        "unless --replicas says more)",
    )


def serve_rollout_config(model: str, rollout: str | None) -> tuple[dict[str, Any], str]:
    """The rollout config ``engine-core serve MODEL_OR_RECIPE`` builds, and the default model
    name: a model folder served by ``rollout`` (hf unless given), or a recipe's rollout on its
    ``engine.model`` with its seed."""
    path = Path(model)
    if path.is_dir():
        return {"backend": rollout or "hf", "model": {"path": str(path)}}, model
    if path.is_file():
        recipe = load_recipe(path)
        engine = recipe.get("engine")
        if not isinstance(engine, dict) or "model" not in engine:
            raise ConfigError(f"{path}: the recipe has no engine.model to serve; add one.")
        raw = {"backend": "hf", **(recipe.get("rollout") or {}), "model": engine["model"]}
        if rollout is not None:
            raw = {"backend": rollout, "model": engine["model"]}
        if "seed" in recipe:
            raw.setdefault("seed", recipe["seed"])
        return raw, path.stem
    raise ConfigError(
        f"{model!r} is neither a model folder nor a recipe file; give a folder saved with "
        f"save_pretrained (its tokenizer beside it) or a YAML recipe."
    )


def run_serve(args: argparse.Namespace, settings: Settings) -> int:
    """The OpenAI-compatible endpoint in front of a rollout (docs/serving.md), until stopped."""
    raw, name = serve_rollout_config(args.model, args.rollout)
    config = ServeConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        model_name=args.served_model_name or name,
    )  # refused here, before any model is built, when the bind is unsafe
    manager = load_plugins(settings)
    serve(
        config,
        served_rollout(raw, manager, replicas=args.replicas, python=args.rollout_python),
    )
    return 0


COMMANDS: tuple[Command, ...] = (
    Command(
        "run",
        "an RL run (GRPO, or PPO with a critic) through the roles, from a YAML recipe",
        run_rl,
        _run_arguments,
    ),
    Command(
        "train",
        "supervised training of a model through any engine, from a YAML recipe",
        run_train,
        _train_arguments,
    ),
    Command(
        "serve",
        "an OpenAI-compatible endpoint in front of a model folder's or a recipe's rollout",
        run_serve,
        _serve_arguments,
    ),
)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``engine-core`` script with the core's commands and these; returns the exit code."""
    return cli.main(argv, (*cli.COMMANDS, *COMMANDS))


if __name__ == "__main__":
    raise SystemExit(main())
