"""Reading a job's stdout and stderr with a byte cap and a wall-clock deadline."""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class Collected:
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    output_exceeded: bool


def collect(
    proc: subprocess.Popen, cap: int, deadline: float, kill: Callable[[], None], drain_s: float = 0.5
) -> Collected:
    """Read both pipes until EOF, keeping `cap` bytes of each. Past the deadline or the
    cap, call `kill` (it must end the whole job) and drain for at most `drain_s` more,
    because a leftover grandchild may hold the pipes open."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    over = {fd: False for fd in bufs}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    timed_out = exceeded = killed = False
    stop_at = deadline
    while sel.get_map():
        now = time.monotonic()
        if now >= stop_at:
            if killed:
                break
            timed_out = not exceeded
            kill()
            killed, stop_at = True, now + drain_s
            continue
        if not killed and proc.poll() is not None:
            # The job's main process is gone: end the rest now, then drain what is left.
            kill()
            killed, stop_at = True, now + drain_s
        for key, _ in sel.select(timeout=min(0.05, max(0.0, stop_at - now))):
            fd = key.fd
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(fd)
                continue
            room = cap - len(bufs[fd])
            if len(chunk) > room:
                over[fd] = True
            bufs[fd] += chunk[: max(room, 0)]
            if over[fd] and not killed:
                exceeded = True
                kill()
                killed, stop_at = True, time.monotonic() + drain_s
    sel.close()
    out, err = proc.stdout.fileno(), proc.stderr.fileno()
    return Collected(bytes(bufs[out]), bytes(bufs[err]), over[out], over[err], timed_out, exceeded)


def memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding `data`, positioned at its start (a job's stdin or
    a file bwrap copies in)."""
    fd = os.memfd_create(name)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
