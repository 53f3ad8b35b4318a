"""Errors that end a run with one line on stderr (exit 1) instead of a traceback. A leaf
module: the CLI imports it before Ray is initialised."""


class RunFailed(RuntimeError):
    """The run cannot go on; the message says what failed and how to continue."""


class LearnerFailed(RunFailed):
    pass


class WeightSyncTimeout(RunFailed):
    pass


class WeightsCorrupt(RunFailed):
    """Weights a rollout worker received do not match the checksum the learner sent with them."""


class Stopped(RunFailed):
    """A signal stopped the run at a step boundary; the message names the step, the checkpoint
    and the resume command, and the CLI exits 128 + the signal's number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
