"""Tool-using episodes over a task's rows: the Env protocol (envs/base.py) with tools.

`ToolEnv(task, tools)` plays one episode at a time:

    reset(row)   the row's prompt: its chat messages where the task has them (`task.messages`:
                 the dataset task), else its text (`task.prompt_text`); the tools are offered by
                 the rollout through the chat template's `tools=` (`env.tool_schemas()`)
    step(text)   the policy's turn, read with `parse_tool_calls` (envs/tools.py):
                   tool calls   each is run with `call_tool` (never raises: a malformed call, an
                                unknown tool, a tool that raises or runs past `timeout_s` is an
                                `Error: ...` observation); the observation is the results' text,
                                one per line in call order, and `info["messages"]` the same
                                results as the template's tool-role messages; reward: the turn's
                                call penalty (0 by default), not done
                   no tool call the final answer: reward `task.reward(row, text)` (e.g. the math
                                reward of its `\\boxed{}`), `info["correct"]` is
                                `task.is_correct(row, text)`, done; with `grade_answers` off
                                it is not graded here: reward 0, `info["answer"]` its text
                                (the multi-turn rollout grades it with the run's reward,
                                algorithms/episodes.py), `info["correct"]` None

Bounds: at most `max_turns` policy turns. A turn that is the `max_turns`-th and still calls tools
ends the episode with reward 0 and `info["truncated"]`: its calls are not run (no turn follows to
read them) and its text is not graded (a call is not an answer).

Per-turn rewards: `call_penalty` maps a call status (envs/tools.py STATUSES) to what each such
call costs, e.g. `{"malformed": 0.1}`; a turn's reward is minus the sum over its calls, so the
rewards of an episode's turns are what an algorithm with token-level rewards puts on each turn's
last token (an algorithm with one reward per episode sums them).

`info` of every step: `turn` (1-based), `messages` (the tool messages to append), `tool_results`
(the `ToolResult`s), `tool_counts` (a `ToolCounts` of the turn's statuses: ok, malformed,
unknown_tool, error, timeout; a rollout merges them into its `tools/*` metrics), `correct`
(False until the final answer), `truncated`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from envs.base import Task
from envs.tools import (
    MAX_OBSERVATION_CHARS,
    STATUSES,
    Runner,
    Tool,
    ToolCounts,
    ToolResult,
    call_tool,
    load_tools,
    parse_tool_calls,
    tools_by_name,
)
from sandbox.types import Limits


def observation_text(results: Sequence[ToolResult]) -> str:
    """The text the policy reads after a turn of calls: each result's observation, in call order,
    one after another on new lines (the chat template's tool role carries them one by one)."""
    return "\n".join(r.observation for r in results)


def turn_penalty(results: Sequence[ToolResult], call_penalty: Mapping[str, float]) -> float:
    """Minus the summed cost of a turn's calls, each costing `call_penalty[its status]` (0 if absent)."""
    return -sum(call_penalty.get(r.status, 0.0) for r in results)


def checked_penalties(call_penalty: Mapping[str, float]) -> dict[str, float]:
    """`call_penalty` as a dict of floats; ValueError (one line) naming a key that is not a status."""
    unknown = sorted(set(call_penalty) - set(STATUSES))
    if unknown:
        raise ValueError(f"call_penalty: {', '.join(map(repr, unknown))} is not a call status ({', '.join(STATUSES)})")
    return {status: float(cost) for status, cost in call_penalty.items()}


@dataclass
class ToolEnv:
    """One tool-using episode at a time over `task`'s rows (see the module's docstring): `tools`
    the policy may call, at most `max_turns` policy turns, each call given `timeout_s` and its
    observation cut to `max_observation_chars`; `call_penalty`: status -> cost of each such call;
    `grade_answers` off: the final answer is left to the rollout to grade (`info["answer"]`)."""

    task: Task
    tools: Sequence[Tool]
    max_turns: int = 4
    timeout_s: float = 10.0
    max_observation_chars: int = MAX_OBSERVATION_CHARS
    call_penalty: Mapping[str, float] = field(default_factory=dict)
    grade_answers: bool = True
    row: dict | None = field(default=None, init=False)
    turn: int = field(default=0, init=False)
    done: bool = field(default=False, init=False)

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns is {self.max_turns}: an episode needs at least 1 turn")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s is {self.timeout_s}: a call needs a positive time limit")
        self.call_penalty = checked_penalties(self.call_penalty)
        self._by_name = tools_by_name(self.tools)  # two tools of one name: an error now, not per call

    @classmethod
    def from_names(
        cls,
        task: Task,
        names: Sequence[str],
        run: Runner | None = None,
        limits: Limits | None = None,
        **options: Any,
    ) -> "ToolEnv":
        """The env with the tools of `names` (built-ins or `package.module:function`, as
        `load_tools` reads them; `run`/`limits`: the sandbox of the python tool); `options`: the
        other fields (max_turns, timeout_s, max_observation_chars, call_penalty)."""
        return cls(task, load_tools(names, run, limits), **options)

    def tool_schemas(self) -> list[dict]:
        """The function schemas a chat template's `tools=` takes, in the tools' order."""
        return [t.schema for t in self.tools]

    def reset(self, row: dict) -> str | list[dict]:
        """Start an episode on `row`; its first observation is the row's prompt: the task's chat
        messages of it where the task has them (the dataset task), else its text."""
        self.row, self.turn, self.done = row, 0, False
        messages = getattr(self.task, "messages", None)  # getattr: task wrappers (ShapedTask) delegate attributes
        return messages(row) if messages is not None else self.task.prompt_text(row)

    def step(self, text: str) -> tuple[str | None, float, bool, dict[str, Any]]:
        """The policy's turn `text` -> (the tool results' text, or None once done; the turn's
        reward; done; info), as the module's docstring says."""
        if self.row is None:
            raise RuntimeError("step() before reset(row)")
        if self.done:
            raise RuntimeError("step() after the episode ended: reset(row) starts the next one")
        self.turn += 1
        calls = parse_tool_calls(text)
        if not calls:
            return self._finish(text)
        if self.turn >= self.max_turns:
            self.done = True
            return None, 0.0, True, self._info([], correct=False, truncated=True)
        results = [call_tool(c, self._by_name, self.timeout_s, self.max_observation_chars) for c in calls]
        info = self._info(results, correct=False, truncated=False)
        return observation_text(results), turn_penalty(results, self.call_penalty), False, info

    def _finish(self, answer: str) -> tuple[None, float, bool, dict[str, Any]]:
        """The final answer: the task's reward and whether it is correct; the episode is done."""
        self.done = True
        if not self.grade_answers:
            return None, 0.0, True, {**self._info([], correct=None), "answer": answer}
        reward = float(self.task.reward(self.row, answer))
        return None, reward, True, self._info([], correct=bool(self.task.is_correct(self.row, answer)))

    def _info(self, results: list[ToolResult], correct: bool | None, truncated: bool = False) -> dict[str, Any]:
        return {
            "turn": self.turn,
            "messages": [r.message() for r in results],
            "tool_results": results,
            "tool_counts": ToolCounts().add(results),
            "correct": correct,
            "truncated": truncated,
        }
