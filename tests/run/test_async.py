"""trainer.mode: async. The producer's schedule against a real buffer actor (a scripted rollout
whose rows carry the version it saw: the staleness bound under `wait` and `drop`, the
deterministic hold on syncs, pause, errors); then whole runs on the local cluster (the bound
in every step's rows, the batches a checkpoint keeps)."""

import json
import threading
import time
from contextlib import contextmanager

import pyarrow.parquet as pq
import pytest
from fakes import TINY_JOB

from rlsys.buffer import ExperienceBuffer
from rlsys.config import load_config
from rlsys.contract import Prompt
from rlsys.experience import make_experience
from rlsys.run.rollouts import AsyncRollouts, PromptStream, RolloutSource

pytestmark = pytest.mark.integration


class Timings:
    @contextmanager
    def timed(self, phase):
        yield


class ScriptedRollout:
    """Each batch: one row per prompt, at the policy version the producer holds when it starts
    (what a worker would sample by), after `seconds`; `fail_at`: that batch raises."""

    def __init__(self, seconds: float = 0.0, fail_at: int | None = None):
        self.seconds, self.fail_at = seconds, fail_at
        self.started: list[tuple[int, int]] = []  # (batch, version) at each start
        self.producer: AsyncRollouts | None = None

    def rollout(self, ctx, prompts):
        i, version = len(self.started), self.producer.version
        self.started.append((i, version))
        if i == self.fail_at:
            raise RuntimeError(f"batch {i}: the reward server is gone")
        time.sleep(self.seconds)
        return make_experience(
            [
                dict(uid=f"{i}-{p.uid}", group=p.uid, prompt_ids=p.prompt_ids, response_ids=[1], logprobs=[-0.5])
                | dict(reward=0.0, policy_version=version)
                for p in prompts
            ]
        )


def producer(ray_cluster, k: int, policy: str, steps: int, deterministic=False, **scripted):
    buffer = ray_cluster.remote(ExperienceBuffer).remote(max_staleness=k)
    stream = PromptStream([Prompt(f"p{i}", [3, 4], "", {}) for i in range(20)], seed=0)
    algorithm = ScriptedRollout(**scripted)
    source = RolloutSource(algorithm, Timings(), buffer, stream, 2, overlap=False, steps=steps)
    algorithm.producer = AsyncRollouts(source, k, policy, deterministic)
    return algorithm, algorithm.producer


def learn(rollouts: AsyncRollouts, steps: int, seconds: float) -> list:
    """The learner's side: take a batch, 'train' for `seconds`, send the next version."""
    taken = []
    for step in range(steps):
        table = rollouts.take()
        taken.append((step, table.column("policy_version").to_pylist()))
        time.sleep(seconds)
        rollouts.before_sync(step + 1)
        rollouts.set_policy_version(step + 1)
    rollouts.close()
    return taken


@pytest.mark.parametrize("k", [1, 2])
def test_wait_starts_batch_i_once_the_learner_holds_version_i_minus_k(ray_cluster, k):
    algorithm, rollouts = producer(ray_cluster, k, "wait", steps=6, seconds=0.01)
    taken = learn(rollouts, 6, seconds=0.15)  # a slow learner: the producer would run far ahead
    assert all(version >= i - k for i, version in algorithm.started)
    assert any(version == i - k for i, version in algorithm.started if i >= k)  # it ran as far ahead as allowed
    for step, versions in taken:  # step s trains at version s: rows at most k behind, none dropped
        assert all(step - v <= k for v in versions)
    assert len(algorithm.started) == 6 and rollouts.dropped == 0


def test_drop_runs_ahead_and_drops_a_batch_that_fell_more_than_k_behind(ray_cluster):
    algorithm, rollouts = producer(ray_cluster, 1, "drop", steps=5, seconds=0.0)
    taken = learn(rollouts, 5, seconds=0.3)  # the producer fills k + 1 = 2 batches at once, by version 0
    for step, versions in taken:
        assert all(step - v <= 1 for v in versions)
    stats = ray_cluster.get(rollouts.source.buffer.stats.remote())
    assert rollouts.dropped >= 1 and stats["dropped_batches"] == rollouts.dropped
    assert len(algorithm.started) == 5 + rollouts.dropped  # each dropped batch was made again
    assert rollouts.metrics()["staleness/dropped_batches"] == rollouts.dropped


def test_deterministic_generates_batch_i_by_version_i_minus_k_exactly(ray_cluster):
    algorithm, rollouts = producer(ray_cluster, 2, "wait", steps=6, deterministic=True, seconds=0.05)
    learn(rollouts, 6, seconds=0.0)  # a fast learner: without the hold it would send versions early
    assert algorithm.started == [(i, max(0, i - 2)) for i in range(6)]


def test_a_failing_rollout_reaches_the_learner_and_pause_waits_for_the_batch_in_flight(ray_cluster):
    algorithm, rollouts = producer(ray_cluster, 1, "wait", steps=4, fail_at=1, seconds=0.3)
    rollouts.take()
    with pytest.raises(RuntimeError, match="batch 1: the reward server is gone"):
        rollouts.take()
    rollouts.close()

    algorithm, rollouts = producer(ray_cluster, 2, "wait", steps=4, seconds=0.5)
    rollouts.take()
    threading.Event().wait(0.1)  # batch 1 is in flight
    rollouts.pause()
    assert not rollouts.busy and rollouts.produced == 2
    threading.Event().wait(0.6)
    assert rollouts.produced == 2 and len(algorithm.started) == 2  # nothing started while paused
    rollouts.unpause()
    assert rollouts.take().num_rows == 2
    rollouts.close()


def test_a_checkpoint_of_one_mode_is_not_resumed_in_the_other(ray_cluster):
    from rlsys.checkpoint import CheckpointError

    _, rollouts = producer(ray_cluster, 1, "wait", steps=4)
    with pytest.raises(CheckpointError, match="rows saved under trainer.mode sync/overlap"):
        rollouts.restored(2, {"size": 8, "batches": 0})
    rollouts.restored(2, {"size": 8, "batches": 2, "dropped_batches": 3})
    assert (rollouts.produced, rollouts.removed) == (4, 2)
    assert rollouts.metrics()["staleness/dropped_batches"] == 3  # the checkpoint's count goes on
    with pytest.raises(CheckpointError, match="2 batches made ahead under trainer.mode=async"):
        rollouts.source.restored(2, {"size": 8, "batches": 2})


def test_an_async_run_keeps_every_row_within_the_bound_and_checkpoints_its_queued_batches(ray_cluster, tmp_path):
    from rlsys.run.controller import Controller

    cfg = load_config(
        "configs/quickstart.yaml",
        [*TINY_JOB, "rollout.max_new_tokens=4", "rollout.num_workers=2", "trainer.steps=6", "trainer.eval_every=3"]
        + ["trainer.mode=async", "buffer.max_staleness=2", "trainer.checkpoint_every=3"]
        + [f"run.output_dir={tmp_path}", "run.name=async"],
    )
    controller = Controller(cfg, tmp_path / "async", progress=False)
    summary = controller.run()
    controller.shutdown()
    rows = [json.loads(l) for l in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 6 and [r["samples"] for r in rows] == [32] * 6
    assert all(r["staleness/max"] <= 2 and r["staleness/dropped_batches"] == 0 for r in rows)
    assert max(r["staleness/max"] for r in rows) >= 1  # the producer ran ahead of the learner
    assert placement_sync(tmp_path / "async") == "ObjectStoreSync"  # auto takes the object store under async
    # the step-3 checkpoint holds the batches made for steps 4.. (whole, each with its rows)
    saved = pq.read_table(tmp_path / "async" / "checkpoints" / "step_3" / "buffer.parquet")
    batch_rows = json.loads(saved.schema.metadata[b"batch_rows"])
    assert batch_rows and set(batch_rows) == {32} and sum(batch_rows) == saved.num_rows
    assert min(saved.column("policy_version").to_pylist()) >= 3 - 2


def placement_sync(run_dir) -> str:
    return json.loads((run_dir / "placement.json").read_text())["weight_sync"]


@pytest.mark.parametrize("inflight", [["resume", "rollout.inflight_chunk_tokens=2"], ["continue"]], ids=lambda v: v[0])
def test_partial_rollouts_record_each_tokens_version_within_the_bound(ray_cluster, tmp_path, inflight):
    """rollout.inflight_update resume: responses generated in chunks of 2 tokens, each chunk by the
    newest weights its worker holds; continue: new weights offered to a worker (its "weights"
    concurrency group) load between two decode steps. Every token's version is recorded (the
    checkpointed batches keep them) and no token is more than k versions behind when trained on."""
    from rlsys.experience import response_token_versions
    from rlsys.run.controller import Controller

    cfg = load_config(
        "configs/quickstart.yaml",
        [*TINY_JOB, "rollout.max_new_tokens=6", "rollout.num_workers=2", "trainer.steps=4", "trainer.eval_every=0"]
        + ["trainer.mode=async", "buffer.max_staleness=1", "trainer.checkpoint_every=2"]
        + [f"rollout.inflight_update={inflight[0]}", *inflight[1:]]
        + [f"run.output_dir={tmp_path}", "run.name=partial"],
    )
    controller = Controller(cfg, tmp_path / "partial", progress=False)
    controller.run()
    controller.shutdown()
    rows = [json.loads(l) for l in (tmp_path / "partial" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in rows] == [32] * 4 and all(r["staleness/max"] <= 1 for r in rows)
    saved = pq.read_table(tmp_path / "partial" / "checkpoints" / "step_2" / "buffer.parquet")
    versions = response_token_versions(saved)
    assert saved.column("token_versions").null_count == 0
    assert [len(v) for v in versions] == [len(r) for r in saved.column("response_ids").to_pylist()]
    row_versions = saved.column("policy_version").to_pylist()
    assert all(row == min(v) for row, v in zip(row_versions, versions) if v)  # a row's version: its oldest token's
    assert all(v == sorted(v) and min(v) >= 2 - 1 for v in versions if v)  # versions only grow along a response


def test_a_rollout_actor_takes_weights_offered_in_the_middle_of_its_generation(ray_cluster, tmp_path):
    """rollout.inflight_update continue through Ray: while the worker actor's generate call runs,
    `offer_weights` in its "weights" concurrency group is answered at once, and the response's
    tokens after a step boundary are the new version's (a plain actor would run it after)."""
    from actors.rollout import RolloutWorker
    from rlsys.generation import GenerationRequest, SamplingParams
    from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir
    from rlsys.weight_digest import digest

    spec = TinyModelSpec(64, 32, 64, 2, 2, 1, max_position_embeddings=4200)
    policy, newer = (build_tiny_model(spec, None, seed=s).eval() for s in (0, 1))
    policy.config.eos_token_id, policy.config.pad_token_id = 1, 0
    save_model_dir(policy, None, tmp_path / "policy")
    worker = (
        ray_cluster.remote(concurrency_groups={"weights": 1})(RolloutWorker)
        .options(num_cpus=0)
        .remote(str(tmp_path / "policy"), inflight_update="continue")
    )
    weights = {k: v.numpy().copy() for k, v in newer.state_dict().items()}
    long = GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=4000, temperature=0.0))
    ray_cluster.get(worker.generate.remote([GenerationRequest([5], SamplingParams(max_new_tokens=2))]))  # started
    generating = worker.generate.remote([long])
    time.sleep(0.3)  # well into its 4000 steps (a second or more)
    offered = worker.offer_weights.options(concurrency_group="weights").remote(1, weights, digest(weights))
    assert ray_cluster.get(offered, timeout=10) == 1
    versions = ray_cluster.get(generating, timeout=300)[0].token_versions
    assert len(versions) == 4000 and versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
