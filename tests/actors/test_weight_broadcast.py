"""trainer.weight_sync=broadcast: the bucket plan, a real gloo group, and the whole path on
a real local Ray cluster (DeepSpeed learner rank 0 -> rollout worker actors)."""

import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from fakes import TINY_JOB

from actors.weight_broadcast import BroadcastGroup, TensorSpec, bucket_plan, weight_manifest


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bucket_plan_one_dtype_per_bucket_under_the_cap():
    manifest = [
        TensorSpec("a", (4,), "float32"),
        TensorSpec("b", (2, 2), "float32"),
        TensorSpec("c", (3,), "int64"),
        TensorSpec("d", (100,), "float32"),
        TensorSpec("e", (2,), "bfloat16"),
        TensorSpec("f", (1,), "bfloat16"),
    ]
    assert [s.nbytes for s in manifest] == [16, 16, 24, 400, 4, 2]
    assert bucket_plan(manifest, max_bytes=32) == [[0, 1], [2], [3], [4, 5]]
    assert bucket_plan(manifest, max_bytes=16) == [[0], [1], [2], [3], [4, 5]]
    assert sum(bucket_plan(manifest, max_bytes=10**9), []) == list(range(6))
    assert weight_manifest([("x", torch.zeros(2, 3, dtype=torch.bfloat16))]) == [TensorSpec("x", (2, 3), "bfloat16")]


def _group_pair(world: int = 3):
    port = _port()
    with ThreadPoolExecutor(world) as pool:  # the members rendezvous together
        futures = [pool.submit(BroadcastGroup, "127.0.0.1", port, r, world, "gloo", 30.0) for r in range(world)]
        return [f.result() for f in futures]


def test_gloo_broadcast_is_bit_identical_and_checks_the_version():
    sender, *receivers = _group_pair(3)
    g = torch.Generator().manual_seed(0)
    named = [
        ("w1", torch.randn(5, 7, generator=g)),
        ("ids", torch.arange(11)),
        ("w2", torch.randn(300, generator=g)),
        ("h", torch.randn(4, 3, generator=g).to(torch.bfloat16)),
    ]
    manifest = weight_manifest(named)
    with ThreadPoolExecutor(3) as pool:
        got = [pool.submit(r.receive, 4, manifest, 256) for r in receivers]
        sent = sender.send(4, [t for _, t in named], max_bytes=256)
        got = [f.result() for f in got]
    assert sent == sum(s.nbytes for s in manifest)
    for received in got:
        assert [n for n, _ in received] == [n for n, _ in named]
        for (_, a), (_, b) in zip(named, received):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    # a receiver told to expect another version fails loudly instead of loading the weights
    with ThreadPoolExecutor(3) as pool:
        bad = [pool.submit(r.receive, 6, manifest, 256) for r in receivers]
        sender.send(5, [t for _, t in named], max_bytes=256)
        for f in bad:
            with pytest.raises(RuntimeError, match="expected version 6 with 4 tensors, the learner sent version 5"):
                f.result()


TINY = [
    *TINY_JOB,
    "rollout.max_new_tokens=4",
]


def _broadcast_controller(tmp_path, name: str):
    """A started controller with two rollout workers under trainer.weight_sync=broadcast."""
    from rlsys.config import load_config
    from rlsys.run.controller import Controller

    cfg = load_config(
        "configs/quickstart.yaml",
        [
            *TINY,
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            "rollout.num_workers=2",
            "trainer.weight_sync=broadcast",
            "trainer.sync_timeout_s=30",
        ],
    )
    c = Controller(cfg, tmp_path / name, progress=False)
    c.start_actors(c.prepare_policy())
    return c


def _perturb_learner(ray, c) -> None:
    """Move the learner's weights (stands in for a training step whose advantages might all be
    zero on a tiny model): the next sync must carry the change."""
    ray.get(
        c.learners[0].__ray_call__.remote(
            lambda self: [p.data.add_(0.01 * torch.randn_like(p)) for p in self.module.policy.parameters()] and None
        )
    )


def _served_equals_learner(ray, c, version: int) -> dict:
    """Every worker serves `version`, bit-identical to the learner's weights (returned)."""
    from actors.modeling import state_dict_numpy

    assert ray.get([w.policy_version.remote() for w in c.workers]) == [version] * len(c.workers)
    learner = ray.get(c.learners[0].weights.remote())
    for worker in c.workers:
        served = ray.get(worker.__ray_call__.remote(lambda self: state_dict_numpy(self.backend.model)))
        assert served.keys() == learner.keys()
        assert all(np.array_equal(served[k], learner[k]) for k in learner)  # bit-identical
    return learner


@pytest.mark.integration
def test_broadcast_sync_on_ray_arrives_bit_identical_and_advances_the_version(ray_cluster, tmp_path):
    from rlsys.run.controller import WeightSyncTimeout

    ray = ray_cluster
    c = _broadcast_controller(tmp_path, "bcast")
    metrics = c.train_step()  # generate, train, then sync over the gloo group
    assert metrics["policy_version"] == 1
    before = _served_equals_learner(ray, c, 1)
    _perturb_learner(ray, c)
    c.sync_weights(2)
    after = _served_equals_learner(ray, c, 2)
    assert all(not np.array_equal(before[k], after[k]) for k in after)
    assert c.policies["policy"].weights_ref is None  # no object-store copy of the weights (no evaluator attached)
    # a sync the learner never sends: the receivers wait, the controller fails loudly at the timeout
    c.cfg.trainer.sync_timeout_s = 3
    learners, c.learners = c.learners, []  # fault injection: no learner rank takes part
    with pytest.raises(WeightSyncTimeout, match="policy version 3 did not complete within 3 s \\(2 of 2 rollout"):
        c.sync_weights(3)
    c.learners = learners


@pytest.mark.integration
def test_vllm_backend_on_a_cluster_without_gpus_fails_in_one_line(ray_cluster, tmp_path):
    from rlsys.config import load_config
    from rlsys.errors import RunFailed
    from rlsys.run.controller import Controller

    cfg = load_config(
        "configs/quickstart.yaml",
        [
            *TINY,
            "sft.steps=0",
            f"run.output_dir={tmp_path}",
            "run.name=v",
            "rollout.backend=vllm",
            "rollout.num_workers=2",
            "rollout.tensor_parallel_size=2",
        ],
    )
    c = Controller(cfg, tmp_path / "v", progress=False)
    with pytest.raises(RunFailed) as e:
        c.start_actors(c.prepare_policy())
    assert str(e.value) == (
        "rollout.backend=vllm needs 4 GPU(s) (2 engine(s) x rollout.tensor_parallel_size 2); the cluster has 0"
    )


@pytest.mark.integration
def test_a_restarted_worker_rejoins_the_broadcast_group_and_serves_the_current_version(ray_cluster, tmp_path):
    import os
    import signal

    from rlsys.generation import GenerationRequest

    ray = ray_cluster
    c = _broadcast_controller(tmp_path, "rejoin")
    _perturb_learner(ray, c)  # version 1 differs from the initial weights
    c.sync_weights(1)
    pid = ray.get(c.workers[0].pid.remote())
    os.kill(pid, signal.SIGKILL)  # Ray restarts it with the initial weights, outside the group
    requests = [GenerationRequest(p.prompt_ids, c.ctx.sampling(n=2, seed=5)) for p in c.stream.next(4)]
    gens = c.ctx.generate(requests)
    assert {g.policy_version for g in gens} == {1} and c.ctx.restarted_workers == 1
    assert sorted(g.request_index for g in gens) == sorted(list(range(4)) * 2)
    assert ray.get(c.workers[0].pid.remote()) != pid

    _served_equals_learner(ray, c, 1)
    _perturb_learner(ray, c)
    c.sync_weights(2)  # over the group formed again
    _served_equals_learner(ray, c, 2)
    # a worker that dies after a generate and before the next sync: the sync forms the group again
    os.kill(ray.get(c.workers[1].pid.remote()), signal.SIGKILL)
    ray.get(c.workers[1].policy_version.remote())  # restarted, at the initial weights
    _perturb_learner(ray, c)
    c.sync_weights(3)
    _served_equals_learner(ray, c, 3)
    c.shutdown()


def test_rejoining_the_broadcast_group_is_refused_where_it_cannot_be_exact():
    from rlsys.config import load_config
    from rlsys.placement import readmit_blocked

    base = ["trainer.weight_sync=broadcast"]
    assert readmit_blocked(load_config("configs/quickstart.yaml", base)) is None
    assert readmit_blocked(load_config("configs/quickstart.yaml", [*base, "trainer.mode=overlap"])).startswith(
        "trainer.mode=overlap"
    )
    assert readmit_blocked(load_config("configs/quickstart.yaml", [*base, "rollout.backend=vllm"])).startswith(
        "rollout.backend=vllm"
    )


def test_broadcast_sync_with_several_trained_policies_is_a_config_error():
    """The broadcast group serves the run's policy only: CDG's per-role models would go unsynced."""
    from algorithms.base import build_algorithm
    from rlsys.config import ConfigError, load_config

    cfg = load_config("configs/cdg.yaml", ["algorithm.models=per_role", "trainer.weight_sync=broadcast"])
    with pytest.raises(
        ConfigError,
        match="trains 3 policies \\(prover, helpful, misleading\\): that needs "
        "rollout.backend=hf and a trainer.weight_sync other than broadcast",
    ):
        build_algorithm(cfg)
