"""The experiment a recipe describes, run by TRL's ``GRPOTrainer`` (``benchmarks/learning.py
--vs trl``), for steps to a reward side by side with ``engine-core run``.

What is the same as the job, and how:

- the model: the hand-written loop's (``benchmarks/_minimal.py``: the recipe's config or folder,
  built after ``torch.manual_seed(engine.seed)``, its warm-up done); fp32 (``bf16=False``);
- the prompts: the job's draws in the job's order (``task.seed`` or ``data.seed``), as rows of a
  dataset TRL does not shuffle (``shuffle_dataset=False``). A digit task's token ids go
  through a word-level tokenizer whose vocabulary is the task's ids (``<s>`` 1, ``|`` 2,
  ``</s>`` 3, digits 4-13), so that TRL's prompt ids are the job's; a text recipe's chat
  messages through the recipe's tokenizer and chat template, with the rows' other columns;
- the reward: the digit task's own score (the fraction of target positions right, EOS
  included) on TRL's completion ids, which stop after the first EOS as the job's do; a text
  recipe's reward function on the decoded completion, with the row's columns;
- generation stops at a text recipe's end of turn as well as at EOS, as the job's does;
- sampling: ``samples_per_prompt`` completions per prompt (``num_generations``), at most the
  task's response length of new tokens, the recipe's temperature, no top-k or top-p;
- the update: one optimizer step per generation batch (``per_device_train_batch_size`` = the
  step's completions, no accumulation, one iteration), or with ``actor.ppo_mini_batch_size``
  one per mini-batch of it (``steps_per_generation``), AdamW with the recipe's lr, betas, eps
  and weight decay, gradient clipping at ``clip_grad``, a constant schedule without warm-up,
  no KL (``beta=0``), group-normalized advantages (``scale_rewards="group"``), the token mean
  over the batch (``loss_type="dapo"``, the job's ``token-mean``), the recipe's entropy bonus
  (``actor.entropy_coeff`` as ``entropy_coef``, both the mean entropy over the loss tokens).

Settings of the job that TRL does not have (``trainer.filter_groups``: drawing more prompts in
place of groups whose samples all score the same) run on the job's side only.

What differs and why it cannot matter here: TRL divides by the group's std plus 1e-4, the job
plus 1e-6 (the task's rewards are multiples of 1/4, so a group's std is 0 or at least 0.06 and
both advantages agree to 0.2%); TRL's clip range (0.2) and the job's (0.2/0.28) never act in
one on-policy iteration (the ratio is 1); TRL samples with ``transformers.generate`` and its
own torch generator stream, the job with its rollout's seeded sampler, so the draws differ
sample by sample (the same distribution). After a warm-up, TRL's AdamW starts with empty
moments, where the job and the minimal loop go on with the warm-up's.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engine_core_roles.jobs.config import seeded
from engine_core_roles.jobs.rl.config import RLJobConfig

__all__ = ["have_trl", "task_reward", "tokenizer", "trl_grpo"]


def have_trl() -> str | None:
    """TRL's version, or None where it is not installed."""
    try:
        import trl
    except ImportError:
        return None
    return str(trl.__version__)


def tokenizer() -> Any:
    """A word-level tokenizer whose ids are the digit task's: ``<s> 1 2 3 |`` is ``BOS 5 6 7 SEP``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    from engine_core_roles.data.tasks.digits import DIGIT0, VOCAB_SIZE

    vocab = {"<pad>": 0, "<s>": 1, "|": 2, "</s>": 3}
    vocab |= {str(d): DIGIT0 + d for d in range(10)}
    vocab |= {f"<unused{i}>": i for i in range(DIGIT0 + 10, VOCAB_SIZE)}
    core = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def task_reward(task: Any) -> Any:
    """TRL's reward function for the digit task ``task``: its own score on the completion ids
    (which stop after the first EOS, as the job's responses do), given each row's digits."""
    from engine_core_roles.data.tasks.digits import PAD

    def reward(completion_ids: list[list[int]], digits: list[list[int]], **_: Any) -> list[float]:
        width = task.response_len
        response = torch.full((len(completion_ids), width), PAD)
        for i, ids in enumerate(completion_ids):
            ids = ids[:width]
            response[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        prompt = task.prompt_ids(torch.tensor(digits))
        return [float(x) for x in task.score(prompt, response)]

    return reward


def _text_experiment(raw: dict[str, Any], steps: int, n_prompts: int) -> tuple[Any, ...]:
    """A text recipe's side for TRL: (dataset of the job's prompts in its order, as chat
    messages with their other columns; the recipe's reward function on TRL's decoded
    completions; the recipe's tokenizer; max new tokens; stop ids)."""
    from datasets import Dataset

    from engine_core.config import ModelConfig
    from engine_core.models import build_hf_config
    from engine_core_roles.data.datasets.prompts import DataConfig, PromptData
    from engine_core_roles.data.datasets.stop_strings import stop_token_ids
    from engine_core_roles.data.datasets.tokenizer import load_tokenizer
    from engine_core_roles.data.rewards.functions import RewardConfig, load_function

    model = ModelConfig.model_validate(raw["engine"]["model"])
    hf = build_hf_config(model)
    tok = load_tokenizer(model, hf.vocab_size)
    cfg = DataConfig.model_validate(raw["data"])
    max_new = int(raw.get("trainer", {}).get("max_new_tokens", 32))
    data = PromptData(cfg.train_files, tok, cfg, max_length=hf.max_position_embeddings - max_new)
    order = [i for _ in range(steps) for i in data.next_indices(n_prompts)]  # the job's draws
    prompts = data.data.select_columns([cfg.prompt_key])[order][cfg.prompt_key]
    others = data.rows(order)
    reward_cfg = RewardConfig.model_validate(raw.get("reward") or {})
    fn = load_function(reward_cfg.fn)

    def reward(completions: list[Any], **columns: Any) -> list[float]:
        out = []
        for i, completion in enumerate(completions):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            row = {k: v[i] for k, v in columns.items() if k in others}
            out.append(float(fn("", text, **row, **reward_cfg.kwargs)))
        return out

    dataset = Dataset.from_dict({"prompt": prompts, **others})
    return dataset, reward, tok, max_new, stop_token_ids(tok)


def trl_grpo(raw: dict[str, Any], steps: int, workdir: str) -> tuple[list[float], list[float]]:
    """(mean reward, seconds) of each of ``steps`` steps of TRL's GRPOTrainer on recipe ``raw``
    (a digit task or a text recipe; overrides applied), writing only under ``workdir``."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from engine_core_roles.data.tasks.digits import DigitTask, TaskConfig

    raw = seeded(raw, RLJobConfig)
    trainer, optim = raw.get("trainer", {}), raw["engine"].get("optim", {})
    n_prompts, n = int(raw.get("prompts_per_step", 16)), int(trainer.get("samples_per_prompt", 8))
    if raw.get("data"):
        dataset, reward, processing, max_new, stops = _text_experiment(raw, steps, n_prompts)
    else:
        task = DigitTask(TaskConfig(**raw.get("task", {})))
        digits = [task.sample_digits(n_prompts) for _ in range(steps)]  # the job's order
        rows = torch.cat(digits).tolist()
        dataset = Dataset.from_dict(
            {"prompt": ["<s> " + " ".join(map(str, d)) + " |" for d in rows], "digits": rows}
        )
        reward, processing, max_new, stops = task_reward(task), tokenizer(), task.response_len, None

    # the minimal loop's model: its seeding, config or folder, and the recipe's warm-up
    from _minimal import MinimalGRPO

    model = MinimalGRPO(raw).model
    if stops:  # generation stops at the end of turn as well as at EOS, as the job's does
        model.generation_config.eos_token_id = list(stops)

    rewards: list[float] = []
    seconds: list[float] = []

    class Record(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, *_: Any, **__: Any) -> None:
            # a step of the job is one generation: its optimizer steps' times summed
            if (state.global_step - 1) % updates == 0:
                seconds.append(0.0)
            seconds[-1] += time.perf_counter() - self.t0

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            # logged at the first optimizer step after each generation (its batch's rewards)
            if logs and "reward" in logs and (state.global_step - 1) % updates == 0:
                rewards.append(float(logs["reward"]))

    # the job's actor.ppo_mini_batch_size: several optimizer steps per generation batch, each on
    # a slice of it (TRL's steps_per_generation), the old log-probs those of the generation
    total = n_prompts * n
    mini = int(raw.get("actor", {}).get("ppo_mini_batch_size") or total)
    if total % mini:
        raise ValueError(f"actor.ppo_mini_batch_size={mini} does not divide the step's {total}")
    updates = total // mini
    betas = optim.get("betas", (0.9, 0.999))
    config = GRPOConfig(
        output_dir=workdir,
        max_steps=steps * updates,
        per_device_train_batch_size=mini,
        gradient_accumulation_steps=1,
        steps_per_generation=updates,
        num_iterations=1,
        num_generations=n,
        max_completion_length=max_new,
        temperature=float(trainer.get("temperature", 1.0)),
        top_k=0,
        top_p=1.0,
        learning_rate=float(optim.get("lr", 1e-5)),
        weight_decay=float(optim.get("weight_decay", 0.0)),
        adam_beta1=float(betas[0]),
        adam_beta2=float(betas[1]),
        adam_epsilon=float(optim.get("eps", 1e-8)),
        max_grad_norm=float(optim.get("clip_grad", 1.0)),
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        entropy_coef=float(raw.get("actor", {}).get("entropy_coeff", 0.0)),
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        seed=int(trainer.get("seed", raw.get("seed", 0)) or 0),
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    run = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=processing,
        callbacks=[Record()],
    )
    run.remove_callback(PrinterCallback)  # each step's log as a printed dict
    run.train()
    return rewards, seconds
