"""The request and result shapes every backend, the pool and the harness agree on."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

Status = Literal["ok", "failed", "timeout", "oom", "killed", "error"]
STATUSES: tuple[str, ...] = ("ok", "failed", "timeout", "oom", "killed", "error")


@dataclass
class Limits:
    """Resource limits of one run. Network is always off unless `network` is True
    (no backend here implements network on; asking for it is an error)."""

    wall_time_s: float = 10.0
    cpu_time_s: float = 10.0
    memory_mb: int = 512
    processes: int = 64
    open_files: int = 256
    output_bytes: int = 1 << 20  # per stream; more is truncated and the job killed
    file_size_mb: int = 16  # largest file the program may write
    tmpfs_mb: int = 64  # size of the writable work dir and /tmp
    cpus: float = 1.0
    network: bool = False


@dataclass
class TestCase:
    """One test. `kind="assert"`: `code` runs after the program, with the program's globals, in
    a judge process the program never ran in (sandbox/_runner.py), and passes when it raises
    nothing; plain values cross from the program as data, and an object of the program's own
    compared with a plain value, tested with `in`, or asked a truth its `__bool__`/`__len__`
    would give fails (an always-equal result is not a pass). `kind="io"`: the program runs with
    `stdin` and passes when its stdout equals `expected_stdout` (trailing whitespace per line
    ignored)."""

    __test__ = False  # not a pytest class
    name: str = ""
    kind: Literal["assert", "io"] = "assert"
    code: str = ""
    stdin: str = ""
    expected_stdout: str = ""
    timeout_s: float | None = None  # io cases only; default: the run's wall time


@dataclass
class TestResult:
    __test__ = False
    name: str
    passed: bool
    message: str = ""  # why it failed: expected vs got, or the error's tail


@dataclass
class ExecRequest:
    """What to run: Python source `code` (str, or bytes that need not be UTF-8) as
    main.py in a fresh work dir holding `files`, fed `stdin`. With `tests`, the
    harness runs them and fills `ExecResult.tests`."""

    code: str | bytes
    stdin: str | bytes = b""
    tests: list[TestCase] = field(default_factory=list)
    files: dict[str, str | bytes] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    id: str = ""


@dataclass
class ExecResult:
    status: str  # one of STATUSES
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_time: float = 0.0
    tests: list[TestResult] = field(default_factory=list)
    error: str = ""  # the sandbox's own reason for error/killed/timeout/oom
    backend: str = ""
    id: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "ok" and all(t.passed for t in self.tests)

    def to_dict(self) -> dict:
        return asdict(self)
