"""Where a step's rows come from: the prompt stream, the experience buffer, and the overlap prefetch."""

from __future__ import annotations

import random

import pyarrow as pa
import ray

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
    (its staleness bound, its checkpointed rows). Under `trainer.overlap_rollout` the next step's
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

    def put(self) -> None:
        table = self.algorithm.rollout(self.ctx, self.stream.next(self.prompts_per_step))
        self.calls.append(self.buffer.put.remote(table))

    def set_policy_version(self, version: int) -> None:
        self.calls.append(self.buffer.set_policy_version.remote(version))

    def call(self, ref):
        """The result of a buffer call, after the buffer calls still in flight (their errors surface here)."""
        pending, self.calls = self.calls, []
        return ray.get([*pending, ref])[-1]
