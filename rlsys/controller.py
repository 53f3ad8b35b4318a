"""The single controller: owns the actors and runs the loop, top to bottom.

    prompts -> Algorithm.rollout (rollout workers, reward, reference) -> ExperienceBuffer
            -> Algorithm.prepare -> Learner.train_step (all ranks) -> weight sync -> log/eval
"""
from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import ray

from actors.shared_weights import SLOTS
from algorithms.base import Prompt, build_algorithm, policy_names
from envs.rewards import build_shaping
from rlsys.cluster import free_port
from rlsys.config import ConfigError, JobConfig, dump_config
from rlsys.errors import LearnerFailed, RunFailed, WeightSyncTimeout  # noqa: F401  (WeightSyncTimeout: re-exported)
from rlsys.generation import GenerationRequest, SamplingParams
from rlsys.placement import (acknowledged, learner_gpus, open_shared_weights, open_weight_broadcast, readmit_blocked,
                             rollout_actor_options, vllm_options)


class PromptStream:
    """Training prompts in a seeded shuffled order, epoch after epoch; its cursor is
    (epoch, position), saved in checkpoints so a resumed run consumes the same prompts."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts, self.seed = prompts, seed
        self.epoch, self.position = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self.prompts[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffled(self.epoch)


@dataclasses.dataclass
class PolicyActors:
    """The actors of one trained policy: its rollout workers, its learner ranks, the newest
    weights synced to the workers through the object store (None: the initial policy on disk,
    or not asked for under the other syncs) and its shared-memory weights file's layout (None:
    it syncs through the object store or the broadcast group)."""

    workers: list
    learners: list
    weights_ref: object = None
    shared: object = None


class ActorContext:
    """The `RolloutContext` algorithms see: actor calls behind plain methods, timed per phase.
    `policies` holds every trained policy by name, the first being the run's policy (most
    algorithms train just that one; CDG with `algorithm.models` trains one per role)."""

    def __init__(self, cfg: JobConfig, tokenizer, task, policies: dict[str, PolicyActors], reference, reward, seed: int):
        self.cfg, self.tokenizer, self.task = cfg, tokenizer, task
        self.policies, self.main_policy = policies, next(iter(policies))
        self.reference, self.reward = reference, reward
        self.policy_version = 0
        self.rng = np.random.default_rng(seed)
        self.timings: dict[str, float] = defaultdict(float)
        self.tokens_generated = 0
        self.restarted_workers = 0
        self.reference_version = None  # the policy version the reference holds (None: the initial policy)
        self.teacher = None  # a distillation teacher (ReferenceWorker) when the algorithm has one
        self.sandbox = None  # a SandboxPool when the task runs code (task.needs_sandbox)
        self.sync_in_flight = None  # waits for the last weight sync (Controller.sync_weights sends it unawaited)
        self.readmit = self.reload_weights  # (policy, worker): gives a restarted worker the current weights

    @property
    def workers(self) -> list:
        return self.policies[self.main_policy].workers

    @property
    def learners(self) -> list:
        return self.policies[self.main_policy].learners

    @property
    def weights_ref(self):
        return self.policies[self.main_policy].weights_ref

    @weights_ref.setter
    def weights_ref(self, ref) -> None:
        self.policies[self.main_policy].weights_ref = ref

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        yield
        self.timings[phase] += time.perf_counter() - start

    def sampling(self, **overrides) -> SamplingParams:
        r = self.cfg.rollout
        base = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, stop_token_ids=(self.tokenizer.eos_token_id,))
        return dataclasses.replace(base, **overrides)

    def next_seed(self) -> int:
        return int(self.rng.integers(0, 2**31 - 1))

    def settle_sync(self) -> None:
        """Wait for the weight sync sent last; its errors (a dead learner rank, a worker that
        did not acknowledge in time) surface here."""
        pending, self.sync_in_flight = self.sync_in_flight, None
        if pending is not None:
            with self.timed("sync"):
                pending()

    def generate(self, requests, policy: str | None = None):
        """Contiguous shares of the requests to each worker of `policy` (the run's policy when
        None); results back in request order. A worker that Ray restarted after a crash comes
        back with the initial weights: it is given the current ones and its share generated
        again, so no sample is stale or lost."""
        policy = policy or self.main_policy
        return self.generate_each({policy: requests})[policy]

    def generate_each(self, requests_by_policy: dict) -> dict:
        """`generate` for several policies at once (CDG's per-role models): every worker's share
        is sent before any is awaited, so the models' workers generate side by side. A weight
        sync still in flight is awaited after the calls are sent (a worker runs its calls in
        order: it loads the weights, then generates) and before any result is used."""
        with self.timed("generate"):
            calls = []
            for policy, requests in requests_by_policy.items():
                served = self.policies[policy]
                shares = np.array_split(np.arange(len(requests)), len(served.workers))
                for w, (worker, idx) in enumerate(zip(served.workers, shares)):
                    if len(idx):
                        part = [dataclasses.replace(requests[i], params=_worker_seeded(requests[i].params, w))
                                for i in idx]
                        calls.append((policy, worker, idx, part, worker.generate.remote(part)))
        self.settle_sync()  # a failed sync raises here, before rows by the old weights are used
        with self.timed("generate"):
            out = {policy: [] for policy in requests_by_policy}
            for policy, worker, idx, part, fut in calls:
                gens = ray.get(fut)
                if any(g.policy_version != self.policy_version for g in gens):
                    self.readmit(policy, worker)
                    self.restarted_workers += 1
                    gens = ray.get(worker.generate.remote(part))
                for g in gens:
                    g.request_index = int(idx[g.request_index])
                    out[policy].append(g)
            self.tokens_generated += sum(len(g.response_ids) for gens in out.values() for g in gens)
            return out

    def reload_weights(self, policy: str, worker) -> None:
        """The last object-store sync's weights into `worker` (the controller's `readmit` knows the other syncs)."""
        ray.get(worker.load_weights.remote(self.policy_version, self.policies[policy].weights_ref))

    def score(self, table):
        with self.timed("reward"):
            return ray.get(self.reward.score.remote(table))

    def ref_logprobs(self, table):
        with self.timed("reference"):
            return ray.get(self.reference.logprobs.remote(table))

    def score_and_ref_logprobs(self, table):
        """`score` and `ref_logprobs` of one table, the reward and reference workers working at
        once; each phase's time runs from the common start to its own answer (they overlap)."""
        start = time.perf_counter()
        rewards, ref_logprobs = self.reward.score.remote(table), self.reference.logprobs.remote(table)
        rewards = ray.get(rewards)
        self.timings["reward"] += time.perf_counter() - start
        ref_logprobs = ray.get(ref_logprobs)
        self.timings["reference"] += time.perf_counter() - start
        return rewards, ref_logprobs

    def anchor_reference(self) -> None:
        """Load the learner's current weights into the reference worker: the KL anchor becomes
        the current policy (BRiTE's P(.|x, theta_t)) until the next call; checkpoints keep it."""
        with self.timed("reference"):
            refs = [l.weights.remote() for l in self.learners]  # ZeRO-3: every rank joins the gather
            ray.get([self.reference.load_weights.remote(refs[0]), *refs[1:]])
            self.reference_version = self.policy_version

    def values(self, table, policy: str | None = None):
        """Value-head estimates per token of `table` from `policy`'s learner (the run's policy by default)."""
        with self.timed("values"):
            return ray.get(self.policies[policy or self.main_policy].learners[0].values.remote(table))

    def policy_logprobs(self, table):
        with self.timed("policy_logprobs"):
            return ray.get(self.learners[0].logprobs.remote(table))

    def teacher_logprobs(self, table):
        with self.timed("teacher"):
            return ray.get(self.teacher.logprobs.remote(table))

    def execute(self, requests):
        """Sandboxed runs (sandbox.ExecRequest), all sent to the pool at once; results in order."""
        with self.timed("sandbox"):
            return self.sandbox.run_many(list(requests))

    def teacher_top_logprobs(self, table, k: int = 0):
        with self.timed("teacher"):
            return ray.get(self.teacher.top_logprobs.remote(table, k))


def started(first_calls: list, timeout: float) -> None:
    """Wait for the actors' first calls; RunFailed when they do not answer within `timeout`,
    naming the cluster's free logical CPUs (a cluster too small for the run's actors, or busy
    with another run, would otherwise leave them pending without a word)."""
    ready, pending = ray.wait(first_calls, num_returns=len(first_calls), timeout=timeout)
    if pending:
        free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)
        raise RunFailed(f"{len(pending)} of {len(first_calls)} rollout/learner actors did not start within {timeout:.0f} s "
                        f"(trainer.start_timeout_s); the cluster has {free:.2f} of {total:.0f} logical CPUs free: another "
                        f"job on it, or too few CPUs (ray.num_cpus)")
    ray.get(ready)


def rank_means(rank_metrics: list[dict]) -> dict[str, float]:
    """The learner ranks' step metrics, averaged over the ranks that report each one."""
    out = {k: float(np.mean([m[k] for m in rank_metrics if k in m])) for k in rank_metrics[0]}
    out.pop("time/train_rank", None)
    return out


def learner_schedule(cfg: JobConfig) -> dict:
    """The learner's lr schedule in optimizer steps (epochs x minibatches per trainer step)."""
    l = cfg.learner
    per_step = l.epochs * l.minibatches
    return dict(lr_schedule=l.lr_schedule, warmup_steps=l.warmup_steps * per_step,
                total_steps=cfg.trainer.steps * per_step, min_lr_ratio=l.min_lr_ratio)


def _worker_seeded(params: SamplingParams, worker: int) -> SamplingParams:
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed + 7919 * worker)


class Controller:
    def __init__(self, cfg: JobConfig, run_dir: Path, progress: bool = True):
        self.cfg, self.run_dir, self.progress = cfg, Path(run_dir), progress
        self.algorithm = build_algorithm(cfg)  # config errors surface before anything starts
        build_shaping(cfg.task.shaping)  # and those of task.shaping (make_task builds it again)
        if cfg.task.shaping and cfg.reward.source != "rule":
            raise ConfigError(f"config error: 'task.shaping' shapes the task's rule reward, but reward.source is "
                              f"'{cfg.reward.source}' (its scores are not shaped): remove task.shaping or use "
                              f"reward.source=rule")
        self.step = 0
        self.evals: list[dict] = []
        self.attached = None  # the run's AttachedEvaluators, opened by run()
        self.buffer_calls: list = []  # buffer calls in flight (put, set_policy_version), awaited with the next one
        self.prefetched = False  # the buffer holds the next step's rows (trainer.overlap_rollout)
        self.restored_evaluators: list[dict] = []  # evaluator specs a restored checkpoint held

    # the run's policy (the first of `self.policies`): its rollout workers and learner ranks
    @property
    def workers(self) -> list:
        return self.policies[next(iter(self.policies))].workers

    @property
    def learners(self) -> list:
        return self.policies[next(iter(self.policies))].learners

    @learners.setter
    def learners(self, learners: list) -> None:
        self.policies[next(iter(self.policies))].learners = learners

    def all_learners(self) -> list:
        return [l for p in self.policies.values() for l in p.learners]

    # ---- setup -------------------------------------------------------------------------
    def prepare_policy(self) -> Path:
        """Tokenizer + initial policy (tiny model from config, or a local HF dir), SFT warm-up,
        saved once to run_dir/policy_init; later calls reuse it."""
        from algorithms.sft import warmup
        from envs.registry import make_task
        from rlsys.models import TinyModelSpec, build_tiny_model, load_model, load_tokenizer, save_model_dir, train_tokenizer

        cfg = self.cfg
        self.task = make_task(cfg.task, self.run_dir / "data", cfg.run.seed)
        self._check_sandbox()
        init_dir = self.run_dir / "policy_init"
        if (init_dir / "config.json").exists():
            self.tokenizer = load_tokenizer(init_dir)
            return init_dir
        if cfg.model.path:
            model, tokenizer = load_model(cfg.model.path), load_tokenizer(cfg.model.path)
        else:
            tokenizer = train_tokenizer(self.task.corpus(), cfg.model.vocab_size)
            model = build_tiny_model(TinyModelSpec.from_config(cfg.model), tokenizer, seed=cfg.run.seed)
        if cfg.sft.steps:
            bar = _bar(cfg.sft.steps, "warm-up", self.progress)
            warm = getattr(self.algorithm, "warmup_task", lambda task, tok: task)(self.task, tokenizer)  # CDG: + game format
            if cfg.sft.demo_error and not hasattr(warm, "flawed_demonstration"):
                raise ConfigError(f"config error: 'sft.demo_error'={cfg.sft.demo_error}: task '{cfg.task.name}' has no "
                                  f"flawed demonstrations (allowed: 0)")
            warmup(model, tokenizer, warm, warm.rows("train"), cfg.sft.steps, cfg.sft.batch_size,
                   cfg.sft.lr, cfg.run.seed, on_step=lambda s, loss: bar.set_postfix(loss=f"{loss:.3f}") or bar.update(),
                   demo_error=cfg.sft.demo_error)
            bar.close()
        save_model_dir(model, tokenizer, init_dir)
        self.tokenizer = tokenizer
        return init_dir

    def start_actors(self, policy_dir: Path) -> None:
        from actors.learner import Learner
        from actors.reference import ReferenceWorker
        from actors.rollout import RolloutWorker
        from rlsys.buffer import ExperienceBuffer
        from rlsys.reward_source import start_reward_actor

        cfg = self.cfg
        self.policy_dir = Path(policy_dir)  # the initial policy (a learner restart goes back to it)
        r, l = cfg.rollout, cfg.learner
        teacher_dir = getattr(self.algorithm, "teacher_dir", None)  # DA-KD: trained or checked before any actor
        teacher_dir = teacher_dir and teacher_dir(self.run_dir, self.task, self.tokenizer, cfg.run.seed)
        opts = dict(max_restarts=-1, max_task_retries=2)
        worker = lambda i, **placement: ray.remote(RolloutWorker).options(**placement, **opts).remote(
            str(policy_dir), r.backend, r.batch_size, r.threads_per_worker, i, quantized=r.quantized,
            specache=r.specache_settings(), backend_options=vllm_options(cfg, i), decode=r.decode)
        workers = [worker(i, **placement) for i, placement in enumerate(rollout_actor_options(cfg))]
        temperature = r.temperature if r.temperature > 0 else 1.0
        self.reference = ray.remote(ReferenceWorker).options(num_cpus=0.25).remote(str(policy_dir), temperature)
        self.reward = start_reward_actor(cfg.reward, policy_dir, self.task, cfg.run.seed)  # reward.source: rule/model/judge
        port = free_port()
        learner = lambda rank, world_size, port, **placement: ray.remote(Learner).options(**placement).remote(
            str(policy_dir), self.algorithm, lr=l.lr, weight_decay=l.weight_decay, grad_clip=l.grad_clip,
            zero_stage=l.zero_stage, epochs=l.epochs, minibatches=l.minibatches, temperature=temperature,
            threads=l.threads, rank=rank, world_size=world_size, master_port=port, seed=cfg.run.seed,
            bf16=l.bf16, **learner_schedule(cfg))
        learners = [learner(rank, l.num_ranks, port, num_cpus=0.5, num_gpus=learner_gpus(cfg)) for rank in range(l.num_ranks)]
        self.buffer = ray.remote(ExperienceBuffer).options(num_cpus=0.1).remote(
            cfg.buffer.capacity, cfg.buffer.max_staleness, cfg.run.seed)
        names = policy_names(self.algorithm)
        self.policies = {names[0]: PolicyActors(workers, learners)}
        # further policies (CDG's per-role copies): one CPU rollout worker and one learner rank each, all
        # from the same initial policy; small CPU shares so they fit beside the run's policy on 2 cores
        for name in names[1:]:
            self.policies[name] = PolicyActors([worker(0, num_cpus=0.1)], [learner(0, 1, free_port(), num_cpus=0.1)])
        try:
            started([a.ready.remote() for a in self.all_learners()] +
                    [w.policy_version.remote() for p in self.policies.values() for w in p.workers], cfg.trainer.start_timeout_s)
        except RunFailed:
            self.shutdown()  # none of them stays queued on the cluster
            raise
        self.ctx = ActorContext(cfg, self.tokenizer, self.task, self.policies, self.reference, self.reward, cfg.run.seed)
        self.ctx.readmit = self._readmit
        open_shared_weights(cfg, self.policies)
        if cfg.trainer.weight_sync == "broadcast":
            open_weight_broadcast(cfg, self.learners, self.workers)
            self.weight_manifest = self._from_learners([l.weight_manifest.remote() for l in self.learners])[0]
        if teacher_dir:
            self.ctx.teacher = ray.remote(ReferenceWorker).options(num_cpus=0.25).remote(str(teacher_dir), temperature)
        if getattr(self.task, "needs_sandbox", False):
            from sandbox.pool import SandboxPool

            self.ctx.sandbox = SandboxPool(cfg.sandbox.backend, workers=cfg.sandbox.workers)
        prompts = [self._prompt(f"train-{i}", row) for i, row in enumerate(self.task.rows("train"))]
        self.stream = PromptStream(prompts, cfg.run.seed)

    def shutdown(self) -> None:
        """Kill the run's actors (a failed start; tests that start a second controller)."""
        try:  # a weight sync still in flight finishes first (its actors are about to go)
            self.ctx.settle_sync()
        except Exception:  # noqa: BLE001 - a failed run's sync may have failed with it
            pass
        self.close_shared_weights()
        for actor in [self.reference, self.reward, self.buffer, *(a for p in self.policies.values()
                                                                    for a in [*p.workers, *p.learners])]:
            ray.kill(actor)

    def close_shared_weights(self) -> None:
        """Remove the policies' shared-memory weights files (at the end of a run, at shutdown); a
        file a dead learner left is removed by the next learner on its node (`remove_stale`)."""
        closing = [p.learners[0].close_shared.remote() for p in self.policies.values() if p.shared is not None]
        try:
            ray.get(closing, timeout=10)
        except Exception:  # noqa: BLE001 - a dead learner cannot answer; its file is swept later
            pass
        for p in self.policies.values():
            p.shared = None

    def _check_sandbox(self) -> None:
        """A task that runs code gets the configured backend and limits, or the run stops here
        with one line saying why the sandbox engine is unusable."""
        if not getattr(self.task, "needs_sandbox", False):
            return
        from sandbox.base import unavailable
        from sandbox.types import Limits

        s = self.cfg.sandbox
        why = unavailable(s.backend)
        if why:
            raise RunFailed(f"task '{self.cfg.task.name}' runs code in the {s.backend} sandbox, which is unavailable "
                            f"here: {why} (set up the engines: .ci/setup_sandbox.sh; or set sandbox.backend)")
        self.task.use_sandbox(s.backend, Limits(wall_time_s=s.wall_time_s, cpu_time_s=s.cpu_time_s, memory_mb=s.memory_mb))

    def _prompt(self, uid: str, row: dict) -> Prompt:
        text = self.task.prompt_text(row)
        return Prompt(uid, self.tokenizer(text, add_special_tokens=False)["input_ids"], text, row)

    # ---- the loop ----------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg, ctx = self.cfg, self.ctx
        ctx.timings.clear()
        tokens_before = ctx.tokens_generated
        start = time.perf_counter()
        overlap = cfg.trainer.overlap_rollout
        # under overlap_rollout the previous step left this step's rows in the buffer (checkpointed with it)
        if not (overlap and self.prefetched):
            self.put_rollout()
        with ctx.timed("buffer"):
            table = self._buffer_get(self.buffer.take.remote())
        if table.num_rows == 0 and overlap and self.prefetched:  # the prefetched rows were dropped (staleness)
            self.put_rollout()
            table = self._buffer_get(self.buffer.take.remote())
        self.prefetched = False
        lag = ctx.policy_version - np.asarray(table.column("policy_version").to_pylist())  # versions behind the learner
        with ctx.timed("prepare"):
            batches = {name: self.algorithm.prepare(rows) for name, rows in self._rows_per_policy(table).items()}
            batches = {name: b for name, b in batches.items() if b is not None}  # None: no update (CDG's ReST play)
            extra = getattr(self.algorithm, "prepare_metrics", lambda t: {})(table)
            if cfg.reward.source == "judge":  # judge/* verdict rates and order disagreements of this step
                extra.update(ray.get(self.reward.take_metrics.remote()))
        metrics = {}
        if batches:
            if getattr(self.algorithm, "restarts_policy", lambda t: False)(table):  # ReST: a round retrains from the start
                with ctx.timed("restart"):
                    self._from_learners([l.restart.remote(str(self.policy_dir)) for l in self.all_learners()])
            training = self._train(batches, ctx.policy_version + 1)
            prefetch = overlap and self.step + 1 < cfg.trainer.steps
            early_sync = not prefetch and cfg.trainer.weight_sync != "broadcast"
            if early_sync:  # sent with the step: the workers' loads wait on the learner, not on the controller
                with ctx.timed("sync"):
                    self.sync_weights(ctx.policy_version + 1, training)
            if prefetch:
                self.put_rollout()  # the next step's rows, by the current weights, while the learner trains
                self.prefetched = True
            with ctx.timed("train"):  # under overlap: the wait left after the next rollout
                for name, refs in training.items():  # the run's policy's metrics plain, the others' under "<name>/"
                    prefix = "" if name == ctx.main_policy else f"{name}/"
                    metrics.update({prefix + k: v for k, v in rank_means(self._from_learners(refs)).items()})
            if not early_sync:
                with ctx.timed("sync"):
                    self.sync_weights(ctx.policy_version + 1, training)
        self.step += 1
        rewards = np.asarray(table.column("reward").to_pylist())
        lengths = [len(x) for x in table.column("response_ids").to_pylist()]
        metrics.update(extra)
        metrics.update({
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "response_length": float(np.mean(lengths)), "policy_lag": float(lag.mean()) if len(lag) else 0.0,
            "samples": float(table.num_rows), "policy_version": float(ctx.policy_version),
        })
        if cfg.reward.source == "rule":  # a rule reward >= 1 is a correct answer; model and judge scores are not
            metrics["accuracy/train"] = float((rewards >= 1.0).mean())
        if ctx.sandbox is not None:  # every step of a run with a sandbox pool reports it, 0 when nothing ran
            ctx.timings.setdefault("sandbox", 0.0)
        for phase, seconds in ctx.timings.items():
            metrics[f"time/{phase}"] = seconds
        metrics["time/step"] = time.perf_counter() - start
        generated = ctx.tokens_generated - tokens_before
        metrics["perf/tokens_per_s"] = generated / max(ctx.timings.get("generate", 0.0), 1e-9)
        metrics["perf/samples_per_s"] = table.num_rows / metrics["time/step"]
        return metrics

    def _train(self, batches: dict, version: int) -> dict[str, list]:
        """Send each policy's batch to its learner ranks; their metrics refs per policy. A policy
        with a shared-memory weights file has the step write `version` into its slot; the sync
        sent before (the workers' loads of the slot this one overwrites) is awaited first."""
        if any(self.policies[name].shared is not None for name in batches):
            self.ctx.settle_sync()
        training = {}
        for name, batch in batches.items():
            p = self.policies[name]
            slot = version % SLOTS if p.shared is not None else None
            training[name] = [l.train_step.remote(s, slot) for l, s in zip(p.learners, batch.split(len(p.learners)))]
        return training

    def _rows_per_policy(self, table):
        """The step's rows by the policy they train: all to the run's policy, unless the
        algorithm trains several (`split_by_policy`, e.g. CDG's per-role models)."""
        if len(self.policies) == 1:
            return {self.ctx.main_policy: table}
        return self.algorithm.split_by_policy(table)

    def put_rollout(self) -> None:
        """One step's experience from the rollout workers into the buffer (the put is awaited
        with the next buffer call: an actor runs one caller's calls in order)."""
        table = self.algorithm.rollout(self.ctx, self.stream.next(self.cfg.trainer.prompts_per_step))
        self.buffer_calls.append(self.buffer.put.remote(table))

    def _buffer_get(self, ref):
        """The result of a buffer call, after the buffer calls still in flight (their errors surface here)."""
        pending, self.buffer_calls = self.buffer_calls, []
        return ray.get([*pending, ref])[-1]

    def _from_learners(self, refs: list) -> list:
        """`ray.get` of learner calls; a dead rank ends the run with one line naming it and the
        checkpoint to resume from (the DeepSpeed group cannot go on without it)."""
        from rlsys.checkpoint import candidates

        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            dead = []
            for rank, learner in enumerate(self.learners):
                try:
                    ray.get(learner.ready.remote(), timeout=10)
                except Exception:  # noqa: BLE001 - any failure to answer counts as dead
                    dead.append(rank)
            saved = candidates(self.run_dir / "checkpoints")
            resume = (f"resume from {saved[0].name} with `rlsys resume {self.run_dir}`" if saved
                      else "no checkpoint was written yet (set trainer.checkpoint_every)")
            cause = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise LearnerFailed(f"learner rank {', '.join(map(str, dead)) or '?'} of {len(self.learners)} died during "
                                f"step {self.step + 1} ({cause}); the run stopped: {resume}") from None

    def _readmit(self, policy: str, worker) -> None:
        """A rollout worker that Ray restarted (back with the initial weights) gets the current ones
        by the run's weight sync."""
        p, version = self.policies[policy], self.ctx.policy_version
        if self.cfg.trainer.weight_sync == "broadcast":
            self._readmit_by_broadcast(p.workers.index(worker))
        elif p.shared is not None:
            ray.get(worker.load_shared.remote(version, p.shared, version % SLOTS))
        else:
            self.ctx.reload_weights(policy, worker)

    def _readmit_by_broadcast(self, index: int) -> None:
        """Rollout worker `index`, restarted by Ray, comes back outside the broadcast group with the
        initial weights: the group is formed again with every worker and the current weights are
        broadcast at the current version. Exact because the learner is idle while the workers
        generate (no overlap_rollout), so its weights are the version the workers serve."""
        blocked = readmit_blocked(self.cfg)
        if blocked:
            raise RunFailed(f"rollout worker {index} restarted; the weight-broadcast group cannot re-admit it under "
                            f"{blocked}: resume from the last checkpoint")
        open_weight_broadcast(self.cfg, self.learners, self.workers)
        self._sync_by_broadcast(self.ctx.policy_version)

    def _sync_by_broadcast(self, version: int) -> None:
        """Learner rank 0 -> every rollout receiver over the broadcast group, tagged `version`.
        A worker restarted since the last generate (its version check has not seen it yet) is
        outside the group: the group is formed again first."""
        if readmit_blocked(self.cfg) is None and not all(ray.get([w.in_weight_broadcast.remote() for w in self.workers])):
            open_weight_broadcast(self.cfg, self.learners, self.workers)
        sends = [l.broadcast_weights.remote(version) for l in self.learners]  # all ranks: ZeRO-3 gathers
        acks = [w.receive_weights.remote(version, self.weight_manifest) for w in self.workers]
        ray.get(acknowledged(acks, version, self.cfg.trainer.sync_timeout_s))
        self._from_learners(sends)
        self.ctx.policy_version = version
        self.ctx.weights_ref = None  # asked for when needed (`_weights_ref`)

    def _weights_ref(self, policy: str | None = None):
        """An object ref to the policy's current weights (for attached evaluators): the last
        object-store sync's, or, under the shared-memory and broadcast syncs, asked of the
        learner once per version."""
        p = self.policies[policy or self.ctx.main_policy]
        if p.weights_ref is None and self.ctx.policy_version > 0:
            refs = [l.weights.remote() for l in p.learners]  # ZeRO-3: every rank joins the gather
            self._from_learners(refs[1:])
            p.weights_ref = refs[0]
        return p.weights_ref

    def sync_weights(self, version: int, training: dict[str, list] | None = None) -> None:
        """Learner rank 0 -> every rollout worker: through its shared-memory file on the same node
        (the slot the step wrote, or one written now), else through the object store as numpy
        arrays, or over the broadcast group under trainer.weight_sync=broadcast.
        The first two are sent, not awaited: an actor runs its calls in order, so the learner
        hands out these weights before its next step and a worker loads them before its next
        generate; the controller waits for it (`ctx.settle_sync`) only when it next uses the
        workers' results or checkpoints, meanwhile taking and preparing the next batch.
        `training`: per policy, this step's train calls (they may still run: a worker's load of
        the slot they write waits on them)."""
        self.ctx.settle_sync()
        if self.cfg.trainer.weight_sync == "broadcast":
            self._sync_by_broadcast(version)
            self.buffer_calls.append(self.buffer.set_policy_version.remote(version))
            return
        acks, gathered = [], []
        for name, p in self.policies.items():
            if p.shared is not None:
                written = (training or {}).get(name) or [l.write_shared.remote(version % SLOTS) for l in p.learners]
                acks += [w.load_shared.remote(version, p.shared, version % SLOTS, written[0]) for w in p.workers]
                gathered += written[1:]
                p.weights_ref = None  # asked for when needed (`_weights_ref`)
            else:
                refs = [l.weights.remote() for l in p.learners]  # ZeRO-3: every rank joins the gather
                acks += [w.load_weights.remote(version, refs[0]) for w in p.workers]
                gathered += refs[1:]
                p.weights_ref = refs[0]
        timeout = self.cfg.trainer.sync_timeout_s
        self.ctx.sync_in_flight = lambda: self._from_learners(gathered + acknowledged(acks, version, timeout))
        self.ctx.policy_version = version
        self.buffer_calls.append(self.buffer.set_policy_version.remote(version))

    def evaluate(self, split: str = "eval", greedy: bool | None = None) -> dict[str, float]:
        """Accuracy on a split through the rollout workers (current policy version): greedy
        unless `rollout.eval_greedy` is off (or `greedy=False`), then pass@1 at the rollout
        temperature. An algorithm with an `evaluate` hook measures it its own way."""
        rows = self.task.rows(split)
        prompts = [self._prompt(f"{split}-{i}", row) for i, row in enumerate(rows)]
        greedy = self.cfg.rollout.eval_greedy if greedy is None else greedy
        params = self.ctx.sampling(n=1, temperature=0.0 if greedy else self.cfg.rollout.temperature, seed=12345)
        if hasattr(self.algorithm, "evaluate"):  # its own protocol (RLEF: multi-turn episodes, 1@3)
            return {**self.algorithm.evaluate(self.ctx, prompts, params), "n": float(len(prompts))}
        gens = self.ctx.generate([GenerationRequest(p.prompt_ids, params) for p in prompts])
        texts = self.tokenizer.batch_decode([g.response_ids for g in gens], skip_special_tokens=True)
        correct = [self.task.is_correct(prompts[g.request_index].meta, t) for g, t in zip(gens, texts)]
        return {"accuracy": float(np.mean(correct)), "n": float(len(correct))}

    # ---- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self, metrics: dict | None = None) -> Path:
        """Learner (DeepSpeed: model, optimizer, scheduler on every rank), buffer, data cursor,
        RNG states, algorithm state, step/version, config and an HF export; atomically.
        `metrics`: the step's row, logged after the checkpoint; kept in it so a run killed in
        between gets the row back on resume."""
        from rlsys import checkpoint

        self.ctx.settle_sync()  # a checkpoint is written only after its weights reached the workers
        root = self.run_dir / "checkpoints"
        tmp = checkpoint.staging_dir(root, self.step)
        for name, p in self.policies.items():  # the run's policy in learner/ and hf/, the others beside it
            ray.get([l.save.remote(str(tmp / policy_subdir("learner", name, self.ctx))) for l in p.learners])
            ray.get(p.learners[0].export_hf.remote(str(tmp / policy_subdir("hf", name, self.ctx))))
        self.tokenizer.save_pretrained(str(tmp / "hf" / "tokenizer"))
        self._buffer_get(self.buffer.save.remote(str(tmp / "buffer.parquet")))
        if self.ctx.reference_version is not None:  # a moved KL anchor (BRiTE's theta_t)
            ray.get(self.reference.save.remote(str(tmp / "reference")))
        state = {
            "step": self.step,
            "policy_version": self.ctx.policy_version,
            "reference_version": self.ctx.reference_version,
            "data_cursor": self.stream.state(),
            "controller_rng": self.ctx.rng.bit_generator.state,
            "buffer_rng": ray.get(self.buffer.rng_state.remote()),
            "reward": ray.get(self.reward.state.remote()),  # a sampling judge's seed counter
            "algorithm": self.algorithm.state(),
            "evaluators": self.attached.specs() if self.attached else [],
            "metrics": {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float, np.number))},
        }
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        (tmp / "config.yaml").write_text(dump_config(self.cfg))
        return checkpoint.commit(root, tmp, self.step, self.cfg.trainer.keep_checkpoints)

    def restore(self) -> Path:
        """Load the newest readable checkpoint; say so in one line for each one skipped."""
        from rlsys import checkpoint

        tried = checkpoint.candidates(self.run_dir / "checkpoints")
        if not tried:
            raise checkpoint.CheckpointError(f"no checkpoint to resume from in {self.run_dir / 'checkpoints'}")
        for i, path in enumerate(tried):
            try:
                checkpoint.verify(path)
                state = json.loads((path / "state.json").read_text())
                ray.get([l.load.remote(str(path / policy_subdir("learner", name, self.ctx)))
                         for name, p in self.policies.items() for l in p.learners])
                ray.get(self.buffer.load.remote(str(path / "buffer.parquet")))
                anchor = self.policy_dir if state.get("reference_version") is None else path / "reference"
                ray.get(self.reference.load_weights.remote(None, str(anchor)))
            except Exception as e:  # any unreadable part: report it and try the previous one
                reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                nxt = f"falling back to {tried[i + 1].name}" if i + 1 < len(tried) else "no older checkpoint left"
                print(f"rlsys: checkpoint {path.name} is unreadable ({reason[:200]}); {nxt}", file=sys.stderr)
                continue
            self.step = state["step"]
            self.ctx.reference_version = state.get("reference_version")
            self.stream.load_state(state["data_cursor"])
            self.ctx.rng.bit_generator.state = state["controller_rng"]
            ray.get(self.buffer.set_rng_state.remote(state["buffer_rng"]))
            ray.get(self.reward.load_state.remote(state.get("reward", {})))
            self.prefetched = ray.get(self.buffer.stats.remote())["size"] > 0  # overlap: rows saved with the checkpoint
            self.algorithm.load_state(state["algorithm"])
            self.restored_evaluators = state.get("evaluators", [])
            self.restored_metrics = state.get("metrics")
            self.sync_weights(state["policy_version"])
            return path
        raise checkpoint.CheckpointError(f"no readable checkpoint in {self.run_dir / 'checkpoints'}")

    # ---- the whole run -------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict:
        from rlsys.checkpoint import CheckpointError, candidates

        cfg = self.cfg
        if resume and not candidates(self.run_dir / "checkpoints"):
            raise CheckpointError(f"no checkpoint to resume from in {self.run_dir / 'checkpoints'}")
        if not resume and ((self.run_dir / "metrics.jsonl").exists() or (self.run_dir / "checkpoints").exists()):
            raise CheckpointError(f"run dir {self.run_dir} already holds a run: resume it (rlsys resume {self.run_dir}) "
                                  f"or pick another run.name")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        self.attached = self.open_evaluators()
        t0 = time.perf_counter()
        policy_dir = self.prepare_policy()
        self.start_actors(policy_dir)
        try:
            return self._loop(resume, policy_dir, t0)
        finally:
            self.close_shared_weights()

    def _loop(self, resume: bool, policy_dir: Path, t0: float) -> dict:
        from rlsys.tracking import Tracker, read_jsonl

        cfg = self.cfg
        tracker = Tracker(self.run_dir)
        if resume:
            path = self.restore()
            tracker.truncate_after(self.step)
            if self.restored_metrics and not any(r["step"] == self.step for r in read_jsonl(tracker.metrics_path)):
                tracker.log(self.step, self.restored_metrics)  # killed between the checkpoint and its row
            print(f"rlsys: resumed {cfg.run.name} from {path.name} (step {self.step})", file=sys.stderr)
            evals = [r for r in read_jsonl(tracker.evals_path) if r["evaluator"] == "heldout"]  # not attached ones
            first = evals[0] if evals else self.evaluate()
            last_eval = evals[-1] if evals else first
        else:
            first = last_eval = self.evaluate()
            tracker.log_eval(self.step, "heldout", first, self.ctx.policy_version)
        self.attached.start(policy_dir, self.task, cfg.rollout.max_new_tokens, self.restored_evaluators)
        every = cfg.trainer.checkpoint_every
        bar = _bar(cfg.trainer.steps, f"{cfg.algorithm.name}", self.progress, initial=self.step)
        while self.step < cfg.trainer.steps:
            metrics = self.train_step()
            handoff = time.perf_counter()  # the loop's whole cost of attached evaluators at this boundary
            for row in self.attached.poll(self.step, self.ctx.policy_version, self._weights_ref):
                tracker.log_eval(*row)
            metrics["time/eval_handoff"] = time.perf_counter() - handoff
            last_step = self.step == cfg.trainer.steps
            if cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0 or last_step:
                last_eval = self.evaluate()
                tracker.log_eval(self.step, "heldout", last_eval, self.ctx.policy_version)
            if every and (self.step % every == 0 or last_step):
                for row in self.attached.drain():  # a checkpoint holds no evaluation in flight
                    tracker.log_eval(*row)
                with self.ctx.timed("checkpoint"):
                    self.save_checkpoint(metrics)
                metrics["time/checkpoint"] = self.ctx.timings["checkpoint"]
            tracker.log(self.step, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", eval_acc=f"{last_eval['accuracy']:.2f}")
            bar.update()
        bar.close()
        self.ctx.settle_sync()
        for row in self.attached.drain():
            tracker.log_eval(*row)
        self.attached.close()
        if self.ctx.sandbox is not None:
            self.ctx.sandbox.close()
        tracker.close()
        return {
            "run": cfg.run.name, "algorithm": cfg.algorithm.name, "steps": self.step,
            "eval_accuracy_before_rl": first["accuracy"], "eval_accuracy_after_rl": last_eval["accuracy"],
            "seconds": time.perf_counter() - t0, "run_dir": str(self.run_dir),
        }

    def open_evaluators(self):
        """The run's evaluator registry (named actor) and runs/<name>/cluster.json to reach it."""
        from rlsys.evaluators import AttachedEvaluators, write_cluster_info

        attached = AttachedEvaluators(self.cfg.run.name)
        write_cluster_info(self.run_dir, self.cfg.run.name)
        return attached


def policy_subdir(kind: str, policy: str, ctx: ActorContext) -> str:
    """A checkpoint's directory of one policy's `kind` (learner, hf): `kind` for the run's
    policy, `kind-<name>` for a further one."""
    return kind if policy == ctx.main_policy else f"{kind}-{policy}"


def _bar(total: int, desc: str, enabled: bool, initial: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, initial=initial,
                mininterval=1.0 if sys.stderr.isatty() else 10.0, dynamic_ncols=True)
