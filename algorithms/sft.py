"""Supervised warm-up: next-token cross-entropy on (prompt, answer) pairs, answer tokens only.

It runs in-process before the RL actors start, so the policy begins RL with well-formed
answers; its result is both the initial policy and the frozen reference.

A multi-turn demonstration (a list of chat messages after the prompt: assistant turns, tool
results; the dataset task's `task.demonstration_key` column) is built as the multi-turn rollout
builds an episode's row (envs/conversation.py, token-in/token-out): the prompt through the chat
template (with the episodes' `tools=`), each assistant message as a policy turn (its text's
tokens and the template's end-of-turn token, which the rollout stops on) and each run of other
messages as an observation; the loss is on the assistant turns only, the tool results masked out.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

import torch

from algorithms.common import masked_mean
from envs.conversation import ChatEncoder, Conversation, end_of_turn_id
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


def demonstration(task, row: dict) -> str | list[dict]:
    """The answer the warm-up teaches: the task's `demonstration(row)` where it has one (the dataset
    task's answer column, or a multi-turn demonstration's chat messages), else the row's "answer"."""
    demo = getattr(task, "demonstration", None)  # getattr: task wrappers (ShapedTask) delegate attributes
    return demo(row) if demo is not None else str(row["answer"])


def conversation_ids(
    tokenizer, row: dict, task, messages: Sequence[dict], tools: Sequence[dict] | None = None
) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, loss mask) of a multi-turn demonstration `messages` of `row`: the
    prompt as an episode's (the task's chat messages of the row where it has them, else its text as
    a user message; `tools`: the template's `tools=`), each assistant message a policy turn (loss
    mask 1: its tokens and the end-of-turn token), each run of other messages an observation
    (mask 0). ValueError (one line) for a demonstration with no assistant message."""
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("a multi-turn demonstration needs at least one assistant message")
    encoder = ChatEncoder(tokenizer, end_of_turn_id(tokenizer))
    as_messages = getattr(task, "messages", None)  # getattr: task wrappers (ShapedTask) delegate attributes
    prompt = as_messages(row) if as_messages is not None else [{"role": "user", "content": task.prompt_text(row)}]
    conversation = Conversation.start(encoder, prompt, tools)
    observation: list[dict] = []
    for message in messages:
        if message["role"] != "assistant":
            observation.append(message)
            continue
        if observation:
            conversation.add_messages(observation)
            observation = []
        ids = tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [encoder.end_of_turn_id]
        conversation.add_policy(ids, [0.0] * len(ids))
    fields = conversation.experience_fields()
    return fields["prompt_ids"], fields["response_ids"], fields["loss_mask"]


def sft_batch(tokenizer, rows: Sequence[dict], task, tools: Sequence[dict] | None = None) -> TrainBatch:
    """prompt + answer + eos, with the loss on the answer and eos; a multi-turn demonstration
    (chat messages) as `conversation_ids` builds it, the loss on its assistant turns."""
    single = [r for r in rows if not isinstance(demonstration(task, r), list)]
    prompts, targets = sft_ids(tokenizer, single, task) if single else ([], [])
    masks: list[list[int] | None] = [None] * len(single)
    for row in rows:
        demo = demonstration(task, row)
        if isinstance(demo, list):
            prompt, response, mask = conversation_ids(tokenizer, row, task, demo, tools)
            prompts.append(prompt)
            targets.append(response)
            masks.append(mask)
    return collate_ids(prompts, targets, masks, pad_id=tokenizer.pad_token_id)


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
    tools: Sequence[dict] | None = None,
) -> list[float]:
    """`steps` AdamW steps on random minibatches of `rows`. Returns the loss curve.
    `demo_error`: each drawn row is, with this probability, the task's flawed demonstration
    of it (`task.flawed_demonstration`), as imperfect human or model-written SFT data is.
    `tools`: the function schemas the multi-turn episodes' prompts list (env.tools), so a
    multi-turn demonstration's prompt is the episodes' own."""
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
        batch = sft_batch(tokenizer, drawn, task, tools)
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
