"""The tool-use task's data: arithmetic word problems whose numbers are too large to work out in a
tiny model's head, solved by calling the calculator (envs/tools.py) in the Hermes format, in the
conversational format of HF datasets (one JSON object a line):

    {"prompt": [{"role": "user", "content": "A warehouse has 48213 boxes with 739 items each. How
                 many items are in the warehouse? Use the calculator, then give the final answer
                 as \\\\boxed{}."}],
     "answer": "35629407", "expression": "48213*739",
     "demonstration": [
        {"role": "assistant", "content": "<tool_call>{\\"name\\": \\"calculator\\", \\"arguments\\":
                                          {\\"expression\\": \\"48213*739\\"}}</tool_call>"},
        {"role": "tool", "name": "calculator", "content": "35629407"},
        {"role": "assistant", "content": "The answer is \\\\boxed{35629407}."}],
     "flawed_demonstration": [...], "flaw": "operand"}

Problems combine 2 or 3 operands of 2-6 digits (products, sums, differences and mixes of them, one
template each; `TEMPLATES`). The demonstration is the episode a `ToolEnv` (envs/tool_env.py)
plays when the policy calls the calculator once with the problem's expression and then boxes the
result: its tool message is the real calculator's answer (`call_tool`). It is a list of messages
that follow the prompt, not one text: the policy's turns are the assistant messages, the tool
message is the environment's, which a supervised warm-up must not train on.

The flawed demonstration, as imperfect SFT data RL has to fix, is one of (`flaw`):

    operator   the call's expression has one operator swapped (* -> +, + -> -, - -> +)
    operand    the call's expression has one operand typo'd (a digit changed, or two adjacent
               digits swapped)
    guess      no call: the answer guessed, the right one rounded to two significant digits

and it boxes what the wrong call returned (or the guess), so its final answer is always wrong.
Train and eval never share a problem. The same seed writes the same files:

    python -m envs.agent_arithmetic                 # configs/data/agent_arithmetic_{train,eval}.jsonl
    python -m envs.agent_arithmetic --train 500 --eval 50 --seed 1 --out /tmp/agent
    python -m envs.agent_arithmetic --tool python --out /tmp/agent-python

`tool="python"` (`--tool python`) writes the same problems for the python tool (the sandbox)
instead: the prompt says "Use python", each call is `{"name": "python", "arguments": {"code":
"print(<expression>)"}}` and its tool message is what the real python tool returns for it (the
printed value: `python_tool`'s output of a run that printed it); the calculator data is unchanged.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from envs.datasets import write_rows
from envs.tools import ToolCall, calculator, call_tool, load_tools, python_tool
from sandbox.types import ExecResult

INSTRUCTION = "Use the calculator, then give the final answer as \\boxed{}."
INSTRUCTIONS = {"calculator": INSTRUCTION, "python": "Use python, then give the final answer as \\boxed{}."}
TOOLS = tuple(INSTRUCTIONS)
PRINTED = re.compile(r"print\((.+)\)")
FLAWS = ("operator", "operand", "guess")
OPERATOR_SWAP = {"*": "+", "+": "-", "-": "+"}
OPERAND = re.compile(r"\d+")
CALCULATOR = load_tools(["calculator"])


@dataclass(frozen=True)
class Template:
    """One kind of word problem: its `text` and calculator `expression` (with {a}, {b}, {c} for the
    operands), each operand's number of `digits`, and its `value` computed from the operands."""

    text: str
    expression: str
    digits: tuple[int, ...]
    value: Callable[..., int]


TEMPLATES = (
    Template(
        "A warehouse has {a} boxes with {b} items each. How many items are in the warehouse?",
        "{a}*{b}",
        (5, 3),
        lambda a, b: a * b,
    ),
    Template(
        "A printer prints {a} pages a day for {b} days. How many pages does it print?",
        "{a}*{b}",
        (4, 3),
        lambda a, b: a * b,
    ),
    Template(
        "A library had {a} books and received {b} more. How many books does it have now?",
        "{a}+{b}",
        (6, 5),
        lambda a, b: a + b,
    ),
    Template(
        "A reservoir held {a} liters of water and {b} liters were used. How many liters are left?",
        "{a}-{b}",
        (6, 5),
        lambda a, b: a - b,
    ),
    Template(
        "Three trucks delivered {a}, {b} and {c} kilograms of sand. How many kilograms were delivered in all?",
        "{a}+{b}+{c}",
        (5, 5, 5),
        lambda a, b, c: a + b + c,
    ),
    Template(
        "A factory made {a} bolts on Monday and {b} bolts on Tuesday. Each bolt weighs {c} grams. "
        "How many grams do the bolts weigh in all?",
        "({a}+{b})*{c}",
        (4, 4, 3),
        lambda a, b, c: (a + b) * c,
    ),
    Template(
        "A farm packed {a} crates of {b} apples each and sold {c} apples. How many apples are left?",
        "{a}*{b}-{c}",
        (4, 3, 5),
        lambda a, b, c: a * b - c,
    ),
    Template(
        "A school bought {a} boxes of {b} pencils each and {c} loose pencils. How many pencils did it buy?",
        "{a}*{b}+{c}",
        (3, 3, 4),
        lambda a, b, c: a * b + c,
    ),
    Template(
        "A shipping company has {a} trucks, each carrying {b} crates of {c} cans. How many cans are there?",
        "{a}*{b}*{c}",
        (3, 2, 2),
        lambda a, b, c: a * b * c,
    ),
)
NAMES = "abc"


@dataclass(frozen=True)
class Problem:
    """A template with its operands: the prompt's text, the calculator expression and the answer."""

    template: Template
    operands: tuple[int, ...]

    @property
    def fields(self) -> dict[str, int]:
        return dict(zip(NAMES, self.operands))

    @property
    def text(self) -> str:
        return self.template.text.format(**self.fields)

    @property
    def expression(self) -> str:
        return self.template.expression.format(**self.fields)

    @property
    def answer(self) -> int:
        return self.template.value(*self.operands)


# ---- demonstrations ----------------------------------------------------------------------------


def tool_call(expression: str, tool: str = "calculator") -> ToolCall:
    """The call that computes `expression` with `tool`: the calculator's expression, or a python
    program that prints it."""
    if tool == "calculator":
        return ToolCall("calculator", {"expression": expression})
    if tool == "python":
        return ToolCall("python", {"code": f"print({expression})"})
    raise ValueError(f"unknown tool {tool!r} (allowed: {', '.join(TOOLS)})")


def call_text(expression: str, tool: str = "calculator") -> str:
    """A call of `tool` computing `expression` (`tool_call`) in the Hermes format."""
    call = tool_call(expression, tool)
    return f"<tool_call>{json.dumps({'name': call.name, 'arguments': call.arguments})}</tool_call>"


def answer_text(value: int | str) -> str:
    """The final turn: the answer in a box."""
    return f"The answer is \\boxed{{{value}}}."


def printed_runs(requests) -> list[ExecResult]:
    """What a sandbox gives for the demonstrations' programs, `print(<expression>)`: the
    expression's value printed (computed by the calculator, which gives Python's digits for the
    templates' integer arithmetic), so `python_tool` turns it into the tool message the real tool
    returns. Nothing is run."""
    results = []
    for r in requests:
        match = PRINTED.fullmatch(r.code.strip())
        if match is None:
            raise ValueError(f"not a demonstration's program (print(<expression>)): {r.code!r}")
        results.append(ExecResult("ok", exit_code=0, stdout=calculator(match.group(1)) + "\n", id=r.id))
    return results


PYTHON = [python_tool(printed_runs)]


def tool_message(expression: str, tool: str = "calculator") -> dict:
    """The tool message a ToolEnv gives for a call of `tool` computing `expression` (the real
    calculator's answer, or the python tool's output of a run that printed the value); ValueError
    when the tool refuses it."""
    result = call_tool(tool_call(expression, tool), CALCULATOR if tool == "calculator" else PYTHON)
    if result.status != "ok":
        raise ValueError(f"the {tool} tool refused {expression!r}: {result.observation}")
    return result.message()


def tool_demonstration(expression: str, tool: str = "calculator") -> list[dict]:
    """The messages after the prompt: a call of `tool` computing `expression`, its result, that result boxed."""
    result = tool_message(expression, tool)
    return [
        {"role": "assistant", "content": call_text(expression, tool)},
        result,
        {"role": "assistant", "content": answer_text(result["content"])},
    ]


def guess_demonstration(value: int) -> list[dict]:
    """No call: a guess boxed (`guess(value)`)."""
    return [{"role": "assistant", "content": answer_text(guess(value))}]


def guess(value: int) -> int:
    """A head estimate of `value`: rounded to two significant digits, one step off when that is exact."""
    step = 10 ** max(len(str(abs(value))) - 2, 0)
    rounded = round(value / step) * step
    return rounded if rounded != value else value + step


def swap_operator(expression: str, rng: random.Random) -> str:
    """`expression` with one of its operators (drawn) swapped by OPERATOR_SWAP."""
    places = [i for i, ch in enumerate(expression) if ch in OPERATOR_SWAP]
    i = rng.choice(places)
    return expression[:i] + OPERATOR_SWAP[expression[i]] + expression[i + 1 :]


def typo(number: str, rng: random.Random) -> str:
    """`number` with a typing slip: two adjacent different digits swapped, or (when it has none, or
    by draw) one digit changed; never a leading zero, never the number itself."""
    pairs = [i for i in range(len(number) - 1) if number[i] != number[i + 1] and not (i == 0 and number[1] == "0")]
    if pairs and rng.random() < 0.5:
        i = rng.choice(pairs)
        return number[:i] + number[i + 1] + number[i] + number[i + 2 :]
    i = rng.randrange(len(number))
    choices = [d for d in "0123456789" if d != number[i] and not (i == 0 and d == "0")]
    return number[:i] + rng.choice(choices) + number[i + 1 :]


def typo_operand(expression: str, rng: random.Random) -> str:
    """`expression` with one of its operands (drawn) typo'd."""
    match = rng.choice(list(OPERAND.finditer(expression)))
    return expression[: match.start()] + typo(match.group(), rng) + expression[match.end() :]


def flawed_demonstration(
    problem: Problem, flaw: str, rng: random.Random, tool: str = "calculator"
) -> tuple[str, list[dict]]:
    """(the flaw made, the demonstration with it): `flaw` (one of FLAWS), or a guess where a slip
    happened to leave the answer right; its final answer is never the problem's."""
    if flaw not in FLAWS:
        raise ValueError(f"unknown flaw {flaw!r} (allowed: {', '.join(FLAWS)})")
    if flaw != "guess":
        wrong = swap_operator if flaw == "operator" else typo_operand
        messages = tool_demonstration(wrong(problem.expression, rng), tool)
        if messages[1]["content"] != str(problem.answer):
            return flaw, messages
    return "guess", guess_demonstration(problem.answer)


def final_text(messages: list[dict]) -> str:
    """The last assistant message's content: the answer a demonstration gives."""
    return next(m["content"] for m in reversed(messages) if m["role"] == "assistant")


# ---- rows and splits ---------------------------------------------------------------------------


def draw_problem(rng: random.Random) -> Problem:
    """A template drawn, and operands of its digit counts."""
    template = rng.choice(TEMPLATES)
    return Problem(template, tuple(rng.randint(10 ** (d - 1), 10**d - 1) for d in template.digits))


def problems(n: int, rng: random.Random, exclude: frozenset[str] = frozenset()) -> list[Problem]:
    """n problems with distinct expressions, none of whose expression is in `exclude`."""
    out: dict[str, Problem] = {}
    while len(out) < n:
        problem = draw_problem(rng)
        if problem.expression not in exclude:
            out.setdefault(problem.expression, problem)
    return list(out.values())


def row(problem: Problem, rng: random.Random, tool: str = "calculator") -> dict:
    """A dataset row: the prompt as chat messages, the answer, the demonstration, a flawed one
    (their calls to `tool`)."""
    demonstration = tool_demonstration(problem.expression, tool)
    computed = demonstration[1]["content"]
    if computed != str(problem.answer):
        raise ValueError(f"the {tool} tool gives {computed} for {problem.expression}, not {problem.answer}")
    flaw, flawed = flawed_demonstration(problem, rng.choice(FLAWS), rng, tool)
    return {
        "prompt": [{"role": "user", "content": f"{problem.text} {INSTRUCTIONS[tool]}"}],
        "answer": str(problem.answer),
        "expression": problem.expression,
        "demonstration": demonstration,
        "flawed_demonstration": flawed,
        "flaw": flaw,
    }


def generate(n_train: int, n_eval: int, seed: int = 0, tool: str = "calculator") -> dict[str, list[dict]]:
    """The train and eval rows (eval drawn first; no training problem has an eval expression),
    their demonstrations calling `tool` (calculator or python; the same problems and flaws for both)."""
    if tool not in TOOLS:
        raise ValueError(f"unknown tool {tool!r} (allowed: {', '.join(TOOLS)})")
    rng = random.Random(seed)
    held_out = problems(n_eval, rng)
    train = problems(n_train, rng, exclude=frozenset(p.expression for p in held_out))
    return {"train": [row(p, rng, tool) for p in train], "eval": [row(p, rng, tool) for p in held_out]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=2000, help="training problems")
    p.add_argument("--eval", type=int, default=200, help="held-out problems (never among the training ones)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("configs/data"), help="directory of the two .jsonl files")
    p.add_argument("--tool", choices=TOOLS, default="calculator", help="the tool the demonstrations call")
    args = p.parse_args(argv)
    for split, rows in generate(args.train, args.eval, args.seed, args.tool).items():
        print(write_rows(rows, args.out / f"agent_arithmetic_{split}.jsonl"))


if __name__ == "__main__":
    main()
