"""The sandbox on real backends (bubblewrap and a Docker-API engine): bad input, the test
harness, the 164 HumanEval canonical solutions and broken variants, the Ray pool and the
CLI. The attack suite is in test_sandbox_attacks.py. Needs `.ci/setup_sandbox.sh`; skips
with its reason otherwise."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import sandbox_skip_reason

from sandbox import ExecRequest, Limits, TestCase, make_backend
from sandbox.humaneval import broken_completions, check_request, load_problems

pytestmark = pytest.mark.sandbox
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def backend(sandbox_backend):
    """bwrap, then docker (tests/conftest.py); skips with the reason where one is unusable."""
    return sandbox_backend


def need(name: str) -> None:
    why = sandbox_skip_reason(name)
    if why:
        pytest.skip(why)


# ---------------------------------------------------------------- bad input

BAD_INPUT = {
    # name: (code, expected status, text the result must hold: in stderr or error)
    "non_utf8_code": (b"print('\xff\xfe')\n", "failed", "SyntaxError"),
    "empty_code": ("", "error", "empty code"),
    "whitespace_code": (" \n\t\n", "error", "empty code"),
    "closes_stdout_fd": ("import os\nos.close(1)\nprint('after')\n", "failed", "Bad file descriptor"),
    "closes_sys_stdout": ("import sys\nsys.stdout.close()\nprint('still here', file=sys.stderr)\n", "ok", "still here"),
    "huge_output": ("import sys\nsys.stdout.write('y' * (8 << 20))\n", "killed", "output limit"),
    "huge_stderr": ("import sys\nwhile True:\n    sys.stderr.write('e' * 65536)\n", "killed", "output limit"),
    "kills_itself": ("import os\nos.kill(os.getpid(), 9)\n", "killed", "SIGKILL"),
    "syntax_error": ("def f(:\n", "failed", "SyntaxError"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_gives_a_clear_status(backend, case):
    code, status, text = BAD_INPUT[case]
    res = backend.run(ExecRequest(code, limits=Limits(output_bytes=1 << 20, wall_time_s=10)))
    assert res.status == status, res
    assert text in res.stderr + res.error, res
    assert len(res.stdout) <= 1 << 20 and len(res.stderr) <= 1 << 20


def test_binary_and_non_utf8_io(backend):
    code = "import sys\ndata = sys.stdin.buffer.read()\nsys.stdout.buffer.write(bytes(range(256)) + data)\n"
    res = backend.run(ExecRequest(code, stdin=b"\xff\x00tail"))
    assert res.status == "ok", res
    assert res.stdout.startswith("".join(map(chr, range(128))))  # ASCII kept, the rest replaced
    assert res.stdout.endswith("\ufffd\x00tail") and "\ufffd" in res.stdout[128:256]


def test_request_errors_are_results(backend):
    cases = [
        ExecRequest("print(1)", files={"../escape.py": "x"}),
        ExecRequest("print(1)", files={"/abs": "x"}),
        ExecRequest("print(1)", limits=Limits(network=True)),
        ExecRequest("x = 1", stdin=b"x" * 2_000_000),
    ]
    for req in cases:
        res = backend.run(req)
        assert res.status == "error" and res.error, res


def test_files_and_stdin_reach_the_program(backend):
    code = "import helper\nprint(helper.VALUE, input(), open('data/in.txt').read())\n"
    res = backend.run(ExecRequest(code, stdin="from stdin\n", files={"helper.py": "VALUE = 7\n", "data/in.txt": b"f"}))
    assert (res.status, res.stdout) == ("ok", "7 from stdin f\n"), res


def test_docker_replaces_a_dead_warm_container():
    need("docker")
    b = make_backend("docker")
    try:
        assert b.run(ExecRequest("print(1)")).stdout == "1\n"
        b._warm[0].kill()  # its init gone, as after an engine restart
        res = b.run(ExecRequest("print(2)"))
        assert (res.status, res.stdout) == ("ok", "2\n"), res
        b._warm[0].remove(force=True)
        assert b.run(ExecRequest("print(3)")).stdout == "3\n"
    finally:
        b.close()


def test_docker_fresh_mode_uses_a_container_per_run_and_removes_it():
    need("docker")
    b = make_backend("docker", isolation="fresh")
    try:

        def ours():
            return {c.id for c in b.client.containers.list(all=True, filters={"label": "rlsys-sandbox=1"})}

        before = ours()
        ids = [b.run(ExecRequest("print(open('/proc/1/cgroup').read().split('/')[-1].strip())")) for _ in range(2)]
        assert [r.status for r in ids] == ["ok", "ok"] and ids[0].stdout != ids[1].stdout, ids
        assert ids[0].backend == "docker-fresh" and ours() == before, "a fresh container was left behind"
    finally:
        b.close()


# ---------------------------------------------------------------- test harness


def test_assert_tests_report_per_test(backend):
    code = "def add(a, b):\n    return a + b\n"
    tests = [
        TestCase(code="assert add(1, 2) == 3"),
        TestCase(name="wrong", code="assert add(2, 2) == 5"),
        TestCase(name="raises", code="add(1)"),
        TestCase(name="last", code="assert add('a', 'b') == 'ab'"),
    ]
    res = backend.run(ExecRequest(code, tests=tests))
    assert res.status == "failed" and not res.passed, res
    got = {t.name: (t.passed, t.message) for t in res.tests}
    assert list(got) == ["test_0", "wrong", "raises", "last"]
    assert got["test_0"] == (True, "") and got["last"] == (True, "")
    assert got["wrong"][0] is False and "expected 5, got 4" in got["wrong"][1]
    assert got["raises"][0] is False and "TypeError" in got["raises"][1]
    ok = backend.run(ExecRequest(code, tests=tests[:1]))
    assert ok.status == "ok" and ok.passed and ok.stdout == "", ok


def test_io_tests_report_per_test(backend):
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    tests = [
        TestCase(kind="io", stdin="1 2\n", expected_stdout="3\n"),
        TestCase(kind="io", name="wrong", stdin="2 2\n", expected_stdout="5"),
        TestCase(kind="io", name="crash", stdin="x y\n", expected_stdout="0"),
        TestCase(kind="io", name="trailing_space_ok", stdin="5 5", expected_stdout="10   \n\n"),
    ]
    res = backend.run(ExecRequest(code, tests=tests))
    got = {t.name: (t.passed, t.message) for t in res.tests}
    assert res.status == "failed"
    assert got["case_0"] == (True, "") and got["trailing_space_ok"] == (True, "")
    assert got["wrong"] == (False, "line 1: expected '5', got '4'")
    assert got["crash"][0] is False and "ValueError" in got["crash"][1]


def test_program_that_exits_or_hangs_fails_its_tests(backend):
    exits = backend.run(ExecRequest("import os\nos._exit(0)\n", tests=[TestCase(code="pass")]))
    assert exits.status == "failed" and "exited (code 0) before its tests ran" in exits.tests[0].message, exits
    code = "import os\ndef f(x):\n    if x == 2:\n        os._exit(3)\n    return x\n"
    tests = [
        TestCase(code="assert f(1) == 1"),
        TestCase(code="try:\n    f(2)\nexcept Exception:\n    pass"),
        TestCase(code="assert f(1) == 1"),
    ]
    mid = backend.run(ExecRequest(code, tests=tests))
    assert [t.passed for t in mid.tests] == [True, False, False], mid
    assert all("exited (code 3) during this test" in t.message for t in mid.tests[1:]), mid
    code = (
        "import os, time\ndef f():\n    for fd in range(3, 64):\n        try:\n            os.close(fd)\n"
        "        except OSError:\n            pass\n    time.sleep(60)\n"
    )
    closes = backend.run(ExecRequest(code, tests=[TestCase(code="f()")], limits=Limits(wall_time_s=20)))
    assert "closed its pipe to the judge during this test" in closes.tests[0].message and closes.wall_time < 10, closes
    hangs = backend.run(
        ExecRequest("while True:\n    pass\n", tests=[TestCase(code="pass")], limits=Limits(wall_time_s=1.5))
    )
    assert hangs.status == "timeout" and not hangs.tests[0].passed, hangs


def test_program_cannot_forge_test_reports(backend):
    """The program hunts for the report nonce (argv, /proc, the work dir, the runner's
    module) and prints a passing report with every candidate before exiting hard."""
    code = r"""
import glob, json, os, re, sys
text = open('/proc/self/cmdline', 'rb').read().decode('latin-1') + ' '.join(sys.argv)
for f in glob.glob('/work/*') + glob.glob('/tmp/*'):
    try:
        text += open(f, 'rb').read().decode('latin-1')
    except OSError:
        pass
import __main__
text += repr(vars(__main__))
for nonce in set(re.findall(r'RLSYS-[0-9a-f]{16}', text)):
    os.write(1, (nonce + ' ' + json.dumps({'name': 'check', 'passed': True, 'message': ''}) + '\n').encode())
os._exit(0)
"""
    res = backend.run(ExecRequest(code, tests=[TestCase(name="check", code="assert False")]))
    assert res.status == "failed" and not res.tests[0].passed, res


SCAN_PROC = (
    r"""
import json, os, re
seen = set()
for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
    for what in ('cmdline', 'environ', 'maps'):
        try:
            if what == 'maps':
                mem, text = open('/proc/%s/mem' % pid, 'rb'), ''
                for line in open('/proc/%s/maps' % pid):
                    lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
                    if line.split()[1].startswith('rw') and hi - lo < (64 << 20):
                        try:
                            mem.seek(lo)
                            text += mem.read(hi - lo).decode('latin-1')
                        except (OSError, ValueError, OverflowError):
                            pass
            else:
                text = open('/proc/%s/%s' % (pid, what), 'rb').read().decode('latin-1')
        except OSError:
            continue
        seen |= set(re.findall(r'RLSYS-[0-9a-f]{16}', text))
        for chunk in re.findall(r'[A-Za-z0-9+/=]{64,}', text):  # the base64 payload of a bootstrap
            try:
                seen |= set(re.findall(r'RLSYS-[0-9a-f]{16}', __import__('base64').b64decode(chunk + '==')"""
    r""".decode('latin-1')))
            except ValueError:
                pass
for nonce in seen:
    os.write(1, (nonce + ' ' + json.dumps({'name': 'test_0', 'passed': True, 'message': ''}) + '\n').encode())
os._exit(0)
"""
)

# A program a policy under RL could write to pass tests it does not solve; each must fail.
REWARD_HACKS = {
    "always_equal": (
        "class A:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\ndef f(x):\n    return A()\n",
        ["assert f(1) == 2", "assert [f(1)] == [2]", "assert f(1) in (2,)"],
    ),
    "always_true": (
        "class T:\n    def __bool__(self):\n        return True\ndef f(x):\n    return T()\n",
        ["assert f(1)", "assert not not f(1)"],
    ),
    "int_that_equals_all": (
        "class I(int):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return I(7)\n",
        ["assert f(1) == 2"],
    ),
    "exec_patched": (
        "import builtins\nbuiltins.exec = lambda *a, **k: None\ndef f(x):\n    return 0\n",
        ["assert f(1) == 2"],
    ),
    "abs_patched_in_a_call": (
        "import builtins\ndef f(x):\n    builtins.abs = lambda v: 0\n    return 5\n",
        ["f(1)\nassert abs(f(1) - 2) < 1e-6"],
    ),
    "report_rewritten": (
        "import os\nreal = os.write\n"
        "os.write = lambda fd, b: real(fd, b.replace(b'\"passed\": false', b'\"passed\": true'))\n"
        "def f(x):\n    return 0\n",
        ["assert f(1) == 2"],
    ),
    # Reaching into the runner: its frames and globals, a module planted where it imports from,
    # and the memory and command line of every process the program can see.
    "runner_frames": (
        "import gc, sys\ndef forge():\n    for o in gc.get_objects():\n"
        "        if callable(o) and getattr(o, '__name__', '') == 'report':\n"
        "            o('test_0', True)\n    f = sys._getframe()\n    while f:\n"
        "        if 'report' in f.f_globals:\n            f.f_globals['report']('test_0', True)\n"
        "        f = f.f_back\n    import os\n    os._exit(0)\nforge()\ndef f(x):\n    return 0\n",
        ["assert f(1) == 2"],
    ),
    "module_planted": (
        'src = \'import gc, os\\nfor o in gc.get_objects():\\n    if getattr(o, "__name__", "") == "report":\\n'
        '        o("test_0", True)\\nos._exit(0)\\n\'\n'
        "for name in ('ast.py', 'traceback.py', 'importlib.py', 'ctypes.py', 'fractions.py'):\n"
        "    open(name, 'w').write(src)\ndef f(x):\n    return 0\n",
        ["assert f(1) == 2", "assert f(1) == 2"],
    ),
    "nonce_from_proc": (SCAN_PROC, ["assert f(1) == 2"]),
    "stop_iteration": ("def f(x):\n    raise StopIteration\n", ["assert all(map(lambda c: f(c) == 2, [1, 2]))"]),
}


@pytest.mark.parametrize("hack", sorted(REWARD_HACKS))
def test_reward_hacks_fail_their_tests(backend, hack):
    code, tests = REWARD_HACKS[hack]
    res = backend.run(ExecRequest(code, tests=[TestCase(code=t) for t in tests]))
    assert res.status == "failed" and not any(t.passed for t in res.tests), res
    assert not any("more than one report" in t.message for t in res.tests), res  # not even a forged one
    if hack.startswith("always"):
        assert all("object of the program's class" in t.message for t in res.tests), res
    if hack == "int_that_equals_all":  # crossed as the plain int it is
        assert "expected 2, got 7" in res.tests[0].message, res


def test_runner_starts_from_bytecode_or_from_source_when_the_magic_differs(backend, monkeypatch):
    """bwrap: the host ships the runner compiled (its Python's magic number first) and as source;
    a sandbox Python of another version compiles the source instead (docker ships the source only)."""
    from sandbox import harness

    request = ExecRequest(
        "def f(x):\n    return x + 1\n", tests=[TestCase(code="assert f(1) == 2"), TestCase(code="assert f(1) == 3")]
    )
    for bytecode in (harness.BYTECODE, b"\0\0\r\n" + harness.BYTECODE[4:]):
        monkeypatch.setattr(harness, "BYTECODE", bytecode)
        assert [t.passed for t in backend.run(request).tests] == [True, False]


def test_io_cases_run_before_the_program_can_patch_their_runner(backend):
    """A patched subprocess.run that fakes the expected output must not reach the io cases."""
    code = (
        "import subprocess\nclass Faked:\n    returncode, stdout, stderr = 0, b'3\\n', b''\n"
        "subprocess.run = lambda *a, **k: Faked()\ndef f():\n    return 0\nprint(1)\n"
    )
    res = backend.run(
        ExecRequest(
            code,
            tests=[TestCase(name="a", code="assert f() == 0"), TestCase(name="io", kind="io", expected_stdout="3\n")],
        )
    )
    got = {t.name: t.passed for t in res.tests}
    assert got == {"a": True, "io": False}, res


def test_honest_programs_pass_across_the_process_boundary(backend):
    """Program-defined classes compared with each other, a namedtuple and an int subclass that
    keep the builtin comparison, numbers across types, chains, membership, `is`, a test that
    does not compile, and the assert's own message."""
    code = (
        "import collections\nclass P:\n    def __init__(self, x):\n        self.x = x\n"
        "    def __eq__(self, other):\n        return isinstance(other, P) and other.x == self.x\n"
        "Pair = collections.namedtuple('Pair', 'a b')\n"
        "class Num(int):\n    def double(self):\n        return self * 2\n"
        "def f(x):\n    return x * 2\n"
    )
    tests = [
        "assert P(1) == P(1) and not P(1) == P(2)",
        "assert f(2) == 4.0 and Pair(1, 2) == (1, 2) and Num(3) == 3",
        "assert f([1]) == [1, 1]",
        "assert f(2) in (4, 5) and f(2) not in (1,)",
        "assert 0 < f(1) < 3 and f(0) is not None",
        "def check(candidate):\n    assert abs(candidate(0.25) - 0.5) < 1e-9\ncheck(f)",
        "assert f(2) == 5, 'two doubled'",
        "assert f(2) ==",
    ]
    res = backend.run(ExecRequest(code, tests=[TestCase(code=t) for t in tests]))
    assert [t.passed for t in res.tests] == [True] * 6 + [False, False], res
    assert "expected 5, got 4" in res.tests[6].message and "two doubled" in res.tests[6].message
    assert "does not compile: SyntaxError" in res.tests[7].message


def test_program_objects_are_used_through_their_process(backend):
    """What tests do with the program's objects works across the process boundary: methods and
    state, attributes, generators, arithmetic and comparisons between its objects, isinstance,
    the default truth of an object whose class has no __bool__ / __len__ (a linked list walked),
    its exceptions as the builtin class they derive from (args kept, its line in the message),
    its globals and stdlib modules, keyword arguments, arguments it changes in place, and plain
    values of every kind."""
    code = (
        "import math, fractions, collections\nLIMIT = 10\nclass Stack:\n"
        "    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n        return self\n    def pop(self):\n"
        "        if not self.items:\n"
        "            raise IndexError('pop from an empty stack')\n        return self.items.pop()\n"
        "class V:\n    def __init__(self, x):\n        self.x = x\n"
        "    def __add__(self, o):\n        return V(self.x + o.x)\n"
        "    def __eq__(self, o):\n        return self.x == o.x\n"
        "class Bad(ValueError):\n    pass\n"
        "def check_sign(x):\n    if x < 0:\n        raise Bad('negative', x)\n"
        "    return {'k': {(1, 2): b'\\xff'}, 's': {1, 2}}\n"
        "def gen(n):\n    yield from range(n)\n"
        "def kw(a, *, b=1):\n    return a * b\n"
        "def fact(n):\n    return math.factorial(n)\n"
        "def half():\n    return fractions.Fraction(1, 2), collections.deque([1]), 2 + 3j, float('inf')\n"
        "def sort_in_place(xs, seen):\n    xs.sort()\n    seen['n'] = len(xs)\n"
        "class Node:\n    def __init__(self, val, next=None):\n        self.val, self.next = val, next\n"
        "def reverse(node):\n    prev = None\n    while node:\n"
        "        node.next, prev, node = prev, node, node.next\n    return prev\n"
        "class Bag:\n    def __len__(self):\n        return 1\n"
    )
    tests = [
        "s = Stack()\nassert s.push(1).push(2) is s and s.pop() == 2 and s.items == [1]\n"
        "s.items = [7]\nassert s.pop() == 7",
        "try:\n    Stack().pop()\n    assert False\n"
        "except IndexError as e:\n    assert str(e) == 'pop from an empty stack'",
        "assert list(gen(3)) == [0, 1, 2] and sum(x for x in gen(4)) == 6",
        "assert V(1) + V(2) == V(3) and isinstance(V(1), V) and not isinstance(1, V)",
        "try:\n    check_sign(-1)\nexcept ValueError as e:\n    assert e.args == ('negative', -1)",
        "assert check_sign(1) == {'k': {(1, 2): b'\\xff'}, 's': {1, 2}} and LIMIT == 10",
        "assert math.sqrt(4) == 2 and kw(3, b=2) == 6 and fact(2000) == math.factorial(2000)",
        "import fractions, collections\n"
        "assert half() == (fractions.Fraction(1, 2), collections.deque([1]), 2 + 3j, float('inf'))",
        "xs, seen = [3, 1, 2], {}\nassert sort_in_place(xs, seen) is None and xs == [1, 2, 3] and seen == {'n': 3}",
        "node, vals = reverse(Node(1, Node(2, Node(3)))), []\n"
        "while node:\n    vals.append(node.val)\n    node = node.next\n"
        "assert vals == [3, 2, 1] and Stack()",
        "check_sign(-2)",
        "assert Bag()",
    ]
    res = backend.run(ExecRequest(code, tests=[TestCase(code=t) for t in tests]))
    assert [t.passed for t in res.tests] == [True] * 10 + [False, False], res
    assert "ValueError: ('negative', -2)" in res.tests[10].message, res
    assert (
        "raised in the program Bad (as ValueError) at main.py line 24: raise Bad('negative', x)"
        in res.tests[10].message
    ), res
    assert (
        "class Bag stands where a plain value is expected: its own truth value is not trusted" in res.tests[11].message
    ), res


# ---------------------------------------------------------------- HumanEval


def run_all(name: str, requests, workers: int):
    """Run `requests` on `workers` backend instances (threads), in order."""
    backends = [make_backend(name) for _ in range(workers)]
    try:
        with ThreadPoolExecutor(workers) as ex:
            chunks = [requests[i::workers] for i in range(workers)]
            parts = list(ex.map(lambda b, reqs: [b.run(r) for r in reqs], backends, chunks))
    finally:
        for b in backends:
            b.close()
    by_id = {r.id: r for part in parts for r in part}
    return [by_id[r.id] for r in requests]


@pytest.mark.parametrize("name", ["bwrap", "docker"])
def test_humaneval_canonical_solutions_pass_and_broken_ones_fail(name):
    need(name)
    problems = load_problems()
    assert len(problems) == 164
    good = [check_request(p, p.canonical_solution) for p in problems]
    bad = []
    for p in problems[::16]:
        for kind, completion in broken_completions(p).items():
            req = check_request(p, completion)
            req.id = f"{p.task_id}:{kind}"
            bad.append(req)
    t0 = time.monotonic()
    results = run_all(name, good + bad, workers=4)
    elapsed = time.monotonic() - t0
    failing = [(r.id, r.status, r.tests[0].message if r.tests else r.error) for r in results[:164] if not r.passed]
    assert failing == [], failing
    wrongly_passing = [r.id for r in results[164:] if r.passed or r.status != "failed"]
    assert wrongly_passing == []
    assert all(r.tests[0].message for r in results[164:])
    assert elapsed < 120, f"{len(results)} checks took {elapsed:.0f} s"


# ---------------------------------------------------------------- the Ray pool


def alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except OSError:
        return False


@pytest.fixture
def cluster(request):
    """The shared Ray cluster, started only when the sandbox can run."""
    need("bwrap")
    return request.getfixturevalue("ray_cluster")


@pytest.fixture(scope="module")
def pool(request):
    need("bwrap")
    request.getfixturevalue("ray_cluster")
    from sandbox.pool import SandboxPool

    p = SandboxPool("bwrap", workers=2, grace_s=3)
    yield p
    p.close()


def test_pool_returns_results_in_request_order(pool):
    # The first request is the slowest, so completion order differs from request order.
    reqs = [ExecRequest(f"import time\ntime.sleep({0.8 if i == 0 else 0})\nprint({i})", id=str(i)) for i in range(6)]
    reqs.append(ExecRequest(b"\xff", id="bad"))
    reqs.append(ExecRequest("", id="empty"))
    results = pool.run_many(reqs)
    assert [r.id for r in results] == [r.id for r in reqs]
    assert [r.stdout for r in results[:6]] == [f"{i}\n" for i in range(6)]
    assert [r.status for r in results[6:]] == ["failed", "error"]
    summary = pool.metrics.summary()
    assert summary["runs"] >= 8 and summary["runs_per_s"] > 0
    assert summary["statuses"]["ok"] >= 6 and summary["statuses"]["error"] >= 1
    assert summary["queue_wait_p95_s"] > 0, "8 requests on 2 workers: some waited in the queue"
    assert summary["queue_wait_mean_s"] <= summary["queue_wait_p95_s"] and summary["retries"] == 0


def test_pool_calls_from_several_threads_share_its_workers(pool):
    """Two threads' calls (two episodes' tool calls) run at once on the pool's two workers; a
    third waits for a worker one of them gives back; each call gets its own results."""
    program = "import time\nstart = time.time()\ntime.sleep(1.5)\nprint(start, time.time(), {i})"
    with ThreadPoolExecutor(3) as threads:
        calls = [threads.submit(pool.run_many, [ExecRequest(program.format(i=i), id=str(i))]) for i in range(3)]
        results = [c.result()[0] for c in calls]
    assert [r.id for r in results] == ["0", "1", "2"] and all(r.status == "ok" for r in results)
    spans = sorted(tuple(map(float, r.stdout.split()[:2])) for r in results)
    assert [int(r.stdout.split()[2]) for r in results] == [0, 1, 2]
    assert spans[1][0] < spans[0][1], "the first two runs overlap in time"
    assert spans[2][0] >= min(spans[0][1], spans[1][1]) - 0.05, "the third ran on a worker given back"


def test_a_closed_pool_says_so(cluster):
    from sandbox.pool import SandboxPool

    pool = SandboxPool("bwrap", workers=1)
    pool.close()
    with pytest.raises(RuntimeError, match="the sandbox pool is closed"):
        pool.run(ExecRequest("print(1)"))


def test_pool_on_docker_and_on_an_unusable_engine(cluster):
    need("docker")
    from sandbox.pool import SandboxPool

    pool = SandboxPool("docker", workers=2)
    try:
        res = pool.run_many([ExecRequest(f"print({i})", id=str(i)) for i in range(4)])
        assert [(r.status, r.stdout, r.backend) for r in res] == [("ok", f"{i}\n", "docker-warm") for i in range(4)]
    finally:
        pool.close()
    broken = SandboxPool("docker", workers=1, base_url="unix:///nonexistent/engine.sock")
    try:
        res = broken.run(ExecRequest("print(1)", id="x"))
        assert (res.status, res.id) == ("error", "x") and "died twice" in res.error, res
        assert "DockerException: Error while fetching server API version" in res.error, res.error
    finally:
        broken.close()


def kill_soon(pool, how: str, delay: float = 1.0):
    """Kill every worker of the pool `delay` s from now: ray.kill, or SIGKILL/SIGSTOP to its pid."""
    import ray

    pids = {w: ray.get(w.pid.remote()) for w in pool.workers}

    def act():
        time.sleep(delay)
        for w, pid in pids.items():
            if how == "ray.kill":
                ray.kill(w, no_restart=True)
            else:
                os.kill(pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)

    t = threading.Thread(target=act, daemon=True)
    t.start()
    return t, pids


@pytest.mark.parametrize("how", ["ray.kill", "sigkill"])
def test_pool_replaces_a_dead_worker_and_retries_its_run(cluster, how):
    from sandbox.pool import SandboxPool

    pool = SandboxPool("bwrap", workers=1)
    try:
        before = pool.metrics.summary()
        t, pids = kill_soon(pool, how)
        res = pool.run(ExecRequest("import time\ntime.sleep(2.5)\nprint('done')", id="slow"))
        t.join()
        assert (res.status, res.stdout, res.id) == ("ok", "done\n", "slow"), res
        after = pool.metrics.summary()
        assert after["retries"] == before["retries"] + 1 and after["replaced_workers"] == 1
        assert pool.run(ExecRequest("print(2)")).stdout == "2\n"
        assert not any(alive(p) for p in pids.values()), "the killed worker is still alive"
    finally:
        pool.close()


def test_pool_replaces_a_stuck_worker(pool):
    t, pids = kill_soon(pool, "sigstop", delay=0.3)
    t0 = time.monotonic()
    res = pool.run_many(
        [
            ExecRequest("import time\ntime.sleep(1)\nprint(1)", id="a", limits=Limits(wall_time_s=2)),
            ExecRequest("import time\ntime.sleep(1)\nprint(2)", id="b", limits=Limits(wall_time_s=2)),
        ]
    )
    t.join()
    assert [r.status for r in res] == ["timeout", "timeout"], res
    assert "unresponsive" in res[0].error and time.monotonic() - t0 < 15
    assert pool.run(ExecRequest("print('fresh')")).stdout == "fresh\n"
    assert pool.metrics.summary()["replaced_workers"] >= 2


def test_stale_job_cgroups_are_swept():
    from sandbox.cgroups import JobCgroup, layout, sweep_stale

    if os.geteuid() != 0 or layout() == "none":
        pytest.skip("needs root and a writable cgroup tree")
    empty, busy = JobCgroup.create("job-test-empty", Limits()), JobCgroup.create("job-test-busy", Limits())
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        for path in busy.procs:
            path.write_text(str(sleeper.pid))
        sweep_stale(max_age_s=3600)
        assert all(d.exists() for d in empty.dirs.values()), "a fresh job cgroup was removed"
        sweep_stale(max_age_s=0)
        assert not any(d.exists() for d in empty.dirs.values()), "an empty job cgroup was left"
        assert all(d.exists() for d in busy.dirs.values()), "a live job's cgroup was removed"
    finally:
        sleeper.kill()
        sleeper.wait()
        busy.kill()
        busy.remove()
        empty.remove()


# ---------------------------------------------------------------- the CLI


def rlsys(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "rlsys.run.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120, **kw
    )


def test_cli_run_prints_one_json_object(tmp_path):
    need("bwrap")
    prog = tmp_path / "prog.py"
    prog.write_text("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)\n")
    p = rlsys("sandbox", "run", str(prog), "--backend", "bwrap", "--timeout", "5")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert (out["status"], out["stdout"], out["stderr"], out["backend"]) == ("ok", "42\n", "warn\n", "bwrap")
    prog.write_text("while True:\n    pass\n")
    p = rlsys("sandbox", "run", str(prog), "--backend", "bwrap", "--timeout", "1")
    assert p.returncode == 1 and json.loads(p.stdout)["status"] == "timeout"


def test_cli_errors_are_one_line(tmp_path):
    p = rlsys("sandbox", "run", str(tmp_path / "missing.py"))
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().count("\n") == 0 and "cannot read" in p.stderr, p.stderr
