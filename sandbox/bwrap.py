"""The local backend: bubblewrap, all namespaces unshared, on the sandbox root
filesystem mounted read-only, as uid 65534, with rlimits and a cgroup per job."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from . import base
from .cgroups import JobCgroup, sweep_stale
from .procio import collect
from .types import ExecResult, Limits

NOBODY = 65534
# Run as root: put this shell in the job's cgroups, then drop to nobody before bwrap, so
# that every process of the job is inside the cgroup from its first instruction.
JOIN_AND_DROP = 'for p in $RLSYS_CGROUP_PROCS; do echo $$ > "$p" || exit 125; done; exec "$@"'


@base.register("bwrap")
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

    def command(self, job: dict, limits: Limits) -> list[str]:
        tmpfs = str(limits.tmpfs_mb << 20)
        cmd = [
            self.bwrap, "--unshare-all", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--clearenv",
        ]
        for k, v in base.ENV.items():
            cmd += ["--setenv", k, v]
        cmd += ["--ro-bind", self.rootfs, "/", "--dev", "/dev", "--proc", "/proc",
                "--size", tmpfs, "--tmpfs", "/tmp", "--size", tmpfs, "--tmpfs", "/work",
                "--chdir", "/work", "--cap-drop", "ALL", "--", *base.bootstrap_argv(job)]
        if self.root:  # bwrap as root with --uid still reads root's files: drop first
            cmd = [self.setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
        return cmd

    def _execute(self, job: dict, limits: Limits) -> ExecResult:
        cg = JobCgroup.create(f"job-{uuid.uuid4().hex[:12]}", limits) if self.cgroups and self.root else None
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
               "RLSYS_CGROUP_PROCS": " ".join(map(str, cg.procs)) if cg else ""}
        start = time.monotonic()
        proc = subprocess.Popen(["/bin/sh", "-c", JOIN_AND_DROP, "sh", *self.command(job, limits)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, start_new_session=True, close_fds=True)

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
            code = 128 - code if code < 0 else code  # killed by a signal: 128 + signal, as the bootstrap reports
            oom = bool(cg and cg.oom_killed())
        finally:
            kill()
            proc.stdout.close()
            proc.stderr.close()
            if cg:
                cg.remove()
        stderr = base.decode(got.stderr)
        status, why = base.outcome(code, timed_out=got.timed_out, output_exceeded=got.output_exceeded,
                                   oom=oom, stderr=stderr, limits=limits)
        return ExecResult(status, code, base.decode(got.stdout), stderr, got.stdout_truncated,
                          got.stderr_truncated, wall, error=why)
