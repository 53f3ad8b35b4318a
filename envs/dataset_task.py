"""A user's dataset as a task (`task.name: dataset`).

Rows come from `task.train_path` / `task.eval_path` (.jsonl, .json, .parquet or a
`save_to_disk` directory; envs/datasets.py `load_rows`). The prompt column (`task.prompt_key`)
holds a string or chat messages (`[{"role": ..., "content": ...}, ...]`); the answer column
(`task.answer_key`) the reference answer; every column travels with the row to the reward.

Prompts go through the tokenizer's chat template (`task.chat_template`, default: when the
tokenizer has one), with `task.system_prompt` as a first system message; without a template
the messages' text is tokenized as it is. Prompts longer than the budget (`task.max_prompt_tokens`,
default: the model's context less `rollout.max_new_tokens`) are dropped with one count on stderr,
or rejected (`task.drop_long_prompts: false`): `fit_to_model`, called once the tokenizer is known.

The task's own reward is an exact match of the whole response with the answer, both normalised
(`reward_functions.normalize_text`); `reward.function` replaces it where set.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from envs.datasets import DatasetError, load_rows
from envs.reward_functions import normalize_text
from rlsys.config import ConfigError
from rlsys.prompts import chat_prompt, context_length, has_chat_template, text_prompt

Messages = list[dict[str, str]]


def row_problem(row: Any, prompt_key: str, answer_key: str, text_keys: tuple[str, ...] = ()) -> str | None:
    """What is wrong with a row (missing key, empty prompt, wrong type, malformed messages, a
    `text_keys` column that is neither a string nor chat messages opening with the assistant's:
    a demonstration), or None."""
    if not isinstance(row, dict):
        return f"expected an object, got {type(row).__name__}"
    for key in (prompt_key, answer_key, *text_keys):
        if row.get(key) is None:
            return f"missing key '{key}'"
    for key in text_keys:
        if isinstance(row[key], list):  # a multi-turn demonstration: the messages after the prompt
            problem = messages_problem(row[key])
            if problem:
                return f"malformed messages in '{key}': {problem}"
            if row[key][0]["role"] != "assistant":
                first = row[key][0]["role"]
                return f"'{key}' opens with a {first!r} message: a demonstration opens with the assistant's"
        elif not isinstance(row[key], str):
            return f"'{key}' is {type(row[key]).__name__}: expected a string or a list of chat messages"
    prompt, answer = row[prompt_key], row[answer_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            return f"empty prompt ('{prompt_key}')"
    elif isinstance(prompt, list):
        problem = messages_problem(prompt)
        if problem:
            return f"malformed messages in '{prompt_key}': {problem}"
    else:
        return f"'{prompt_key}' is {type(prompt).__name__}: expected a string or a list of chat messages"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return f"'{answer_key}' is {type(answer).__name__}: expected a string or a number"
    try:
        json.dumps(row)
    except (TypeError, ValueError) as e:
        return f"a column is not JSON-serialisable ({e})"
    return None


def messages_problem(messages: list) -> str | None:
    """What is wrong with a list of chat messages, or None."""
    if not messages:
        return "no messages"
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            return f"message {i} is {type(m).__name__}, not an object with 'role' and 'content'"
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                return f"message {i} has no string '{key}'"
        if not m["role"].strip():
            return f"message {i} has an empty role"
    if not any(m["content"].strip() for m in messages):
        return "every message is empty"
    return None


def checked_rows(
    rows: list, path: Path, prompt_key: str, answer_key: str, text_keys: tuple[str, ...] = ()
) -> list[dict]:
    """The rows, or a DatasetError naming the file, the first bad row (1-based) and what is wrong."""
    for i, row in enumerate(rows, 1):
        problem = row_problem(row, prompt_key, answer_key, text_keys)
        if problem:
            raise DatasetError(f"dataset {path} row {i}: {problem}")
    return rows


def plain_text(messages: Messages) -> str:
    """The prompt without a chat template: the messages' contents, a blank line between them."""
    return "\n\n".join(m["content"] for m in messages)


def prompt_budget(max_prompt_tokens: int | None, context: int | None, max_new_tokens: int) -> int | None:
    """Longest prompt kept, in tokens: `task.max_prompt_tokens`, else the model's context less the
    response's tokens; None: no limit known."""
    if max_prompt_tokens is not None:
        return max_prompt_tokens
    if context is None:
        return None
    if context <= max_new_tokens:
        raise ConfigError(
            f"config error: 'rollout.max_new_tokens'={max_new_tokens}: leaves no room for a prompt in the "
            f"model's context of {context} tokens (allowed: below {context})"
        )
    return context - max_new_tokens


def fit_to_model(task, tokenizer, cfg, model_config: Mapping) -> None:
    """Drop (or reject) the task's prompts over the budget of `cfg` and the model (its config as a
    dict); a task without long-prompt handling is left as it is."""
    fit = getattr(task, "fit_prompts", None)  # getattr: task wrappers (ShapedTask) delegate attributes
    if fit is None:
        return
    budget = prompt_budget(cfg.task.max_prompt_tokens, context_length(model_config), cfg.rollout.max_new_tokens)
    fit(tokenizer, budget, cfg.task.drop_long_prompts)


@dataclass
class DatasetTask:
    train_path: Path
    eval_path: Path
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    system_prompt: str | None = None
    chat_template: bool | None = None
    demonstration_key: str | None = None
    flawed_demonstration_key: str | None = None
    name: str = "dataset"
    _rows: dict[str, list[dict]] = field(default_factory=dict, repr=False)
    _budget: tuple | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, task_cfg) -> "DatasetTask":
        return cls(
            Path(task_cfg.train_path),
            Path(task_cfg.eval_path or task_cfg.train_path),
            prompt_key=task_cfg.prompt_key,
            answer_key=task_cfg.answer_key,
            system_prompt=task_cfg.system_prompt,
            chat_template=task_cfg.chat_template,
            demonstration_key=task_cfg.demonstration_key,
            flawed_demonstration_key=task_cfg.flawed_demonstration_key,
        )

    def path(self, split: str) -> Path:
        return self.train_path if split == "train" else self.eval_path

    def rows(self, split: str) -> list[dict]:
        """The split's rows (read and checked once), less any prompts `fit_prompts` dropped."""
        if split not in self._rows:
            path = self.path(split)
            demos = tuple(k for k in (self.demonstration_key, self.flawed_demonstration_key) if k and split == "train")
            self._rows[split] = checked_rows(load_rows(path), path, self.prompt_key, self.answer_key, demos)
        return list(self._rows[split])

    # ---- prompts --------------------------------------------------------------------------
    def messages(self, row: dict) -> Messages:
        """The row's prompt as chat messages, `system_prompt` first unless the row has its own."""
        prompt = row[self.prompt_key]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def prompt_text(self, row: dict) -> str:
        """The prompt without a chat template."""
        return plain_text(self.messages(row))

    def uses_template(self, tokenizer) -> bool:
        if self.chat_template is None:
            return has_chat_template(tokenizer)
        if self.chat_template and not has_chat_template(tokenizer):
            raise ConfigError(
                "config error: 'task.chat_template'=true: the tokenizer has no chat template "
                "(allowed: false, or null to use one when the tokenizer has it)"
            )
        return self.chat_template

    def build_prompt(self, tokenizer, row: dict) -> tuple[list[int], str]:
        """(token ids, text) the model is given: the chat template applied, or the plain text."""
        if self.uses_template(tokenizer):
            return chat_prompt(tokenizer, self.messages(row))
        return text_prompt(tokenizer, self.prompt_text(row))

    def fit_prompts(self, tokenizer, budget: int | None, drop: bool) -> None:
        """Keep the prompts of at most `budget` tokens in every split; the others are dropped (one
        count on stderr) or, with `drop` off, the first is rejected with its file and row."""
        self.uses_template(tokenizer)  # task.chat_template=true without a template: fails here, before the actors
        if budget is None or self._budget == (budget, drop):
            return
        dropped = {}
        for split in ("train", "eval"):
            rows = self.rows(split)
            lengths = [len(self.build_prompt(tokenizer, r)[0]) for r in rows]
            long = [i for i, n in enumerate(lengths) if n > budget]
            if long and not drop:
                i = long[0]
                raise DatasetError(
                    f"dataset {self.path(split)} row {i + 1}: prompt is {lengths[i]} tokens, over the limit of "
                    f"{budget} (task.max_prompt_tokens, default the model's context less rollout.max_new_tokens); "
                    f"set task.drop_long_prompts: true to drop such rows"
                )
            if len(long) == len(rows):
                raise DatasetError(f"dataset {self.path(split)}: every prompt is over the limit of {budget} tokens")
            self._rows[split] = [r for r, n in zip(rows, lengths) if n <= budget]
            dropped[split] = (len(long), len(rows))
        self._budget = (budget, drop)
        if any(n for n, _ in dropped.values()):
            counts = " and ".join(f"{n} of {total} {split}" for split, (n, total) in dropped.items())
            print(f"rlsys: dropped {counts} prompts over {budget} tokens (task.max_prompt_tokens)", file=sys.stderr)

    # ---- answers and rewards --------------------------------------------------------------
    def answer(self, row: dict) -> str:
        return str(row[self.answer_key])

    def demonstration(self, row: dict) -> str | Messages:
        """What the supervised warm-up teaches the model to answer: the demonstration column
        (`task.demonstration_key`, a worked solution, or the chat messages after the prompt of a
        multi-turn one: assistant turns and tool results), else the reference answer."""
        if not self.demonstration_key:
            return self.answer(row)
        demo = row[self.demonstration_key]
        return [dict(m) for m in demo] if isinstance(demo, list) else str(demo)

    @property
    def flawed_demonstration(self):
        """row -> the row taught with its flawed demonstration (`task.flawed_demonstration_key`) in
        place of its demonstration; None when the dataset names no such column."""
        if self.flawed_demonstration_key is None:
            return None
        target = self.demonstration_key or self.answer_key
        return lambda row: {**row, target: row[self.flawed_demonstration_key]}

    def is_correct(self, row: dict, response_text: str) -> bool:
        return normalize_text(response_text) == normalize_text(self.answer(row))

    def reward(self, row: dict, response_text: str) -> float:
        return 1.0 if self.is_correct(row, response_text) else 0.0

    def corpus(self) -> list[str]:
        """Text a tokenizer is trained on: each training row's messages with their roles, and its answer."""
        lines = []
        for row in self.rows("train"):
            turns = "\n".join(f"{m['role']}\n{m['content']}" for m in self.messages(row))
            demo = self.demonstration(row)
            if isinstance(demo, list):  # a multi-turn demonstration: its messages with their roles
                lines.append(turns + "".join(f"\n{m['role']}\n{m['content']}" for m in demo))
            else:
                lines.append(f"{turns}\nassistant\n{demo}")
        return lines
