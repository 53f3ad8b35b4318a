"""Supervised warm-up: next-token cross-entropy on (prompt, answer) pairs, answer tokens only.

It runs in-process before the RL actors start, so the policy begins RL with well-formed
answers; its result is both the initial policy and the frozen reference.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

import torch

from algorithms.common import masked_mean
from rlsys.batch import TrainBatch, collate_ids
from rlsys.logprobs import forward_logprobs
from rlsys.prompts import prompt_ids


def sft_ids(tokenizer, rows: Sequence[dict], task) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of each row's prompt (as the rollout gives it: `prompt_ids`) and of its answer + eos."""
    prompts = [prompt_ids(task, tokenizer, r)[0] for r in rows]
    answers = [
        tokenizer(demonstration(task, r), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for r in rows
    ]
    return prompts, answers


def demonstration(task, row: dict) -> str:
    """The answer the warm-up teaches: the task's `demonstration(row)` where it has one (the dataset
    task's answer column), else the row's "answer"."""
    demo = getattr(task, "demonstration", None)  # getattr: task wrappers (ShapedTask) delegate attributes
    return demo(row) if demo is not None else str(row["answer"])


def sft_batch(tokenizer, rows: Sequence[dict], task) -> TrainBatch:
    """prompt + answer + eos, with the loss on the answer and eos."""
    return collate_ids(*sft_ids(tokenizer, rows, task), pad_id=tokenizer.pad_token_id)


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the masked (answer) tokens."""
    return -masked_mean(logprobs, mask)


def warmup(
    model,
    tokenizer,
    task,
    rows: list[dict],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    on_step: Callable[[int, float], None] | None = None,
    demo_error: float = 0.0,
) -> list[float]:
    """`steps` AdamW steps on random minibatches of `rows`. Returns the loss curve.
    `demo_error`: each drawn row is, with this probability, the task's flawed demonstration
    of it (`task.flawed_demonstration`), as imperfect human or model-written SFT data is."""
    rng = random.Random(seed)
    flaw_rng = random.Random(seed + 1)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.1, 1 - s / max(steps, 1)))
    model.train()
    losses = []
    for step in range(steps):
        drawn = rng.sample(rows, min(batch_size, len(rows)))
        if demo_error:
            drawn = [task.flawed_demonstration(r) if flaw_rng.random() < demo_error else r for r in drawn]
        batch = sft_batch(tokenizer, drawn, task)
        _, logprobs, _ = forward_logprobs(model, batch.input_ids, batch.attention_mask)
        loss = sft_loss(logprobs, batch.response_mask)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, loss.item())
    model.eval()
    return losses
