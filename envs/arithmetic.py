"""Exact-answer arithmetic: "37+58=" -> "95". A task a ~1M-parameter model learns on CPU.

Rows are generated from a seed, written to parquet and read back through the dataset
reader (the same path a user's own jsonl/parquet takes). Train and eval splits never
share a problem.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from envs.datasets import read_rows, write_rows

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def generate_problems(
    n_train: int, n_eval: int, lo: int, hi: int, ops: Sequence[str], seed: int
) -> tuple[list[dict], list[dict]]:
    """Distinct problems, shuffled with `seed`, the first n_eval held out."""
    rng = random.Random(seed)
    space = (hi - lo + 1) ** 2 * len(ops)
    want = min(n_train + n_eval, space)
    seen: set[tuple] = set()
    problems = []
    while len(problems) < want:
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(list(ops))
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        problems.append({"prompt": f"{a}{op}{b}=", "answer": str(_OPS[op](a, b))})
    return problems[n_eval:], problems[:n_eval]


def carry_dropped_answer(prompt: str) -> str | None:
    """What a demonstrator who forgets every carry writes for an addition: the digit-wise sums
    mod 10 ("37+58=" -> "85", right: 95). None for any other operation."""
    left, op, right = parse_problem(prompt)
    if op != "+" or left < 0 or right < 0:
        return None
    width = max(len(str(left)), len(str(right)))
    digits = [(int(x) + int(y)) % 10 for x, y in zip(str(left).zfill(width), str(right).zfill(width))]
    return str(int("".join(map(str, digits))))


def ones_digit_step(prompt: str) -> int:
    """The problem's operation on the operands' ones digits (each signed like its operand), the
    first step of working it out by hand: "18+17=" -> 15 (8+7: the answer's ones digit 5, carry 1),
    "37-58=" -> -1 (7-8: a borrow), "17*18=" -> 56 (7*8). The answer is this plus a multiple of 10."""
    left, op, right = parse_problem(prompt)
    return _OPS[op](int(math.fmod(left, 10)), int(math.fmod(right, 10)))


def parse_problem(prompt: str) -> tuple[int, str, int]:
    """(left operand, operator, right operand) of a prompt such as "37+58="."""
    body = prompt.rstrip("=")
    for i in range(1, len(body)):  # the operator is the first op symbol after the first character
        if body[i] in _OPS:
            return int(body[:i]), body[i], int(body[i + 1 :])
    raise ValueError(f"not an arithmetic prompt: {prompt!r}")


ANSWER_MARKER = "#"  # ends a rationale: "<rationale>#<answer>" (BRiTE, algorithms/brite.py)


def answer_text(response_text: str) -> str:
    """The model's answer: the response after its last ANSWER_MARKER (all of it when there is
    none), up to the first whitespace or special token."""
    text = response_text.split("<eos>")[0].rsplit(ANSWER_MARKER, 1)[-1].strip()
    return text.split()[0] if text else ""


@dataclass
class ArithmeticTask:
    train_path: Path
    eval_path: Path
    name: str = "arithmetic"

    @classmethod
    def create(cls, data_dir: Path, n_train: int, n_eval: int, lo: int, hi: int, ops: Sequence[str], seed: int):
        data_dir = Path(data_dir)
        train, held_out = generate_problems(n_train, n_eval, lo, hi, ops, seed)
        return cls(write_rows(train, data_dir / "train.parquet"), write_rows(held_out, data_dir / "eval.parquet"))

    def rows(self, split: str) -> list[dict]:
        return read_rows(self.train_path if split == "train" else self.eval_path, required=("prompt", "answer"))

    def prompt_text(self, row: dict) -> str:
        return row["prompt"]

    def is_correct(self, row: dict, response_text: str) -> bool:
        return answer_text(response_text) == str(row["answer"]).strip()

    def reward(self, row: dict, response_text: str) -> float:
        return 1.0 if self.is_correct(row, response_text) else 0.0

    def flawed_demonstration(self, row: dict) -> dict:
        """The row as a sloppy demonstrator writes it (`sft.demo_error`): additions with every
        carry dropped; other rows as they are."""
        flawed = carry_dropped_answer(row["prompt"])
        return row if flawed is None else {**row, "answer": flawed}

    def corpus(self) -> list[str]:
        """Text the tokenizer is trained on."""
        return [r["prompt"] + r["answer"] for r in self.rows("train")]
