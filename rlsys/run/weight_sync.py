"""How new weights reach the rollout workers: one strategy object per `trainer.weight_sync` mode.

- object store: learner rank 0's weights as numpy arrays in Ray's object store; each worker loads them.
- shared memory: a weights file per policy on the node its learner and workers share; the learner
  writes a slot as part of its step, the workers load that slot (policies whose workers run
  elsewhere fall back to the object store under `auto`).
- broadcast: a process group of learner rank 0 and every rollout receiver (gloo, or NCCL for vLLM).

The first two are sent, not awaited: an actor runs its calls in order, so the learner hands out
these weights before its next step and a worker loads them before its next generate; the
controller waits (`settle`) only when it next uses the workers' results or checkpoints.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol

import ray

from actors.shared_weights import SLOTS
from rlsys.config import JobConfig
from rlsys.errors import RunFailed, WeightsCorrupt
from rlsys.placement import acknowledged, open_shared_weights, open_weight_broadcast, readmit_blocked
from rlsys.run.context import WORKER_LOST, PolicyActors

FromLearners = Callable[[list], list]  # ray.get of learner calls; a dead rank ends the run in one line


class WeightSync(Protocol):
    version: int  # the policy version the workers were last sent
    sends_with_step: bool  # the sync may be sent before the step's training finished

    # where a step writes its weights, and the workers' loads it waits for before it writes (None: nowhere)
    def train_slot(self, policy: str, version: int) -> tuple[int, list] | None: ...
    def send(self, version: int, training: dict[str, list] | None = None) -> None: ...
    def settle(self) -> None: ...  # wait for the last send; its errors surface here
    def readmit(self, policy: str, worker) -> None: ...  # a restarted worker gets the current weights
    def weights_ref(self, policy: str): ...  # the current weights as an object ref (None: the initial policy)
    def close(self) -> None: ...


@dataclass
class InFlight:
    """A sync sent but not awaited: the workers' acknowledgements, each with the call that sends
    that worker the same weights again, and the other ranks' calls."""

    version: int
    learners: list = field(default_factory=list)  # every policy's ranks: asked when a worker's load fails as lost
    acks: list = field(default_factory=list)
    resends: list = field(default_factory=list)  # per ack: () -> a new ack
    gathered: list = field(default_factory=list)

    def add(self, ack, resend: Callable) -> None:
        self.acks.append(ack)
        self.resends.append(resend)

    def finished(self) -> bool:
        """Every worker answered and every rank's call returned (ok or not): `wait` will not block."""
        calls = [*self.acks, *self.gathered]
        return len(ray.wait(calls, num_returns=len(calls), timeout=0)[0]) == len(calls)

    def wait(self, timeout: float, from_learners: FromLearners, superseded: bool = False) -> None:
        """Every acknowledgement; weights that arrived corrupt (WeightsCorrupt) are sent once more,
        and a second failure ends the run with the worker's one line. `superseded`: a newer sync is
        already on its way to every worker (async), so corrupt weights are not sent again: a resend
        would load after the newer ones and take the worker back a version."""
        from_learners(self.gathered)
        acknowledged(self.acks, self.version, timeout)
        for ack, resend in zip(self.acks, self.resends):
            try:
                ray.get(ack)
            except WORKER_LOST:
                learners_alive(self.learners, from_learners)
                continue  # the worker was lost: Ray restarts it, the next generate readmits it
            except ray.exceptions.ObjectLostError:  # the weights were lost with the node that held them
                learners_alive(self.learners, from_learners)
                raise
            except WeightsCorrupt as e:
                then = "newer weights are on their way" if superseded else "sending them again"
                print(f"rlsys: {getattr(e, 'cause', e)}; {then}", file=sys.stderr, flush=True)
                if superseded:
                    continue
                try:
                    ray.get(acknowledged([resend()], self.version, timeout))
                except WeightsCorrupt as again:
                    cause = getattr(again, "cause", again)
                    raise WeightsCorrupt(f"{cause} (twice: the run stopped)") from None


def settle_in_order(
    in_flight: list[InFlight], timeout: float, from_learners: FromLearners, finished_only: bool
) -> None:
    """Wait for the syncs in `in_flight`, oldest first, removing each (`finished_only`: just those
    already answered); one with a newer sync behind it is settled as superseded (no resend)."""
    while in_flight and not (finished_only and not in_flight[0].finished()):
        oldest = in_flight.pop(0)
        oldest.wait(timeout, from_learners, superseded=bool(in_flight))


def learners_alive(learners: list, from_learners: FromLearners) -> None:
    """After a worker's weight load failed as lost, whether the learner ranks are alive: a load
    also fails so when its input was lost, the weights in the object store of a learner's node
    that died; a dead rank then ends the run in its one line (naming the node and the step)."""
    from_learners([l.ready.remote() for l in learners])


def every_rank(policies: dict[str, PolicyActors]) -> list:
    return [l for p in policies.values() for l in p.learners]


def readmitted(load, sync) -> None:
    """Wait for a restarted worker's load of the current weights (`sync`: an object-store or
    shared-memory sync); one that fails as lost asks the learners first (`learners_alive`)."""
    try:
        ray.get(load)
    except (*WORKER_LOST, ray.exceptions.ObjectLostError):
        learners_alive(every_rank(sync.policies), sync.from_learners)
        raise


def weights_call(worker, offered: bool):
    """The worker's method that takes a sync: `load_weights`, run in order with its generations, or
    (rollout.inflight_update continue) `offer_weights` in its "weights" concurrency group, beside
    a generation in progress, which loads them between two decode steps."""
    return worker.offer_weights.options(concurrency_group="weights") if offered else worker.load_weights


def send_through_object_store(
    p: PolicyActors,
    version: int,
    sent: InFlight,
    timeout: float,
    from_learners,
    asynchronous: bool = False,
    offered: bool = False,
) -> None:
    """Rank 0's weights and their checksums into the object store, every worker loading them
    (awaited later, through `sent`); a policy larger than one bucket goes in buckets, awaited now,
    or under async (`asynchronous`) all of them to each worker in one unawaited call. `offered`:
    the workers take them through `offer_weights` (see `weights_call`)."""
    if p.buckets is not None and len(p.buckets) > 1:
        if asynchronous:
            return send_buckets_in_one_call(p, version, sent, offered)
        return send_in_buckets(p, version, timeout, from_learners)
    weights, digest = p.learners[0].weights_and_digest.options(num_returns=2).remote()
    sent.gathered += [l.weights.remote() for l in p.learners[1:]]  # ZeRO-3: every rank joins the gather
    for w in p.workers:
        load = lambda w=w: weights_call(w, offered).remote(version, weights, digest)  # noqa: E731
        sent.add(load(), load)
    p.weights_ref, p.weights_digest = weights, digest


def send_in_buckets(p: PolicyActors, version: int, timeout: float, from_learners: FromLearners) -> None:
    """Rank 0's weights bucket by bucket (`trainer.sync_bucket_mb`), each with its checksums and
    loaded by every worker before the next is asked for: the previous version's buckets are let go
    first and a worker replaces its arrays a bucket at a time, so no object store holds more than
    one full copy and a bucket. The buckets stay referenced for a restarted worker or an evaluator."""
    p.weights_ref = p.weights_digest = None
    refs, digests = [], []
    for i, names in enumerate(p.buckets):
        part, checksums = p.learners[0].weights_bucket.options(num_returns=2).remote(names)
        sent = InFlight(version, p.learners, gathered=[l.weights_bucket.remote(names) for l in p.learners[1:]])
        for w in p.workers:
            load = lambda w=w: w.load_weights.remote(version, part, checksums, (i, len(p.buckets)))  # noqa: E731
            sent.add(load(), load)
        sent.wait(timeout, from_learners)
        refs.append(part)
        digests.append(checksums)
    p.weights_ref, p.weights_digest = refs, digests


def send_buckets_in_one_call(p: PolicyActors, version: int, sent: InFlight, offered: bool = False) -> None:
    """Under trainer.mode async: every bucket of rank 0's weights into the object store, then one
    load call per worker with all of them (fetched and loaded a bucket at a time inside the call),
    not awaited. One call, so no generation runs between two buckets on half-new weights; the cost
    is a full copy in the object store per version in flight, not one bucket."""
    refs, digests = [], []
    for names in p.buckets:
        part, checksums = p.learners[0].weights_bucket.options(num_returns=2).remote(names)
        sent.gathered += [l.weights_bucket.remote(names) for l in p.learners[1:]]  # ZeRO-3: every rank gathers
        refs.append(part)
        digests.append(checksums)
    for w in p.workers:
        load = lambda w=w: weights_call(w, offered).remote(version, refs, digests)  # noqa: E731
        sent.add(load(), load)
    p.weights_ref, p.weights_digest = refs, digests


def bucket_policies(policies: dict[str, PolicyActors], bucket_mb: float, from_learners: FromLearners) -> bool:
    """Each policy's object-store buckets (every rank asked: collective under ZeRO-3); True when
    some policy needs more than one (its syncs are then awaited, not sent with the step)."""
    for p in policies.values():
        p.buckets = from_learners([l.bucket_names.remote(bucket_mb) for l in p.learners])[0]
    return any(len(p.buckets) > 1 for p in policies.values())


def asked_weights_ref(p: PolicyActors, version: int, from_learners: FromLearners):
    """The policy's weights as an object ref, asked of its learner once per version (syncs that
    do not go through the object store)."""
    if p.weights_ref is None and version > 0:
        refs = [l.weights.remote() for l in p.learners]  # ZeRO-3: every rank joins the gather
        from_learners(refs[1:])
        p.weights_ref, p.weights_digest = refs[0], None
    return p.weights_ref


class ObjectStoreSync:
    """`trainer.weight_sync: object_store` (and `auto` where no policy can share memory). Under
    `trainer.mode: async` a send does not wait for the one before (a worker loads it when its
    generation in progress ends, or under rollout.inflight_update continue between two of its decode
    steps): the syncs already answered are settled, the others stay in flight."""

    def __init__(
        self,
        policies: dict[str, PolicyActors],
        timeout: float,
        from_learners: FromLearners,
        bucket_mb: float,
        asynchronous: bool = False,
        offered: bool = False,
    ):
        """`offered`: rollout.inflight_update continue (the workers' `offer_weights`)."""
        self.policies, self.timeout, self.from_learners = policies, timeout, from_learners
        self.version, self.in_flight, self.asynchronous, self.offered = 0, [], asynchronous, offered
        self.lock = threading.Lock()
        self.sends_with_step = not bucket_policies(policies, bucket_mb, from_learners)

    def train_slot(self, policy: str, version: int) -> None:
        return None

    def send(self, version: int, training: dict[str, list] | None = None) -> None:
        self.settle(finished_only=self.asynchronous)
        sent = InFlight(version, every_rank(self.policies))
        with self.lock:  # a readmit from the async producer reads the version and its weights together
            for p in self.policies.values():
                send_through_object_store(
                    p, version, sent, self.timeout, self.from_learners, self.asynchronous, self.offered
                )
            self.in_flight.append(sent)
            self.version = version

    def settle(self, finished_only: bool = False) -> None:
        """Wait for the syncs in flight, oldest first (`finished_only`: just those already answered)."""
        settle_in_order(self.in_flight, self.timeout, self.from_learners, finished_only)

    def readmit(self, policy: str, worker) -> None:
        p = self.policies[policy]
        with self.lock:
            version, weights, digest = self.version, p.weights_ref, p.weights_digest
        readmitted(worker.load_weights.remote(version, weights, digest), self)

    def weights_ref(self, policy: str):
        return self.policies[policy].weights_ref

    def close(self) -> None:
        self.settle()


class SharedMemorySync:
    """`trainer.weight_sync: shared_memory | auto`: the slot a step writes (`train_slot`) is loaded
    by the policy's workers; a policy without a weights file syncs through the object store."""

    def __init__(
        self, policies: dict[str, PolicyActors], timeout: float, from_learners: FromLearners, bucket_mb: float
    ):
        self.policies, self.timeout, self.from_learners = policies, timeout, from_learners
        self.version, self.in_flight = 0, None
        by_object_store = {name: p for name, p in policies.items() if p.shared is None}
        self.sends_with_step = not bucket_policies(by_object_store, bucket_mb, from_learners)

    def train_slot(self, policy: str, version: int) -> tuple[int, list] | None:
        """The slot a step writes `version` into, and the workers' loads of the sync in flight (of
        version - 1, which moves them off the slot's version - 2): the learner waits for them before
        it writes, not the controller before it sends the step, so a step's training can be queued
        behind the one before (trainer.mode overlap). Their errors surface in the next `settle`."""
        if self.policies[policy].shared is None:
            return None
        return version % SLOTS, list(self.in_flight.acks) if self.in_flight is not None else []

    def send(self, version: int, training: dict[str, list] | None = None) -> None:
        """`training`: per policy, this step's train calls (they may still run: a worker's load of
        the slot they write waits on them); without them the learner writes the slot now."""
        self.settle()
        self.in_flight = sent = InFlight(version, every_rank(self.policies))
        for name, p in self.policies.items():
            if p.shared is None:
                send_through_object_store(p, version, sent, self.timeout, self.from_learners)
                continue
            written = (training or {}).get(name) or [l.write_shared.remote(version % SLOTS) for l in p.learners]
            slot = version % SLOTS
            for w in p.workers:
                again = lambda w=w, p=p: w.load_shared.remote(version, p.shared, slot)  # noqa: E731
                sent.add(w.load_shared.remote(version, p.shared, slot, written[0]), again)
            sent.gathered += written[1:]
            p.weights_ref = p.weights_digest = None  # asked for when needed (`weights_ref`)
        self.version = version

    def settle(self) -> None:
        pending, self.in_flight = self.in_flight, None
        if pending is not None:
            pending.wait(self.timeout, self.from_learners)

    def readmit(self, policy: str, worker) -> None:
        p = self.policies[policy]
        if p.shared is None:
            readmitted(worker.load_weights.remote(self.version, p.weights_ref, p.weights_digest), self)
        else:
            readmitted(worker.load_shared.remote(self.version, p.shared, self.version % SLOTS), self)

    def weights_ref(self, policy: str):
        p = self.policies[policy]
        return p.weights_ref if p.shared is None else asked_weights_ref(p, self.version, self.from_learners)

    def close(self) -> None:
        """Remove the policies' weights files; a file a dead learner left is removed by the next
        learner on its node (`remove_stale`)."""
        try:  # a sync still in flight finishes first; a failed run's sync may have failed with it
            self.settle()
        except Exception:  # noqa: BLE001
            pass
        closing = [p.learners[0].close_shared.remote() for p in self.policies.values() if p.shared is not None]
        try:
            ray.get(closing, timeout=10)
        except Exception:  # noqa: BLE001 - a dead learner cannot answer; its file is swept later
            pass
        for p in self.policies.values():
            p.shared = None


class BroadcastSync:
    """`trainer.weight_sync: broadcast`: learner rank 0 -> every rollout receiver over one group,
    awaited (the group is collective). One policy only (config rule)."""

    sends_with_step = False

    def __init__(self, cfg: JobConfig, policies: dict[str, PolicyActors], from_learners: FromLearners):
        self.cfg, self.from_learners = cfg, from_learners
        self.policy = next(iter(policies.values()))
        self.version = 0
        open_weight_broadcast(cfg, self.policy.learners, self.policy.workers)
        self.manifest = from_learners([l.weight_manifest.remote() for l in self.policy.learners])[0]

    def train_slot(self, policy: str, version: int) -> None:
        return None

    def send(self, version: int, training: dict[str, list] | None = None) -> None:
        """A worker restarted since the last generate (its version check has not seen it yet) is
        outside the group: the group is formed again first."""
        p = self.policy
        if readmit_blocked(self.cfg) is None and not all(ray.get([w.in_weight_broadcast.remote() for w in p.workers])):
            open_weight_broadcast(self.cfg, p.learners, p.workers)
        sends = [l.broadcast_weights.remote(version) for l in p.learners]  # all ranks: ZeRO-3 gathers
        acks = [w.receive_weights.remote(version, self.manifest) for w in p.workers]
        ray.get(acknowledged(acks, version, self.cfg.trainer.sync_timeout_s))
        self.from_learners(sends)
        self.version = version
        p.weights_ref = p.weights_digest = None  # asked for when needed (`weights_ref`)

    def settle(self) -> None:
        pass  # `send` waits

    def readmit(self, policy: str, worker) -> None:
        """The restarted worker is back outside the group with the initial weights: the group is
        formed again and the current weights broadcast. Exact because the learner is idle while
        the workers generate (trainer.mode sync), so its weights are the version they serve."""
        index = self.policy.workers.index(worker)
        blocked = readmit_blocked(self.cfg)
        if blocked:
            raise RunFailed(
                f"rollout worker {index} restarted; the weight-broadcast group cannot re-admit it under "
                f"{blocked}: resume from the last checkpoint"
            )
        open_weight_broadcast(self.cfg, self.policy.learners, self.policy.workers)
        self.send(self.version)

    def weights_ref(self, policy: str):
        return asked_weights_ref(self.policy, self.version, self.from_learners)

    def close(self) -> None:
        pass


def make_weight_sync(cfg: JobConfig, policies: dict[str, PolicyActors], from_learners: FromLearners) -> WeightSync:
    """The strategy `trainer.weight_sync` names; `auto` shares memory where a policy's learner and
    workers share a node."""
    mode, timeout = cfg.trainer.weight_sync, cfg.trainer.sync_timeout_s
    if mode == "broadcast":
        return BroadcastSync(cfg, policies, from_learners)
    open_shared_weights(cfg, policies)  # sets PolicyActors.shared where it can (auto, shared_memory)
    bucket_mb = cfg.trainer.sync_bucket_mb
    if any(p.shared is not None for p in policies.values()):
        return SharedMemorySync(policies, timeout, from_learners, bucket_mb)
    asynchronous, offered = cfg.trainer.mode == "async", cfg.rollout.inflight_update == "continue"
    return ObjectStoreSync(policies, timeout, from_learners, bucket_mb, asynchronous, offered)
