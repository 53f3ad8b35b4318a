"""Exact resume: a run killed with SIGKILL after a checkpoint and resumed ends with the same
weights (max abs difference 0) and the same metrics rows as the uninterrupted run; full
fine-tuning, LoRA (learner.lora: the checkpoint holds the adapters and their optimizer state), and
async mode with its deterministic interleaving (the checkpoint holds the batches made ahead)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakes import TINY_JOB
from safetensors.torch import load_file

from rlsys import checkpoint
from rlsys.tracking import read_jsonl

pytestmark = pytest.mark.integration

TINY = [
    *TINY_JOB,
    "trainer.eval_every=2",
    "rollout.max_new_tokens=4",
    "trainer.steps=4",
    "trainer.checkpoint_every=2",
    "trainer.keep_checkpoints=3",
]


def rlsys(*args, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "rlsys.run.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kw,
    )


def deterministic(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


def final_weights(run_dir: Path):
    return load_file(str(run_dir / "checkpoints" / "step_4" / "hf" / "model.safetensors"))


def assert_same_run(a: Path, b: Path):
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) == 0.0
    assert deterministic(read_jsonl(a / "metrics.jsonl")) == deterministic(read_jsonl(b / "metrics.jsonl"))
    assert read_jsonl(a / "evals.jsonl") == read_jsonl(b / "evals.jsonl")


WARM = ["sft.steps=150", "sft.lr=0.005"]  # a warm-up after which some rewards are 1: the weights move
TRAINING = {
    "full": WARM,
    "lora": [*WARM, "learner.lora.rank=4", "learner.lora.alpha=8", "learner.lr=0.01"],
    # the checkpoint holds the batches made ahead; the producer goes on after them
    "async": [*WARM, "trainer.mode=async", "buffer.max_staleness=2", "trainer.deterministic=true"],
}


@pytest.mark.parametrize("training", list(TRAINING))
def test_sigkill_then_resume_is_exact_and_falls_back_past_a_corrupt_checkpoint(tmp_path, training):
    """Full fine-tuning also checks the fallback past a damaged newest checkpoint."""
    # an evaluation after every step widens the window between the step_2 checkpoint and the run's
    # end (steps 3 and 4 of the tiny model take tens of ms); the watcher looks every 10 ms
    tiny = [*TINY, "trainer.eval_every=1", *TRAINING[training]]
    full = rlsys(
        "run", "configs/quickstart.yaml", *tiny, f"run.output_dir={tmp_path}", "run.name=full", "--no-progress"
    )
    _, err = full.communicate(timeout=600)  # one run at a time: two side by side take longer on 2 cores
    assert full.returncode == 0, err[-2000:]
    killed = rlsys(
        "run", "configs/quickstart.yaml", *tiny, f"run.output_dir={tmp_path}", "run.name=killed", "--no-progress"
    )
    latest = tmp_path / "killed" / "checkpoints" / "latest"
    deadline = time.time() + 600
    while not (latest.exists() and latest.read_text() == "step_2"):
        assert killed.poll() is None, killed.communicate()[1][-2000:]
        assert time.time() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.01)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    assert not (tmp_path / "killed" / "checkpoints" / "step_4").exists()

    resumed = rlsys("resume", str(tmp_path / "killed"), "--no-progress")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-2000:]
    assert "resumed killed from step_2" in err
    assert_same_run(tmp_path / "full", tmp_path / "killed")
    initial = load_file(str(tmp_path / "full" / "policy_init" / "model.safetensors"))
    final = final_weights(tmp_path / "full")
    assert any(not (final[k] == initial[k]).all() for k in initial)  # the run trained something

    if training != "full":
        return  # the fallback reads checkpoint files, the same in every mode: one mode pays for it
    # damage the newest checkpoint: resume says so in one line, uses step_2, and still ends identical
    victim = tmp_path / "killed" / "checkpoints" / "step_4" / "state.json"
    victim.write_text(victim.read_text()[:-20])
    again = rlsys("resume", str(tmp_path / "killed"), "--no-progress")
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-2000:]
    lines = [l for l in err.splitlines() if "unreadable" in l]
    assert len(lines) == 1 and "step_4" in lines[0] and "falling back to step_2" in lines[0], err[-2000:]
    assert_same_run(tmp_path / "full", tmp_path / "killed")


def test_checkpoint_commit_verify_and_candidates(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        tmp = checkpoint.staging_dir(root, step)
        (tmp / "a.bin").write_bytes(b"x" * step)
        checkpoint.commit(root, tmp, step, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_2", "step_3"]
    assert (root / "latest").read_text() == "step_3"
    assert checkpoint.verify(root / "step_3")["step"] == 3
    (root / "step_3" / "a.bin").write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match="a.bin is 0 bytes, expected 3"):
        checkpoint.verify(root / "step_3")
    # a staging folder left by a crash is never a candidate
    (root / ".tmp_step_4").mkdir()
    assert [p.name for p in checkpoint.candidates(root)] == ["step_3", "step_2"]


def test_resume_without_checkpoint_and_rerun_into_a_used_dir_fail_in_one_line(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("run:\n  name: r\n")
    p = subprocess.run(
        [sys.executable, "-m", "rlsys.run.cli", "resume", str(run_dir)], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("no checkpoint to resume from"), p.stderr


def test_a_run_killed_between_its_checkpoint_and_the_steps_row_gets_the_row_back(ray_cluster, tmp_path):
    """The step's metrics row is written after its checkpoint; the checkpoint keeps the row, so a
    kill in between (emulated: the row is cut off the log) loses nothing on resume."""
    from rlsys.config import load_config
    from rlsys.run.controller import Controller

    overrides = [*TINY, "trainer.steps=2", f"run.output_dir={tmp_path}", "run.name=cut"]
    Controller(load_config("configs/quickstart.yaml", overrides), tmp_path / "cut", progress=False).run()
    log = tmp_path / "cut" / "metrics.jsonl"
    rows = read_jsonl(log)
    assert [r["step"] for r in rows] == [1, 2] and "time/checkpoint" in rows[1]
    log.write_text(json.dumps(rows[0]) + "\n")  # killed after the step_2 checkpoint, before its row
    resumed = Controller(
        load_config("configs/quickstart.yaml", [*overrides, "trainer.steps=3"]), tmp_path / "cut", progress=False
    )
    resumed.run(resume=True)
    after = read_jsonl(log)
    assert [r["step"] for r in after] == [1, 2, 3]
    timeless = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
    assert timeless(after[1]) == timeless(rows[1])
