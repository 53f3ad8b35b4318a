"""Tools a policy may call during a multi-turn episode, and the calls it writes.

A `Tool` is a name, a description, a JSON schema of its parameters and the callable behind it;
`tool.schema` is the OpenAI/HF function schema a chat template's `tools=` argument takes.
`tool_from_function(fn)` builds one from a typed function with a Google-style docstring
(transformers' `get_json_schema`: the text before `Args:` is the description, each argument's
line there its description; an argument without a default is required).

Built-ins (`load_tools(["calculator", "python", "package.module:function"])`):

    calculator  arithmetic on ints of any size and floats, evaluated by walking the `ast`
                (+ - * / // % **, unary +/-, parentheses; no names, calls or attributes); a
                result past MAX_DIGITS digits is refused before it is computed (9**9**9)
    python      a program run in the repo's sandbox (`python_tool(run, limits)`: the run's
                SandboxPool, `ctx.execute`, or a backend's runs, with the sandbox's limits);
                its stdout and stderr, each cut to a bound (a program that fails is output
                the policy reads, status ok; one past the wall time is status timeout)

Calls are written in the Hermes/Qwen format, several per turn allowed:

    <tool_call>{"name": "calculator", "arguments": {"expression": "2**100"}}</tool_call>

`parse_tool_calls(text)` finds them (a call that cannot be read carries its `error`);
`call_tool(call, tools, timeout_s)` runs one and never raises: the result's `observation` is the
text the policy reads next and its `status` one of STATUSES:

    ok            the tool returned; the observation is its output
    malformed     the call could not be read, or its arguments do not fit the tool's schema
    unknown_tool  no tool has that name
    error         the tool raised, or its process died
    timeout       the tool ran past `timeout_s` (its process group is killed), or said it timed out

A tool runs in a forked child process of its own process group, killed at the timeout, so a
hanging function is really stopped; a tool with `fork=False` runs in the caller's process and
bounds its own time (the calculator's work is bounded; the python tool's program runs under the
sandbox's limits). `ToolCounts` adds up a rollout's statuses as `tools/*` metrics.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import multiprocessing
import operator
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import jsonschema
from transformers.utils import get_json_schema

from sandbox.types import ExecRequest, ExecResult, Limits

STATUSES = ("ok", "malformed", "unknown_tool", "error", "timeout")
METRIC_NAMES = {
    "ok": "tools/ok",
    "malformed": "tools/malformed",
    "unknown_tool": "tools/unknown",
    "error": "tools/error",
    "timeout": "tools/timeout",
}
MAX_OBSERVATION_CHARS = 2000  # the longest observation a call returns, by default
MAX_DIGITS = 4000  # the calculator's largest result (below Python's 4300-digit str() limit)
MAX_EXPRESSION_CHARS = 2000  # the calculator's longest expression
MAX_DEPTH = 100  # the calculator's deepest expression tree (a chain of n operations is n deep)
LOG10_2 = math.log10(2)

Runner = Callable[[list[ExecRequest]], list[ExecResult]]  # SandboxPool.run_many, ctx.execute


class ToolTimeout(Exception):
    """Raised by a tool whose work ran out of time (the python tool's program): status timeout."""


# ---- tools and their schemas -------------------------------------------------------------------


@dataclass
class Tool:
    """A callable the policy may call by `name` with keyword `arguments` fitting `parameters` (a JSON
    schema of type object). `fork`: run each call in a forked child killed at the timeout (False:
    the tool bounds its own time and runs in the caller's process)."""

    name: str
    description: str
    parameters: dict
    function: Callable[..., Any]
    fork: bool = True
    validator: jsonschema.Draft202012Validator = field(init=False, repr=False)

    def __post_init__(self):
        schema = validation_schema(self.parameters)
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as e:
            raise ValueError(f"tool {self.name!r}: its parameters are not a JSON schema: {e.message}") from None
        self.validator = jsonschema.Draft202012Validator(schema)

    @property
    def schema(self) -> dict:
        """The function schema a chat template's `tools=` takes."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def argument_problem(self, arguments: dict) -> str:
        """Why `arguments` do not fit the parameters ("" when they do), in one line."""
        error = jsonschema.exceptions.best_match(self.validator.iter_errors(arguments))
        if error is None:
            return ""
        where = ".".join(str(p) for p in error.absolute_path)
        return f"{where}: {error.message}" if where else error.message


def validation_schema(parameters: dict) -> dict:
    """`parameters` as jsonschema checks them: `nullable: true` (get_json_schema's mark of an
    Optional argument) admits null, and an object without `additionalProperties` takes no
    argument it does not name."""

    def fix(node):
        if isinstance(node, list):
            return [fix(n) for n in node]
        if not isinstance(node, dict):
            return node
        nullable = node.get("nullable") is True  # (a `properties` mapping may name an argument "nullable")
        out = {k: fix(v) for k, v in node.items() if not (k == "nullable" and nullable)}
        if nullable and isinstance(out.get("type"), (str, list)):
            types = out["type"] if isinstance(out["type"], list) else [out["type"]]
            out["type"] = [*types, "null"] if "null" not in types else types
            if "enum" in out and None not in out["enum"]:
                out["enum"] = [*out["enum"], None]
        elif nullable:
            out = {"anyOf": [out, {"type": "null"}]}
        if out.get("type") == "object" and "properties" in out:
            out.setdefault("additionalProperties", False)
        return out

    return fix(parameters)


def function_schema(fn: Callable[..., Any]) -> dict:
    """The `function` part of `fn`'s tool schema (transformers' `get_json_schema`); ValueError,
    one line, saying why the signature or docstring cannot be read."""
    try:
        return get_json_schema(fn)["function"]
    except Exception as e:  # noqa: BLE001 - transformers' parsing errors, a missing hint: all one line
        raise ValueError(first_line(e)) from None


def tool_from_function(fn: Callable[..., Any], fork: bool = True) -> Tool:
    """The tool of a typed function with a Google-style docstring (transformers' `get_json_schema`:
    int, float, str, bool, list, dict, Optional, Literal; an argument with a default is not required;
    the description is the docstring's text before `Args:`). ValueError, one line, naming the
    function when its signature or docstring cannot be read."""
    try:
        schema = function_schema(fn)
    except ValueError as e:
        raise ValueError(f"tool {getattr(fn, '__name__', repr(fn))!r}: {e}") from None
    return Tool(schema["name"], schema.get("description") or "", schema["parameters"], fn, fork)


def tool_schemas(tools: Iterable[Tool]) -> list[dict]:
    """The schemas a chat template's `tools=` takes."""
    return [t.schema for t in tools]


def tools_by_name(tools: Iterable[Tool]) -> dict[str, Tool]:
    """Name -> tool; ValueError when two tools share a name."""
    out: dict[str, Tool] = {}
    for t in tools:
        if t.name in out:
            raise ValueError(f"two tools are named {t.name!r}")
        out[t.name] = t
    return out


# ---- the calculator ----------------------------------------------------------------------------

BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def digits(n: int) -> int:
    """About how many decimal digits |n| has (from its bit length; never below the truth)."""
    return int(abs(n).bit_length() * LOG10_2) + 1


def checked(value: int | float) -> int | float:
    """`value` when it is a finite real number (an int of at most MAX_DIGITS digits), else ValueError."""
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, int) and digits(value) > MAX_DIGITS:
        raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large for a decimal number")
    return value


def power(base: int | float, exponent: int | float) -> int | float:
    """base ** exponent, refused before it is computed when an int result would pass MAX_DIGITS."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * (abs(base).bit_length() - 1) * LOG10_2 > MAX_DIGITS:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    return checked(base**exponent)


def tree_depth(tree: ast.AST) -> int:
    """How many nodes deep `tree` is, walked without recursion."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def evaluate(node: ast.AST) -> int | float:
    """The value of an arithmetic expression tree; ValueError naming what is not arithmetic."""
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = evaluate(node.left), evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return power(left, right)
        return checked(BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return checked(UNARY[type(node.op)](evaluate(node.operand)))
    what = {
        ast.Name: "names",
        ast.Call: "function calls",
        ast.Attribute: "attributes",
        ast.Constant: "constants other than numbers",
    }.get(type(node), type(node).__name__)
    raise ValueError(f"{what} are not arithmetic: only numbers, + - * / // % ** and parentheses")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: integers of any size (exact), decimals, + - * / // % ** and parentheses.

    Args:
        expression: the arithmetic expression, e.g. "(2**64 - 1) * 3 / 7"
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        if tree_depth(tree) > MAX_DEPTH:
            raise ValueError(f"the expression is nested more than {MAX_DEPTH} deep")
        return str(evaluate(tree))
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large for a decimal number") from None
    except RecursionError:  # the parser's own bound, near MAX_EXPRESSION_CHARS
        raise ValueError(f"the expression is nested more than {MAX_DEPTH} deep") from None


# ---- the python tool (the sandbox) -------------------------------------------------------------


def sandbox_limits(settings) -> Limits:
    """The Limits of a run's sandbox settings (a job config's `sandbox` section: its wall time,
    CPU time and memory), as the controller gives them to the code task."""
    return Limits(wall_time_s=settings.wall_time_s, cpu_time_s=settings.cpu_time_s, memory_mb=settings.memory_mb)


def trim_middle(text: str, max_chars: int) -> str:
    """`text` when it fits `max_chars`, else its head and tail around a note of what was cut."""
    if len(text) <= max_chars:
        return text
    note = f"\n... [{len(text) - max_chars} characters cut] ...\n"
    keep = max(0, max_chars - len(note))
    head = keep // 2
    return text[:head] + note + text[len(text) - (keep - head) :]


def program_output(result: ExecResult, max_chars: int) -> str:
    """What the policy reads of a sandboxed run: its stdout, its stderr and, unless it exited 0,
    how it ended; stdout and stderr each cut to half of `max_chars`."""
    parts = []
    if result.stdout:
        parts.append(trim_middle(result.stdout.rstrip("\n"), max_chars // 2))
    if result.stderr:
        parts.append("stderr:\n" + trim_middle(result.stderr.rstrip("\n"), max_chars // 2))
    if result.status == "failed":
        parts.append(f"(exit code {result.exit_code})")
    elif result.status != "ok":
        parts.append(f"({result.status}: {result.error})")
    return "\n".join(parts) if parts else "(no output)"


def python_tool(run: Runner, limits: Limits | None = None, max_output_chars: int = MAX_OBSERVATION_CHARS) -> Tool:
    """The `python` tool: a program run in the sandbox through `run` (a SandboxPool's `run_many`,
    `ctx.execute`) under `limits` (the run's: `sandbox_limits(cfg.sandbox)`). A program that
    fails, runs out of memory or is killed is output the policy reads; one past the wall time is
    status timeout; a sandbox that cannot run it is status error."""
    limits = limits or Limits()

    def python(code: str) -> str:
        """Run a Python program in a sandbox (no network, no files kept) and return what it printed.

        Args:
            code: the program; print what you want to see
        """
        result = run([ExecRequest(code, limits=limits, id="tool/python")])[0]
        if result.status == "timeout":
            raise ToolTimeout(result.error or f"the program ran past {limits.wall_time_s:g} s")
        if result.status == "error":
            raise RuntimeError(f"the sandbox could not run the program: {result.error}")
        return program_output(result, max_output_chars)

    return tool_from_function(python, fork=False)


# ---- loading tools by name ---------------------------------------------------------------------

BUILTINS = ("calculator", "python")


def load_tool(spec: str, run: Runner | None = None, limits: Limits | None = None) -> Tool:
    """One tool: a built-in's name or `package.module:function`; ValueError (one line) naming a bad spec."""
    if spec == "calculator":
        return tool_from_function(calculator, fork=False)  # bounded by MAX_DIGITS and MAX_EXPRESSION_CHARS
    if spec == "python":
        if run is None:
            raise ValueError("tool 'python' runs code in the sandbox: give load_tools a sandbox runner (run=)")
        return python_tool(run, limits)
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr.isidentifier():
        raise ValueError(f"tool {spec!r} is not a built-in ({', '.join(BUILTINS)}) nor package.module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the spec's problem, in one line
        raise ValueError(f"tool {spec!r}: importing {module_name} failed: {first_line(e)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"tool {spec!r}: {module_name} has no function {attr!r}")
    try:
        schema = function_schema(fn)
    except ValueError as e:
        raise ValueError(f"tool {spec!r}: {e}") from None
    return Tool(schema["name"], schema.get("description") or "", schema["parameters"], fn)


def load_tools(specs: Sequence[str], run: Runner | None = None, limits: Limits | None = None) -> list[Tool]:
    """The tools of `specs` (built-in names or `package.module:function` paths), in order; `run`
    and `limits`: the sandbox the python tool runs in. ValueError (one line) naming a bad spec or
    a name used twice."""
    tools = [load_tool(s, run, limits) for s in specs]
    tools_by_name(tools)  # two tools of one name are an error
    return tools


# ---- the calls a policy writes -----------------------------------------------------------------

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    """One `<tool_call>` of a turn: `name` and `arguments` when it parsed, else `error` says why."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str = ""
    text: str = ""  # what stood between the tags

    @property
    def ok(self) -> bool:
        return not self.error


def parse_call(body: str) -> ToolCall:
    """A call from the JSON between the tags: {"name": str, "arguments": object (absent: {})}."""
    text = body.strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCall(error=f"invalid JSON ({e.msg} at character {e.pos})", text=body)
    if not isinstance(data, dict):
        return ToolCall(error=f"expected a JSON object, got {type(data).__name__}", text=body)
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCall(error='no "name" string', text=body)
    arguments = data.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f'"arguments" must be a JSON object, got {type(arguments).__name__}', text=body)
    return ToolCall(name.strip(), arguments, text=body)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` of `text`, in order. A tag with no closing tag before
    the next opening one (or the end) is an unclosed call; text outside the tags is ignored."""
    calls, pos = [], 0
    while (start := text.find(OPEN, pos)) >= 0:
        body_start = start + len(OPEN)
        end, next_open = text.find(CLOSE, body_start), text.find(OPEN, body_start)
        if end < 0 or 0 <= next_open < end:
            stop = next_open if next_open >= 0 else len(text)
            calls.append(ToolCall(error=f"unclosed {OPEN} (no {CLOSE})", text=text[body_start:stop]))
            pos = stop
            continue
        calls.append(parse_call(text[body_start:end]))
        pos = end + len(CLOSE)
    return calls


# ---- running a call ----------------------------------------------------------------------------


@dataclass
class ToolResult:
    """The outcome of one call: `observation` is the text the policy reads, `status` one of STATUSES."""

    name: str
    status: str
    observation: str
    seconds: float = 0.0

    def message(self) -> dict:
        """The chat message that carries it (the template's `tool` role)."""
        return {"role": "tool", "name": self.name, "content": self.observation}


def first_line(e: BaseException) -> str:
    """`Type: message`, the message's first line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def as_text(value: Any) -> str:
    """A tool's return value as the policy reads it: a string as it is, None as "(no output)",
    anything else as JSON (str() where JSON cannot hold it)."""
    if isinstance(value, str):
        return value
    if value is None:
        return "(no output)"
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def outcome(function: Callable[..., Any], arguments: dict, max_chars: int) -> tuple[str, str]:
    """(status, text) of `function(**arguments)` in this process: ok and its output, timeout when
    it raised ToolTimeout, error and `raised Type: message` when it raised anything else."""
    try:
        return "ok", trim_middle(as_text(function(**arguments)), max_chars)
    except ToolTimeout as e:
        return "timeout", trim_middle(str(e) or "the tool timed out", max_chars)
    except Exception as e:  # noqa: BLE001 - whatever the tool raised is the policy's observation
        return "error", trim_middle(f"raised {type(e).__name__}: {e}", max_chars)


def _forked_child(function, arguments, send, max_chars) -> None:
    os.setsid()  # a process group of its own: the parent kills it and anything it started at once
    send.send(outcome(function, arguments, max_chars))
    send.close()


def kill_group(process) -> None:
    """SIGKILL the forked call's process group (what it started too), then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone, or killed before it made its group: the kill below is enough
    process.kill()
    process.join()


def run_forked(function: Callable[..., Any], arguments: dict, timeout_s: float, max_chars: int) -> tuple[str, str]:
    """(status, text) of `function(**arguments)` run in a forked child process; the child's whole
    process group is killed once it answers or at `timeout_s` (status timeout)."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_forked_child, args=(function, arguments, send, max_chars), daemon=True)
    try:
        process.start()
    except OSError as e:  # no process to be had (memory, the process limit)
        receive.close()
        return "error", f"could not start a process for the call: {first_line(e)}"
    finally:
        send.close()  # the child holds its own copy
    try:
        answer = receive.recv() if receive.poll(timeout_s) else None
    except EOFError:  # the child died before it answered
        answer = ()
    finally:
        receive.close()
        kill_group(process)
    if answer is None:
        return "timeout", f"no answer within {timeout_s:g} s: the call was stopped"
    if not answer:
        return "error", f"ended its process without an answer (exit code {process.exitcode})"
    return answer


def call_tool(
    call: ToolCall,
    tools: Mapping[str, Tool] | Sequence[Tool],
    timeout_s: float = 10.0,
    max_chars: int = MAX_OBSERVATION_CHARS,
) -> ToolResult:
    """Run one call; never raises. The observation is the tool's output, or an `Error: ...` line
    the policy can read (a malformed call, an unknown tool, arguments that do not fit the schema,
    what the tool raised, the timeout), cut to `max_chars`."""
    tools = tools if isinstance(tools, Mapping) else tools_by_name(tools)
    start = time.monotonic()

    def result(status: str, text: str) -> ToolResult:
        text = text if status == "ok" else trim_middle(f"Error: {text}", max_chars)
        return ToolResult(call.name, status, text, time.monotonic() - start)

    if call.error:
        return result("malformed", f"malformed tool call: {call.error}")
    tool = tools.get(call.name)
    if tool is None:
        return result("unknown_tool", f"unknown tool {call.name!r}; the tools are: {', '.join(sorted(tools))}")
    problem = tool.argument_problem(call.arguments)
    if problem:
        return result("malformed", f"invalid arguments for {call.name}: {problem}")
    if tool.fork:
        status, text = run_forked(tool.function, call.arguments, timeout_s, max_chars)
    else:
        status, text = outcome(tool.function, call.arguments, max_chars)
    if status == "error":
        text = f"{call.name} {text}"
    elif status == "timeout":
        text = f"{call.name} timed out: {text}"
    return result(status, text)


@dataclass
class ToolCounts:
    """How many calls ended in each status, for a rollout's metrics: `add` each result,
    `merge` episodes' counts, `metrics()` -> {tools/calls, tools/ok, tools/malformed, tools/unknown,
    tools/error, tools/timeout}."""

    counts: Counter = field(default_factory=Counter)

    def add(self, results: ToolResult | Iterable[ToolResult]) -> "ToolCounts":
        for r in [results] if isinstance(results, ToolResult) else results:
            self.counts[r.status] += 1
        return self

    def merge(self, other: "ToolCounts") -> "ToolCounts":
        return ToolCounts(self.counts + other.counts)

    def metrics(self) -> dict[str, float]:
        out = {"tools/calls": float(sum(self.counts.values()))}
        out.update({METRIC_NAMES[s]: float(self.counts[s]) for s in STATUSES})
        return out
