"""The `RolloutContext` algorithms are given: the run's actors behind plain calls, timed per phase."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np
import ray

from rlsys.config import JobConfig
from rlsys.errors import RunFailed
from rlsys.generation import SamplingParams, generate_in_chunks


@dataclasses.dataclass
class PolicyActors:
    """The actors of one trained policy: its rollout workers, its learner ranks, the newest
    weights synced to the workers through the object store (None: the initial policy on disk,
    or not asked for under the other syncs; a list of refs when sent in buckets) and its
    shared-memory weights file's layout (None: it syncs through the object store or the
    broadcast group)."""

    workers: list
    learners: list
    weights_ref: object = None
    weights_digest: object = None  # the checksums of `weights_ref` (an object ref; rlsys/weight_digest.py)
    shared: object = None
    buckets: list | None = None  # object-store sync: tensor names per bucket (trainer.sync_bucket_mb)


WORKER_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)  # a crash, a lost node


def back_within(worker, timeout: float) -> None:
    """Wait until a lost rollout worker answers again (Ray restarts it where there is room);
    RunFailed in one line when it does not within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ray.get(worker.policy_version.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            return
        except (*WORKER_LOST, ray.exceptions.GetTimeoutError) as e:
            if time.monotonic() >= deadline:
                raise RunFailed(
                    f"a lost rollout worker did not come back within {timeout:.0f} s (trainer.start_timeout_s): "
                    f"no alive node has room for it ({type(e).__name__})"
                ) from None
            time.sleep(0.5)


class ActorContext:
    """The `RolloutContext` algorithms see: actor calls behind plain methods, timed per phase.
    `policies` holds every trained policy by name, the first being the run's policy (most
    algorithms train just that one; CDG with `algorithm.models` trains one per role)."""

    def __init__(
        self, cfg: JobConfig, tokenizer, task, policies: dict[str, PolicyActors], reference, reward, weights, seed: int
    ):
        self.cfg, self.tokenizer, self.task = cfg, tokenizer, task
        self.policies, self.main_policy = policies, next(iter(policies))
        self.reference, self.reward = reference, reward
        self.weights = weights  # the run's WeightSync: a sync in flight is awaited before results are used
        self.policy_version = 0
        self.rng = np.random.default_rng(seed)
        self.timings: dict[str, float] = defaultdict(float)
        self.tokens_generated = 0
        self.restarted_workers = 0
        self.reference_version = None  # the policy version the reference holds (None: the initial policy)
        self.teacher = None  # a distillation teacher (ReferenceWorker) when the algorithm has one
        self.sandbox = None  # a SandboxPool when the task runs code (task.needs_sandbox)
        self._sandbox_busy_at = 0.0  # the pool's busy seconds at the last reset_timings
        self.prompt_stream = None  # the run's PromptStream (its cursor is checkpointed), set by the controller
        self._timings_lock = threading.Lock()
        # trainer.mode async: a producer thread generates while the learner's thread syncs weights,
        # so a generate does not wait for the sync in flight (rows carry the version that sampled them)
        self.asynchronous = cfg.trainer.mode == "async"
        # rollout.inflight_update resume: generations in chunks, each resumed by the newest weights
        self.inflight_chunk = cfg.rollout.inflight_chunk_tokens if cfg.rollout.inflight_update == "resume" else None
        self.episodes = None  # an EpisodeSettings (algorithms/episodes.py) when env.name is set, by the controller
        self.episode_tokens = None  # an episode's token budget when the run plays episodes, by the controller

    @property
    def workers(self) -> list:
        return self.policies[self.main_policy].workers

    @property
    def learners(self) -> list:
        return self.policies[self.main_policy].learners

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        yield
        with self._timings_lock:  # episodes' env steps time their sandbox runs from their threads
            self.timings[phase] += time.perf_counter() - start

    def reset_timings(self) -> None:
        with self._timings_lock:
            self.timings.clear()
            self._sandbox_busy_at = self.sandbox.metrics.busy_s if self.sandbox is not None else 0.0

    def timings_snapshot(self) -> dict[str, float]:
        """The phases' seconds since `reset_timings`; `sandbox`: the pool's busy wall time (a
        busy spell still under way counts once it ends)."""
        with self._timings_lock:
            timings = dict(self.timings)
            if self.sandbox is not None:
                timings["sandbox"] = self.sandbox.metrics.busy_s - self._sandbox_busy_at
            return timings

    def sampling(self, **overrides) -> SamplingParams:
        r = self.cfg.rollout
        base = SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_token_ids=(self.tokenizer.eos_token_id,),
        )
        return dataclasses.replace(base, **overrides)

    def next_seed(self) -> int:
        return int(self.rng.integers(0, 2**31 - 1))

    def more_prompts(self, n: int) -> list:
        """The next n prompts of the run's stream, beyond the step's (DAPO refills its groups)."""
        return self.prompt_stream.next(n)

    def settle_sync(self) -> None:
        """Wait for the weight sync sent last; its errors (a dead learner rank, a worker that
        did not acknowledge in time) surface here."""
        with self.timed("sync"):
            self.weights.settle()

    def generate(self, requests, policy: str | None = None):
        """Contiguous shares of the requests to each worker of `policy` (the run's policy when
        None); results back in request order. A worker that Ray restarted after a crash comes
        back with the initial weights: it is given the current ones and its share generated
        again, so no sample is stale or lost."""
        policy = policy or self.main_policy
        return self.generate_each({policy: requests})[policy]

    def generate_each(self, requests_by_policy: dict) -> dict:
        """`generate` for several policies at once (CDG's per-role models), in chunks under
        `rollout.inflight_update: resume` (rlsys.generation.generate_in_chunks; not for requests
        that ask for embeddings, which are of the whole response)."""
        wants_embedding = any(r.embedding for reqs in requests_by_policy.values() for r in reqs)
        if self.inflight_chunk is None or wants_embedding:
            return self._generate_each(requests_by_policy)
        return generate_in_chunks(self._generate_each, requests_by_policy, self.inflight_chunk)

    def _generate_each(self, requests_by_policy: dict) -> dict:
        """One generate call per worker of each policy: every worker's share
        is sent before any is awaited, so the models' workers generate side by side. A weight
        sync still in flight is awaited after the calls are sent (a worker runs its calls in
        order: it loads the weights, then generates) and before any result is used (under async
        it is not: the rows say their version). A worker that answers by an older version than the
        run's when the calls were sent was restarted (`_share`)."""
        sent_at = self.policy_version  # the workers were sent this version's weights before these calls
        with self.timed("generate"):
            calls = []
            for policy, requests in requests_by_policy.items():
                served = self.policies[policy]
                shares = np.array_split(np.arange(len(requests)), len(served.workers))
                for w, (worker, idx) in enumerate(zip(served.workers, shares)):
                    if len(idx):
                        part = [
                            dataclasses.replace(requests[i], params=_worker_seeded(requests[i].params, w)) for i in idx
                        ]
                        calls.append((policy, worker, idx, part, worker.generate.remote(part)))
        if not self.asynchronous:
            self.settle_sync()  # a failed sync raises here, before rows by the old weights are used
        with self.timed("generate"):
            out = {policy: [] for policy in requests_by_policy}
            for policy, worker, idx, part, fut in calls:
                for g in self._share(policy, worker, part, fut, sent_at):
                    g.request_index = int(idx[g.request_index])
                    out[policy].append(g)
            with self._timings_lock:
                self.tokens_generated += sum(len(g.response_ids) for gens in out.values() for g in gens)
            return out

    def _share(self, policy: str, worker, part: list, fut, sent_at: int) -> list:
        """A worker's generations of its share. A worker that Ray restarted meanwhile (a crash, or
        its node lost: it comes back on another node) answers by the initial weights or not at
        all: it is waited for, given the current weights and asked again."""
        try:
            gens = ray.get(fut)
            if all(g.policy_version >= sent_at for g in gens):
                return gens
        except WORKER_LOST:
            back_within(worker, self.cfg.trainer.start_timeout_s)
        self.weights.readmit(policy, worker)
        self.restarted_workers += 1
        return ray.get(worker.generate.remote(part))

    def score(self, table):
        with self.timed("reward"):
            return ray.get(self.reward.score.remote(table))

    def token_rewards(self, table):
        """The per-token form of the rows' shaped rewards (`task.shaping` with a rule reward: each
        dense penalty on its token), or None where the task has no shaping."""
        if not getattr(self.task, "shaping", None) or self.cfg.reward.source != "rule":
            return None
        with self.timed("reward"):
            return ray.get(self.reward.take_token_rewards.remote(table.column("uid").to_pylist()))

    def _ask_reference(self, table) -> list:
        """The calls whose first answer is log pi_ref of `table`'s response tokens: the reference
        worker's, or with no worker (learner.lora) the learner's with its adapters off, from every
        rank under ZeRO-3 (its forward gathers the parameters together) and from rank 0 otherwise."""
        if self.reference is not None:
            return [self.reference.logprobs.remote(table)]
        return [l.reference_logprobs.remote(table) for l in self.scoring_ranks()]

    def scoring_ranks(self, policy: str | None = None) -> list:
        """The learner ranks a forward of `policy`'s learner (the run's policy by default) is asked
        of: all under ZeRO-3 (each forward gathers the parameters together; the first answers), rank 0 otherwise."""
        learners = self.policies[policy or self.main_policy].learners
        return learners if self.cfg.learner.zero_stage == 3 else learners[:1]

    def ref_logprobs(self, table):
        with self.timed("reference"):
            return ray.get(self._ask_reference(table))[0]

    def score_and_ref_logprobs(self, table):
        """`score` and `ref_logprobs` of one table, the reward and reference workers working at
        once; each phase's time runs from the common start to its own answer (they overlap)."""
        start = time.perf_counter()
        rewards, ref_logprobs = self.reward.score.remote(table), self._ask_reference(table)
        rewards = ray.get(rewards)
        reward_s = time.perf_counter() - start
        ref_logprobs = ray.get(ref_logprobs)[0]
        with self._timings_lock:
            self.timings["reward"] += reward_s
            self.timings["reference"] += time.perf_counter() - start
        return rewards, ref_logprobs

    def anchor_reference(self) -> None:
        """Load the learner's current weights into the reference worker: the KL anchor becomes
        the current policy (BRiTE's P(.|x, theta_t)) until the next call; checkpoints keep it."""
        if self.reference is None:
            raise RunFailed(
                f"algorithm '{self.cfg.algorithm.name}' moves its reference (anchor_reference) but does not "
                f"declare MovesReference, so under learner.lora no reference worker was started"
            )
        with self.timed("reference"):
            refs = [l.weights.remote() for l in self.learners]  # ZeRO-3: every rank joins the gather
            ray.get([self.reference.load_weights.remote(refs[0]), *refs[1:]])
            self.reference_version = self.policy_version

    def values(self, table, policy: str | None = None):
        """Value-head estimates per token of `table` from `policy`'s learner (the run's policy by default)."""
        with self.timed("values"):
            return ray.get([l.values.remote(table) for l in self.scoring_ranks(policy)])[0]

    def policy_logprobs(self, table):
        with self.timed("policy_logprobs"):
            return ray.get([l.logprobs.remote(table) for l in self.scoring_ranks()])[0]

    def teacher_logprobs(self, table):
        with self.timed("teacher"):
            return ray.get(self.teacher.logprobs.remote(table))

    def execute(self, requests):
        """Sandboxed runs (sandbox.ExecRequest), all sent to the pool at once; results in order.
        Calls from several threads (episodes' env steps) share the pool's workers, each run on
        whichever is idle; `time/sandbox` is the wall time with at least one call under way (the
        pool's busy time), however many threads wait on it."""
        if self.sandbox is None:
            raise RunFailed(
                f"algorithm '{self.cfg.algorithm.name}' runs code, but task '{self.cfg.task.name}' has no "
                f"sandbox pool (a task that runs code: task.name=code)"
            )
        return self.sandbox.run_many(list(requests))

    def teacher_top_logprobs(self, table, k: int = 0):
        with self.timed("teacher"):
            return ray.get(self.teacher.top_logprobs.remote(table, k))


def _worker_seeded(params: SamplingParams, worker: int) -> SamplingParams:
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed + 7919 * worker)
