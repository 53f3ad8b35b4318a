"""A task row's prompt as the model sees it: token ids and their text.

A task that builds its own prompts (`build_prompt(tokenizer, row)`: the dataset task, which
applies the tokenizer's chat template) gives them; any other task's `prompt_text(row)` is
tokenized as it is, without special tokens. The controller's prompts, the held-out evaluation
and the supervised warm-up all go through `prompt_ids`, so they agree token for token.
"""

from __future__ import annotations

from typing import Mapping, Sequence

# keys of a model config that hold its context length, the first one present wins
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def prompt_ids(task, tokenizer, row: dict) -> tuple[list[int], str]:
    """(token ids, text) of `row`'s prompt for `task`."""
    build = getattr(task, "build_prompt", None)  # getattr: task wrappers (ShapedTask) delegate attributes
    if build is not None:
        return build(tokenizer, row)
    return text_prompt(tokenizer, task.prompt_text(row))


def text_prompt(tokenizer, text: str) -> tuple[list[int], str]:
    """`text` tokenized as it is (no bos/eos added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), text


def chat_prompt(tokenizer, messages: Sequence[Mapping[str, str]]) -> tuple[list[int], str]:
    """The messages through the tokenizer's chat template, ending with the assistant turn's opening."""
    messages = [dict(m) for m in messages]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(ids["input_ids"]), text


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def context_length(model_config: Mapping) -> int | None:
    """The longest sequence (prompt + response) a model takes, from its config's dict; None: not stated."""
    for key in CONTEXT_KEYS:
        value = model_config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None
