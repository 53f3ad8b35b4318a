"""The test harness, host side: wraps a request with tests so the in-sandbox runner
(`_runner.py`) executes them, then turns the runner's report into per-test results."""

from __future__ import annotations

import importlib.util
import json
import marshal
import secrets
from dataclasses import asdict, replace
from pathlib import Path

from .types import ExecRequest, ExecResult, TestResult

RUNNER = (Path(__file__).with_name("_runner.py")).read_bytes()
RUNNER_NAME, BYTECODE_NAME, STARTER_NAME = "_rlsys_runner.py", "_rlsys_runner.bin", "_rlsys_start.py"
TESTS_NAME = "_rlsys_tests.json"  # the runner's TESTS_FILE
TESTS_FD_ENV = "RLSYS_TESTS_FD"  # where a backend hands the runner that file as a pipe instead
# The runner as this interpreter's bytecode, behind its magic number: compiling the runner's source
# costs 3-6 ms of every check in the sandbox, loading the bytecode 0.1 ms. The starter runs it where
# the sandbox's Python has the same magic number, and compiles the source where it has not.
BYTECODE = importlib.util.MAGIC_NUMBER + marshal.dumps(compile(RUNNER, RUNNER_NAME, "exec", dont_inherit=True))
STARTER = b"""import marshal
from _frozen_importlib_external import MAGIC_NUMBER
with open("%s", "rb") as f:
    data = f.read()
if data[:len(MAGIC_NUMBER)] == MAGIC_NUMBER:
    code = marshal.loads(data[len(MAGIC_NUMBER):])
else:
    with open("%s", "rb") as f:
        code = compile(f.read(), "%s", "exec")
del data, f
exec(code)
""" % (BYTECODE_NAME.encode(), RUNNER_NAME.encode(), RUNNER_NAME.encode())
RESERVED_NAMES = (RUNNER_NAME, BYTECODE_NAME, STARTER_NAME, TESTS_NAME)  # no request file may take these


def wrap(req: ExecRequest, bytecode: bool = True) -> tuple[dict[str, bytes], list[str], str]:
    """Files and argv that run `req.tests` against `req.code`, and the nonce that marks
    the runner's report lines on stdout; `bytecode`: start the runner from `BYTECODE`."""
    nonce = "RLSYS-" + secrets.token_hex(8)
    # The nonce travels with the tests (a file the runner deletes, or a pipe: see bwrap), never
    # in argv, where the program could read it from /proc/<pid>/cmdline and forge reports.
    spec = {"tests": [asdict(t) for t in req.tests], "wall_time_s": req.limits.wall_time_s, "nonce": nonce}
    files = {RUNNER_NAME: RUNNER, TESTS_NAME: json.dumps(spec).encode()}
    if not bytecode:
        return files, [RUNNER_NAME], nonce
    return {**files, STARTER_NAME: STARTER, BYTECODE_NAME: BYTECODE}, [STARTER_NAME], nonce


def finish(res: ExecResult, req: ExecRequest, nonce: str) -> ExecResult:
    """Strip the report lines from stdout and fill `tests`; a test without a report
    failed. Status: ok when every test passed, failed when one did not, unless the run
    itself hit a limit (timeout, oom, killed) or the sandbox failed (error)."""
    reports, kept, forged = {}, [], set()
    for line in res.stdout.splitlines(keepends=True):
        at = line.find(nonce + " ")  # after a line the program left unfinished on the shared stdout, too
        if at >= 0:
            if at:
                kept.append(line[:at])
            try:
                r = json.loads(line[at + len(nonce) + 1 :])
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
