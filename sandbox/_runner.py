# The test runner. Runs INSIDE the sandbox (standard library only) as a fresh interpreter,
# `python3 -E -s _rlsys_runner.py`, in two processes:
# - this one, the judge: it runs every test and reports one JSON line per test, prefixed by
#   the report nonce, on a private copy of stdout. It never runs a line of the program.
# - the program's process, forked from the judge before the judge reads the tests or the nonce
#   (so neither is in its memory). It runs main.py once, then answers the judge's requests
#   about the program's objects: call this function with these arguments, get this attribute,
#   the next item, ... (`program_process`).
# Values cross the pipe between them as plain data (numbers, strings, bytes and containers of
# them: `encode` / `decode`, JSON, never pickle). Any other object stays in the program's
# process; the judge holds a `ProgramObject` for it, which refuses to stand for a plain value
# (comparing it with one, `in`, or a truth value its own `__bool__`/`__len__` would give).
# So the comparisons that decide a test run on values in a process the program never ran in,
# whatever the program patches, walks or plants. The judge is not dumpable from before the
# fork (the program can read neither its memory nor its fds), imports nothing from a directory
# the program can write, and reads the tests from a pipe (bwrap: `RLSYS_TESTS_FD`) or a file it
# deletes before the program starts. stdin/stdout cases run main.py as the judge's child
# processes. A test that never reports counts as failed on the host.
import builtins
import gc
import json
import os
import sys
import time

# ast, select, subprocess and traceback are imported where needed: each costs ms of every check.

PROGRAM_PATH = list(sys.path)  # the program imports its own modules from the work dir, as python3 main.py would
# The judge imports (lazily, after the program started) only from directories the program cannot
# write (its work dir above all; as root, where access() says yes to all, the work dir only).
sys.path[:] = [
    p
    for p in sys.path
    if p
    and os.path.isdir(p)
    and os.path.realpath(p) != os.path.realpath(".")
    and (os.geteuid() == 0 or not os.access(p, os.W_OK))
]
if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)  # a big integer answer crosses as JSON text
TESTS_FILE, TESTS_FD = "_rlsys_tests.json", os.environ.pop("RLSYS_TESTS_FD", None)
MAX_REPR = 300
MAX_DEPTH = 100  # a deeper (or cyclic) container stays in the program's process
MUTABLE = (list, dict, set, bytearray)


def encode(value, other, depth=0):
    """`value` as JSON-ready data: None, bool, int, float and str as they are, containers and a
    few exact value types tagged (`{"l": [...]}` a list, ...), a subclass of a container or
    number as its base type; anything else goes to `other(value)` (the program's process makes
    a handle of it, the judge refuses it)."""
    t = type(value)
    if value is None or t is bool or t is int or t is float or t is str:
        return value
    if depth > MAX_DEPTH:
        return other(value)
    enc = lambda items: [encode(v, other, depth + 1) for v in items]  # noqa: E731
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        base = next(b for b in (list, tuple, set, frozenset, dict) if isinstance(value, b))
        if base is dict:
            return {"d": [[encode(k, other, depth + 1), encode(v, other, depth + 1)] for k, v in dict.items(value)]}
        return {{list: "l", tuple: "t", set: "s", frozenset: "f"}[base]: enc(base.__iter__(value))}
    if isinstance(value, int):  # a subclass (bool has none: exact bools returned above)
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray)):
        return {"y" if isinstance(value, bytearray) else "b": bytes(value).decode("latin-1")}
    if isinstance(value, complex):
        return {"c": [value.real, value.imag]}
    if isinstance(value, range):
        return {"r": [value.start, value.stop, value.step]}
    name = (t.__module__, t.__qualname__)
    if name == ("collections", "deque"):
        return {"q": enc(value)}
    if name == ("fractions", "Fraction"):
        return {"F": [value.numerator, value.denominator]}
    if name == ("decimal", "Decimal"):
        return {"D": str(value)}
    return other(value)


def decode(data, handle):
    """The value `encode` made `data` from; `handle(ref)` for a handle. Raises on anything else."""
    t = type(data)
    if data is None or t is bool or t is int or t is float or t is str:
        return data
    ((tag, v),) = data.items()  # a dict of one item, or this raises
    dec = lambda items: [decode(x, handle) for x in items]  # noqa: E731
    if tag in "ltsfq" and type(v) is not list:
        raise ValueError("malformed %s" % tag)
    if tag == "l":
        return dec(v)
    if tag == "t":
        return tuple(dec(v))
    if tag == "s":
        return set(dec(v))
    if tag == "f":
        return frozenset(dec(v))
    if tag == "d":
        return {decode(k, handle): decode(x, handle) for k, x in v}
    if tag in ("b", "y"):
        return (bytes if tag == "b" else bytearray)(str.encode(v, "latin-1"))
    if tag == "c":
        return complex(float(v[0]), float(v[1]))
    if tag == "r":
        return range(*(int.__index__(x) for x in v))
    if tag == "q":
        import collections

        return collections.deque(dec(v))
    if tag == "F":
        import fractions

        return fractions.Fraction(int.__index__(v[0]), int.__index__(v[1]))
    if tag == "D":
        import decimal

        return decimal.Decimal(str.__str__(v))
    if tag in ("h", "m"):
        return handle(tag, v)
    raise ValueError("unknown tag %r" % tag)


def send(stream, message):
    stream.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
    stream.flush()


# ---------------------------------------------------------------- the program's process


def program_process(requests, replies):
    """Wait for "go", run main.py as `__main__`, send its globals, then apply the judge's
    requests to the program's objects until the judge closes the pipe. Never returns."""
    import operator
    import types

    exit_now, stdout, stderr = os._exit, sys.stdout, sys.stderr
    objects, index = [], {}

    def handle_of(value):
        key = id(value)
        if key not in index:
            index[key] = len(objects)
            objects.append(value)  # kept alive, so an id is never reused
        default_truth = not any(hasattr(type(value), m) for m in ("__bool__", "__len__"))
        ref = [index[key], type(value).__qualname__, default_truth]
        return {"m": [value.__name__, *ref]} if isinstance(value, types.ModuleType) else {"h": ref}

    def encoded(value):
        try:
            return encode(value, handle_of)
        except RecursionError:
            return handle_of(value)

    def raised(e):
        import traceback

        where = ""
        for frame in traceback.extract_tb(e.__traceback__):
            if frame.filename == "main.py":
                where = "main.py line %d: %s" % (frame.lineno, (frame.line or "").strip())
        try:
            args = encoded(e.args)
        except BaseException:  # noqa: BLE001 - e.g. args whose repr fails
            args = {"t": []}
        return ["raise", [c.__name__ for c in type(e).__mro__], args, where]

    def call(f, args, kwargs):
        """The result, and each list, dict, set or bytearray argument as the call left it (the
        judge passed copies: `ProgramObject.__call__` writes changes back)."""
        result = f(*args, **kwargs)
        return result, [a if type(a) in MUTABLE else None for a in args]

    def is_instance(value, cls):
        return isinstance(value, cls)

    requests_api = {
        "call": call,
        "getattr": getattr,
        "setattr": setattr,
        "delattr": delattr,
        "getitem": operator.getitem,
        "setitem": operator.setitem,
        "delitem": operator.delitem,
        "iter": iter,
        "next": next,
        "len": len,
        "repr": repr,
        "str": str,
        "isinstance": is_instance,
        "int": int,
        "float": float,
        "index": operator.index,
    }
    for name in (
        "add",
        "sub",
        "mul",
        "truediv",
        "floordiv",
        "mod",
        "pow",
        "matmul",
        "and_",
        "or_",
        "xor",
        "lshift",
        "rshift",
        "neg",
        "pos",
        "abs",
        "invert",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
    ):
        requests_api[name] = getattr(operator, name)

    if not requests.readline():
        exit_now(0)  # no assert tests: the judge never needs the program here
    sys.path[:] = PROGRAM_PATH
    sys.argv = ["main.py"]
    main = types.ModuleType("__main__")
    main.__file__ = "main.py"
    sys.modules["__main__"] = main
    try:
        with open("main.py", "rb") as f:
            exec(compile(f.read(), "main.py", "exec"), main.__dict__)
        reply = [
            "ready",
            {
                "d": [
                    [k, encoded(v)]
                    for k, v in list(main.__dict__.items())
                    if not (k.startswith("__") and k.endswith("__"))
                ]
            },
        ]
    except SystemExit as e:
        reply = ["ready", {}] if e.code in (None, 0) else raised(e)
    except BaseException as e:  # noqa: BLE001 - reported to the judge, which fails every test
        reply = raised(e)
    while True:
        try:
            send(replies, reply)
            line = requests.readline()
        except BaseException:  # noqa: BLE001 - the judge is gone
            break
        if not line:
            break
        try:
            name, *args = json.loads(line)
            args = decode({"t": args}, lambda tag, ref: objects[ref[1] if tag == "m" else ref[0]])
            reply = ["ok", encoded(requests_api[name](*args))]
        except BaseException as e:  # noqa: BLE001 - the program's exception, sent to the judge
            reply = raised(e)
    for stream in (stdout, stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    exit_now(0)


def set_dumpable(flag):
    """prctl(PR_SET_DUMPABLE, flag). Not dumpable, /proc/<pid>/mem, fd, environ, ... are root's:
    the program's process (the same user) cannot read the nonce out of the judge."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, flag, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, %d) failed" % flag)


set_dumpable(0)  # before the fork: never a moment when the judge holds the nonce and can be read
gc.freeze()  # the collector leaves the objects both processes start with alone: fewer pages copied
requests_read, requests_write = os.pipe()
replies_read, replies_write = os.pipe()
CHILD = os.fork()
if CHILD == 0:
    set_dumpable(1)  # the program's process is an ordinary one
    os.close(requests_write)
    os.close(replies_read)
    if TESTS_FD is not None:
        os.close(int(TESTS_FD))
    program_process(os.fdopen(requests_read, "rb"), os.fdopen(replies_write, "wb"))
os.close(requests_read)
os.close(replies_write)
to_program, from_program = os.fdopen(requests_write, "wb"), os.fdopen(replies_read, "rb")


# ---------------------------------------------------------------- the judge

if TESTS_FD is not None:
    with os.fdopen(int(TESTS_FD), "rb") as f:
        spec = json.loads(f.read())
else:
    with open(TESTS_FILE) as f:
        spec = json.load(f)
    os.unlink(TESTS_FILE)


def reporter(nonce, out, write=os.write, dumps=json.dumps):
    """`report(name, passed, message)`; the nonce lives only in this closure."""

    def report(name, passed, message=""):
        line = "%s %s\n" % (nonce, dumps({"name": name, "passed": passed, "message": message[-2000:]}))
        write(out, line.encode())

    return report


report = reporter(spec.pop("nonce"), os.dup(1))


class ProgramGone(BaseException):
    """The program's process exited: no test's `except Exception` swallows it."""


GONE = []  # why the program's process is gone, once it is
PROXIES = {}  # handle -> its ProgramObject: the same object in the program is the same one here


def gone(during):
    """The program's end of the pipe closed: why (its exit status), once; it stays gone."""
    if not GONE:
        for _ in range(50):  # exiting, it closes its files just before its status is ready
            pid, status = os.waitpid(CHILD, os.WNOHANG)
            if pid:
                break
            time.sleep(0.002)
        else:  # alive with its pipe closed
            os.kill(CHILD, 9)
            os.waitpid(CHILD, 0)
            status = None
        how = (
            "closed its pipe to the judge"
            if status is None
            else "killed by signal %d" % os.WTERMSIG(status)
            if os.WIFSIGNALED(status)
            else "exited (code %d)" % os.WEXITSTATUS(status)
        )
        GONE.append("the program's process %s %s" % (how, during))
    raise ProgramGone(GONE[0])


def not_plain(value):
    raise TypeError(
        "only plain values (numbers, strings, bytes, containers of them) and the program's own "
        "objects can be passed to the program, not %s" % type(value).__name__
    )


def as_request(value):
    return {"h": [value._rlsys_id]} if type(value) is ProgramObject else not_plain(value)


def proxy(tag, ref):
    if tag == "m":
        name, ref = ref[0], ref[1:]
        if name.partition(".")[0] in getattr(sys, "stdlib_module_names", ()):
            import importlib

            try:
                return importlib.import_module(name)  # the judge's own copy: the program may have patched its one
            except Exception:  # noqa: BLE001 - e.g. tkinter without its library: the program's one, then
                pass
    idx, type_name, default_truth = int.__index__(ref[0]), str.__str__(ref[1]), ref[2] is True
    if idx not in PROXIES:
        PROXIES[idx] = ProgramObject(idx, type_name, default_truth)
    return PROXIES[idx]


def rebuilt(names, args, where):
    """The program's exception as the first builtin exception class in its MRO."""
    for name in names:
        cls = getattr(builtins, name, None) if type(name) is str else None
        if isinstance(cls, type) and issubclass(cls, BaseException):
            try:
                e = cls(*args)
                break
            except Exception:  # noqa: BLE001 - e.g. UnicodeDecodeError wants five arguments
                continue
    else:
        e = Exception(*args)
    where = where if type(where) is str else ""
    if names and names[0] != type(e).__name__ and type(names[0]) is str:
        where = "%s (as %s)" % (names[0], type(e).__name__) + (" at " + where if where else "")
    elif where:
        where = "at " + where
    e._rlsys_where = where
    return e


def ask(name, *args, during="during this test"):
    """Apply request `name` to `args` in the program's process; its result (plain data or a
    ProgramObject), or its exception raised here."""
    if GONE:
        raise ProgramGone(GONE[0])
    try:
        if name is not None:  # None: only the reply to a request already sent
            send(to_program, [name, *(encode(a, as_request) for a in args)])
        line = from_program.readline()
    except OSError:
        line = b""
    if not line:
        gone(during)
    try:
        kind, *rest = json.loads(line)
        if kind == "raise":
            names, exc_args, where = rest
            exc_args = decode(exc_args, proxy)
        else:
            value = decode(rest[0], proxy)
    except Exception as e:  # noqa: BLE001 - the program's process wrote something else on the pipe
        raise ProgramGone("malformed reply from the program's process: %s" % type(e).__name__) from None
    if kind == "raise":
        e = rebuilt(names, exc_args if type(exc_args) is tuple else (), where)
        if type(e) is StopIteration and name != "next":  # would end the test's loop early: all(map(f, cases))
            raise RuntimeError("the program raised StopIteration outside an iterator") from e
        raise e
    return value


def refuse(obj, what):
    raise AssertionError(
        "an object of the program's class %s stands where a plain value is expected: its own "
        "%s is not trusted" % (obj._rlsys_type, what)
    )


class ProgramObject:
    """An object that lives in the program's process; each use of it is a request there. It
    compares only with other program objects (the program's own methods answer): with a plain
    value, for `in`, or as a truth value when its class has `__bool__` or `__len__`, it refuses
    (AssertionError), because the program's methods would answer for the test. Without them its
    truth is Python's default, True (the program's process says which: a lie buys no more than
    returning a bare `object()` would)."""

    __slots__ = ("_rlsys_id", "_rlsys_type", "_rlsys_default_truth")

    def __init__(self, idx, type_name, default_truth=False):
        object.__setattr__(self, "_rlsys_id", idx)
        object.__setattr__(self, "_rlsys_type", type_name)
        object.__setattr__(self, "_rlsys_default_truth", default_truth)

    def __getattr__(self, name):
        return ask("getattr", self, name)

    def __setattr__(self, name, value):
        ask("setattr", self, name, value)

    def __delattr__(self, name):
        ask("delattr", self, name)

    def __call__(self, *args, **kwargs):
        result, after = ask("call", self, args, kwargs)
        for arg, changed in zip(args, after):  # an argument the program changed in place, changed here too
            if type(arg) in MUTABLE and type(changed) is type(arg):
                if type(arg) is dict or type(arg) is set:
                    arg.clear()
                    arg.update(changed)
                else:
                    arg[:] = changed
        return result

    def __repr__(self):
        try:
            text = ask("repr", self)
        except Exception:  # noqa: BLE001 - a broken __repr__ still gets a name in a message
            text = None
        return text if type(text) is str else "<%s object of the program>" % self._rlsys_type

    def __str__(self):
        return ask("str", self)

    def __hash__(self):
        return object.__hash__(self)

    def __bool__(self):
        if self._rlsys_default_truth:
            return True
        refuse(self, "truth value")

    def __contains__(self, item):
        refuse(self, "membership test")

    def __instancecheck__(self, value):
        return ask("isinstance", value, self) is True


def request_method(name, reflected=False):
    if reflected:
        return lambda self, other: ask(name, other, self)
    return lambda self, *args: ask(name, self, *args)


for _name in (
    "len",
    "iter",
    "next",
    "getitem",
    "setitem",
    "delitem",
    "int",
    "float",
    "index",
    "neg",
    "pos",
    "abs",
    "invert",
):
    setattr(ProgramObject, "__%s__" % _name, request_method(_name))
for _name in (
    "add",
    "sub",
    "mul",
    "truediv",
    "floordiv",
    "mod",
    "pow",
    "matmul",
    "and_",
    "or_",
    "xor",
    "lshift",
    "rshift",
):
    setattr(ProgramObject, "__%s__" % _name.rstrip("_"), request_method(_name))
    setattr(ProgramObject, "__r%s__" % _name.rstrip("_"), request_method(_name, reflected=True))


def comparison(name, what):
    def compare(self, other):
        if type(other) is ProgramObject:
            return ask(name, self, other)
        refuse(self, what)

    return compare


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(ProgramObject, "__%s__" % _name, comparison(_name, "comparison"))


def short(value):
    text = repr(value)
    return text if len(text) <= MAX_REPR else text[:MAX_REPR] + "..."


def error_tail(exc, filename):
    """`Type: message` plus where it happened (the test's line, the program's line when the
    program raised); for a failed `assert a == b` in the test's own code, the two sides
    re-evaluated: what was expected and what came back."""
    import ast
    import traceback

    head = traceback.format_exception_only(type(exc), exc)[-1].strip()
    if getattr(exc, "_rlsys_where", ""):
        head += "\nraised in the program " + exc._rlsys_where
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
                why = "\n" + head if exc.args else ""  # the assert's own message, or why it was refused
                return "%s\nexpected %s, got %s%s" % (where, short(want), short(got), why)
        except BaseException:  # noqa: BLE001 - the plain message is still useful
            pass
    return "%s\n%s" % (where, head)


SOURCES = {}
asserts = [t for t in spec["tests"] if t["kind"] == "assert"]
ios = [t for t in spec["tests"] if t["kind"] == "io"]
if asserts:
    try:
        send(to_program, ["go"])  # the program runs while the judge gets its tests ready
    except OSError:
        pass  # gone already: the reply says so
if ios:
    import subprocess
deadline = time.monotonic() + spec["wall_time_s"]
for i, t in enumerate(ios):
    name = t["name"] or "case_%d" % i
    timeout = max(0.01, min(t["timeout_s"] or spec["wall_time_s"], deadline - time.monotonic()))
    try:
        p = subprocess.run(
            [sys.executable, "-E", "-s", "main.py"], input=t["stdin"].encode(), capture_output=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        report(name, False, "timed out after %.1f s" % timeout)
        continue
    got = p.stdout.decode("utf-8", "replace")
    want, have = (
        [l.rstrip() for l in t["expected_stdout"].rstrip().splitlines()],
        [l.rstrip() for l in got.rstrip().splitlines()],
    )
    if p.returncode != 0:
        report(name, False, "exit code %d\n%s" % (p.returncode, p.stderr.decode("utf-8", "replace")[-1000:]))
    elif want != have:
        n = next(
            (k for k in range(max(len(want), len(have))) if k >= len(want) or k >= len(have) or want[k] != have[k]), 0
        )
        report(
            name,
            False,
            "line %d: expected %s, got %s"
            % (
                n + 1,
                short(want[n] if n < len(want) else "<end of output>"),
                short(have[n] if n < len(have) else "<end of output>"),
            ),
        )
    else:
        report(name, True)

compiled = []
for i, t in enumerate(asserts):
    filename = "<test %s>" % (t["name"] or "test_%d" % i)
    SOURCES[filename] = t["code"].splitlines()
    try:
        compiled.append(compile(t["code"], filename, "exec"))
    except BaseException as e:  # noqa: BLE001 - a test that does not compile fails, alone
        compiled.append("the test does not compile: %s: %s" % (type(e).__name__, e))

program_error, namespace = None, {"__builtins__": builtins, "__name__": "__rlsys_tests__"}
if asserts:
    try:
        namespace.update(ask(None, during="before its tests ran"))
    except ProgramGone as e:
        program_error = str(e)
    except BaseException as e:  # noqa: BLE001 - the program raised while it ran
        program_error = "the program raised before the tests: " + error_tail(e, "main.py")
for i, (t, code) in enumerate(zip(asserts, compiled)):
    name = t["name"] or "test_%d" % i
    if program_error or isinstance(code, str):
        report(name, False, program_error or code)
        continue
    try:
        exec(code, namespace)
        report(name, True)
    except BaseException as e:  # noqa: BLE001 - a test that exits or is interrupted fails
        try:
            message = error_tail(e, "<test %s>" % name)
        except BaseException:  # noqa: BLE001 - e.g. out of memory while formatting
            message = type(e).__name__
        report(name, False, message)

to_program.close()  # the program's process flushes its output and exits: its end of the pipe closes
if not GONE:
    import select

    if not select.select([from_program], [], [], 1.0)[0]:  # or a child it forked holds the pipe open
        os.kill(CHILD, 9)
    os.waitpid(CHILD, 0)
