"""Where the controller's actors go on a cluster with GPUs, the weight-broadcast group
(`trainer.weight_sync: broadcast`) and the shared-memory weights files (`auto`, `shared_memory`):
how the controller's actors are placed and reach each other.

On a CPU cluster every rollout worker takes half a CPU and the learner ranks no GPU; with
`rollout.backend: vllm` each engine gets a placement-group bundle of
`rollout.tensor_parallel_size` GPUs and each learner rank one GPU beside them (no colocation).
"""

from __future__ import annotations

import numpy as np
import ray

from rlsys.config import JobConfig
from rlsys.errors import RunFailed, WeightSyncTimeout


def rollout_actor_options(cfg: JobConfig) -> list[dict]:
    """Ray options of each rollout worker: half a CPU (hf), or a bundle of a placement
    group holding its vLLM engine's tensor_parallel_size GPUs (vllm)."""
    r = cfg.rollout
    if r.backend != "vllm":
        return [dict(num_cpus=0.5)] * r.num_workers
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actors.vllm_backend import rollout_placement  # floor module: actor code loads only on the vllm path

    gpus, needed = ray.cluster_resources().get("GPU", 0), r.num_workers * r.tensor_parallel_size
    if gpus < needed:
        raise RunFailed(
            f"rollout.backend=vllm needs {needed} GPU(s) ({r.num_workers} engine(s) x "
            f"rollout.tensor_parallel_size {r.tensor_parallel_size}); the cluster has {gpus:.0f}"
        )
    bundles, strategy = rollout_placement(r.num_workers, r.tensor_parallel_size)
    group = placement_group(bundles, strategy=strategy)
    timeout = cfg.trainer.sync_timeout_s
    if not group.wait(timeout_seconds=timeout):
        raise RunFailed(
            f"the cluster cannot place {r.num_workers} vLLM engines of {r.tensor_parallel_size} GPU(s) "
            f"each within {timeout:.0f} s (resources: {ray.cluster_resources().get('GPU', 0):.0f} GPUs)"
        )
    return [
        dict(
            num_cpus=b["CPU"],
            num_gpus=b["GPU"],
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        )
        for i, b in enumerate(bundles)
    ]


def learner_gpus(cfg: JobConfig) -> int:
    """1 GPU per learner rank on a cluster with GPUs (beside the vLLM engines'), else 0 (CPU)."""
    r, gpus = cfg.rollout, ray.cluster_resources().get("GPU", 0)
    rollout_gpus = r.num_workers * r.tensor_parallel_size if r.backend == "vllm" else 0
    if gpus and gpus < cfg.learner.num_ranks + rollout_gpus:
        raise RunFailed(
            f"the cluster has {gpus:.0f} GPU(s); {cfg.learner.num_ranks} learner rank(s) and "
            f"{rollout_gpus} vLLM GPU(s) need one each (no colocation)"
        )
    return 1 if gpus else 0


def vllm_options(cfg: JobConfig, index: int) -> dict | None:
    """The vLLM engine arguments of rollout worker `index` (None for other backends)."""
    if cfg.rollout.backend != "vllm":
        return None
    return dict(
        tensor_parallel_size=cfg.rollout.tensor_parallel_size,
        seed=cfg.run.seed + index,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        dtype="bfloat16" if cfg.learner.bf16 else "auto",
    )


def open_weight_broadcast(cfg: JobConfig, learners: list, workers: list) -> None:
    """Learner rank 0 (rank 0 of the group) and every rollout receiver (a worker, or each
    tensor-parallel worker of a vLLM engine) form one process group: NCCL when the rollout
    engines are vLLM on GPUs, else gloo."""
    backend = "nccl" if cfg.rollout.backend == "vllm" else "gloo"
    timeout = cfg.trainer.sync_timeout_s
    addr, port = ray.get(learners[0].broadcast_endpoint.remote())
    sizes = ray.get([w.weight_sync_ranks.remote() for w in workers])
    world, first = 1 + sum(sizes), np.cumsum([1] + sizes[:-1])
    joins = [learners[0].open_weight_broadcast.remote(addr, port, world, backend, timeout)]
    joins += [
        w.open_weight_broadcast.remote(addr, port, int(f), world, backend, timeout) for w, f in zip(workers, first)
    ]
    ready, pending = ray.wait(joins, num_returns=len(joins), timeout=timeout)
    if pending:
        raise WeightSyncTimeout(
            f"the weight-broadcast group ({backend}, {world} members) did not form within "
            f"{timeout:.0f} s ({len(pending)} members did not join)"
        )
    ray.get(ready)


def readmit_blocked(cfg: JobConfig) -> str | None:
    """Why a rollout worker that Ray restarted cannot rejoin the broadcast group mid-run (None: it can).
    Rejoining re-forms the group and broadcasts the learner's weights at the version the workers serve."""
    if cfg.trainer.overlap_rollout:
        return (
            "trainer.overlap_rollout (the learner trains while the workers generate: its weights are a version ahead)"
        )
    if cfg.rollout.backend == "vllm":
        return "rollout.backend=vllm (re-forming an NCCL group around a dead member needs an abort of its communicator)"
    return None


def acknowledged(acks: list, version: int, timeout: float) -> list:
    """The rollout workers' acknowledgements of a weight sync, or WeightSyncTimeout naming
    how many did not answer within `timeout` (a sync never hangs)."""
    ready, pending = ray.wait(acks, num_returns=len(acks), timeout=timeout)
    if pending:
        raise WeightSyncTimeout(
            f"weight sync to policy version {version} did not complete within {timeout:.0f} s "
            f"({len(pending)} of {len(acks)} rollout workers did not acknowledge)"
        )
    return ready


def open_shared_weights(cfg: JobConfig, policies: dict) -> None:
    """`trainer.weight_sync: auto | shared_memory`: a policy whose rollout workers all run on
    its learner rank 0's node gets a shared-memory weights file (`PolicyActors.shared`, see
    actors/shared_weights.py); under `auto` the others keep the object store, under
    `shared_memory` a policy that cannot have one ends the run in one line."""
    mode = cfg.trainer.weight_sync
    if mode not in ("auto", "shared_memory"):
        return
    for name, p in policies.items():
        learner_node, *worker_nodes = ray.get(
            [p.learners[0].node_id.remote(), *[w.node_id.remote() for w in p.workers]]
        )
        elsewhere = sum(node != learner_node for node in worker_nodes)
        if elsewhere:
            why = f"{elsewhere} of {len(worker_nodes)} rollout workers run on another node than learner rank 0"
        else:
            shared = ray.get([l.share_weights.remote(name) for l in p.learners])[0]  # collective under ZeRO-3
            if not isinstance(shared, str):
                p.shared = shared
                continue
            why = shared
        if mode == "shared_memory":
            raise RunFailed(
                f"trainer.weight_sync=shared_memory for policy '{name}': {why} "
                f"(use trainer.weight_sync=auto or object_store)"
            )
