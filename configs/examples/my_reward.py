"""A reward function of your own, named in a config as `reward.function: configs/examples/my_reward.py:reward`.

It is called once per response with the prompt's text (the task's `prompt_text`), the response's text and the
dataset row (every column: here prompt, answer, steps, kind) and returns a float, or a dict with
a `reward` float and extra metrics, logged as `reward/<key>` means.
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number in the text (thousands separators ignored), or None."""
    numbers = NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def reward(prompt: str, response: str, row: dict) -> dict:
    """1 for the right number, plus 0.1 when the response is the number alone; `correct` as a metric."""
    correct = last_number(response) == float(row["answer"])
    short = len(response.split()) == 1
    return {"reward": float(correct) + (0.1 if correct and short else 0.0), "correct": float(correct)}
