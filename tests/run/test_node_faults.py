"""Node faults on a real multi-node Ray cluster on one machine. One run lives through both:
the node its rollout workers run on is killed mid-run (its raylet's process group, as a lost
machine goes) and the workers come back on a node that joined meanwhile, with the current
weights, every step keeping its full batch; then the learner's node is killed and the run ends
in one line naming the rank, the node, the step and the checkpoint, and `rlsys resume` places
the learner on the node that is left and trains to the end."""

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from fakes import TINY_JOB
from local_cluster import LocalCluster

from rlsys.tracking import read_jsonl

pytestmark = pytest.mark.integration

STEPS = 40
PLACED = [
    "placement.learner.resources={learner_slot: 1}",
    "placement.rollout.resources={rollout_slot: 1}",
    "placement.services.resources={services: 1}",  # the reference, reward and buffer stay on the head
]


def wait_for(what, predicate, run: subprocess.Popen, every: float = 0.2, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert run.poll() is None, f"the run ended before {what}: {run.stderr_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


@contextmanager
def paused(run: subprocess.Popen):
    """The run's driver stopped (SIGSTOP) inside the block and continued after it."""
    os.kill(run.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(run.pid, signal.SIGCONT)


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [r["step"] for r in read_jsonl(path)] if path.exists() else []


def test_a_lost_rollout_node_and_then_a_lost_learner_node(tmp_path):
    # a node's death is noticed within ~3 s (Ray's default health check takes ~30 s)
    checks = dict(health_check_period_ms=1000, health_check_timeout_ms=1000, health_check_failure_threshold=3)
    cluster = LocalCluster(Path(f"/tmp/rlsys-test-faults-{os.getpid()}"), 1, {"services": 4}, **checks)
    try:
        cluster.add_node("learner_a", 2, {"learner_slot": 1})
        cluster.add_node("rollout_c", 2, {"rollout_slot": 2})
        run_dir = tmp_path / "faults"
        args = [*TINY_JOB, f"trainer.steps={STEPS}", "trainer.eval_every=0", "trainer.checkpoint_every=2"]
        args += ["rollout.num_workers=2", "rollout.max_new_tokens=4", f"ray.address={cluster.address}", *PLACED]
        args += [f"run.output_dir={tmp_path}", "run.name=faults", "--no-progress"]
        cli = [sys.executable, "-m", "rlsys.run.cli"]
        log = open(tmp_path / "run.stderr", "w+")
        run = subprocess.Popen([*cli, "run", "configs/quickstart.yaml", *args], env=cluster.env, stderr=log, text=True)
        run.stderr_path = tmp_path / "run.stderr"
        wait_for("the first step", lambda: len(steps_logged(run_dir)) >= 1, run)
        first = json.loads((run_dir / "placement.json").read_text())
        (roles,) = first["policies"].values()
        (learner_node,) = roles["learner"]
        assert len(set(roles["rollout"])) == 1 and roles["rollout"][0] != learner_node

        # a second node that can host both roles joins; the rollout node is lost (the driver is
        # held meanwhile so that a tiny run cannot end first; its actors' calls go on)
        with paused(run):
            cluster.add_node("spare_b", 2, {"learner_slot": 1, "rollout_slot": 2})
            cluster.kill("rollout_c")
            killed_at = len(steps_logged(run_dir))
        wait_for("steps after the rollout node's loss", lambda: len(steps_logged(run_dir)) >= killed_at + 4, run, 0.02)
        rows = read_jsonl(run_dir / "metrics.jsonl")
        assert rows[-1]["workers/restarted"] >= 1  # recreated on spare_b and given the current weights
        assert {r["samples"] for r in rows} == {rows[0]["samples"]}  # no step lost a share of its prompts
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))

        # the learner's node is lost: one line naming it, the step and the checkpoint
        with paused(run):
            cluster.kill("learner_a")
        run.wait(timeout=300)
        stderr = run.stderr_path.read_text()
        assert run.returncode == 1, stderr[-3000:]
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("rlsys: learner rank 0 of 1 died during step "), last
        lost_at = int(last.split("died during step ")[1].split()[0])
        assert f" on node {learner_node[:8]} (" in last
        assert "learner_slot 1), which the cluster lost (" in last
        assert f"with `rlsys resume {run_dir}`" in last
        assert lost_at > killed_at + 4

        # resumed on the nodes that are left: the learner and the workers on spare_b
        resumed = subprocess.run(
            [*cli, "resume", str(run_dir), "--no-progress"], env=cluster.env, capture_output=True, text=True
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        second = json.loads((run_dir / "placement.json").read_text())
        (roles,) = second["policies"].values()
        spare = [n for n, info in second["nodes"].items() if info["resources"].get("rollout_slot")]
        assert roles["learner"] == spare and roles["rollout"] == spare * 2
        rows = read_jsonl(run_dir / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert {r["samples"] for r in rows} == {rows[0]["samples"]}
    finally:
        cluster.shutdown()
