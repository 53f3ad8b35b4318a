"""A real multi-node Ray cluster on one machine: a head and two worker nodes started with
`ray start` (loopback, token auth), each worker node offering a custom resource naming it. A
run placed by role puts its learner on one node and its rollout workers on the other (the
weights cross nodes through the object store); a two-rank learner spread over both nodes meets
at rank 0's node; a placement no node can satisfy ends the run in one line naming it."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakes import TINY_JOB
from local_cluster import LocalCluster
from test_jobs import cli

from rlsys.tracking import read_jsonl

pytestmark = pytest.mark.integration

NODES = {"node_a": 2, "node_b": 2}  # name -> logical CPUs; each offers {name: 4, learner_slot: 1}


@pytest.fixture(scope="module")
def cluster():
    """(GCS address, environment with the token) of a head and two worker nodes; torn down after."""
    nodes = LocalCluster(Path(f"/tmp/rlsys-test-nodes-{os.getpid()}"), jobs=True)
    try:
        for name, cpus in NODES.items():
            nodes.add_node(name, cpus, {name: 4, "learner_slot": 1})
        yield nodes.address, nodes.env, nodes.dashboard
    finally:
        nodes.shutdown()


def rlsys_run(cluster, tmp_path, name: str, *overrides, timeout=600):
    gcs, env, _ = cluster
    args = [*TINY_JOB, "trainer.steps=2", "trainer.eval_every=0", "rollout.max_new_tokens=4", f"ray.address={gcs}"]
    args += [f"run.output_dir={tmp_path}", f"run.name={name}", *overrides, "--no-progress"]
    return subprocess.run(
        [sys.executable, "-m", "rlsys.run.cli", "run", "configs/quickstart.yaml", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def node_of(report: dict, resource: str) -> str:
    (node,) = [n for n, info in report["nodes"].items() if resource in info["resources"]]
    return node


def test_placement_by_role_puts_learner_and_rollout_on_their_nodes(cluster, tmp_path):
    done = rlsys_run(
        cluster,
        tmp_path,
        "by_role",
        "rollout.num_workers=2",
        "placement.learner.resources={node_a: 1}",
        "placement.rollout.resources={node_b: 1}",
        "placement.services.resources={node_a: 1}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "by_role" / "placement.json").read_text())
    assert len(report["nodes"]) == 3
    (roles,) = report["policies"].values()
    assert roles["learner"] == [node_of(report, "node_a")]
    assert roles["rollout"] == [node_of(report, "node_b")] * 2
    assert set(report["services"]) == {"reference", "reward", "buffer"}
    assert set(report["services"].values()) == {node_of(report, "node_a")}
    assert report["weight_sync"] == "ObjectStoreSync"  # auto: the workers are on another node than the learner
    rows = read_jsonl(tmp_path / "by_role" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["policy_version"] == 2


def test_a_two_rank_learner_spread_over_two_nodes_meets_at_rank_0s_node(cluster, tmp_path):
    done = rlsys_run(
        cluster,
        tmp_path,
        "spread",
        "rollout.num_workers=1",
        "learner.num_ranks=2",
        "learner.zero_stage=2",
        "placement.learner.resources={learner_slot: 1}",
        "placement.learner.strategy=STRICT_SPREAD",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "spread" / "placement.json").read_text())
    (roles,) = report["policies"].values()
    assert sorted(roles["learner"]) == sorted([node_of(report, "node_a"), node_of(report, "node_b")])
    assert [r["step"] for r in read_jsonl(tmp_path / "spread" / "metrics.jsonl")] == [1, 2]


def test_a_placement_no_node_offers_fails_at_once_in_one_line(cluster, tmp_path):
    start = time.monotonic()
    done = rlsys_run(cluster, tmp_path, "nowhere", "placement.learner.resources={node_x: 1}", timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("rlsys: placement.learner.resources asks for {'node_x': 1.0}, which no node")
    assert "node_a 4" in last and "node_b 4" in last and time.monotonic() - start < 200


def test_rlsys_submit_runs_the_quickstart_to_the_end_on_the_cluster(cluster, tmp_path):
    """The job's driver on the head, its learner and workers placed by role on the worker nodes."""
    _, env, dashboard = cluster
    args = [*TINY_JOB, "trainer.steps=2", "trainer.eval_every=0", "rollout.max_new_tokens=4"]
    args += ["placement.learner.resources={node_a: 1}", "placement.rollout.resources={node_b: 1}"]
    job = cli(env, "submit", "configs/quickstart.yaml", *args, "run.name=submitted", f"run.output_dir={tmp_path}",
              "--address", dashboard).splitlines()[-1]  # fmt: skip
    deadline = time.monotonic() + 600
    while (state := cli(env, "status", job, "--address", dashboard)) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.monotonic() < deadline
        time.sleep(2)
    logs = cli(env, "logs", job, "--address", dashboard)
    assert state == "SUCCEEDED" and "finished 2 steps" in logs, logs[-3000:]
    report = json.loads((tmp_path / "submitted" / "placement.json").read_text())
    (roles,) = report["policies"].values()
    assert roles["learner"] == [node_of(report, "node_a")] and set(roles["rollout"]) == {node_of(report, "node_b")}
