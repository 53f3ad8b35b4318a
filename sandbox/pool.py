"""A pool of sandbox workers on Ray: a bound on concurrent runs (one per worker), a queue
for the rest, a per-run deadline enforced from outside the worker, a dead or stuck
worker replaced (a dead worker's run is retried once), and metrics."""

from __future__ import annotations

import os
import re
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import ray

from .backends import make_backend
from .types import ExecRequest, ExecResult

GRACE_S = 30.0  # beyond the run's own wall limit before the pool gives up on a worker


def one_line(e: BaseException | None) -> str:
    """`Type: message` in one line of at most 300 characters. For an error that carries a
    traceback (a worker whose constructor raised), the message is the root cause's line."""
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).splitlines() if ln.strip()]
    cause = next((ln for ln in reversed(lines) if re.match(r"^[\w.]+(Error|Exception): ", ln)), None)
    return f"{type(e).__name__}: {cause or (lines[0] if lines else '')}"[:300]


@ray.remote(max_restarts=0)
class SandboxWorker:
    """One backend instance (for docker: one warm container); one run at a time."""

    def __init__(self, backend: str, config: dict):
        self.backend = make_backend(backend, **config)

    def run(self, req: ExecRequest) -> ExecResult:
        return self.backend.run(req)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.backend.close()


@dataclass
class PoolMetrics:
    runs: int = 0
    busy_s: float = 0.0  # wall time inside run_many
    queue_waits: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    retries: int = 0
    replaced_workers: int = 0

    def summary(self) -> dict:
        waits = sorted(self.queue_waits)
        return {
            "runs": self.runs,
            "runs_per_s": self.runs / self.busy_s if self.busy_s else 0.0,
            "queue_wait_mean_s": statistics.fmean(waits) if waits else 0.0,
            "queue_wait_p95_s": waits[int(0.95 * (len(waits) - 1))] if waits else 0.0,
            "statuses": dict(self.statuses),
            "retries": self.retries,
            "replaced_workers": self.replaced_workers,
        }


class SandboxPool:
    """`SandboxPool("bwrap", workers=4).run_many(requests)` -> results in request order.
    Needs `ray.init()` first. `num_cpus` per worker defaults to 0: the bound on
    concurrency is `workers`, not Ray's CPU count. A worker that has not answered
    `grace_s` after its run's wall limit is taken as stuck and replaced."""

    def __init__(
        self, backend: str = "bwrap", workers: int = 4, num_cpus: float = 0, grace_s: float = GRACE_S, **config
    ):
        self.backend, self.config, self.num_cpus, self.grace_s = backend, config, num_cpus, grace_s
        self.workers = [self._spawn() for _ in range(workers)]
        self.metrics = PoolMetrics()

    def _spawn(self):
        return SandboxWorker.options(num_cpus=self.num_cpus).remote(self.backend, self.config)

    def _replace(self, worker):
        ray.kill(worker, no_restart=True)
        self.metrics.replaced_workers += 1
        new = self._spawn()
        self.workers[self.workers.index(worker)] = new
        return new

    def run(self, req: ExecRequest) -> ExecResult:
        return self.run_many([req])[0]

    def run_many(self, requests: list[ExecRequest]) -> list[ExecResult]:
        t0 = time.monotonic()
        results: list[ExecResult | None] = [None] * len(requests)
        queue = deque((i, 0) for i in range(len(requests)))  # (index, attempt)
        idle = list(self.workers)
        inflight = {}  # ref -> (index, attempt, worker, deadline)
        while queue or inflight:
            while queue and idle:
                i, attempt = queue.popleft()
                worker = idle.pop()
                if attempt == 0:
                    self.metrics.queue_waits.append(time.monotonic() - t0)
                deadline = time.monotonic() + requests[i].limits.wall_time_s + self.grace_s
                inflight[worker.run.remote(requests[i])] = (i, attempt, worker, deadline)
            wait_s = max(0.0, min(d for *_, d in inflight.values()) - time.monotonic())
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=wait_s)
            for ref in ready:
                i, attempt, worker, _ = inflight.pop(ref)
                try:
                    results[i] = ray.get(ref)
                    idle.append(worker)
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
                    idle.append(self._replace(worker))
                    if attempt == 0:
                        self.metrics.retries += 1
                        queue.appendleft((i, 1))
                    else:
                        results[i] = ExecResult(
                            "error", error=f"sandbox worker died twice: {one_line(e)}", id=requests[i].id
                        )
                except ray.exceptions.RayTaskError as e:
                    idle.append(worker)
                    results[i] = ExecResult(
                        "error", error=f"sandbox worker failed: {one_line(e.cause)}", id=requests[i].id
                    )
            now = time.monotonic()
            for ref, (i, _, worker, deadline) in list(inflight.items()):
                if now >= deadline:  # the worker ignored its own wall limit: stuck
                    del inflight[ref]
                    idle.append(self._replace(worker))
                    results[i] = ExecResult(
                        "timeout", error="sandbox worker unresponsive past the wall time limit", id=requests[i].id
                    )
        self.metrics.busy_s += time.monotonic() - t0
        self.metrics.runs += len(requests)
        self.metrics.statuses.update(r.status for r in results)
        return results

    def close(self) -> None:
        for w in self.workers:
            try:
                ray.get(w.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - closing a dead worker is fine
                pass
            ray.kill(w, no_restart=True)
        self.workers = []
