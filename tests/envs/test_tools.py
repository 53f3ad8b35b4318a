"""envs/tools.py: schemas from typed functions, the calculator, parsing Hermes-format calls,
calling tools (unknown, raising, hanging, wrong arguments) without ever raising, loading tools by
name, the counts a rollout reports, and the python tool on the real sandbox."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal, Optional

import pytest
from conftest import sandbox_skip_reason

from envs.tools import (
    MAX_DIGITS,
    STATUSES,
    Tool,
    ToolCall,
    ToolCounts,
    ToolTimeout,
    calculator,
    call_tool,
    load_tools,
    parse_tool_calls,
    python_tool,
    tool_from_function,
    tool_schemas,
)
from sandbox import Limits, make_backend

# ---- functions the tests turn into tools -----------------------------------------------------


def search_notes(
    query: str,
    limit: int = 5,
    exact: bool = False,
    weights: Optional[list[float]] = None,
    filters: dict | None = None,
    scale: float = 1.0,
) -> str:
    """Search the notes for a query.

    Args:
        query: what to look for
        limit: the most results to return
        exact: match the whole query only
        weights: a weight per field
        filters: field -> value the results must have
        scale: how much to scale the scores
    """
    return f"{query}|{limit}|{exact}|{weights}|{filters}|{scale}"


def pick(mode: Optional[Literal["fast", "slow"]] = None, nullable: int = 0) -> str:
    """Pick a mode.

    Args:
        mode: how to go
        nullable: an argument that happens to be named like the schema's mark
    """
    return f"{mode}|{nullable}"


def quits(code: int) -> str:
    """Call sys.exit.

    Args:
        code: the exit status
    """
    sys.exit(code)


def fail(message: str) -> str:
    """Raise a ValueError.

    Args:
        message: the error's message
    """
    raise ValueError(message)


def hang(pid_file: str) -> str:
    """Start a child process that sleeps, write both process ids, and hang.

    Args:
        pid_file: where the process ids go
    """
    child = subprocess.Popen(["sleep", "60"])
    Path(pid_file).write_text(f"{os.getpid()} {child.pid}")
    time.sleep(60)
    return "never"


def exit_abruptly(code: int) -> str:
    """End the process at once.

    Args:
        code: the exit code
    """
    os._exit(code)


def structured(n: int) -> dict:
    """A structured result.

    Args:
        n: how many items
    """
    return {"items": list(range(n)), "big": 2**80}


def too_slow_inside(seconds: float) -> str:
    """A tool that knows it ran out of time.

    Args:
        seconds: the budget it ran past
    """
    raise ToolTimeout(f"the job ran past {seconds} s")


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie, killed but not yet reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.fixture(scope="module")
def tools():
    return [
        tool_from_function(f)
        for f in (search_notes, pick, fail, quits, hang, exit_abruptly, structured, too_slow_inside)
    ]


# ---- schemas ---------------------------------------------------------------------------------


def test_schema_from_signature_and_docstring():
    tool = tool_from_function(search_notes)
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "search_notes",
            "description": "Search the notes for a query.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look for"},
                    "limit": {"type": "integer", "description": "the most results to return"},
                    "exact": {"type": "boolean", "description": "match the whole query only"},
                    "weights": {
                        "type": "array",
                        "items": {"type": "number"},
                        "nullable": True,
                        "description": "a weight per field",
                    },
                    "filters": {
                        "type": "object",
                        "nullable": True,
                        "description": "field -> value the results must have",
                    },
                    "scale": {"type": "number", "description": "how much to scale the scores"},
                },
                "required": ["query"],
            },
        },
    }
    assert tool_schemas([tool]) == [tool.schema]


def test_a_function_the_schema_cannot_describe_is_a_one_line_error():
    def no_hint(x):
        """Do a thing.

        Args:
            x: the thing
        """

    def undocumented_argument(x: int, y: int):
        """Do a thing.

        Args:
            x: the thing
        """

    with pytest.raises(ValueError, match="tool 'no_hint': .*missing a type hint") as e:
        tool_from_function(no_hint)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="tool 'undocumented_argument': .*no description for the argument 'y'"):
        tool_from_function(undocumented_argument)
    with pytest.raises(ValueError, match="not a JSON schema"):
        Tool("bad", "a bad schema", {"type": "object", "properties": {"x": {"type": "integr"}}}, print)


# ---- the calculator ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, value",
    [
        ("2**100", str(2**100)),
        (
            "-(3**200) // 7 + 123456789123456789 * 987654321987654321",
            str(-(3**200) // 7 + 123456789123456789 * 987654321987654321),
        ),
        ("(2**64 - 1) % 1000", "615"),
        ("1/4 + 0.5", "0.75"),
        ("2**-2", "0.25"),
        ("-2**2", "-4"),
        ("+7 // 2", "3"),
        ("10**3999", "1" + "0" * 3999),
        ("+".join(["1"] * 60), "60"),
    ],
)
def test_calculator_computes(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("x + 1", "names are not arithmetic"),
        ("__import__('os').system('true')", "function calls are not arithmetic"),
        ("abs(-1)", "function calls are not arithmetic"),
        ("(1).real", "attributes are not arithmetic"),
        ("'a' * 3", "constants other than numbers"),
        ("True + 1", "constants other than numbers"),
        ("[1, 2]", "List"),
        ("9**9**9", f"more than {MAX_DIGITS} digits"),
        ("2**(10**18)", f"more than {MAX_DIGITS} digits"),
        ("10**3000 * 10**3000", f"more than {MAX_DIGITS} digits"),
        ("1e308 * 10", "too large"),
        ("10**3000 / 3", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 / 0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 3000, "longer than"),
        ("1+" * 900 + "1", "nested more than"),
        ("-" * 500 + "1", "nested more than"),
    ],
)
def test_calculator_refuses(expression, reason):
    start = time.monotonic()
    with pytest.raises(ValueError, match=reason):
        calculator(expression)
    assert time.monotonic() - start < 1.0  # refused, not computed


def test_calculator_as_a_tool_call():
    tools = load_tools(["calculator"])
    assert call_tool(ToolCall("calculator", {"expression": "3**50"}), tools).observation == str(3**50)
    huge = call_tool(ToolCall("calculator", {"expression": "9**9**9"}), tools, timeout_s=1)
    assert huge.status == "error" and huge.observation.startswith("Error: calculator raised ValueError: the result")


# ---- parsing calls ---------------------------------------------------------------------------


def test_parses_several_calls_of_a_turn():
    text = (
        "Let me compute both.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2**10"}}\n</tool_call>\n'
        '<tool_call>{"name": "search_notes", "arguments": {"query": "x", "limit": 2}}</tool_call>\n'
        '<tool_call>{"name": "structured"}</tool_call> done'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.ok) for c in calls] == [
        ("calculator", {"expression": "2**10"}, True),
        ("search_notes", {"query": "x", "limit": 2}, True),
        ("structured", {}, True),
    ]
    assert parse_tool_calls("no calls here") == []


@pytest.mark.parametrize(
    "text, error",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": }}</tool_call>', "invalid JSON"),
        ('<tool_call>{"arguments": {"x": 1}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": 3}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "calculator", "arguments": "2+2"}</tool_call>', '"arguments" must be a JSON object'),
        ('<tool_call>["calculator"]</tool_call>', "expected a JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": {}}', "unclosed <tool_call>"),
    ],
)
def test_malformed_calls_carry_their_error(text, error):
    (call,) = parse_tool_calls(text)
    assert not call.ok and error in call.error
    result = call_tool(call, load_tools(["calculator"]))
    assert result.status == "malformed" and result.observation.startswith("Error: malformed tool call: ")


def test_an_unclosed_call_before_another_one_does_not_swallow_it():
    calls = parse_tool_calls(
        '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    assert [c.ok for c in calls] == [False, True] and calls[1].name == "b"
    assert "unclosed" in calls[0].error


# ---- calling tools ---------------------------------------------------------------------------


def test_a_call_runs_and_returns_its_output(tools):
    result = call_tool(ToolCall("search_notes", {"query": "q", "weights": None, "filters": {"a": 1}}), tools)
    assert (result.status, result.observation) == ("ok", "q|5|False|None|{'a': 1}|1.0")
    assert result.message() == {"role": "tool", "name": "search_notes", "content": result.observation}
    assert call_tool(ToolCall("structured", {"n": 2}), tools).observation == (
        '{"items": [0, 1], "big": 1208925819614629174706176}'
    )


def test_an_unknown_tool_is_an_observation(tools):
    result = call_tool(ToolCall("browse", {"url": "x"}), tools)
    assert result.status == "unknown_tool"
    assert result.observation.startswith("Error: unknown tool 'browse'; the tools are: ") and "search_notes" in (
        result.observation
    )


def test_a_tool_that_raises_is_an_observation(tools):
    result = call_tool(ToolCall("fail", {"message": "no such note"}), tools)
    assert (result.status, result.observation) == ("error", "Error: fail raised ValueError: no such note")


def test_a_tool_whose_process_dies_is_an_observation(tools):
    result = call_tool(ToolCall("exit_abruptly", {"code": 3}), tools)
    assert result.status == "error" and "exit code 3" in result.observation


def test_a_tool_that_says_it_timed_out(tools):
    result = call_tool(ToolCall("too_slow_inside", {"seconds": 2}), tools)
    assert (result.status, result.observation) == ("timeout", "Error: too_slow_inside timed out: the job ran past 2 s")


def test_a_hanging_tool_is_stopped_with_what_it_started(tools, tmp_path):
    pid_file = tmp_path / "pids"
    start = time.monotonic()
    result = call_tool(ToolCall("hang", {"pid_file": str(pid_file)}), tools, timeout_s=1)
    assert time.monotonic() - start < 5
    assert result.status == "timeout" and result.observation == (
        "Error: hang timed out: no answer within 1 s: the call was stopped"
    )
    tool_pid, child_pid = map(int, pid_file.read_text().split())
    assert tool_pid != os.getpid()
    deadline = time.monotonic() + 5
    while (alive(tool_pid) or alive(child_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(tool_pid) and not alive(child_pid)


@pytest.mark.parametrize(
    "arguments, problem",
    [
        ({}, "'query' is a required property"),
        ({"query": 3}, "query: 3 is not of type 'string'"),
        ({"query": "q", "limit": "5"}, "limit: '5' is not of type 'integer'"),
        ({"query": "q", "limit": True}, "limit: True is not of type 'integer'"),
        ({"query": "q", "weights": [1, "x"]}, "weights.1: 'x' is not of type"),
        ({"query": "q", "page": 2}, "'page' was unexpected"),
    ],
)
def test_arguments_that_do_not_fit_the_schema_are_an_observation(tools, arguments, problem):
    result = call_tool(ToolCall("search_notes", arguments), tools)
    assert result.status == "malformed"
    assert result.observation.startswith("Error: invalid arguments for search_notes: ") and problem in (
        result.observation
    )


def test_optional_arguments_take_null_and_their_choices_only(tools):
    assert call_tool(ToolCall("pick", {"mode": None, "nullable": 3}), tools).observation == "None|3"
    assert call_tool(ToolCall("pick", {"mode": "slow"}), tools).observation == "slow|0"
    wrong = call_tool(ToolCall("pick", {"mode": "medium"}), tools)
    assert wrong.status == "malformed" and "mode: 'medium' is not one of ['fast', 'slow', None]" in wrong.observation
    assert call_tool(ToolCall("pick", {"nullable": None}), tools).status == "malformed"


def test_a_tool_that_exits_is_an_observation(tools):
    result = call_tool(ToolCall("quits", {"code": 2}), tools)
    assert result.status == "error" and "exit code 2" in result.observation


def test_observations_are_cut_to_the_bound(tools):
    result = call_tool(ToolCall("search_notes", {"query": "y" * 5000}), tools, max_chars=300)
    assert result.status == "ok" and len(result.observation) <= 300 and "characters cut" in result.observation
    assert result.observation.startswith("yyy") and result.observation.endswith("|1.0")


def test_counts_are_metrics(tools):
    calls = parse_tool_calls(
        '<tool_call>{"name": "fail", "arguments": {"message": "m"}}</tool_call>'
        '<tool_call>{"name": "browse"}</tool_call><tool_call>{bad</tool_call>'
        '<tool_call>{"name": "structured", "arguments": {"n": 1}}</tool_call>'
    )
    counts = ToolCounts().add(call_tool(c, tools) for c in calls)
    counts = counts.merge(ToolCounts().add(call_tool(ToolCall("too_slow_inside", {"seconds": 1}), tools)))
    assert counts.metrics() == {
        "tools/calls": 5.0,
        "tools/ok": 1.0,
        "tools/malformed": 1.0,
        "tools/unknown": 1.0,
        "tools/error": 1.0,
        "tools/timeout": 1.0,
    }
    assert set(STATUSES) == {"ok", "malformed", "unknown_tool", "error", "timeout"}


# ---- loading tools by name -------------------------------------------------------------------


def test_load_tools_by_name_and_import_path():
    (builtin,) = load_tools(["calculator"])
    (imported,) = load_tools(["envs.tools:calculator"])
    assert builtin.schema == imported.schema and builtin.schema["function"]["name"] == "calculator"
    assert not builtin.fork and imported.fork  # an imported function runs in a forked process
    assert call_tool(ToolCall("calculator", {"expression": "6*7"}), [imported]).observation == "42"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("calc", "tool 'calc' is not a built-in (calculator, python) nor package.module:function"),
        ("envs.tools:", "tool 'envs.tools:' is not a built-in"),
        ("no_such_package.mod:f", "tool 'no_such_package.mod:f': importing no_such_package.mod failed: "),
        ("envs.tools:no_such_function", "tool 'envs.tools:no_such_function': envs.tools has no function"),
        ("json:dumps", "tool 'json:dumps': "),
        ("python", "tool 'python' runs code in the sandbox"),
    ],
)
def test_a_bad_spec_is_a_one_line_error_naming_it(spec, message):
    with pytest.raises(ValueError) as e:
        load_tools([spec])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_two_tools_of_one_name_are_an_error():
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        load_tools(["calculator", "envs.tools:calculator"])


# ---- the python tool on the real sandbox -----------------------------------------------------


@pytest.fixture(scope="module")
def bwrap():
    why = sandbox_skip_reason("bwrap")
    if why:
        pytest.skip(why)
    backend = make_backend("bwrap")
    yield lambda requests: [backend.run(r) for r in requests]
    backend.close()


@pytest.mark.sandbox
def test_python_tool_runs_in_the_sandbox(bwrap):
    (tool,) = load_tools(["python"], run=bwrap, limits=Limits(wall_time_s=5, cpu_time_s=5))
    assert tool.name == "python" and not tool.fork and tool.parameters["required"] == ["code"]
    ok = call_tool(ToolCall("python", {"code": "import os\nprint(2**100)\nprint(os.getuid())"}), [tool])
    assert ok.status == "ok" and ok.observation.splitlines()[0] == str(2**100)
    failed = call_tool(ToolCall("python", {"code": "print('before')\n1/0"}), [tool])
    assert failed.status == "ok"
    assert failed.observation.startswith("before\nstderr:\nTraceback")
    assert "ZeroDivisionError" in failed.observation and failed.observation.endswith("(exit code 1)")


@pytest.mark.sandbox
def test_python_tool_output_is_cut_and_a_loop_times_out(bwrap):
    tool = python_tool(bwrap, Limits(wall_time_s=1, cpu_time_s=1), max_output_chars=400)
    long = call_tool(ToolCall("python", {"code": "print('x' * 100000)"}), [tool])
    assert long.status == "ok" and len(long.observation) <= 400 and "characters cut" in long.observation
    start = time.monotonic()
    loop = call_tool(ToolCall("python", {"code": "while True:\n    pass"}), [tool])
    assert loop.status == "timeout" and loop.observation.startswith("Error: python timed out: ")
    assert time.monotonic() - start < 10
