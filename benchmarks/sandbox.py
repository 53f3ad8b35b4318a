"""HumanEval checks/s and latency per sandbox backend and worker count, against plain
unsandboxed `subprocess` as the floor.

    eval "$(bash .ci/setup_sandbox.sh)"     # bwrap root filesystem, podman's Docker API
    .venv/bin/python benchmarks/sandbox.py [--quick] [--workers 1,2,4] [--modes floor,bwrap,docker-warm,docker-fresh]

Each check is one canonical HumanEval solution run with its tests through the harness
(`sandbox.humaneval.check_request`): the request the code-RL environment sends. N
workers are N backend instances (for docker: N warm containers) fed from one queue by N
threads; every worker runs one check first as a warm-up (container start, page cache),
outside the timing. Each cell is the best of `--repeat` runs (another job may share the
machine's cores). A mode that cannot run here (no engine, no root filesystem) is
reported as skipped with its reason. Fresh containers are slow (~1 s each), so that mode
runs at most `--fresh-problems` checks.

Prints one markdown table: checks/s, p50/p95 latency of one check, how many passed, and
throughput as a multiple of the floor at the same worker count.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandbox import make_backend  # noqa: E402
from sandbox.base import unavailable  # noqa: E402
from sandbox.humaneval import check_request, load_problems  # noqa: E402

MODES = {  # name: (backend, config, label)
    "floor": ("subprocess-unsafe", {}, "subprocess (no sandbox: floor)"),
    "bwrap": ("bwrap", {}, "bwrap"),
    "docker-warm": ("docker", {"isolation": "warm"}, "docker warm (exec per check)"),
    "docker-fresh": ("docker", {"isolation": "fresh"}, "docker fresh (container per check)"),
}


@dataclass
class Row:
    mode: str
    workers: int
    checks: int
    per_s: float
    p50_ms: float
    p95_ms: float
    passed: int


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(mode: str, workers: int, requests) -> Row:
    """Run `requests` on `workers` fresh backend instances; time only the queue's drain."""
    name, config, _ = MODES[mode]
    backends = [make_backend(name, **config) for _ in range(workers)]
    todo: queue.Queue = queue.Queue()
    latencies, passed, lock = [], [0], threading.Lock()

    def work(b):
        while True:
            try:
                req = todo.get_nowait()
            except queue.Empty:
                return
            t = time.monotonic()
            ok = b.run(req).passed
            with lock:
                latencies.append(time.monotonic() - t)
                passed[0] += ok

    try:
        for b in backends:  # warm-up, untimed
            b.run(requests[0])
        for r in requests:
            todo.put(r)
        threads = [threading.Thread(target=work, args=(b,)) for b in backends]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
    finally:
        for b in backends:
            b.close()
    return Row(
        mode,
        workers,
        len(requests),
        len(requests) / elapsed,
        1e3 * statistics.median(latencies),
        1e3 * percentile(latencies, 0.95),
        passed[0],
    )


def table(rows: list[Row], skipped: dict[str, str]) -> str:
    floor = {r.workers: r.per_s for r in rows if r.mode == "floor"}
    lines = [
        "| backend | workers | checks | checks/s | p50 ms | p95 ms | passed | x floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r.per_s / floor[r.workers]:.2f}" if r.workers in floor else "-"
        lines.append(
            f"| {MODES[r.mode][2]} | {r.workers} | {r.checks} | {r.per_s:.1f} | {r.p50_ms:.0f} | "
            f"{r.p95_ms:.0f} | {r.passed}/{r.checks} | {ratio} |"
        )
    lines += [f"| {MODES[m][2]} | skipped: {why} | | | | | | |" for m, why in skipped.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the first 32 problems only")
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--fresh-problems", type=int, default=24, help="at most this many checks in docker-fresh mode")
    p.add_argument("--repeat", type=int, default=2, help="best of this many runs per cell (the machine is shared)")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown mode {bad[0]!r}; choose from {', '.join(MODES)}")
    problems = load_problems()[:32] if args.quick else load_problems()
    requests = [check_request(pr, pr.canonical_solution) for pr in problems]
    workers = [int(w) for w in args.workers.split(",")]
    print(
        f"# {len(requests)} HumanEval checks; {os.cpu_count()} cpus; load average {os.getloadavg()[0]:.1f} at start",
        file=sys.stderr,
    )
    rows, skipped = [], {}
    for mode in modes:
        why = unavailable(MODES[mode][0])
        if why:
            skipped[mode] = why
            continue
        reqs = requests[: args.fresh_problems] if mode == "docker-fresh" else requests
        for w in workers:
            tries = 1 if mode == "docker-fresh" else args.repeat
            r = max((measure(mode, w, reqs) for _ in range(tries)), key=lambda row: row.per_s)
            rows.append(r)
            print(f"{mode} x{w}: {r.per_s:.1f} checks/s, p50 {r.p50_ms:.0f} ms", file=sys.stderr)
    print(table(rows, skipped))
    print(f"# load average {os.getloadavg()[0]:.1f} at the end", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
