"""envs/tool_env.py: tool-using episodes with the real calculator (and tools defined here, loaded
by import path): a direct answer, a call then an answer, a malformed call, an unknown tool, a
raising tool, a hanging tool, the turn limit, per-turn call penalties and the env's bounds."""

from __future__ import annotations

import time

import pytest

from envs.base import Env
from envs.reward_functions import math_reward
from envs.tool_env import ToolEnv
from envs.tools import ToolCounts, calculator, load_tools, parse_tool_calls

ROW = {"prompt": "A warehouse has 48213 boxes with 739 items each. How many items?", "answer": "35629407"}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "48213*739"}}</tool_call>'
ANSWER = "The answer is \\boxed{35629407}."


def explode(expression: str) -> str:
    """A tool that always raises.

    Args:
        expression: ignored
    """
    raise RuntimeError(f"cannot handle {expression}")


def stall(seconds: float) -> str:
    """A tool that sleeps past any sensible limit.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "woke up"


class BoxedAnswerTask:
    """Stands in for the dataset task (envs/dataset_task.py) with `reward.function: math`: the
    prompt is the row's text, the reward the math reward of the final answer's `\\boxed{}`."""

    name = "boxed"

    def rows(self, split: str) -> list[dict]:
        return [ROW]

    def prompt_text(self, row: dict) -> str:
        return row["prompt"]

    def reward(self, row: dict, response_text: str) -> float:
        return math_reward(self.prompt_text(row), response_text, row)

    def is_correct(self, row: dict, response_text: str) -> bool:
        return self.reward(row, response_text) == 1.0


def make_env(names=("calculator",), **options) -> ToolEnv:
    return ToolEnv.from_names(BoxedAnswerTask(), list(names), **options)


def test_a_direct_answer_ends_the_episode_with_the_task_reward():
    env: Env = make_env()  # the protocol the rollout drives (not runtime-checkable: checked by type)
    assert env.reset(ROW) == ROW["prompt"]
    observation, reward, done, info = env.step(ANSWER)
    assert (observation, reward, done) == (None, 1.0, True)
    assert info["correct"] and not info["truncated"] and info["turn"] == 1
    assert info["messages"] == [] and info["tool_counts"].metrics()["tools/calls"] == 0
    env.reset(ROW)
    assert env.step("The answer is \\boxed{35000000}.")[1:3] == (0.0, True)


def test_a_call_then_an_answer():
    env = make_env()
    env.reset(ROW)
    observation, reward, done, info = env.step("Let me compute it.\n" + CALL)
    assert (observation, reward, done) == ("35629407", 0.0, False)
    assert info["messages"] == [{"role": "tool", "name": "calculator", "content": "35629407"}]
    assert [r.status for r in info["tool_results"]] == ["ok"]
    assert info["tool_counts"].metrics()["tools/ok"] == 1 and not info["correct"]
    observation, reward, done, info = env.step(ANSWER)
    assert (observation, reward, done, info["correct"], info["turn"]) == (None, 1.0, True, True, 2)


def test_several_calls_of_a_turn_are_answered_in_order():
    env = make_env()
    env.reset(ROW)
    two = CALL + "\n" + CALL.replace("48213*739", "2**10")
    observation, _, done, info = env.step(two)
    assert observation == "35629407\n1024" and not done
    assert [m["content"] for m in info["messages"]] == ["35629407", "1024"]


def test_a_malformed_call_is_an_observation_and_the_episode_goes_on():
    env = make_env(call_penalty={"malformed": 0.1})
    env.reset(ROW)
    observation, reward, done, info = env.step('<tool_call>{"name": "calculator", "arguments": </tool_call>')
    assert observation.startswith("Error: malformed tool call: invalid JSON") and not done
    assert reward == pytest.approx(-0.1)  # the per-turn penalty
    assert info["tool_counts"].metrics()["tools/malformed"] == 1
    observation, reward, done, _ = env.step(CALL)
    assert observation == "35629407" and reward == 0.0 and not done
    assert env.step(ANSWER)[1:3] == (1.0, True)


def test_arguments_that_do_not_fit_are_malformed():
    env = make_env()
    env.reset(ROW)
    observation, _, _, info = env.step('<tool_call>{"name": "calculator", "arguments": {"expr": "1+1"}}</tool_call>')
    assert observation.startswith("Error: invalid arguments for calculator")
    assert [r.status for r in info["tool_results"]] == ["malformed"]


def test_an_unknown_tool_names_the_tools():
    env = make_env(call_penalty={"unknown_tool": 0.25})
    env.reset(ROW)
    observation, reward, done, info = env.step('<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert observation == "Error: unknown tool 'search'; the tools are: calculator"
    assert (reward, done) == (-0.25, False)
    assert info["tool_counts"].metrics()["tools/unknown"] == 1


def test_a_raising_tool_is_an_error_observation():
    env = make_env(["calculator", "tests.envs.test_tool_env:explode"])
    env.reset(ROW)
    call = '<tool_call>{"name": "explode", "arguments": {"expression": "6*7"}}</tool_call>'
    observation, reward, done, info = env.step(call + CALL)
    assert observation == "Error: explode raised RuntimeError: cannot handle 6*7\n35629407"
    assert (reward, done) == (0.0, False)
    counts = info["tool_counts"].metrics()
    assert (counts["tools/error"], counts["tools/ok"], counts["tools/calls"]) == (1, 1, 2)


def test_a_hanging_tool_times_out():
    env = make_env(["tests.envs.test_tool_env:stall"], timeout_s=0.5)
    env.reset(ROW)
    start = time.monotonic()
    observation, _, done, info = env.step('<tool_call>{"name": "stall", "arguments": {"seconds": 30}}</tool_call>')
    assert time.monotonic() - start < 10
    assert observation == "Error: stall timed out: no answer within 0.5 s: the call was stopped" and not done
    assert info["tool_counts"].metrics()["tools/timeout"] == 1


def test_the_turn_limit_ends_a_calling_episode_with_reward_zero_without_running_its_calls():
    env = make_env(max_turns=2, call_penalty={"ok": 0.5})
    env.reset(ROW)
    assert env.step(CALL)[1:3] == (-0.5, False)
    observation, reward, done, info = env.step(CALL.replace("48213*739", "35629407") + "\\boxed{35629407}")
    assert (observation, reward, done) == (None, 0.0, True)
    assert info["truncated"] and not info["correct"] and info["turn"] == 2 and info["messages"] == []
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(ANSWER)


def test_an_answer_on_the_last_turn_is_graded():
    env = make_env(max_turns=2)
    env.reset(ROW)
    env.step(CALL)
    _, reward, done, info = env.step(ANSWER)
    assert (reward, done, info["correct"], info["truncated"]) == (1.0, True, True, False)


def test_one_turn_makes_it_a_single_turn_env():
    env = make_env(max_turns=1)
    env.reset(ROW)
    assert env.step(CALL)[1:3] == (0.0, True)
    env.reset(ROW)
    assert env.step(ANSWER)[1:3] == (1.0, True)


def test_turn_counts_merge_into_a_rollouts_metrics():
    env = make_env(["calculator", "tests.envs.test_tool_env:explode"])
    total = ToolCounts()
    for turns in ([CALL, ANSWER], ['<tool_call>{"name": "x"}</tool_call>', "<tool_call>oops</tool_call>", ANSWER]):
        env.reset(ROW)
        for text in turns:
            total = total.merge(env.step(text)[3]["tool_counts"])
    metrics = total.metrics()
    assert (metrics["tools/calls"], metrics["tools/ok"], metrics["tools/unknown"], metrics["tools/malformed"]) == (
        3,
        1,
        1,
        1,
    )


def test_schemas_are_the_tools_and_the_calls_they_describe_parse():
    env = make_env()
    (schema,) = env.tool_schemas()
    assert schema == load_tools(["calculator"])[0].schema
    assert schema["function"]["name"] == "calculator"
    (call,) = parse_tool_calls(CALL)
    assert calculator(**call.arguments) == ROW["answer"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_turns": 0}, "max_turns is 0: an episode needs at least 1 turn"),
        ({"timeout_s": 0}, "timeout_s is 0: a call needs a positive time limit"),
        ({"call_penalty": {"malformd": 0.1}}, "call_penalty: 'malformd' is not a call status"),
    ],
)
def test_bad_bounds_are_one_line_errors(options, message):
    with pytest.raises(ValueError, match=message):
        make_env(**options)


def test_step_needs_a_reset():
    with pytest.raises(RuntimeError, match="before reset"):
        make_env().step(ANSWER)
