"""Task and Env protocols (docs/architecture.md, Env).

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


@dataclass
class TrainSplitView:
    """A task as a supervised warm-up sees it: only the train split's rows change
    (`train_rows`); the other splits, prompts, grading, reward and corpus are the task's own."""

    task: Task

    @property
    def name(self) -> str:
        return self.task.name

    def rows(self, split: str) -> list[dict]:
        rows = self.task.rows(split)
        return self.train_rows(rows) if split == "train" else rows

    def train_rows(self, rows: list[dict]) -> list[dict]:
        return rows

    def prompt_text(self, row: dict) -> str:
        return self.task.prompt_text(row)

    def is_correct(self, row: dict, response_text: str) -> bool:
        return self.task.is_correct(row, response_text)

    def reward(self, row: dict, response_text: str) -> float:
        return self.task.reward(row, response_text)

    def corpus(self) -> list[str]:
        return self.task.corpus()


class Env(Protocol):
    """One episode at a time. `reset(row)`: the first observation, a text (one user message) or a
    list of chat messages. `step(text)`: the policy's turn -> (the next observation: a text, or
    None once done; the turn's reward; done; info). What the multi-turn rollout
    (algorithms/episodes.py) reads of `info`: `messages` (the observation as chat messages, e.g.
    tool results in the template's tool role; else the text is one user message), `tool_counts`
    (envs/tools.py ToolCounts), `correct` (a bool, once done) and `answer` (once done: a final
    answer the run's reward grades, added to the last turn's reward). Optional, `end_early()`:
    the episode stopped before done (env.max_turns, or an observation past its token budget) ->
    (a final reward added to the last turn's, info with `correct` and `answer` as at done); without
    it such an episode keeps the rewards it had."""

    def reset(self, row: dict) -> str | list[dict]: ...
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
