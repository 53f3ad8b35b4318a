"""Envs for the multi-turn integration tests, loaded by file path (`env.name:
tests/run/scripted_envs.py:ScriptedCalculatorEnv`) as a user's env is: the real ToolEnv with the
calculator, whose turns follow the row's demonstration whatever the (untrained) policy writes, so
every episode is a tool call, its result and a graded answer."""

import os
import random
import time

from envs.tool_env import ToolEnv
from envs.tools import load_tools


class ScriptedCalculatorEnv(ToolEnv):
    """ToolEnv(task, [calculator]), a call costing 0.05, the answer left to the run's reward; each
    turn plays the row's demonstration's next assistant message in place of the policy's text."""

    def __init__(self, task):
        super().__init__(task, load_tools(["calculator"]), max_turns=3, call_penalty={"ok": 0.05}, grade_answers=False)

    def step(self, text):
        script = [m["content"] for m in self.row["demonstration"] if m["role"] == "assistant"]
        return super().step(script[self.turn])


class LoggedSlowCalculatorEnv(ScriptedCalculatorEnv):
    """ScriptedCalculatorEnv whose resets append the row's expression to the file named by
    $RLSYS_EPISODE_LOG and whose steps take 0.2 s (a slow tool): a test sees which episodes a run
    played and can kill it while a step's episodes are in flight."""

    def reset(self, row):
        with open(os.environ["RLSYS_EPISODE_LOG"], "a") as log:
            log.write(row["expression"] + "\n")
        return super().reset(row)

    def step(self, text):
        time.sleep(0.2)
        return super().step(text)


class JitteryCalculatorEnv(ScriptedCalculatorEnv):
    """ScriptedCalculatorEnv whose steps take a random 0-100 ms (unseeded: different in every run),
    around the rollout's gather window: without env.lockstep, which episodes share a generation
    call would change from run to run."""

    def step(self, text):
        time.sleep(random.uniform(0.0, 0.1))
        return super().step(text)
