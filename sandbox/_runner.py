# The test runner. Runs INSIDE the sandbox (standard library only) as
# `python3 _rlsys_runner.py`. It loads the tests and the report nonce, deletes their file
# so the program can read neither, runs the program once, then every assert-style test in
# its namespace and every stdin/stdout case as a child process. One JSON line per test,
# prefixed by NONCE, goes to a private copy of stdout. A test that never reports (the
# program called os._exit, timed out, ...) counts as failed on the host.
import json
import os
import sys
import time
import types

# ast, subprocess and traceback are imported where needed: ~7 ms of every check otherwise.

TESTS_FILE = "_rlsys_tests.json"
with open(TESTS_FILE) as f:
    spec = json.load(f)
os.unlink(TESTS_FILE)
sys.argv = ["main.py"]
MAX_REPR = 300


def reporter(nonce, out):
    """`report(name, passed, message)`; the nonce and the private stdout copy (it survives
    the program closing or redirecting fd 1) live only in this closure, not in a global."""
    def report(name, passed, message=""):
        line = "%s %s\n" % (nonce, json.dumps({"name": name, "passed": passed, "message": message[-2000:]}))
        os.write(out, line.encode())
    return report


report = reporter(spec.pop("nonce"), os.dup(1))


def short(value):
    text = repr(value)
    return text if len(text) <= MAX_REPR else text[:MAX_REPR] + "..."


def error_tail(exc, filename):
    """`Type: message` plus where it happened; for a failed `assert a == b` in the test's
    own code, the two sides re-evaluated: what was expected and what came back."""
    import ast
    import traceback

    head = traceback.format_exception_only(type(exc), exc)[-1].strip()
    tb, frame, lineno = exc.__traceback__, None, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            frame, lineno = tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
    if frame is None:
        return head
    line = SOURCES[filename][lineno - 1].strip() if lineno <= len(SOURCES[filename]) else ""
    where = "line %d: %s" % (lineno, line)
    if isinstance(exc, AssertionError):
        try:
            node = ast.parse(line).body[0]
            cmp = node.test
            if isinstance(cmp, ast.Compare) and len(cmp.ops) == 1 and isinstance(cmp.ops[0], ast.Eq):
                got = eval(ast.unparse(cmp.left), frame.f_globals, frame.f_locals)
                want = eval(ast.unparse(cmp.comparators[0]), frame.f_globals, frame.f_locals)
                return "%s\nexpected %s, got %s" % (where, short(want), short(got))
        except Exception:  # noqa: BLE001 - the plain message is still useful
            pass
    return "%s\n%s" % (where, head)


SOURCES = {}
asserts = [t for t in spec["tests"] if t["kind"] == "assert"]
ios = [t for t in spec["tests"] if t["kind"] == "io"]
# The program gets a __main__ module of its own, not this runner's.
main_module = types.ModuleType("__main__")
main_module.__file__ = "main.py"
sys.modules["__main__"] = main_module
namespace = main_module.__dict__
program_error = None
if asserts:
    try:
        with open("main.py", "rb") as f:
            exec(compile(f.read(), "main.py", "exec"), namespace)
    except BaseException as e:  # noqa: BLE001 - SystemExit too: the tests still run
        if not isinstance(e, SystemExit) or e.code not in (None, 0):
            import traceback

            program_error = "the program raised before the tests: " + traceback.format_exception_only(type(e), e)[-1].strip()
for i, t in enumerate(asserts):
    name = t["name"] or "test_%d" % i
    if program_error:
        report(name, False, program_error)
        continue
    filename = "<test %s>" % name
    SOURCES[filename] = t["code"].splitlines()
    try:
        exec(compile(t["code"], filename, "exec"), namespace)
        report(name, True)
    except BaseException as e:  # noqa: BLE001 - a test that exits or is interrupted fails
        try:
            message = error_tail(e, filename)
        except BaseException:  # noqa: BLE001 - e.g. out of memory while formatting
            message = type(e).__name__
        report(name, False, message)

if ios:
    import subprocess
deadline = time.monotonic() + spec["wall_time_s"]
for i, t in enumerate(ios):
    name = t["name"] or "case_%d" % i
    timeout = max(0.01, min(t["timeout_s"] or spec["wall_time_s"], deadline - time.monotonic()))
    try:
        p = subprocess.run([sys.executable, "-E", "-s", "main.py"], input=t["stdin"].encode(),
                           capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        report(name, False, "timed out after %.1f s" % timeout)
        continue
    got = p.stdout.decode("utf-8", "replace")
    want, have = [l.rstrip() for l in t["expected_stdout"].rstrip().splitlines()], [l.rstrip() for l in got.rstrip().splitlines()]
    if p.returncode != 0:
        report(name, False, "exit code %d\n%s" % (p.returncode, p.stderr.decode("utf-8", "replace")[-1000:]))
    elif want != have:
        n = next((k for k in range(max(len(want), len(have))) if k >= len(want) or k >= len(have) or want[k] != have[k]), 0)
        report(name, False, "line %d: expected %s, got %s" % (n + 1, short(want[n] if n < len(want) else "<end of output>"), short(have[n] if n < len(have) else "<end of output>")))
    else:
        report(name, True)
