"""Reward functions by name: `reward.function` (with `reward.source: rule`).

A reward function is called as `f(prompt: str, response: str, row: dict)` and returns a float,
or a dict with a `reward` float and extra numbers that are logged as `reward/<key>` means. With
`reward.batched: true` a user's function is called once per step as `f(prompts, responses, rows)`
and returns a list of those. `row` is the dataset row (every column, the answer under
`reward.answer_key`), so the same function works with any task.

Built-ins (`BUILTINS`):

    math    the final answer, from the last \\boxed{...} or else the last number of the response,
            equal to the row's answer by the math-verify package (1/2 = 0.5 = \\frac{1}{2};
            50% = 50 = 0.5; 1,234 = 1234)
    exact   the whole response equals the answer after `normalize_text` (strip, case-fold,
            collapse whitespace, drop a trailing period)
    choice  the multiple-choice letter A-J the response gives (`choice_letter`) equals the row's
            letter (an integer answer is an index: 0 -> A)
    regex   `reward.pattern` is found in the response (`re.search`: anchor it with ^ and $, or
            (?s) for a pattern across lines, to ask for more)
    code    the response's code (its first ```python block, else all of it, after the row's
            `code_prefix`) passes every test of the row's `tests` (else `private_tests`) in the
            sandbox; `tests_passed` (the fraction) is logged

A user's function: `path/to/file.py:name` (a relative path: from the working directory, then
from the config file's directory; rlsys/config.py locates it) or `package.module:name`.
`FunctionSpec` says which, and travels to the process that runs it (envs/reward_runner.py), where
`load_function` imports it; `as_reward` turns what it returned into a reward and its metrics.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import numbers
import os
import re
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

BUILTINS = ("math", "exact", "choice", "regex", "code")
LETTERS = "ABCDEFGHIJ"


class FunctionLoadError(ValueError):
    """A reward function that cannot be loaded (a missing file, module or name, an import error)."""


# ---- math ---------------------------------------------------------------------------------------
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?(?:\s*\\?%)?|(?<![\w.])-?\.\d+")


_INTEGER = re.compile(r"-?[0-9]+")


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` (or `\\fbox{...}`), braces balanced."""
    for start in reversed([m.end() for m in _BOX.finditer(text)]):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start : i - 1].strip()
    return None


def last_number(text: str) -> str | None:
    """The last number of the text: a sign, thousands separators, decimals, a `/` fraction and a
    percent sign are part of it ("-1,234.5", "3/4", "50%")."""
    found = _NUMBER.findall(text.replace("\u2212", "-"))
    return found[-1].strip() if found else None


def final_answer(response: str) -> str | None:
    """The answer a math response gives: its last \\boxed{} content, else its last number."""
    boxed = last_boxed(response)
    return boxed if boxed is not None else last_number(response)


def _math_parses(text: str) -> list:
    from math_verify import parse  # sympy and an ANTLR parser: only the math reward loads them

    text = text.strip().replace("\u2212", "-").strip("$").strip()
    parsed = [parse(f"${text}$"), parse(text)]
    return [p for p in parsed if p]


def math_equal(answer, predicted: str | None) -> bool:
    """Whether `predicted` is mathematically the reference `answer` (math-verify, which reads
    LaTeX and plain expressions: fractions, decimals, percentages, signs, thousands separators)."""
    if predicted is None or not str(predicted).strip():
        return False
    gold, predicted = str(answer).strip(), str(predicted).strip()
    if normalize_text(gold) == normalize_text(predicted):
        return True
    if _INTEGER.fullmatch(gold) and _INTEGER.fullmatch(predicted):  # math-verify's verdict, ~1000x faster
        return int(gold) == int(predicted)
    return math_verify_equal(gold, predicted)


def math_verify_equal(gold: str, predicted: str) -> bool:
    """math-verify's verdict on two answers (each read as LaTeX and as a plain expression)."""
    from math_verify import verify  # as in _math_parses

    return any(verify(g, p) for g in _math_parses(gold) for p in _math_parses(predicted))


def math_reward(prompt: str, response: str, row: dict, answer_key: str = "answer") -> float:
    return 1.0 if math_equal(_answer(row, answer_key), final_answer(response)) else 0.0


# ---- exact, choice, regex ----------------------------------------------------------------------
def normalize_text(text) -> str:
    """Strip, case-fold, collapse whitespace runs to one space, drop one trailing period."""
    text = " ".join(str(text).split()).casefold()
    return text[:-1].rstrip() if text.endswith(".") else text


def exact_reward(prompt: str, response: str, row: dict, answer_key: str = "answer") -> float:
    return 1.0 if normalize_text(response) == normalize_text(_answer(row, answer_key)) else 0.0


_CHOICE_PATTERNS = (
    re.compile(r"\\boxed\s*\{\s*(?:\\text\s*\{\s*)?\(?([A-J])\)?\s*\}"),  # \boxed{B}, \boxed{\text{(B)}}
    re.compile(r"(?i:answer)\s*(?:(?i:is)|:)?\s*(?i:option|choice)?\s*:?\s*\(?([A-J])\)?(?![A-Za-z])"),
    re.compile(r"^\s*\(?([A-J])\)?\s*[.:)]?\s*$"),  # the whole response is the letter: "B", "(B)", "B."
    re.compile(r"^\s*\(?([A-J])[).:]\s"),  # a response that starts with it: "B. because", "(B) since"
    re.compile(r"\(([A-J])\)"),  # a parenthesised letter anywhere: the last one
)


def choice_letter(response: str) -> str | None:
    """The multiple-choice letter (A-J, upper case) a response gives, by the first rule that finds
    one: a \\boxed{} letter, "answer is (X)" / "Answer: X" (the last such), the response being
    just the letter, the response starting with "X." or "(X)", else its last "(X)"."""
    for pattern in _CHOICE_PATTERNS:
        found = pattern.findall(response)
        if found:
            return found[-1]
    return None


def answer_letter(answer) -> str:
    """The row's letter: "b", "(B)", "B." -> "B"; an integer is an index (0 -> "A")."""
    if isinstance(answer, numbers.Integral) and not isinstance(answer, bool):
        return LETTERS[int(answer)] if 0 <= int(answer) < len(LETTERS) else str(answer)
    return str(answer).strip().strip("().:").strip().upper()


def choice_reward(prompt: str, response: str, row: dict, answer_key: str = "answer") -> float:
    letter = choice_letter(response)
    return 1.0 if letter is not None and letter == answer_letter(_answer(row, answer_key)) else 0.0


def regex_reward(prompt: str, response: str, row: dict, pattern: str = "") -> float:
    return 1.0 if re.search(pattern, response) else 0.0


# ---- code ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _sandbox_backend(name: str):
    from sandbox import make_backend  # the sandbox package: only the code reward loads it

    return make_backend(name)


def code_reward(prompt: str, response: str, row: dict, backend: str = "bwrap", limits: dict | None = None) -> dict:
    from envs.code import extract_code, test_cases  # the sandbox package: only the code reward loads it
    from sandbox import ExecRequest, Limits  # as above

    tests = row.get("tests") or row.get("private_tests")
    if not tests:
        raise ValueError("the row has no tests (a 'tests' or 'private_tests' list)")
    code = extract_code(response)
    if not code:
        return {"reward": 0.0, "tests_passed": 0.0}
    program = (row.get("code_prefix") or "") + code
    request = ExecRequest(program, tests=test_cases(tests, "test"), limits=Limits(**(limits or {})))
    result = _sandbox_backend(backend).run(request)
    passed = sum(t.passed for t in result.tests) / len(tests)
    return {"reward": 1.0 if result.passed else 0.0, "tests_passed": passed}


# ---- what a reward function is, and loading it -------------------------------------------------
@dataclass(frozen=True)
class FunctionSpec:
    """A reward function as configured, picklable. `kind`: builtin (`target` is its name), file
    (`target` an absolute path; `relative`, the same file from the working directory, is tried
    where the absolute path does not exist: another node of a cluster) or module (`target` a
    dotted module name, imported with `search_path` on sys.path). `options`: a built-in's
    keyword arguments (answer_key, pattern, the sandbox of `code`)."""

    label: str
    kind: str
    target: str
    attr: str = ""
    batched: bool = False
    options: dict = field(default_factory=dict)
    relative: str | None = None
    search_path: str | None = None

    @classmethod
    def parse(cls, text: str, batched: bool = False, options: dict | None = None) -> "FunctionSpec":
        """From `reward.function` as rlsys/config.py leaves it (a file path already located)."""
        if text in BUILTINS:
            return cls(text, "builtin", text, options=dict(options or {}))
        target, _, attr = text.rpartition(":")
        if not target or not attr.isidentifier():
            raise FunctionLoadError(
                f"reward function '{text}' is not a built-in ({', '.join(BUILTINS)}), "
                f"path/to/file.py:name or package.module:name"
            )
        if target.endswith(".py"):
            path = Path(target).resolve()
            try:
                relative = str(path.relative_to(Path.cwd()))
            except ValueError:
                relative = None
            return cls(text, "file", str(path), attr, batched, relative=relative)
        return cls(text, "module", target, attr, batched, search_path=os.getcwd())


BUILTIN_FUNCTIONS: dict[str, Callable] = {
    "math": math_reward,
    "exact": exact_reward,
    "choice": choice_reward,
    "regex": regex_reward,
    "code": code_reward,
}
BUILTIN_OPTIONS = {  # which options each built-in takes
    "math": ("answer_key",),
    "exact": ("answer_key",),
    "choice": ("answer_key",),
    "regex": ("pattern",),
    "code": ("backend", "limits"),
}


def load_function(spec: FunctionSpec) -> Callable:
    """The callable `spec` names; FunctionLoadError (one line) when it cannot be loaded."""
    if spec.kind == "builtin":
        options = {k: v for k, v in spec.options.items() if k in BUILTIN_OPTIONS[spec.target]}
        return functools.partial(BUILTIN_FUNCTIONS[spec.target], **options)
    try:
        module = _import_file(spec) if spec.kind == "file" else _import_module(spec)
    except FunctionLoadError:
        raise
    except Exception as e:  # the user's module failed to import: say how, in one line
        raise FunctionLoadError(f"reward function '{spec.label}': importing it failed: {describe_error(e)}") from None
    fn = getattr(module, spec.attr, None)
    if not callable(fn):
        what = "is not callable" if fn is not None else "is not defined there"
        raise FunctionLoadError(f"reward function '{spec.label}': '{spec.attr}' {what}")
    return fn


def _import_file(spec: FunctionSpec):
    path = Path(spec.target)
    if not path.is_file() and spec.relative and Path(spec.relative).is_file():
        path = Path(spec.relative).resolve()
    if not path.is_file():
        raise FunctionLoadError(f"reward function '{spec.label}': file {path} does not exist")
    name = "rlsys_reward_" + re.sub(r"\W", "_", path.stem) + f"_{zlib.crc32(str(path).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))  # a reward file may import the modules beside it
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_module(spec: FunctionSpec):
    if spec.search_path and spec.search_path not in sys.path:
        sys.path.append(spec.search_path)
    try:
        return importlib.import_module(spec.target)
    except ModuleNotFoundError as e:
        if e.name and spec.target.startswith(e.name):
            raise FunctionLoadError(f"reward function '{spec.label}': no module named '{e.name}'") from None
        raise


# ---- what a function returned ---------------------------------------------------------------
def as_reward(value) -> tuple[float, dict[str, float]]:
    """(reward, extra metrics) from a function's return value: a real number (a bool counts as
    0/1), or a dict with a numeric `reward` whose other numeric values are metrics (others are
    left out). TypeError / ValueError with what was wrong otherwise."""
    metrics = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise TypeError(f"returned a dict without a 'reward' key (keys: {', '.join(map(str, value))[:100]})")
        metrics = {str(k): float(v) for k, v in value.items() if k != "reward" and _is_number(v)}
        value = value["reward"]
    if not _is_number(value):
        raise TypeError(f"returned {type(value).__name__} {str(value)[:60]!r}, not a number")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"returned {reward}")
    return reward, metrics


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real)


def describe_error(e: BaseException) -> str:
    """`Type: message (file.py:line)`, on one line: the innermost frame of the traceback."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f" ({Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno})" if tb is not None else ""
    return (text[:300] + "..." if len(text) > 300 else text) + where


def _answer(row: dict, key: str):
    if key not in row or row[key] is None:
        raise KeyError(f"the row has no '{key}' (reward.answer_key)")
    return row[key]


def reference_response(function: str | None, row: dict, answer_key: str = "answer") -> str:
    """The row's reference answer written as a response would carry it, for `rlsys reward check`:
    `\\boxed{answer}` for math, the letter for choice, the answer itself otherwise."""
    answer = _answer(row, answer_key)
    if function == "math":
        return f"\\boxed{{{answer}}}"
    if function == "choice":
        return answer_letter(answer)
    return str(answer)
