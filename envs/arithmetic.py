"""Exact-answer arithmetic: "37+58=" -> "95". A task a ~1M-parameter model learns on CPU.

Rows are generated from a seed, written to parquet and read back through the dataset
reader (the same path a user's own jsonl/parquet takes). Train and eval splits never
share a problem.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from envs.datasets import read_rows, write_rows

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def generate_problems(n_train: int, n_eval: int, lo: int, hi: int, ops: Sequence[str], seed: int) -> tuple[list[dict], list[dict]]:
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

    def corpus(self) -> list[str]:
        """Text the tokenizer is trained on."""
        return [r["prompt"] + r["answer"] for r in self.rows("train")]
