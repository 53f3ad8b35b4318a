"""The test harness, host side: wraps a request with tests so the in-sandbox runner
(`_runner.py`) executes them, then turns the runner's report into per-test results."""
from __future__ import annotations

import ast
import json
import secrets
import threading
from dataclasses import asdict, replace
from functools import lru_cache
from pathlib import Path

from .types import ExecRequest, ExecResult, TestResult

RUNNER = (Path(__file__).with_name("_runner.py")).read_bytes()
RUNNER_NAME = "_rlsys_runner.py"


def wrap(req: ExecRequest) -> tuple[dict[str, bytes], list[str], str]:
    """Files and argv that run `req.tests` against `req.code`, and the nonce that marks
    the runner's report lines on stdout."""
    nonce = "RLSYS-" + secrets.token_hex(8)
    # The nonce travels in the tests file, which the runner deletes before the program
    # starts: in argv the program could read it from /proc/self/cmdline and forge reports.
    tests = [{**asdict(t), "source": t.code, "code": guarded_source(t.code) if t.kind == "assert" else t.code}
             for t in req.tests]
    spec = {"tests": tests, "wall_time_s": req.limits.wall_time_s, "nonce": nonce}
    files = {RUNNER_NAME: RUNNER, "_rlsys_tests.json": json.dumps(spec).encode()}
    return files, [RUNNER_NAME], nonce


_AST_LOCK = threading.Lock()  # CPython 3.11's ast is not thread-safe ("AST constructor recursion depth mismatch")


@lru_cache(maxsize=4096)  # a task's tests are checked again for every answer
def guarded_source(code: str) -> str:
    """An assert test's code with each assert's comparisons and truth tests routed through the
    runner's guards (`__rlsys_compare__(ops, *operands)`, `__rlsys_truth__(value)`: a
    program-made object does not stand for an expected value). Every assert keeps its lines, so
    a failure names the test's own line. Done here so the runner need not import `ast` (5 ms
    of every check in the sandbox); code that does not parse goes as it is (the runner says so)."""
    with _AST_LOCK:
        try:
            tree = ast.parse(code)
        except (SyntaxError, ValueError):
            return code
        return _guard_asserts(code, tree)


def _guard_asserts(code: str, tree: ast.Module) -> str:
    """`guarded_source` of parsed code: each assert's test expression replaced in place."""
    def guard(e: ast.expr) -> ast.expr:
        if isinstance(e, ast.BoolOp):
            return ast.BoolOp(e.op, [guard(v) for v in e.values])
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            return ast.UnaryOp(e.op, guard(e.operand))
        if isinstance(e, ast.Compare):
            ops = ast.Tuple([ast.Constant(type(op).__name__) for op in e.ops], ast.Load())
            return ast.Call(ast.Name("__rlsys_compare__", ast.Load()), [ops, e.left, *e.comparators], [])
        return ast.Call(ast.Name("__rlsys_truth__", ast.Load()), [e], [])

    lines = code.encode().splitlines(keepends=True)  # ast counts UTF-8 bytes, and lines as bytes split them
    tests = sorted((n.test for n in ast.walk(tree) if isinstance(n, ast.Assert)),
                   key=lambda e: (e.lineno, e.col_offset), reverse=True)  # from the end: offsets stay valid
    for e in tests:
        first, last = e.lineno - 1, e.end_lineno - 1
        text = "(" + ast.unparse(guard(e)) + "\n" * (last - first) + ")"  # the same line count
        joined = lines[first][: e.col_offset] + text.encode() + lines[last][e.end_col_offset :]
        lines[first : last + 1] = joined.splitlines(keepends=True)
    return b"".join(lines).decode()


def finish(res: ExecResult, req: ExecRequest, nonce: str) -> ExecResult:
    """Strip the report lines from stdout and fill `tests`; a test without a report
    failed. Status: ok when every test passed, failed when one did not, unless the run
    itself hit a limit (timeout, oom, killed) or the sandbox failed (error)."""
    reports, kept, forged = {}, [], set()
    for line in res.stdout.splitlines(keepends=True):
        if line.startswith(nonce + " "):
            try:
                r = json.loads(line[len(nonce) + 1:])
                if r["name"] in reports:  # each test reports once: a second report is forged
                    forged.add(r["name"])
                reports[r["name"]] = r
            except (ValueError, KeyError):
                pass
        else:
            kept.append(line)
    why = res.error or f"the program exited (code {res.exit_code}) before this test reported"
    if res.stdout_truncated:
        why = "output limit exceeded before this test reported"
    tests = []
    for i, t in enumerate(req.tests):
        ordinal = sum(1 for u in req.tests[:i] if u.kind == t.kind)
        name = t.name or (f"test_{ordinal}" if t.kind == "assert" else f"case_{ordinal}")
        r = reports.get(name)
        if name in forged:
            tests.append(TestResult(name, False, "more than one report for this test: the program forged one"))
        elif r:
            tests.append(TestResult(name, bool(r["passed"]), r["message"]))
        else:
            tests.append(TestResult(name, False, f"not run: {why}"))
    status = res.status
    if status in ("ok", "failed"):
        status = "ok" if all(t.passed for t in tests) else "failed"
    return replace(res, stdout="".join(kept), tests=tests, status=status)
