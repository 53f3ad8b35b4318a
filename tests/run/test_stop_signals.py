"""Preemption and Ctrl-C: `rlsys run` stops after the step in flight with one line naming the
step, the checkpoint and the resume command. SIGTERM to the driver (a scheduler, `kill`)
checkpoints that step, exits 143, and `rlsys resume` goes on from it; Ctrl-C (SIGINT to the
terminal's process group) exits 130 without a checkpoint unless asked."""

import os
import re
import signal
import time

import pytest
import torch
from fakes import TINY_JOB
from test_resume import rlsys

from rlsys.tracking import read_jsonl

pytestmark = pytest.mark.integration

LONG = [*TINY_JOB, "trainer.eval_every=0", "rollout.max_new_tokens=4", "trainer.steps=200"]


def start(tmp_path, name: str, *extra):
    return rlsys(
        "run",
        "configs/quickstart.yaml",
        *LONG,
        f"run.output_dir={tmp_path}",
        f"run.name={name}",
        *extra,
        "--no-progress",
    )


def wait_for_steps(run, run_dir, steps: int):
    deadline = time.monotonic() + 300
    while len(read_jsonl(run_dir / "metrics.jsonl")) < steps:
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not reach its steps"
        time.sleep(0.2)


def test_sigterm_checkpoints_the_step_in_flight_and_resume_goes_on(tmp_path):
    """Under trainer.mode overlap, where the next step may already be training behind the one in
    flight: the run stops after that one too, and the checkpoint's learner is at its step."""
    run = start(tmp_path, "preempted", "trainer.mode=overlap", "buffer.max_staleness=1")
    wait_for_steps(run, tmp_path / "preempted", 2)
    os.kill(run.pid, signal.SIGTERM)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    found = re.fullmatch(
        r"rlsys: stopped by SIGTERM after step (\d+); checkpoint (\S+); resume: rlsys resume (\S+)", last
    )
    assert found, last
    step, run_dir = int(found[1]), tmp_path / "preempted"
    assert found[2] == str(run_dir / "checkpoints" / f"step_{step}") and found[3] == str(run_dir)
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, step + 1))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    saved = torch.load(
        run_dir / "checkpoints" / f"step_{step}" / "learner" / "learner" / "mp_rank_00_model_states.pt",
        weights_only=False,
    )
    assert saved["global_steps"] == step  # one optimizer step a trainer step: none of a step after it
    assert "Traceback" not in err and "SIGTERM received" not in err  # no stack dump, Ray's or Python's

    resumed = rlsys("resume", str(run_dir), f"trainer.steps={step + 1}", "--no-progress")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resumed preempted from step_{step}" in err
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, step + 2))


def test_ctrl_c_stops_after_the_step_without_a_checkpoint_unless_asked(tmp_path):
    interrupted = start(tmp_path, "interrupted")
    asked = start(tmp_path, "asked", "trainer.checkpoint_on_interrupt=true")  # side by side: half the wait
    wait_for_steps(interrupted, tmp_path / "interrupted", 1)
    os.killpg(interrupted.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    _, err = interrupted.communicate(timeout=300)
    assert interrupted.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"rlsys: stopped by SIGINT after step \d+; no checkpoint \(.*\)", last), last
    assert not (tmp_path / "interrupted" / "checkpoints").exists()

    wait_for_steps(asked, tmp_path / "asked", 1)
    os.killpg(asked.pid, signal.SIGINT)
    _, err = asked.communicate(timeout=300)
    assert asked.returncode == 130 and "; checkpoint " in err.strip().splitlines()[-1], err[-3000:]
