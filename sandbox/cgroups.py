"""One cgroup per job: memory, pids and cpu limits, an out-of-memory report, and a kill
that reaches the whole tree. Handles cgroup v2, v1, and the hybrid layout (v1
controllers plus a v2 tree whose `cgroup.kill` works) found on some VMs."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from .types import Limits

ROOT = Path("/sys/fs/cgroup")
PARENT = "rlsys-sandbox"


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _mkdir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        return True
    except OSError:
        return False


def layout() -> str:
    """ "v2", "v1" or "none" (no writable cgroup tree)."""
    if (ROOT / "cgroup.controllers").exists():
        return "v2" if os.access(ROOT, os.W_OK) else "none"
    if os.access(ROOT / "memory", os.W_OK) and os.access(ROOT / "pids", os.W_OK):
        return "v1"
    return "none"


class JobCgroup:
    """Create with `JobCgroup.create(name, limits)`; a job joins by writing its pid to
    every path in `procs`. `None` where the machine offers no cgroups."""

    def __init__(self, kind: str, dirs: dict[str, Path]):
        self.kind, self.dirs = kind, dirs
        self.procs = [d / "cgroup.procs" for d in dirs.values()]

    @classmethod
    def create(cls, name: str, limits: Limits) -> JobCgroup | None:
        kind = layout()
        mem = limits.memory_mb << 20
        quota = int(limits.cpus * 100_000)
        if kind == "v2":
            parent = ROOT / PARENT
            if not _mkdir(parent):
                return None
            _write(ROOT / "cgroup.subtree_control", "+memory +pids +cpu")
            _write(parent / "cgroup.subtree_control", "+memory +pids +cpu")
            d = parent / name
            if not _mkdir(d):
                return None
            _write(d / "memory.max", str(mem))
            _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(limits.processes))
            _write(d / "cpu.max", f"{quota} 100000")
            return cls("v2", {"unified": d})
        if kind == "v1":
            dirs = {c: ROOT / c / PARENT / name for c in ("memory", "pids", "cpu")}
            if (ROOT / "unified" / "cgroup.procs").exists():
                dirs["unified"] = ROOT / "unified" / PARENT / name
            dirs = {c: d for c, d in dirs.items() if _mkdir(d)}
            if "memory" not in dirs or "pids" not in dirs:
                cls("v1", dirs).remove()
                return None
            _write(dirs["memory"] / "memory.limit_in_bytes", str(mem))
            _write(dirs["memory"] / "memory.memsw.limit_in_bytes", str(mem))
            _write(dirs["pids"] / "pids.max", str(limits.processes))
            if "cpu" in dirs:
                _write(dirs["cpu"] / "cpu.cfs_period_us", "100000")
                _write(dirs["cpu"] / "cpu.cfs_quota_us", str(quota))
            return cls("v1", dirs)
        return None

    def oom_killed(self) -> bool:
        if self.kind == "v2":
            events = _read(self.dirs["unified"] / "memory.events")
        else:
            events = _read(self.dirs["memory"] / "memory.oom_control")
            if "oom_kill " not in events:  # older kernels: any failed charge counts
                return _read(self.dirs["memory"] / "memory.failcnt").strip() not in ("", "0")
        for line in events.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return value.strip() != "0"
        return False

    def pids(self) -> list[int]:
        found = set()
        for p in self.procs:
            found.update(int(x) for x in _read(p).split())
        return sorted(found)

    def kill(self) -> None:
        """SIGKILL every process in the job, `setsid` grandchildren included."""
        if "unified" in self.dirs:
            _write(self.dirs["unified"] / "cgroup.kill", "1")
        for _ in range(50):  # v1 has no cgroup.kill: kill what is listed until none is left
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        for d in self.dirs.values():
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # still busy for a moment after the kill
                    time.sleep(0.01)


def sweep_stale(max_age_s: float = 60.0) -> int:
    """Remove job cgroups left behind by a worker that died mid-run: empty ones older than
    `max_age_s` (a live job's cgroup is empty only in the instant between its creation
    and the job joining it). Returns how many were removed."""
    removed = 0
    now = time.time()
    for parent in [ROOT / PARENT, *(ROOT / c / PARENT for c in ("memory", "pids", "cpu", "unified"))]:
        try:
            children = [d for d in parent.iterdir() if d.is_dir() and d.name.startswith("job-")]
        except OSError:
            continue
        for d in children:
            try:
                if now - d.stat().st_ctime >= max_age_s and not _read(d / "cgroup.procs").split():
                    d.rmdir()
                    removed += 1
            except OSError:
                pass
    return removed
