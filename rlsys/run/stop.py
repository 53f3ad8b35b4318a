"""Stopping at a step boundary: SIGTERM (a scheduler's preemption, `kill`) and Ctrl-C (SIGINT)
ask the run to stop after the step in flight (`StopSignals`); the loop then ends it with
`stop_at_boundary`, which checkpoints that step where the config asks (`trainer.
checkpoint_on_signal`, `trainer.checkpoint_on_interrupt`) and raises `Stopped`: one line naming
the step, the checkpoint and the resume command. A second Ctrl-C interrupts at once."""

from __future__ import annotations

import signal
import sys
import threading

from rlsys.checkpoint import candidates
from rlsys.errors import Stopped

STOPPING = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Installs its handlers for the `with` block (main thread only: elsewhere Python cannot, and
    the signals stay with whoever handles them); `signum` is the first signal received, or None."""

    def __init__(self):
        self.signum: int | None = None
        self.previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in STOPPING}  # over Ray's own handlers
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = self.signum or signum
        print(f"rlsys: {signal.Signals(signum).name}: stopping after the step in flight", file=sys.stderr, flush=True)


def stop_at_boundary(run, signum: int, metrics: dict) -> Stopped:
    """The `Stopped` that ends `run` (the Controller) after its current step, that step
    checkpointed first where the config asks for it on this signal."""
    cfg, name = run.cfg.trainer, signal.Signals(signum).name
    wanted = cfg.checkpoint_on_signal if signum == signal.SIGTERM else cfg.checkpoint_on_interrupt
    root = run.run_dir / "checkpoints"
    saved = {p.name: p for p in candidates(root)}
    if wanted and f"step_{run.step}" not in saved:
        saved[f"step_{run.step}"] = run.save_checkpoint(metrics)
    here, newest = saved.get(f"step_{run.step}"), next(iter(candidates(root)), None)
    if here is not None:
        where = f"checkpoint {here}; resume: rlsys resume {run.run_dir}"
    elif newest is not None:
        where = f"no checkpoint of this step (newest: {newest}); resume from it: rlsys resume {run.run_dir}"
    else:
        where = "no checkpoint (trainer.checkpoint_on_signal / checkpoint_on_interrupt / checkpoint_every)"
    return Stopped(f"stopped by {name} after step {run.step}; {where}", signum)
