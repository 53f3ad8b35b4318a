"""NOT A SANDBOX. Plain `subprocess` with the same bootstrap, argv and caps but no
isolation: the program sees the host, its network and its files. It exists only as the
speed floor the benchmark compares the real backends against."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

from . import base
from .procio import collect
from .types import ExecResult, Limits


@base.register("subprocess-unsafe")
class UnsafeSubprocessBackend(base.BaseBackend):
    name = "subprocess-unsafe"

    def _execute(self, job: dict, limits: Limits) -> ExecResult:
        # Private work and tmp dirs, and no kill(-1): on the host that would hit every
        # process of the user (as root, every process).
        top = tempfile.mkdtemp(prefix="rlsys-unsafe-")
        work, tmp = os.path.join(top, "work"), os.path.join(top, "tmp")
        os.mkdir(work)
        os.mkdir(tmp)
        job = {**job, "work": work, "tmp": tmp, "wipe": [work, tmp], "kill_leftovers": False}
        argv = base.bootstrap_argv(job)
        start = time.monotonic()
        proc = subprocess.Popen(argv, cwd=work, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                env={**base.ENV, "HOME": work})

        def kill():
            try:
                os.killpg(proc.pid, 9)
            except OSError:
                pass

        try:
            got = collect(proc, limits.output_bytes, start + limits.wall_time_s, kill)
            code = proc.wait()
        finally:
            kill()
            proc.stdout.close()
            proc.stderr.close()
            shutil.rmtree(top, ignore_errors=True)
        stderr = base.decode(got.stderr)
        status, why = base.outcome(code, timed_out=got.timed_out, output_exceeded=got.output_exceeded,
                                   oom=False, stderr=stderr, limits=limits)
        return ExecResult(status, code, base.decode(got.stdout), stderr, got.stdout_truncated,
                          got.stderr_truncated, time.monotonic() - start, error=why)
