"""The container backend, through the Docker Engine API (`docker` SDK): Docker Engine or
podman's compatible service. `isolation="warm"` (default) keeps one container per
backend instance and runs each job with `exec`; `isolation="fresh"` makes a container
per job. Either way the in-container bootstrap runs the job as nobody, kills what it
left behind and wipes the work dir and /tmp."""

from __future__ import annotations

import os
import threading
import time

from . import base
from .types import ExecResult, Limits

IMAGE = "rlsys-sandbox:py3"
NOBODY = "65534:65534"
CLEANUP = ["/bin/sh", "-c", "kill -9 -1; exit 0"]  # as nobody: every process of the job
INIT_PIDS = 8  # the container's init and sleep, and the exec'd cleanup


class DockerBackend(base.BaseBackend):
    """`base_url`: the engine's socket (default `$DOCKER_HOST`); `image`: the image
    `sandbox image` imported."""

    name = "docker"
    runner_bytecode = False  # see BaseBackend

    def __init__(self, base_url: str | None = None, image: str = IMAGE, isolation: str = "warm"):
        import docker

        if isolation not in ("warm", "fresh"):
            raise ValueError(f"isolation must be 'warm' or 'fresh', not {isolation!r}")
        base_url = base_url or os.environ.get("DOCKER_HOST")
        self.client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
        self.api = self.client.api
        self.image, self.isolation = image, isolation
        self.name = f"docker-{isolation}"
        self._warm = None  # (container, the limits it was made for)

    def container_config(self, limits: Limits) -> dict:
        from docker.types import Ulimit

        mem = f"{limits.memory_mb}m"
        tmpfs = f"rw,size={limits.tmpfs_mb}m,mode=1777"
        return dict(
            image=self.image,
            command=["sleep", "infinity"],
            detach=True,
            init=True,
            # podman's compatibility API ignores network_disabled; network_mode covers it
            network_disabled=True,
            network_mode="none",
            mem_limit=mem,
            memswap_limit=mem,
            pids_limit=limits.processes + INIT_PIDS,
            nano_cpus=int(limits.cpus * 1e9),
            read_only=True,
            tmpfs={"/work": tmpfs, "/tmp": tmpfs},
            working_dir="/work",
            hostname="sandbox",
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            environment=base.ENV,
            # passing ulimits replaces the engine's defaults: always nofile and nproc together
            ulimits=[Ulimit(name="nofile", soft=1024, hard=1024), Ulimit(name="nproc", soft=4096, hard=4096)],
            labels={"rlsys-sandbox": "1"},
        )

    def _container(self, limits: Limits):
        key = (limits.memory_mb, limits.processes, limits.cpus, limits.tmpfs_mb)
        if self.isolation == "warm" and self._warm:
            c, made_for = self._warm
            if made_for == key:
                return c
            self._remove(c)
        c = self.client.containers.run(**self.container_config(limits))
        if self.isolation == "warm":
            self._warm = (c, key)
        return c

    def _remove(self, c) -> None:
        try:
            c.remove(force=True)
        except Exception:  # noqa: BLE001 - already gone is fine
            pass
        if self._warm and self._warm[0] is c:
            self._warm = None

    def _execute(self, job: dict, limits: Limits) -> ExecResult:
        job = {**job, "report_oom": True}  # the container's cgroup is the job's: its OOM count is visible inside
        c, exec_id = self._start_exec(job, limits)
        start = time.monotonic()
        try:
            return self._exec(c, exec_id, limits, start)
        except Exception:
            self._remove(c)  # a container in an unknown state is not reused
            raise
        finally:
            if self.isolation == "fresh":
                self._remove(c)

    def _start_exec(self, job: dict, limits: Limits):
        """(container, exec id) for the job. A warm container that died since its last job
        (engine restart, removed, its init killed) is replaced once."""
        import docker

        for attempt in (0, 1):
            c = self._container(limits)
            try:
                return c, self.api.exec_create(
                    c.id, base.bootstrap_argv(job), user=NOBODY, workdir="/work", environment=base.ENV
                )["Id"]
            except docker.errors.APIError:
                self._remove(c)
                if attempt or self.isolation == "fresh":
                    raise
        raise AssertionError("unreachable")

    def _exec(self, c, exec_id: str, limits: Limits, start: float) -> ExecResult:
        stream = self.api.exec_start(exec_id, stream=True, demux=True)
        out, err = bytearray(), bytearray()
        over = [False, False]
        finished = threading.Event()
        cap = limits.output_bytes

        def read():
            try:
                for o, e in stream:
                    for buf, chunk, i in ((out, o, 0), (err, e, 1)):
                        if chunk:
                            room = cap - len(buf)
                            over[i] = over[i] or len(chunk) > room
                            buf += chunk[: max(room, 0)]
                    if any(over):
                        break
            finally:
                finished.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        finished.wait(limits.wall_time_s)
        timed_out = not finished.is_set()
        if timed_out or any(over):
            self.api.exec_start(self.api.exec_create(c.id, CLEANUP, user=NOBODY)["Id"])
            finished.wait(5)
        wall = time.monotonic() - start
        code = self.api.exec_inspect(exec_id).get("ExitCode")
        if not finished.is_set():  # the stream did not end even after the kill
            self._remove(c)
        stderr, oom = base.take_oom_report(base.decode(bytes(err)))
        if oom is None:  # no report: the bootstrap itself was killed, most likely by the OOM killer
            oom = code == 137 and not timed_out and not any(over)
        status, why = base.outcome(
            code,
            timed_out=timed_out,
            output_exceeded=any(over) and not timed_out,
            oom=oom,
            stderr=stderr,
            limits=limits,
        )
        return ExecResult(status, code, base.decode(bytes(out)), stderr, over[0], over[1], wall, error=why)

    def close(self) -> None:
        if self._warm:
            self._remove(self._warm[0])
        self.client.close()
