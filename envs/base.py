"""Task and Env protocols (DESIGN.md Env).

A *task* is a dataset of rows plus a rule reward; an *env* is the dialog it is played
in: `reset(row) -> observation`, `step(text) -> (observation, reward, done, info)`.
A single-turn verifiable task is a one-step env (`SingleTurnEnv`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class Task(Protocol):
    name: str

    def rows(self, split: str) -> list[dict]: ...
    def prompt_text(self, row: dict) -> str: ...
    def reward(self, row: dict, response_text: str) -> float: ...
    def is_correct(self, row: dict, response_text: str) -> bool: ...


class Env(Protocol):
    def reset(self, row: dict) -> str: ...
    def step(self, text: str) -> tuple[str | None, float, bool, dict]: ...


@dataclass
class SingleTurnEnv:
    """One answer, one rule reward, done."""

    task: Task
    row: dict = field(default_factory=dict)

    def reset(self, row: dict) -> str:
        self.row = row
        return self.task.prompt_text(row)

    def step(self, text: str) -> tuple[None, float, bool, dict[str, Any]]:
        return None, self.task.reward(self.row, text), True, {"correct": self.task.is_correct(self.row, text)}
