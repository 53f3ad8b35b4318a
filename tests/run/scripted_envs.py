"""Envs for the multi-turn integration tests, loaded by file path (`env.name:
tests/run/scripted_envs.py:ScriptedCalculatorEnv`) as a user's env is: the real ToolEnv with the
calculator, whose turns follow the row's demonstration whatever the (untrained) policy writes, so
every episode is a tool call, its result and a graded answer."""

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
