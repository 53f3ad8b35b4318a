"""The backend protocol and what every backend shares: checking a request, packing it for the
in-sandbox bootstrap, naming the outcome's status, and whether an engine is usable here. The
backends by name are in backends.py (this module imports no backend)."""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Protocol

from . import harness
from .types import ExecRequest, ExecResult, Limits

log = logging.getLogger("sandbox")
BOOTSTRAP = (Path(__file__).with_name("_bootstrap.py")).read_text()
PYTHON = "/usr/bin/python3"  # inside the sandbox root filesystem
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
ARG_CHUNK = 100_000  # below the kernel's 128 KiB limit on one argv string
MAX_PAYLOAD = 1_500_000  # below the kernel's ~2 MiB limit on argv as a whole
BOOTSTRAP_FAILED = 125
# Everything the job can write to, in either backend; wiped before and after each job.
WRITABLE = ["/work", "/tmp", "/var/tmp", "/dev/shm", "/run/lock"]
NOFILE_CEILING = 20_000  # hard RLIMIT_NOFILE on this kind of VM cannot go above it


class Backend(Protocol):
    name: str

    def run(self, req: ExecRequest) -> ExecResult: ...

    def close(self) -> None: ...


class BaseBackend:
    """`run` checks and packs the request, calls `_execute`, and never raises: every
    failure comes back as a result with a status."""

    name = "base"
    # Ship the test runner compiled as well as its source (harness.wrap): a compile saved per
    # check where files are cheap to pass (bwrap's memfds); through docker's argv the extra
    # payload costs more than the compile.
    runner_bytecode = True

    def run(self, req: ExecRequest) -> ExecResult:
        start = time.monotonic()
        try:
            res = self._run(req)
        except Exception as e:  # noqa: BLE001 - the contract is a result, never an exception
            log.exception("sandbox %s failed", self.name)
            res = ExecResult("error", error=f"{type(e).__name__}: {e}", wall_time=time.monotonic() - start)
        res.backend, res.id = self.name, req.id
        return res

    def _run(self, req: ExecRequest) -> ExecResult:
        problem = check(req)
        if problem:
            return ExecResult("error", error=problem)
        files = {"main.py": to_bytes(req.code), **{k: to_bytes(v) for k, v in req.files.items()}}
        argv = ["main.py"]
        nonce = None
        if req.tests:
            extra, argv, nonce = harness.wrap(req, bytecode=self.runner_bytecode)
            files.update(extra)
        job = job_spec(files, [PYTHON, "-E", "-s", *argv], to_bytes(req.stdin), req.limits)
        job["secret_files"] = [harness.TESTS_NAME] if nonce else []  # see harness.wrap
        if sum(base64_size(v) for v in [*job["files"].values(), job["stdin"]]) > MAX_PAYLOAD:
            return ExecResult("error", error=f"request too large: files and stdin over {MAX_PAYLOAD} bytes encoded")
        res = self._execute(job, req.limits)
        return harness.finish(res, req, nonce) if nonce else res

    def _execute(self, job: dict, limits: Limits) -> ExecResult:
        """Run `job` (see `job_spec`) inside the sandbox."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def check(req: ExecRequest) -> str:
    """Why the request cannot run, or ""."""
    if not isinstance(req.code, (str, bytes)) or not to_bytes(req.code).strip():
        return "empty code"
    if req.limits.network:
        return "network access is not supported: every backend runs with the network off"
    for name in req.files:
        parts = Path(name).parts
        if not parts or Path(name).is_absolute() or ".." in parts or name in ("main.py", *harness.RESERVED_NAMES):
            return f"bad file name {name!r}: relative paths inside the work dir only"
    return ""


def to_bytes(x: str | bytes) -> bytes:
    return x if isinstance(x, bytes) else x.encode("utf-8", "surrogateescape")


def job_spec(files: dict[str, bytes], argv: list[str], stdin: bytes, limits: Limits) -> dict:
    """What a backend runs: files to write (bytes), the job's argv, stdin (bytes) and rlimits;
    for the in-sandbox bootstrap also its dirs (`bootstrap_argv` encodes it)."""
    return {
        "files": files,
        "stdin": stdin,
        "argv": argv,
        "limits": {
            "cpu_s": max(1, int(limits.cpu_time_s + 0.999)),
            "fsize": limits.file_size_mb << 20,
            "nofile": min(limits.open_files, NOFILE_CEILING),
        },
        "work": "/work",
        "tmp": "/tmp",
        "wipe": WRITABLE,
        "kill_leftovers": True,
    }


def base64_size(data: bytes) -> int:
    return 4 * ((len(data) + 2) // 3)


def bootstrap_argv(job: dict) -> list[str]:
    """`python3 -c BOOTSTRAP` with the job as base64 JSON (its files and stdin base64 inside),
    cut to fit argv."""
    b64 = lambda data: base64.b64encode(data).decode()
    job = {**job, "files": {k: b64(v) for k, v in job["files"].items()}, "stdin": b64(job["stdin"])}
    blob = base64.b64encode(json.dumps(job).encode()).decode()
    return [PYTHON, "-E", "-s", "-c", BOOTSTRAP, *(blob[i : i + ARG_CHUNK] for i in range(0, len(blob), ARG_CHUNK))]


OOM_MARK = "rlsys-bootstrap: oom_kill="


def take_oom_report(stderr: str) -> tuple[str, bool | None]:
    """Split the bootstrap's OOM report (its last stderr line, with `report_oom`) off the
    job's stderr: (stderr, whether the OOM killer fired during the job, None if unknown)."""
    head, sep, tail = stderr.rpartition("\n" + OOM_MARK)
    if not sep or not tail.strip().isdigit():
        return stderr, None
    return head, int(tail) > 0


def decode(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def outcome(
    exit_code: int | None, *, timed_out: bool, output_exceeded: bool, oom: bool, stderr: str, limits: Limits
) -> tuple[str, str]:
    """(status, reason) for a finished job. Exit codes above 128 are 128 + the signal
    that killed the job (the bootstrap reports them that way)."""
    if timed_out:
        return "timeout", f"wall time limit exceeded ({limits.wall_time_s:g} s)"
    if output_exceeded:
        return "killed", f"output limit exceeded ({limits.output_bytes} bytes)"
    if exit_code == BOOTSTRAP_FAILED and "rlsys-bootstrap:" in stderr:
        return "error", stderr.strip().splitlines()[-1]
    if exit_code == 128 + signal.SIGXCPU:
        return "timeout", f"cpu time limit exceeded ({limits.cpu_time_s:g} s)"
    if oom or (exit_code not in (0, None) and stderr.rstrip().endswith("MemoryError")):
        return "oom", f"memory limit exceeded ({limits.memory_mb} MB)"
    if exit_code == 0:
        return "ok", ""
    if exit_code is not None and exit_code > 128:
        sig = exit_code - 128
        try:
            signame = signal.Signals(sig).name
        except ValueError:
            signame = f"signal {sig}"
        return "killed", f"killed by {signame}"
    return "failed", ""


def unavailable(name: str, **config) -> str:
    """Why backend `name` cannot run here ("" when it can): one line, for a skip reason
    or an error message. Starts nothing but a ping of the engine."""
    if name == "bwrap":
        rootfs = config.get("rootfs") or os.environ.get("RLSYS_SANDBOX_ROOTFS")
        if not shutil.which(config.get("bwrap", "bwrap")):
            return "bubblewrap (bwrap) is not installed"
        if not rootfs or not (Path(rootfs) / PYTHON.lstrip("/")).exists():
            return f"no sandbox root filesystem with {PYTHON} (RLSYS_SANDBOX_ROOTFS={rootfs!r})"
        return ""
    if name == "docker":
        try:
            import docker

            url = config.get("base_url") or os.environ.get("DOCKER_HOST")
            client = docker.DockerClient(base_url=url, timeout=5) if url else docker.from_env(timeout=5)
            try:
                client.ping()
                client.images.get(config.get("image", "rlsys-sandbox:py3"))
            finally:
                client.close()
        except Exception as e:  # noqa: BLE001 - any failure is the reason
            return (
                f"Docker-API engine unusable ({os.environ.get('DOCKER_HOST', 'default socket')}): "
                f"{type(e).__name__}: {e}"
            )[:300]
        return ""
    if name == "subprocess-unsafe":
        return ""  # runs on the host: nothing to set up
    return f"unknown sandbox backend {name!r}"
