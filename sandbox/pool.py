"""A pool of sandbox workers on Ray: a bound on concurrent runs (one per worker), a queue
for the rest, a per-run deadline enforced from outside the worker, a dead or stuck
worker replaced (a dead worker's run is retried once), and metrics."""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import ray

from .backends import make_backend
from .types import ExecRequest, ExecResult

GRACE_S = 30.0  # beyond the run's own wall limit before the pool gives up on a worker
POLL_S = 0.05  # how often a call with requests queued looks for a worker another call gave back


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
    busy_s: float = 0.0  # wall time with at least one run_many call under way
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
    `grace_s` after its run's wall limit is taken as stuck and replaced. Calls from several
    threads share the workers: each run takes whichever worker is idle (episodes' tool calls)."""

    def __init__(
        self, backend: str = "bwrap", workers: int = 4, num_cpus: float = 0, grace_s: float = GRACE_S, **config
    ):
        self.backend, self.config, self.num_cpus, self.grace_s = backend, config, num_cpus, grace_s
        self.workers = [self._spawn() for _ in range(workers)]
        self.metrics = PoolMetrics()
        self._idle = list(self.workers)  # shared by concurrent calls, under _cond
        self._cond = threading.Condition()
        self._active, self._busy_since = 0, 0.0  # calls in run_many, and since when one has been

    def _spawn(self):
        return SandboxWorker.options(num_cpus=self.num_cpus).remote(self.backend, self.config)

    def _take(self, wait: bool):
        """An idle worker, or None; with `wait`, after waiting up to POLL_S for one."""
        with self._cond:
            if not self._idle and wait:
                self._cond.wait(POLL_S)
            return self._idle.pop() if self._idle else None

    def _give(self, worker) -> None:
        with self._cond:
            self._idle.append(worker)
            self._cond.notify()

    def _replace(self, worker) -> None:
        """Kill `worker` and put a fresh one in its place, idle."""
        ray.kill(worker, no_restart=True)
        new = self._spawn()
        with self._cond:
            self.metrics.replaced_workers += 1
            self.workers[self.workers.index(worker)] = new
        self._give(new)

    def run(self, req: ExecRequest) -> ExecResult:
        return self.run_many([req])[0]

    def run_many(self, requests: list[ExecRequest]) -> list[ExecResult]:
        if not self.workers:
            raise RuntimeError("the sandbox pool is closed")
        t0 = time.monotonic()
        with self._cond:
            self._busy_since = t0 if self._active == 0 else self._busy_since
            self._active += 1
        results: list[ExecResult | None] = [None] * len(requests)
        queue = deque((i, 0) for i in range(len(requests)))  # (index, attempt)
        inflight = {}  # ref -> (index, attempt, worker, deadline)
        try:
            while queue or inflight:
                while queue and (worker := self._take(wait=not inflight)) is not None:
                    i, attempt = queue[0]
                    try:
                        deadline = time.monotonic() + requests[i].limits.wall_time_s + self.grace_s
                        inflight[worker.run.remote(requests[i])] = (i, attempt, worker, deadline)
                    except BaseException:
                        self._give(worker)  # not sent: the worker is still idle
                        raise
                    queue.popleft()
                    if attempt == 0:
                        with self._cond:
                            self.metrics.queue_waits.append(time.monotonic() - t0)
                if not inflight:  # every worker is another call's: wait for one again
                    if not self.workers:
                        raise RuntimeError("the sandbox pool was closed while a call waited for a worker")
                    continue
                wait_s = max(0.0, min(d for *_, d in inflight.values()) - time.monotonic())
                if queue:  # a worker that another call gives back is taken soon
                    wait_s = min(wait_s, POLL_S)
                ready, _ = ray.wait(list(inflight), num_returns=1, timeout=wait_s)
                for ref in ready:
                    i, attempt, worker, _ = inflight[ref]
                    try:
                        results[i] = ray.get(ref)
                        self._give(worker)
                    except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
                        self._replace(worker)
                        if attempt == 0:
                            with self._cond:
                                self.metrics.retries += 1
                            queue.appendleft((i, 1))
                        else:
                            results[i] = ExecResult(
                                "error", error=f"sandbox worker died twice: {one_line(e)}", id=requests[i].id
                            )
                    except ray.exceptions.RayTaskError as e:
                        self._give(worker)
                        results[i] = ExecResult(
                            "error", error=f"sandbox worker failed: {one_line(e.cause)}", id=requests[i].id
                        )
                    del inflight[ref]  # given back (or replaced) above; an error on the way: `finally` below
                now = time.monotonic()
                for ref, (i, _, worker, deadline) in list(inflight.items()):
                    if now >= deadline:  # the worker ignored its own wall limit: stuck
                        del inflight[ref]
                        self._replace(worker)
                        results[i] = ExecResult(
                            "timeout", error="sandbox worker unresponsive past the wall time limit", id=requests[i].id
                        )
        finally:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self.metrics.busy_s += time.monotonic() - self._busy_since
                self.metrics.runs += len(requests)
                self.metrics.statuses.update(r.status for r in results if r is not None)
            for _, _, worker, _ in inflight.values():  # an error above: runs abandoned mid-way get
                self._replace(worker)  # a fresh worker, not one still busy with them
        return results

    def close(self) -> None:
        for w in self.workers:
            try:
                ray.get(w.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - closing a dead worker is fine
                pass
            ray.kill(w, no_restart=True)
        self.workers, self._idle = [], []
