# The test runner. Runs INSIDE the sandbox (standard library only) as
# `python3 _rlsys_runner.py`. It loads the tests and the report nonce, deletes their file
# so the program can read neither, runs every stdin/stdout case as a child process, then
# runs the program once and every assert-style test in its namespace. One JSON line per
# test, prefixed by NONCE, goes to a private copy of stdout. A test that never reports (the
# program called os._exit, timed out, ...) counts as failed on the host.
#
# What the program may have changed before its tests run is undone or cannot matter: the io
# cases ran before it; the builtins are restored (a patched exec, abs or AssertionError) and its
# namespace gets a copy of them (a patch made while a test runs reaches neither the test nor
# this runner); `report` holds its own os.write and json.dumps. Comparisons and truth tests in
# an assert refuse objects whose comparison or truth methods the program wrote (an always-equal
# result does not pass; the host routes them through `guarded_compare` / `guarded_truth`). A program that walks
# the interpreter's frames to this runner's globals is not stopped: that needs the tests in a
# process the program never ran in.
import builtins
import json
import operator
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
CLEAN_BUILTINS = dict(vars(builtins))
LIBRARY = tuple(os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix))
abspath = os.path.abspath  # taken before the program could replace it
COMPARE = {"Eq": operator.eq, "NotEq": operator.ne, "Lt": operator.lt, "LtE": operator.le, "Gt": operator.gt,
           "GtE": operator.ge, "Is": operator.is_, "IsNot": operator.is_not,
           "In": lambda a, b: operator.contains(b, a), "NotIn": lambda a, b: not operator.contains(b, a)}


def reporter(nonce, out, write=os.write, dumps=json.dumps):
    """`report(name, passed, message)`; the nonce and the private stdout copy (it survives
    the program closing or redirecting fd 1) live only in this closure, not in a global."""
    def report(name, passed, message=""):
        line = "%s %s\n" % (nonce, dumps({"name": name, "passed": passed, "message": message[-2000:]}))
        write(out, line.encode())
    return report


report = reporter(spec.pop("nonce"), os.dup(1))


def restore_builtins():
    """The builtins module as it was before the program ran."""
    current = vars(builtins)
    for name in set(current) - set(CLEAN_BUILTINS):
        del current[name]
    current.update(CLEAN_BUILTINS)


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
                why = "\n" + head if exc.args else ""  # the guard's reason
                return "%s\nexpected %s, got %s%s" % (where, short(want), short(got), why)
        except Exception:  # noqa: BLE001 - the plain message is still useful
            pass
    return "%s\n%s" % (where, head)


PROGRAM_CLASSES = {}


# What a comparison, a truth test or `in` asks of an object itself (a set or dict of them: hash).
JUDGING = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__len__", "__contains__",
           "__iter__", "__getitem__", "__hash__")


def program_class(cls):
    """Whether the program wrote one of `cls`'s JUDGING methods (or a base's): code compiled
    from outside the interpreter's own library that is not a test's. A namedtuple or a class
    that only adds methods keeps the builtin judgement and is not one."""
    if cls not in PROGRAM_CLASSES:
        found = False
        for klass in cls.__mro__:
            for name in JUDGING:
                attr = vars(klass).get(name)
                code = getattr(attr, "__code__", None) or getattr(getattr(attr, "__func__", None), "__code__", None)
                filename = getattr(code, "co_filename", None)
                if not isinstance(filename, str) or filename.startswith(("<test ", "<frozen ")):
                    continue
                if filename.startswith("<") or not abspath(filename).startswith(LIBRARY):
                    found = True  # main.py, a module it wrote, or source it exec'd
        PROGRAM_CLASSES[cls] = found
    return PROGRAM_CLASSES[cls]


def from_program(value):
    """The class with methods the program wrote of `value`, or of an object it holds in a
    list, tuple, set or dict; None when there is none."""
    cls = type(value)
    if cls in (list, tuple, set, frozenset):
        return next((c for c in map(from_program, value) if c is not None), None)
    if cls is dict:
        return next((c for c in map(from_program, (x for kv in value.items() for x in kv)) if c is not None), None)
    return cls if program_class(cls) else None


def refuse(cls):
    raise AssertionError("an object of the program's class %s stands where a plain value is expected: its own "
                         "comparison or truth value is not trusted" % cls.__name__)


def guarded_compare(ops, *operands):
    """`operands[0] ops[0] operands[1] ...` as Python evaluates a chain (every operand already
    evaluated), refusing a comparison between a program-made object and a value that is not."""
    result = True
    for op, a, b in zip(ops, operands, operands[1:]):
        if op not in ("Is", "IsNot"):
            a_ours, b_ours = from_program(a), from_program(b)
            if (a_ours is None) != (b_ours is None):
                refuse(a_ours or b_ours)
        result = COMPARE[op](a, b)
        if not result:
            return result
    return result


def guarded_truth(value):
    cls = from_program(value)
    if cls is not None:
        refuse(cls)
    return value


SOURCES = {}
asserts = [t for t in spec["tests"] if t["kind"] == "assert"]
ios = [t for t in spec["tests"] if t["kind"] == "io"]
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

# Every assert test compiled before the program runs (its code guarded by the host:
# harness.guarded_source; its source kept for messages), so nothing the program does reaches that.
compiled = []
for i, t in enumerate(asserts):
    filename = "<test %s>" % (t["name"] or "test_%d" % i)
    SOURCES[filename] = t["source"].splitlines()
    try:
        compiled.append(compile(t["code"], filename, "exec"))
    except BaseException as e:  # noqa: BLE001 - a test that does not compile fails, alone
        compiled.append("the test does not compile: %s: %s" % (type(e).__name__, e))

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
    restore_builtins()
    namespace["__builtins__"] = dict(CLEAN_BUILTINS)
    namespace["__rlsys_compare__"], namespace["__rlsys_truth__"] = guarded_compare, guarded_truth
for i, (t, code) in enumerate(zip(asserts, compiled)):
    name = t["name"] or "test_%d" % i
    if program_error or isinstance(code, str):
        report(name, False, program_error or code)
        continue
    filename = "<test %s>" % name
    try:
        exec(code, namespace)
        restore_builtins()
        report(name, True)
    except BaseException as e:  # noqa: BLE001 - a test that exits or is interrupted fails
        try:
            message = error_tail(e, filename)
        except BaseException:  # noqa: BLE001 - e.g. out of memory while formatting
            message = type(e).__name__
        restore_builtins()
        report(name, False, message)

