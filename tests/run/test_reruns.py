"""Bit-identical reruns: the same config and seed run twice on the same cluster shape end with the
same weights (max abs difference 0) and the same metrics, evaluation and sample rows, timings
aside: one rollout worker and a one-rank learner; two workers and a two-rank ZeRO-2 learner; two
workers with the rollout overlapped with training; two workers in async mode with its deterministic
interleaving (batches two versions ahead); and an object-store sync in buckets against one
in one object."""

import numpy as np
import pytest
from fakes import TINY_JOB

from rlsys.config import load_config
from rlsys.tracking import read_jsonl

pytestmark = pytest.mark.integration

SHAPES = {
    "1 worker, 1 rank": ["rollout.num_workers=1", "learner.num_ranks=1"],
    "2 workers, 2 ranks": ["rollout.num_workers=2", "learner.num_ranks=2", "learner.zero_stage=2"],
    "overlap": ["rollout.num_workers=2", "trainer.mode=overlap", "buffer.max_staleness=1"],
    "async, deterministic": ["rollout.num_workers=2", "trainer.mode=async", "buffer.max_staleness=2"]
    + ["trainer.deterministic=true"],
}


def run_once(tmp_path, name: str, shape: list[str]):
    from rlsys.run.controller import Controller

    cfg = load_config(
        "configs/quickstart.yaml",
        [*TINY_JOB, *shape, "trainer.steps=3", "trainer.eval_every=0", "rollout.max_new_tokens=6"]
        + [f"run.output_dir={tmp_path}", f"run.name={name}"],
    )
    controller = Controller(cfg, tmp_path / name, progress=False)
    controller.run()
    import ray

    weights = ray.get(controller.learners[0].weights.remote()) if len(controller.learners) == 1 else None
    if weights is None:  # every rank joins a ZeRO gather; rank 0 answers
        weights = ray.get([l.weights.remote() for l in controller.learners])[0]
    controller.shutdown()
    rows = [
        {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}
        for r in read_jsonl(tmp_path / name / "metrics.jsonl")
    ]
    return weights, rows, read_jsonl(tmp_path / name / "evals.jsonl"), read_jsonl(tmp_path / name / "samples.jsonl")


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_the_same_config_and_seed_twice_is_bit_identical(ray_cluster, tmp_path, shape):
    first = run_once(tmp_path, "first", SHAPES[shape])
    second = run_once(tmp_path, "second", SHAPES[shape])
    assert first[0].keys() == second[0].keys()
    assert max(float(np.abs(first[0][k] - second[0][k]).max()) for k in first[0]) == 0.0
    assert first[1] == second[1] and len(first[1]) == 3  # rewards, losses, KL, grad norms: equal
    assert first[2] == second[2] and first[3] == second[3]  # held-out evaluations, rollout samples


def test_a_sync_in_buckets_trains_the_same_run_as_one_object(ray_cluster, tmp_path):
    """trainer.sync_bucket_mb below the policy's size sends the same bytes in pieces: the run it
    trains is the one-object sync's, bit for bit."""
    shape = ["rollout.num_workers=2", "trainer.weight_sync=object_store"]
    whole = run_once(tmp_path, "whole", shape)
    buckets = run_once(tmp_path, "buckets", [*shape, "trainer.sync_bucket_mb=0.02"])
    assert max(float(np.abs(whole[0][k] - buckets[0][k]).max()) for k in whole[0]) == 0.0
    assert whole[1] == buckets[1] and whole[2] == buckets[2] and whole[3] == buckets[3]


def test_an_overlapped_run_trains_the_same_with_each_next_step_queued_behind_the_last(ray_cluster, tmp_path):
    """Under trainer.mode overlap the next step's rows are prepared and sent to the learner behind
    the step in training (no wait on the controller between two steps); a checkpoint at every step
    turns that off (the learner must be at the step it saves). Both train the same run, bit for bit."""
    shape = SHAPES["overlap"]
    queued = run_once(tmp_path, "queued", shape)
    stepwise = run_once(tmp_path, "stepwise", [*shape, "trainer.checkpoint_every=1"])
    assert max(float(np.abs(queued[0][k] - stepwise[0][k]).max()) for k in queued[0]) == 0.0
    assert queued[1] == stepwise[1] and queued[2] == stepwise[2] and queued[3] == stepwise[3]
    flags = {
        name: [r["perf/next_step_queued"] for r in read_jsonl(tmp_path / name / "metrics.jsonl")]
        for name in ("queued", "stepwise")
    }
    assert flags == {"queued": [1.0, 1.0, 0.0], "stepwise": [0.0, 0.0, 0.0]}  # the last step has no next
