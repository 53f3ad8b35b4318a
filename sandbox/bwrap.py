"""The local backend: bubblewrap, all namespaces unshared, on the sandbox root
filesystem mounted read-only, as uid 65534, with rlimits and a cgroup per job.

No in-sandbox bootstrap: bwrap copies the job's files into a fresh /work tmpfs from
memfds (`--file FD`, closed before the job starts; the test runner's tests and nonce through
a pipe instead), stdin is a memfd, the rlimits are set
by the shell that execs bwrap, and the pid namespace takes every leftover process down
with the job. One interpreter start per run instead of two."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path, PurePosixPath

from . import base, harness
from .cgroups import JobCgroup, sweep_stale
from .procio import collect, memfd
from .types import ExecResult, Limits

NOBODY = 65534
# Put this shell in the job's cgroups (as root), set the job's rlimits, then exec (setpriv
# to nobody, then) bwrap: every process of the job is inside the cgroup and under the limits
# from its first instruction. dash's `ulimit -f` counts 512-byte blocks.
JOIN_LIMIT_EXEC = (
    'fail() {{ echo "rlsys-bootstrap: $1" >&2; exit 125; }}; '
    'for p in $RLSYS_CGROUP_PROCS; do echo $$ > "$p" || fail "cannot join cgroup $p"; done; '
    "ulimit -S -t {cpu} && ulimit -H -t {cpu_hard} && ulimit -f {fsize_blocks} && ulimit -n {nofile} "
    '&& ulimit -c 0 || fail "cannot set the rlimits"; exec "$@"'
)


class BwrapBackend(base.BaseBackend):
    """`rootfs`: the sandbox root filesystem (default `$RLSYS_SANDBOX_ROOTFS`); without
    one the host's / is mounted read-only instead, with a warning."""

    name = "bwrap"

    def __init__(self, rootfs: str | None = None, bwrap: str = "bwrap", cgroups: bool = True):
        self.bwrap = shutil.which(bwrap) or bwrap
        self.setpriv = shutil.which("setpriv") or "setpriv"
        rootfs = rootfs or os.environ.get("RLSYS_SANDBOX_ROOTFS")
        if rootfs and not (Path(rootfs) / base.PYTHON.lstrip("/")).exists():
            raise ValueError(f"sandbox root filesystem {rootfs} has no {base.PYTHON}")
        if not rootfs:
            base.log.warning("no sandbox root filesystem (RLSYS_SANDBOX_ROOTFS): mounting the host's / read-only")
        self.rootfs = rootfs or "/"
        self.cgroups = cgroups
        self.root = os.geteuid() == 0
        if cgroups and self.root:
            sweep_stale()  # what a worker killed mid-run left behind

    def command(self, job: dict, limits: Limits, file_fds: dict[str, int], tests_fd: int | None = None) -> list[str]:
        """bwrap around the job's argv; `file_fds`: work-dir name -> memfd holding the file;
        `tests_fd`: a pipe holding the test runner's secret file (`harness.TESTS_FD_ENV`)."""
        tmpfs = str(limits.tmpfs_mb << 20)
        cmd = [
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--hostname",
            "sandbox",
            "--clearenv",
        ]
        for k, v in base.ENV.items():
            cmd += ["--setenv", k, v]
        if tests_fd is not None:
            cmd += ["--setenv", harness.TESTS_FD_ENV, str(tests_fd)]
        cmd += [
            "--ro-bind",
            self.rootfs,
            "/",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
            "--size",
            tmpfs,
            "--tmpfs",
            "/tmp",
            "--size",
            tmpfs,
            "--tmpfs",
            "/work",
        ]
        dirs = sorted({str(p) for name in file_fds for p in PurePosixPath(name).parents if str(p) != "."})
        for d in dirs:
            cmd += ["--dir", f"/work/{d}"]
        for name, fd in file_fds.items():
            cmd += ["--file", str(fd), f"/work/{name}"]
        cmd += ["--chdir", "/work", "--cap-drop", "ALL", "--", *job["argv"]]
        if self.root:  # bwrap as root with --uid still reads root's files: drop first
            cmd = [self.setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
        return cmd

    @staticmethod
    def pipe_with(data: bytes) -> int:
        """The read end of a pipe that a thread fills with `data` and then closes."""
        read_fd, write_fd = os.pipe()

        def fill():
            try:
                with os.fdopen(write_fd, "wb") as f:
                    f.write(data)
            except OSError:  # the job ended before reading it all
                pass

        threading.Thread(target=fill, name="bwrap-tests-pipe", daemon=True).start()
        return read_fd

    def _execute(self, job: dict, limits: Limits) -> ExecResult:
        cg = JobCgroup.create(f"job-{uuid.uuid4().hex[:12]}", limits) if self.cgroups and self.root else None
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "RLSYS_CGROUP_PROCS": " ".join(map(str, cg.procs)) if cg else "",
        }
        lim = job["limits"]
        script = JOIN_LIMIT_EXEC.format(
            cpu=lim["cpu_s"],
            cpu_hard=lim["cpu_s"] + 1,  # SIGXCPU, then SIGKILL
            fsize_blocks=max(1, lim["fsize"] // 512),
            nofile=lim["nofile"],
        )
        secret = [name for name in job.get("secret_files", ()) if name in job["files"]]
        file_fds = {name: memfd(name, data) for name, data in job["files"].items() if name not in secret}
        # bwrap's pid 1 inside the sandbox copies each --file and keeps it in its memory, which
        # the job can read: the runner's secret file goes through a pipe it drains instead.
        tests_fd = self.pipe_with(job["files"][secret[0]]) if secret else None
        stdin = memfd("stdin", job["stdin"])
        start = time.monotonic()
        try:
            passed = [*file_fds.values(), *([tests_fd] if tests_fd is not None else [])]
            proc = subprocess.Popen(
                ["/bin/sh", "-c", script, "sh", *self.command(job, limits, file_fds, tests_fd)],
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
                close_fds=True,
                pass_fds=passed,
            )
        finally:
            for fd in [stdin, *passed]:
                os.close(fd)

        def kill():
            if cg:
                cg.kill()
            try:
                os.killpg(proc.pid, 9)
            except OSError:
                pass

        try:
            got = collect(proc, limits.output_bytes, start + limits.wall_time_s, kill)
            try:
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                kill()
                code = proc.wait()
            wall = time.monotonic() - start
            code = 128 - code if code < 0 else code  # killed by a signal: 128 + signal, as bwrap reports the job's
            oom = bool(cg and cg.oom_killed())
        finally:
            kill()
            proc.stdout.close()
            proc.stderr.close()
            if cg:
                cg.remove()
        stderr = base.decode(got.stderr)
        status, why = base.outcome(
            code, timed_out=got.timed_out, output_exceeded=got.output_exceeded, oom=oom, stderr=stderr, limits=limits
        )
        return ExecResult(
            status, code, base.decode(got.stdout), stderr, got.stdout_truncated, got.stderr_truncated, wall, error=why
        )
