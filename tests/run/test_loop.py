"""When the loop queues the next step's training behind the current one (trainer.mode overlap):
only where nothing at the current step's boundary reads the learner's weights, which by then are
the next step's."""

from types import SimpleNamespace

import pytest

from rlsys.config import load_config
from rlsys.evaluators import AttachedEvaluators
from rlsys.run.loop import may_queue_next
from rlsys.run.rollouts import AsyncRollouts


class Restarting:
    def restarts_policy(self, table) -> bool:
        return True


def run_at(step: int, checkpoint_every=0, evaluator_every=None, signum=None, rollouts=None, algorithm=None):
    """A run object as `may_queue_next` reads it, `step` steps done (the current step is step + 1)."""
    cfg = load_config(
        "configs/quickstart.yaml",
        ["trainer.mode=overlap", "buffer.max_staleness=1", f"trainer.checkpoint_every={checkpoint_every}"],
    )
    attached = SimpleNamespace(active={} if evaluator_every is None else {"eval": ({"every": evaluator_every}, None)})
    attached.due = lambda s: AttachedEvaluators.due(attached, s)
    return SimpleNamespace(
        cfg=cfg,
        step=step,
        attached=attached,
        stop=SimpleNamespace(signum=signum),
        rollouts=rollouts or object(),
        algorithm=algorithm or object(),
    )


def test_the_next_step_is_queued_unless_the_boundary_reads_the_learner():
    assert may_queue_next(run_at(3))
    assert may_queue_next(run_at(3, checkpoint_every=5))
    assert not may_queue_next(run_at(4, checkpoint_every=5))  # step 5 checkpoints the learner
    assert may_queue_next(run_at(3, evaluator_every=3))
    assert not may_queue_next(run_at(3, evaluator_every=4))  # an evaluator asks for step 4's weights
    assert not may_queue_next(run_at(3, signum=15))  # a SIGTERM: the run stops at this step
    assert not may_queue_next(run_at(3, algorithm=Restarting()))  # a ReST round restarts first


@pytest.mark.parametrize("attached", [None, "no evaluator"])
def test_a_run_without_evaluators_queues_and_async_never_does(attached):
    run = run_at(3)
    if attached is None:
        run.attached = None  # a Controller driven step by step (benchmarks) opens no registry
    assert may_queue_next(run)
    run.rollouts = object.__new__(AsyncRollouts)  # its producer thread owns the rows
    assert not may_queue_next(run)
