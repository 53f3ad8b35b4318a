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
    r, resources = cfg.rollout, cfg.placement.rollout.resources
    if r.backend != "vllm":
        why = unplaceable("placement.rollout.resources", resources, r.num_workers)
        if why:
            raise RunFailed(why)
        return [dict(num_cpus=0.5, **({"resources": resources} if resources else {}))] * r.num_workers
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


def service_options(cfg: JobConfig, num_cpus: float) -> dict:
    """Ray options of a service actor (reference, reward, buffer, teacher): its CPU share and the
    `placement.services` resources; RunFailed in one line when no node offers them."""
    resources = cfg.placement.services.resources
    why = unplaceable("placement.services.resources", resources, 1)
    if why:
        raise RunFailed(why)
    return dict(num_cpus=num_cpus, **({"resources": resources} if resources else {}))


def unplaceable(key: str, bundle: dict[str, float], count: int, strategy: str = "PACK") -> str | None:
    """Why `count` actors asking for `bundle` can never be placed on the cluster's alive nodes
    (None: they can, once there is room): names the resource missing on which nodes."""
    custom = custom_resources_of(bundle)
    if not custom:
        return None
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = [n for n in nodes if all(n["Resources"].get(k, 0) >= v for k, v in custom.items())]
    if len(fits) >= (count if strategy == "STRICT_SPREAD" else 1):
        return None
    offered = "; ".join(
        f"node {n['NodeID'][:8]} ({n['NodeManagerAddress']}): "
        + (", ".join(f"{k} {v:g}" for k, v in sorted(custom_resources_of(n["Resources"]).items())) or "none")
        for n in nodes
    )
    if not fits:
        return f"{key} asks for {custom}, which no node of the cluster offers (custom resources: {offered})"
    return f"{key} with STRICT_SPREAD needs {count} nodes offering {custom}; {len(fits)} do ({offered})"


def custom_resources_of(resources: dict[str, float]) -> dict[str, float]:
    """The custom resources among a node's or a bundle's (not CPU, GPU, memory, the node's own
    `node:<ip>` or placement-group ones)."""
    own = ("CPU", "GPU", "memory", "object_store_memory")
    return {k: v for k, v in resources.items() if k not in own and "_group_" not in k and not k.startswith("node:")}


def learner_placement(cfg: JobConfig, num_cpus: float, num_gpus: int) -> tuple[list[dict], str]:
    """Ray options of each learner rank and rank 0's node address (DeepSpeed's rendezvous). Several
    ranks, or a `placement.learner` setting, take one placement group (a bundle per rank, with the
    role's resources); a single rank without one is placed as any actor, on 127.0.0.1's rendezvous."""
    where, n = cfg.placement.learner, cfg.learner.num_ranks
    bundle = {"CPU": num_cpus, **({"GPU": float(num_gpus)} if num_gpus else {}), **where.resources}
    if n == 1 and not where.resources:
        return [dict(num_cpus=num_cpus, num_gpus=num_gpus)], "127.0.0.1"
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    why = unplaceable("placement.learner.resources", bundle, n, where.strategy)
    if why:
        raise RunFailed(why)
    group = placement_group([bundle] * n, strategy=where.strategy)
    timeout = cfg.trainer.start_timeout_s
    if not group.wait(timeout_seconds=timeout):
        remove_placement_group(group)
        raise RunFailed(
            f"the cluster cannot place {n} learner rank(s) of {bundle} ({where.strategy}) within {timeout:.0f} s "
            f"(trainer.start_timeout_s): another job holds the room, or too few nodes"
        )
    node = placement_group_table(group)["bundles_to_node_id"][0]
    address = next(x["NodeManagerAddress"] for x in ray.nodes() if x["NodeID"] == node)
    pinned = {"resources": where.resources} if where.resources else {}
    options = [
        dict(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            **pinned,
        )
        for i in range(n)
    ]
    return options, address


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
        max_lora_rank=cfg.learner.lora.rank or None,
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
    if cfg.trainer.mode != "sync":
        return (
            f"trainer.mode={cfg.trainer.mode} (the learner trains while the workers generate: its weights are a "
            "version ahead)"
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
    `shared_memory` a policy that cannot have one ends the run in one line. Under
    `trainer.mode: async` the object store (a worker may still generate from a slot the learner
    would overwrite two versions on)."""
    mode = cfg.trainer.weight_sync
    if mode not in ("auto", "shared_memory") or cfg.trainer.mode == "async":
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


def placement_report(policies: dict, services: dict, weight_sync: str) -> dict:
    """Where a run's actors landed: per policy each learner rank's and rollout worker's node id,
    each service actor's (name -> actor) node id, each node's address and custom resources, and
    the weight-sync strategy that follows from it (written to the run dir's placement.json)."""
    nodes = {
        n["NodeID"]: {
            "address": n["NodeManagerAddress"],
            "resources": custom_resources_of(n["Resources"]),
        }
        for n in ray.nodes()
        if n.get("Alive")
    }
    roles = {
        name: {
            "learner": ray.get([l.node_id.remote() for l in p.learners]),
            "rollout": ray.get([w.node_id.remote() for w in p.workers]),
        }
        for name, p in policies.items()
    }
    where = ray.get(
        [a.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for a in services.values()]
    )
    return {"policies": roles, "services": dict(zip(services, where)), "nodes": nodes, "weight_sync": weight_sync}


def placement_groups_of(options: list[dict]) -> list:
    """The placement groups that actor `options` schedule into (each once)."""
    groups = [getattr(o.get("scheduling_strategy"), "placement_group", None) for o in options]
    return list({id(g): g for g in groups if g is not None}.values())


def release_placement_groups(groups: list) -> None:
    """Remove a run's placement groups (their actors end with them); a group already gone is skipped."""
    from ray.util.placement_group import remove_placement_group

    if not ray.is_initialized():  # at exit after Ray shut down: its groups went with it (no auto-init)
        return
    for group in groups:
        try:
            remove_placement_group(group)
        except Exception:  # noqa: BLE001 - removed already, or the cluster is gone
            pass
