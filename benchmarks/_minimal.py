"""The hand-written minimal GRPO loop the benchmarks compare ``engine-core run`` with.

One transformers model generates (``generate``, sampling) and trains (after the recipe's
supervised warm-up on its demonstrations, if it has one): rewards, group-normalized
advantages, one forward/backward of the token-level policy gradient (on-policy: the PPO ratio
is 1) with the recipe's entropy bonus, one AdamW step with the recipe's optimizer settings. No engine, no checks, no weight
copy. It runs any recipe the job runs on one process — the digit task (``task``) or a text
task (``data`` + ``reward``: the same files, tokenizer, chat template and reward function) —
with the recipe's seeds as the job reads them (the run's ``seed``, or a section's own):
``engine.seed`` for the initial weights (and this loop's sampling), ``task.seed`` /
``data.seed`` for the prompts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from engine_core_roles.jobs.config import seeded
from engine_core_roles.jobs.rl.config import RLJobConfig

__all__ = ["MinimalGRPO", "minimal_grpo"]


def _prompt_source(raw: dict[str, Any]) -> tuple[Any, Any, int, list[int]]:
    """(next prompt batch as (ids, mask, rows), scorer, max_new_tokens, stop ids)."""
    n_prompts = int(raw.get("prompts_per_step", 16))
    trainer = raw.get("trainer", {})
    if "data" not in raw:
        from engine_core_roles.data.tasks.digits import EOS, PAD, DigitTask, TaskConfig

        task = DigitTask(TaskConfig(**raw.get("task", {})))

        def draw() -> tuple[torch.Tensor, torch.Tensor, None]:
            ids = task.prompt_ids(task.sample_digits(n_prompts))
            return ids, torch.ones_like(ids), None

        def score(
            prompt: torch.Tensor, response: torch.Tensor, mask: torch.Tensor, rows: Any
        ) -> torch.Tensor:
            return task.score(prompt, response.masked_fill(mask == 0, PAD))

        return draw, score, task.response_len, [EOS]

    from engine_core.config import ModelConfig
    from engine_core.models import build_hf_config
    from engine_core_roles.data.datasets.prompts import DataConfig, PromptData
    from engine_core_roles.data.datasets.stop_strings import stop_token_ids
    from engine_core_roles.data.datasets.tokenizer import load_tokenizer
    from engine_core_roles.data.rewards.functions import RewardConfig, load_function

    model = ModelConfig.model_validate(raw["engine"]["model"])
    hf = build_hf_config(model)
    tokenizer = load_tokenizer(model, hf.vocab_size)
    cfg = DataConfig.model_validate(raw["data"])
    max_new = int(trainer.get("max_new_tokens", 32))
    data = PromptData(
        cfg.train_files, tokenizer, cfg, max_length=hf.max_position_embeddings - max_new
    )
    reward = RewardConfig.model_validate(raw.get("reward") or {})
    fn = load_function(reward.fn)

    def draw_text() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        rows = data.next_indices(n_prompts)
        batch = data.batch(rows)
        return batch["prompt_ids"], batch["prompt_mask"], rows

    def score_text(
        prompt: torch.Tensor, response: torch.Tensor, mask: torch.Tensor, rows: Any
    ) -> torch.Tensor:
        texts = tokenizer.batch_decode(
            [r[m.bool()].tolist() for r, m in zip(response, mask, strict=True)],
            skip_special_tokens=True,
        )
        n = len(texts) // len(rows)
        table = data.rows(rows)
        out = []
        for i, text in enumerate(texts):
            row = {k: v[i // n] for k, v in table.items()}
            out.append(float(fn("", text, **row, **reward.kwargs)))
        return torch.tensor(out)

    return draw_text, score_text, max_new, stop_token_ids(tokenizer)


def _warm_up(raw: dict[str, Any], model: Any, opt: torch.optim.Optimizer) -> None:
    """The recipe's supervised warm-up (``warmup_sft_steps`` on ``data.demos``), written out:
    each step, ``warmup_batch_size`` demonstrations drawn with the trainer's seed, the
    negative log-likelihood of their answers (the answer's tokens and the end of turn after
    the prompt rendered with its generation prompt), one AdamW step (the loop's optimizer,
    carried on into RL as the job carries its engine's)."""
    steps = int(raw.get("warmup_sft_steps", 0))
    demos = (raw.get("data") or {}).get("demos") or []
    if not steps or not demos:
        return
    import json

    from engine_core.config import ModelConfig
    from engine_core.models import build_hf_config
    from engine_core_roles.data.datasets.tokenizer import load_tokenizer

    model_cfg = ModelConfig.model_validate(raw["engine"]["model"])
    tokenizer = load_tokenizer(model_cfg, build_hf_config(model_cfg).vocab_size)
    rows = []
    for f in demos:
        for line in Path(f).read_text().splitlines():
            *prompt, answer = json.loads(line)["messages"]
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text).input_ids
            target = tokenizer(answer["content"]).input_ids + [tokenizer.eos_token_id]
            rows.append((ids + target, len(ids)))
    gen = torch.Generator().manual_seed(int(raw.get("trainer", {}).get("seed") or 0))
    batch = int(raw.get("warmup_batch_size", 32))
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(rows), (batch,), generator=gen).tolist()
        width = max(len(rows[i][0]) for i in pick)
        ids = torch.zeros(batch, width, dtype=torch.long)
        attn, trained = torch.zeros_like(ids), torch.zeros_like(ids)
        for j, i in enumerate(pick):
            seq, start = rows[i]
            ids[j, : len(seq)], attn[j, : len(seq)] = torch.tensor(seq), 1
            trained[j, start : len(seq)] = 1
        logits = model(ids, attention_mask=attn).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), ids[:, 1:], reduction="none"
        )
        mask = trained[:, 1:].float()
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


class MinimalGRPO:
    """The loop's state (model, optimizer, prompt source) built from recipe ``raw`` (overrides
    applied; paths resolved), the recipe's warm-up done; :meth:`step` runs one step.
    ``parts``, when given, gets each step's seconds of generation (drawing the prompts
    included), scoring and the update appended."""

    def __init__(self, raw: dict[str, Any], parts: dict[str, list[float]] | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        raw = seeded(raw, RLJobConfig)  # each section's seed, as the job reads them
        engine = raw["engine"]
        torch.manual_seed(int(engine.get("seed", 0)))
        model_cfg = engine["model"]
        if model_cfg.get("config"):
            kwargs = dict(model_cfg["config"])
            config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
            self.model = AutoModelForCausalLM.from_config(config)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(Path(model_cfg["path"]))
        optim = engine.get("optim", {})
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=float(optim.get("lr", 1e-5)),
            weight_decay=float(optim.get("weight_decay", 0.0)),  # the engines' default
            betas=tuple(optim.get("betas", (0.9, 0.999))),
            eps=float(optim.get("eps", 1e-8)),
        )
        self.clip = float(optim.get("clip_grad", 1.0))
        _warm_up(raw, self.model, self.opt)
        self.entropy_coeff = float(raw.get("actor", {}).get("entropy_coeff", 0.0))
        trainer = raw.get("trainer", {})
        self.n = int(trainer.get("samples_per_prompt", 8))
        self.temperature = float(trainer.get("temperature", 1.0))
        self.draw, self.score, self.max_new, self.stops = _prompt_source(raw)
        self.parts = parts

    def step(self) -> tuple[float, float]:
        """One step: (its seconds, its mean reward)."""
        model, n, temperature = self.model, self.n, self.temperature
        t0 = time.perf_counter()
        prompt, pmask, rows = self.draw()
        model.eval()
        with torch.no_grad():
            seqs = model.generate(
                prompt,
                attention_mask=pmask,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                max_new_tokens=self.max_new,
                num_return_sequences=n,
                eos_token_id=self.stops,
                pad_token_id=0,
            )
        t1 = time.perf_counter()
        p = prompt.shape[1]
        response = seqs[:, p:]
        stop = torch.isin(response, torch.tensor(self.stops))
        done = torch.cumsum(stop.long(), 1) - stop.long()  # tokens after the first stop: padding
        mask = (done == 0).float()
        scores = self.score(seqs[:, :p], response, mask, rows)
        grouped = scores.view(-1, n)
        adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
        t2 = time.perf_counter()
        model.train()
        attn = torch.cat([pmask.repeat_interleave(n, 0), mask.long()], 1)
        logits = model(seqs, attention_mask=attn).logits[:, p - 1 : -1]
        all_logp = torch.log_softmax(logits.float() / temperature, -1)
        logp = all_logp.gather(-1, response.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())  # on-policy: 1, with the policy's gradient
        loss = -(ratio * adv.view(-1, 1) * mask).sum() / mask.sum()
        if self.entropy_coeff:  # the recipe's entropy bonus, token-mean like the loss
            entropy = -(all_logp.exp() * all_logp).sum(-1)
            loss = loss - self.entropy_coeff * (entropy * mask).sum() / mask.sum()
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip)
        self.opt.step()
        t3 = time.perf_counter()
        if self.parts is not None:
            self.parts["generation"].append(t1 - t0)
            self.parts["scoring"].append(t2 - t1)
            self.parts["update"].append(t3 - t2)
        return t3 - t0, float(scores.mean())


def minimal_grpo(
    raw: dict[str, Any], steps: int, parts: dict[str, list[float]] | None = None
) -> list[tuple[float, float]]:
    """(seconds, mean reward) of each of ``steps`` steps of the minimal loop on recipe ``raw``
    (see :class:`MinimalGRPO`)."""
    loop = MinimalGRPO(raw, parts)
    return [loop.step() for _ in range(steps)]
