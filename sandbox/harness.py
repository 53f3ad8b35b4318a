"""The test harness, host side: wraps a request with tests so the in-sandbox runner
(`_runner.py`) executes them, then turns the runner's report into per-test results."""
from __future__ import annotations

import json
import secrets
from dataclasses import asdict, replace
from pathlib import Path

from .types import ExecRequest, ExecResult, TestResult

RUNNER = (Path(__file__).with_name("_runner.py")).read_bytes()
RUNNER_NAME = "_rlsys_runner.py"
TESTS_NAME = "_rlsys_tests.json"  # the runner's TESTS_FILE
TESTS_FD_ENV = "RLSYS_TESTS_FD"  # where a backend hands the runner that file as a pipe instead


def wrap(req: ExecRequest) -> tuple[dict[str, bytes], list[str], str]:
    """Files and argv that run `req.tests` against `req.code`, and the nonce that marks
    the runner's report lines on stdout."""
    nonce = "RLSYS-" + secrets.token_hex(8)
    # The nonce travels with the tests (a file the runner deletes, or a pipe: see bwrap), never
    # in argv, where the program could read it from /proc/<pid>/cmdline and forge reports.
    spec = {"tests": [asdict(t) for t in req.tests], "wall_time_s": req.limits.wall_time_s, "nonce": nonce}
    files = {RUNNER_NAME: RUNNER, TESTS_NAME: json.dumps(spec).encode()}
    return files, [RUNNER_NAME], nonce


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
                r = json.loads(line[at + len(nonce) + 1:])
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
