"""NOT A SANDBOX. Plain `subprocess`: the job's files written to a temp dir on the host and
its argv run there, nothing else (no isolation, no limits but the wall time): the program
sees the host, its network and its files. It exists only as the speed floor the benchmark
compares the real backends against."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

from . import base
from .procio import collect, memfd
from .types import ExecResult, Limits


class UnsafeSubprocessBackend(base.BaseBackend):
    name = "subprocess-unsafe"

    def _execute(self, job: dict, limits: Limits) -> ExecResult:
        work = tempfile.mkdtemp(prefix="rlsys-unsafe-")
        for name, data in job["files"].items():
            path = os.path.join(work, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        stdin = memfd("stdin", job["stdin"])
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                job["argv"],
                cwd=work,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env={**base.ENV, "HOME": work},
            )
        finally:
            os.close(stdin)

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
            shutil.rmtree(work, ignore_errors=True)
        stderr = base.decode(got.stderr)
        status, why = base.outcome(
            code, timed_out=got.timed_out, output_exceeded=got.output_exceeded, oom=False, stderr=stderr, limits=limits
        )
        return ExecResult(
            status,
            code,
            base.decode(got.stdout),
            stderr,
            got.stdout_truncated,
            got.stderr_truncated,
            time.monotonic() - start,
            error=why,
        )
