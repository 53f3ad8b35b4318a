"""Where a step's rows come from: the prompt stream, the experience buffer, and the rows made
while the learner trains (the overlap prefetch; the async producer)."""

from __future__ import annotations

import random
import threading

import pyarrow as pa
import ray

from rlsys.checkpoint import CheckpointError
from rlsys.contract import Algorithm, Prompt
from rlsys.run.context import ActorContext


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


class RolloutSource:
    """A step's rows: the algorithm's rollout on the stream's next prompts, through the buffer
    (its staleness bound, its checkpointed rows). Under `trainer.mode: overlap` the next step's
    rows are sampled while the learner trains (`prefetch`) and taken by the next `take`. Buffer
    calls are sent unawaited and awaited with the next call that returns something."""

    def __init__(
        self,
        algorithm: Algorithm,
        ctx: ActorContext,
        buffer,
        stream: PromptStream,
        prompts_per_step: int,
        overlap: bool,
        steps: int,
    ):
        self.algorithm, self.ctx, self.buffer, self.stream = algorithm, ctx, buffer, stream
        self.prompts_per_step, self.overlap, self.steps = prompts_per_step, overlap, steps
        self.calls: list = []  # buffer calls in flight (put, set_policy_version)
        self.prefetched = False  # the buffer holds the next step's rows

    def take(self) -> pa.Table:
        """This step's rows: sampled now, or prefetched by the step before (sampled again if the
        buffer dropped them as too stale)."""
        if not self.prefetched:
            self.put()
        with self.ctx.timed("buffer"):
            table = self.call(self.buffer.take.remote())
        if table.num_rows == 0 and self.prefetched:
            self.put()
            table = self.call(self.buffer.take.remote())
        self.prefetched = False
        return table

    def prefetch(self, step: int) -> bool:
        """Under overlap, and unless `step` is the last, the next step's rows by the current
        weights, sampled now (while the learner trains); whether it did."""
        if not self.overlap or step + 1 >= self.steps:
            return False
        self.put()
        self.prefetched = True
        return True

    def restored(self, step: int, buffer_stats: dict) -> None:
        """A checkpoint's rows are back in the buffer: under overlap, the next step's."""
        if buffer_stats["batches"]:
            raise CheckpointError(
                f"it holds {buffer_stats['batches']} batches made ahead under trainer.mode=async: resume in that mode"
            )
        self.prefetched = buffer_stats["size"] > 0

    # what AsyncRollouts does around syncs, checkpoints and the run's end; nothing here
    def before_sync(self, version: int) -> None:
        pass

    def pause(self) -> None:
        pass

    def unpause(self) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def put(self) -> None:
        table = self.algorithm.rollout(self.ctx, self.stream.next(self.prompts_per_step))
        self.calls.append(self.buffer.put.remote(table))

    def set_policy_version(self, version: int) -> None:
        self.calls.append(self.buffer.set_policy_version.remote(version))

    def call(self, ref):
        """The result of a buffer call, after the buffer calls still in flight (their errors surface here)."""
        pending, self.calls = self.calls, []
        return ray.get([*pending, ref])[-1]


class AsyncRollouts:
    """`trainer.mode: async`: a producer thread runs the algorithm's rollout on the stream's next
    prompts, batch after batch, into the buffer (`put_batch`), while the learner trains; `take`
    hands the learner the oldest batch as soon as one is ready. With k = buffer.max_staleness:
    - `staleness_policy: wait`: batch i starts once the learner holds version i - k, so every row
      of it is at most k versions behind when it is trained on (batch i trains at step i + 1);
    - `drop`: the producer runs ahead up to k + 1 queued batches; the buffer drops, and counts, a
      batch with a row more than k versions behind when it is taken, and one more is made.
    `deterministic` adds to `wait` that the weights of version v reach the workers only once batch
    v + k - 1 is generated, so batch i is generated wholly by version max(0, i - k): the run repeats
    bit for bit (resume included). New weights reach the workers as they are produced: a worker
    loads them between two generations (rows carry the version that sampled them).
    A checkpoint pauses the producer (no batch in flight), so the buffer's batches, the stream's
    cursor and the RNG are saved together; a resumed run goes on from them."""

    def __init__(self, source: RolloutSource, max_staleness: int, policy: str, deterministic: bool):
        self.source, self.k = source, max_staleness
        self.wait_for_version = policy == "wait" or deterministic
        self.deterministic = deterministic
        self.cond = threading.Condition()
        self.produced = 0  # batches put in the buffer since the run began (a resumed run: since step 0)
        self.removed = 0  # batches taken from the buffer or dropped by it
        self.dropped = 0  # batches dropped since the run (or its resume) began
        self.dropped_before = 0  # batches dropped before the checkpoint a resumed run began from
        self.version = 0  # the newest policy version sent to the workers
        self.busy = False  # a batch is being made
        self.paused = False
        self.closing = False
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.queued_when_taken = 0  # batches ready when the learner last took one

    # ---- the producer ---------------------------------------------------------------------
    def _may_start(self) -> bool:
        i = self.produced
        if i - self.dropped >= self.source.steps:
            return False  # every step's batch is made (a dropped one is made again)
        if self.wait_for_version:
            return self.version >= i - self.k
        return self.produced - self.removed <= self.k

    def _produce(self) -> None:
        source = self.source
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.closing or (not self.paused and self._may_start()))
                if self.closing:
                    return
                self.busy = True
            try:
                table = source.algorithm.rollout(source.ctx, source.stream.next(source.prompts_per_step))
                ray.get(source.buffer.put_batch.remote(table))
            except BaseException as e:  # noqa: BLE001 - handed to the learner's thread by `take`
                with self.cond:
                    self.error, self.busy = e, False
                    self.cond.notify_all()
                return
            with self.cond:
                self.produced += 1
                self.busy = False
                self.cond.notify_all()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    # ---- what the loop calls ----------------------------------------------------------------
    def take(self) -> pa.Table:
        """The oldest batch within the staleness bound, waited for (the producer starts with the
        first call); `time/rollout_wait` is how long the learner waited."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._produce, name="rlsys-async-rollout", daemon=True)
            self.thread.start()
        with self.source.ctx.timed("rollout_wait"):
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.error is not None or self.produced > self.removed)
                    if self.produced == self.removed:  # the batches made before a failure are trained on first
                        self._raise_error()
                    self.queued_when_taken = self.produced - self.removed
                table, dropped = self.source.call(self.source.buffer.take_batch.remote())
                with self.cond:
                    self.removed += dropped + (table is not None)
                    self.dropped += dropped
                    self.cond.notify_all()
                if table is not None:
                    return table

    def prefetch(self, step: int) -> bool:
        return True  # the producer makes rows while the learner trains

    def set_policy_version(self, version: int) -> None:
        self.source.set_policy_version(version)
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def before_sync(self, version: int) -> None:
        """Deterministic: the weights of `version` go out once batch version + k - 1 is made."""
        if not self.deterministic or self.thread is None:
            return
        needed = min(version + self.k, self.source.steps + self.dropped)
        with self.cond:
            self.cond.wait_for(lambda: self.error is not None or self.produced >= needed)
            self._raise_error()

    def call(self, ref):
        return self.source.call(ref)

    def pause(self) -> None:
        """No new batch starts; the one in flight is waited for (a checkpoint is taken between batches)."""
        with self.cond:
            self.paused = True
            self.cond.wait_for(lambda: not self.busy)
            self._raise_error()

    def unpause(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def restored(self, step: int, buffer_stats: dict) -> None:
        """A checkpoint's batches are back in the buffer: the producer goes on after them."""
        if buffer_stats["size"] and not buffer_stats["batches"]:
            raise CheckpointError(
                "it holds rows saved under trainer.mode sync/overlap, not async's whole batches: resume in that mode"
            )
        with self.cond:
            self.removed = step
            self.produced = step + buffer_stats["batches"]
            self.dropped, self.dropped_before = 0, buffer_stats["dropped_batches"]

    def close(self, timeout: float | None = None) -> None:
        """Stop the producer; the batch in flight is finished first (its actors stay usable), or,
        with a `timeout` (a failing run), waited for that long at most (the thread is a daemon)."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout)

    def metrics(self) -> dict[str, float]:
        dropped = self.dropped_before + self.dropped  # since step 0, a resume's checkpoint included
        return {"staleness/dropped_batches": float(dropped), "perf/queued_batches": float(self.queued_when_taken)}
