"""Starting a run's actors, and the learner ranks' calls (a dead rank ends the run in one line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray
import torch

from actors.learner import Learner
from actors.reference import ReferenceWorker
from actors.rollout import RolloutWorker
from rlsys.batch import TrainBatch
from rlsys.buffer import ExperienceBuffer
from rlsys.checkpoint import candidates
from rlsys.cluster import free_port
from rlsys.config import JobConfig
from rlsys.contract import Algorithm, MovesReference, SkipsRowsWithoutGradient, policy_names
from rlsys.errors import LearnerFailed, RunFailed
from rlsys.packing import plan_rank_shards, prompt_groups
from rlsys.placement import (
    learner_gpus,
    learner_placement,
    placement_groups_of,
    release_placement_groups,
    rollout_actor_options,
    service_options,
    vllm_options,
)
from rlsys.reward_source import start_reward_actor
from rlsys.run.context import PolicyActors


@dataclass
class RunActors:
    """Every actor of a run: per trained policy its rollout workers and learner ranks (the run's
    policy first), the reference, the reward source and the experience buffer."""

    policies: dict[str, PolicyActors]
    reference: object  # None under learner.lora: the learner's base with its adapters off (`reference_on_learner`)
    reward: object
    buffer: object
    groups: list = field(default_factory=list)  # the placement groups the learner ranks or vLLM engines hold

    @property
    def services(self) -> dict:
        named = {"reference": self.reference, "reward": self.reward, "buffer": self.buffer}
        return {name: actor for name, actor in named.items() if actor is not None}

    def all(self) -> list:
        return [*self.services.values(), *(a for p in self.policies.values() for a in [*p.workers, *p.learners])]


def reference_on_learner(cfg: JobConfig, algorithm: Algorithm) -> bool:
    """Whether the learner is the run's reference: under learner.lora its base weights with the
    adapters off are the initial policy, unless the algorithm moves its KL anchor (MovesReference)."""
    return cfg.learner.lora.rank > 0 and not isinstance(algorithm, MovesReference)


def start_actors(cfg: JobConfig, algorithm: Algorithm, policy_dir: Path, task) -> RunActors:
    """The run's actors from the initial policy in `policy_dir`, started and answering; RunFailed
    (and none left queued on the cluster) when they do not start in trainer.start_timeout_s."""
    r, l = cfg.rollout, cfg.learner
    opts = dict(max_restarts=-1, max_task_retries=2)
    # rollout.inflight_update continue: offers of new weights run beside a generation, in their own thread
    rollout_actor = (
        ray.remote(concurrency_groups={"weights": 1})(RolloutWorker)
        if r.inflight_update == "continue"
        else ray.remote(RolloutWorker)
    )
    temperature = r.temperature if r.temperature > 0 else 1.0

    def worker(i, **placement):
        return rollout_actor.options(**placement, **opts).remote(
            str(policy_dir),
            r.backend,
            r.batch_size,
            r.threads_per_worker,
            i,
            quantized=r.quantized,
            specache=r.specache_settings(),
            backend_options=vllm_options(cfg, i),
            decode=r.decode,
            inflight_update=r.inflight_update,
            dtype=r.dtype,
        )

    def learner(rank, world_size, port, master_addr="127.0.0.1", **placement):
        return (
            ray.remote(Learner)
            .options(**placement)
            .remote(
                str(policy_dir),
                algorithm,
                lr=l.lr,
                weight_decay=l.weight_decay,
                grad_clip=l.grad_clip,
                zero_stage=l.zero_stage,
                epochs=l.epochs,
                minibatches=l.minibatches,
                temperature=temperature,
                threads=l.threads,
                rank=rank,
                world_size=world_size,
                master_addr=master_addr,
                master_port=port,
                seed=cfg.run.seed,
                bf16=l.bf16,
                gradient_checkpointing=l.gradient_checkpointing,
                max_tokens_per_microbatch=l.max_tokens_per_microbatch,
                auto_pack=l.auto_pack,
                lora=l.lora.model_dump(),
                offload=l.offload,
                **learner_schedule(cfg),
            )
        )

    port = free_port()
    names = policy_names(algorithm)
    workers = rollout_actor_options(cfg)
    ranks, master_addr = learner_placement(cfg, num_cpus=0.5, num_gpus=learner_gpus(cfg))
    policies = {
        names[0]: PolicyActors(
            [worker(i, **placement) for i, placement in enumerate(workers)],
            [learner(rank, l.num_ranks, port, master_addr, **ranks[rank]) for rank in range(l.num_ranks)],
        )
    }
    # further policies (CDG's per-role copies): one CPU rollout worker and one learner rank each, all
    # from the same initial policy; small CPU shares so they fit beside the run's policy on 2 cores
    for name in names[1:]:
        policies[name] = PolicyActors([worker(0, num_cpus=0.1)], [learner(0, 1, free_port(), num_cpus=0.1)])
    run = RunActors(
        policies,
        reference=None
        if reference_on_learner(cfg, algorithm)
        else ray.remote(ReferenceWorker)
        .options(**service_options(cfg, 0.25))
        .remote(str(policy_dir), temperature, max_tokens_per_batch=l.max_tokens_per_microbatch, auto_pack=l.auto_pack),
        reward=start_reward_actor(
            cfg.reward, policy_dir, task, cfg.run.seed, cfg.sandbox, cfg.placement.services.resources
        ),
        buffer=ray.remote(ExperienceBuffer)
        .options(**service_options(cfg, 0.1))
        .remote(cfg.buffer.capacity, cfg.buffer.max_staleness, cfg.run.seed),
        groups=placement_groups_of([*workers, *ranks]),
    )
    try:
        started(
            [a.ready.remote() for p in policies.values() for a in p.learners]
            + [w.policy_version.remote() for p in policies.values() for w in p.workers]
            + [service.__ray_ready__.remote() for service in run.services.values()],
            cfg.trainer.start_timeout_s,
        )
    except RunFailed:
        for actor in run.all():
            ray.kill(actor)
        release_placement_groups(run.groups)
        raise
    return run


def started(first_calls: list, timeout: float) -> None:
    """Wait for the actors' first calls; RunFailed when they do not answer within `timeout`,
    naming the cluster's free logical CPUs (a cluster too small for the run's actors, or busy
    with another run, would otherwise leave them pending without a word)."""
    ready, pending = ray.wait(first_calls, num_returns=len(first_calls), timeout=timeout)
    if pending:
        free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)
        raise RunFailed(
            f"{len(pending)} of {len(first_calls)} actors (learner, rollout, reference, reward, buffer) did not start "
            f"within {timeout:.0f} s "
            f"(trainer.start_timeout_s); the cluster has {free:.2f} of {total:.0f} logical CPUs free: another "
            f"job on it, or too few CPUs (ray.num_cpus)"
        )
    ray.get(ready)


def learner_schedule(cfg: JobConfig) -> dict:
    """The learner's lr schedule in optimizer steps (epochs x minibatches per trainer step)."""
    l = cfg.learner
    per_step = l.epochs * l.minibatches
    return dict(
        lr_schedule=l.lr_schedule,
        warmup_steps=l.warmup_steps * per_step,
        total_steps=cfg.trainer.steps * per_step,
        min_lr_ratio=l.min_lr_ratio,
    )


class Learners:
    """The learner ranks of every trained policy: a step's train calls (each rank's shard of the
    batch, `rank_shards`), their metrics, restarts. A dead rank ends the run with one line naming
    it and the checkpoint to resume from (the DeepSpeed group cannot go on without it)."""

    def __init__(self, policies: dict[str, PolicyActors], run_dir: Path, algorithm: Algorithm | None = None):
        self.policies, self.run_dir, self.algorithm = policies, Path(run_dir), algorithm
        self.main_policy = next(iter(policies))
        self.step = 1  # the step being trained, for the error line
        self.nodes: list[str] = []  # the node each rank of the run's policy runs on, for the error line

    def record_placement(self, report: dict) -> None:
        """Each rank's node from a placement report (placement.json), named as the error line names it."""
        nodes = report["nodes"]
        for node in report["policies"][self.main_policy]["learner"]:
            info = nodes.get(node, {"address": "?", "resources": {}})
            resources = ", ".join(f"{k} {v:g}" for k, v in sorted(info["resources"].items()))
            self.nodes.append(f"node {node[:8]} ({info['address']}{'; ' + resources if resources else ''})")

    def train(self, batches: dict, version: int, weights, step: int) -> dict[str, list]:
        """Each policy's batch to its ranks, not awaited, for trainer step `step`; `weights` says
        where a rank writes the new weights as part of its step (a shared-memory slot) or None."""
        self.step, training = step, {}
        for name, batch in batches.items():  # a rank without rows would leave the others waiting in a collective
            ranks = len(self.policies[name].learners)
            if len(batch) < ranks:
                raise RunFailed(f"step {step}: {len(batch)} row(s) to train for {ranks} learner ranks")
        for name, batch in batches.items():
            p, (slot, loads) = self.policies[name], weights.train_slot(name, version) or (None, [])
            shards = rank_shards(batch, len(p.learners), self.algorithm)
            training[name] = [l.train_step.remote(s, slot, loads) for l, s in zip(p.learners, shards)]
        return training

    def wait(self, training: dict[str, list]) -> dict[str, float]:
        """The step's metrics: the run's policy's plain, the others' under "<name>/"."""
        metrics = {}
        for name, refs in training.items():
            prefix = "" if name == self.main_policy else f"{name}/"
            metrics.update({prefix + k: v for k, v in rank_means(self.get(refs)).items()})
        return metrics

    def restart(self, policy_dir: Path) -> None:
        """Every rank back to the initial policy (a ReST round retrains from the start)."""
        self.get([l.restart.remote(str(policy_dir)) for p in self.policies.values() for l in p.learners])

    def get(self, refs: list) -> list:
        """`ray.get` of learner calls; LearnerFailed naming the dead rank when one died."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            learners = self.policies[self.main_policy].learners
            dead = []
            for rank, learner in enumerate(learners):
                try:
                    ray.get(learner.ready.remote(), timeout=10)
                except Exception:  # noqa: BLE001 - any failure to answer counts as dead
                    dead.append(rank)
            saved = candidates(self.run_dir / "checkpoints")
            resume = (
                f"resume from {saved[0].name} with `rlsys resume {self.run_dir}`"
                if saved
                else "no checkpoint was written yet (set trainer.checkpoint_every)"
            )
            cause = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            where = "".join(f" on {self.nodes[r]}{lost_or_not(self.nodes[r])}" for r in dead[:1] if r < len(self.nodes))
            raise LearnerFailed(
                f"learner rank {', '.join(map(str, dead)) or '?'} of {len(learners)} died during "
                f"step {self.step}{where} ({cause}); the run stopped: {resume}"
            ) from None


def lost_or_not(node: str) -> str:
    """The error line's clause for a node (named "node <id[:8]> ...") that is lost; "" for one that
    is not. Lost: the cluster marked it dead, or its raylet no longer answers a connection (Ray
    marks a node dead only after its health checks miss, ~30 s by default)."""
    import socket

    (info,) = [n for n in ray.nodes() if n["NodeID"].startswith(node.split()[1])] or [None]
    if info is None or not info.get("Alive"):
        return ", which the cluster lost"
    try:
        socket.create_connection((info["NodeManagerAddress"], info["NodeManagerPort"]), timeout=3).close()
        return ""
    except OSError:
        return ", which the cluster lost"


def rank_shards(batch: TrainBatch, ranks: int, algorithm: Algorithm | None) -> list[TrainBatch]:
    """Each learner rank's rows: whole prompt groups balanced by the tokens each rank trains on
    (`plan_rank_shards`; a row `algorithm` leaves out of the forward, `gradient_rows`, costs
    nothing). The ranks meet in the gradient all-reduce, so a step lasts as long as the busiest
    rank; the loss is weighed across ranks (`Learner._share_of_ranks`), so with one minibatch a
    step (learner.minibatches 1) any split gives the same gradient."""
    if ranks == 1:
        return [batch]
    trained = (
        algorithm.gradient_rows(batch)
        if isinstance(algorithm, SkipsRowsWithoutGradient)
        else torch.ones(len(batch), dtype=torch.bool)
    )
    costs = (batch.attention_mask.sum(1) * trained).tolist()
    plan = plan_rank_shards(costs, prompt_groups(batch.input_ids, batch.response_mask), ranks)
    return [batch.select(torch.tensor(rows)) for rows in plan]


def rank_means(rank_metrics: list[dict]) -> dict[str, float]:
    """The learner ranks' step metrics, averaged over the ranks that report each one."""
    out = {k: float(np.mean([m[k] for m in rank_metrics if k in m])) for k in rank_metrics[0]}
    out.pop("time/train_rank", None)
    return out
