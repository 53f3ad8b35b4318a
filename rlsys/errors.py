"""Errors that end a run with one line on stderr (exit 1) instead of a traceback. A leaf
module: the CLI imports it before Ray is initialised."""


class RunFailed(RuntimeError):
    """The run cannot go on; the message says what failed and how to continue."""


class LearnerFailed(RunFailed):
    pass


class WeightSyncTimeout(RunFailed):
    pass
