"""Running reward functions so that no fault stops or freezes the loop.

`RewardScorer.score(prompts, responses, rows) -> rewards` is what the reward actor calls (actors/
reward.py) for `reward.function` and `reward.source: http`; `take_metrics()` hands the step's
`reward/errors`, `reward/timeouts` and the functions' extra metrics (means) to the loop. A row
whose function raises, hangs past `reward.timeout_s` or returns a non-number is scored
`reward.on_error` and counted; the first error of each call is printed (one line on stderr).
Only `reward.max_error_rate` over the last `reward.error_window` scoring calls stops the run
(RunFailed, one line naming the function and the last error).

Where the rewards come from (a runner, `run(prompts, responses, rows) -> [Outcome]`):

- `FunctionRunner`: the function runs in `reward.workers` worker processes of its own
  (`python -c ... worker_main`, talking over a socket pair), one row at a time. The timeout is
  kept from outside: a worker past its row's deadline is killed and replaced, its row failed
  and the other rows go on. A batched function (`reward.batched`) is one call per scoring call.
- `HttpRunner`: one POST per scoring call to `reward.url`, `{"items": [{prompt, response, row}]}`
  answered by `{"rewards": [...]}`; retried with backoff, then RunFailed naming the URL.
- `TaskRunner`: the task's own reward, in this process (`rlsys reward check` without a function).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict, deque
from multiprocessing.connection import Connection, Pipe, wait
from typing import NamedTuple
from urllib.parse import urlparse

from envs.reward_functions import FunctionLoadError, FunctionSpec, as_reward, describe_error, load_function
from rlsys.errors import RunFailed

RESERVED_METRICS = ("mean", "std", "errors", "timeouts")  # reward/<key> the loop or this module logs


class Outcome(NamedTuple):
    """One row's result: a reward and its extra metrics, or an error (reward None)."""

    reward: float | None
    metrics: dict
    error: str | None = None
    timed_out: bool = False


def outcome_of(value) -> Outcome:
    try:
        return Outcome(*as_reward(value))
    except (TypeError, ValueError) as e:
        return Outcome(None, {}, str(e))


def call_outcome(fn, *args) -> Outcome:
    """`fn(*args)` as an Outcome: what it returned, or how it failed (in one line)."""
    try:
        return outcome_of(fn(*args))
    except (Exception, SystemExit) as e:
        return Outcome(None, {}, describe_error(e))


def batch_outcomes(fn, prompts: list, responses: list, rows: list) -> list[Outcome]:
    """A batched function's call, one Outcome per row; a failed call fails every row."""
    try:
        values = list(fn(prompts, responses, rows))
    except (Exception, SystemExit) as e:
        return [Outcome(None, {}, describe_error(e))] * len(rows)
    if len(values) != len(rows):
        return [Outcome(None, {}, f"returned {len(values)} values for {len(rows)} rows")] * len(rows)
    return [outcome_of(v) for v in values]


# ---- the worker process ------------------------------------------------------------------------
BOOT = "import sys; from envs.reward_runner import worker_main; worker_main(int(sys.argv[1]))"


def worker_main(fd: int) -> None:
    """A worker process: load the function, answer ("ready",) or ("fatal", why), then one reply
    per job, ("row", prompt, response, row) or ("batch", prompts, responses, rows), until its
    parent closes the socket. It exits when its parent is gone."""
    conn = Connection(fd)
    parent = os.getppid()
    threading.Thread(target=_exit_without_parent, args=(parent,), daemon=True).start()
    spec = conn.recv()
    try:
        fn = load_function(spec)
    except BaseException as e:
        why = str(e) if isinstance(e, FunctionLoadError) else f"reward function '{spec.label}': {describe_error(e)}"
        conn.send(("fatal", why))
        return
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job[0] == "row":
            conn.send(("done", call_outcome(fn, *job[1:])))
        else:
            conn.send(("done", batch_outcomes(fn, *job[1:])))


def _exit_without_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


class _Worker:
    """One worker process, started at once; `job` is the index of the job it is running."""

    def __init__(self, spec: FunctionSpec, startup_timeout: float):
        self.conn, child = Pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BOOT, str(child.fileno())],
            pass_fds=(child.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        child.close()
        self.conn.send(spec)
        self.ready, self.job = False, None
        self.deadline = time.monotonic() + startup_timeout

    def give(self, index: int, job: tuple, timeout: float) -> None:
        self.job, self.deadline = index, time.monotonic() + timeout
        self.conn.send(job)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()


class FunctionRunner:
    """A reward function in `workers` processes of its own, each row under `timeout_s` (a batched
    function: each call). Processes start on first use and live until `close`."""

    def __init__(self, spec: FunctionSpec, workers: int = 2, timeout_s: float = 10.0, startup_timeout: float = 60.0):
        self.spec, self.num_workers, self.timeout_s = spec, workers, timeout_s
        self.startup_timeout = max(startup_timeout, timeout_s)
        self.workers: list[_Worker] = []
        self.restarts = 0  # workers replaced after a timeout or a crash

    def __getstate__(self):  # processes stay with the process that started them
        return {**self.__dict__, "workers": []}

    def run(self, prompts: list[str], responses: list[str], rows: list[dict]) -> list[Outcome]:
        if self.spec.batched:
            jobs = [("batch", list(prompts), list(responses), list(rows))]
            return self._dispatch(jobs, 1, lambda why, timed_out: [Outcome(None, {}, why, timed_out)] * len(rows))[0]
        jobs = [("row", p, r, row) for p, r, row in zip(prompts, responses, rows)]
        return self._dispatch(jobs, self.num_workers, lambda why, timed_out: Outcome(None, {}, why, timed_out))

    def _dispatch(self, jobs: list[tuple], num_workers: int, failed) -> list:
        """Each job to the next free worker; a worker past its deadline or dead is replaced and
        its job answered by `failed(why, timed_out)`."""
        while len(self.workers) < min(num_workers, len(jobs)):
            self.workers.append(_Worker(self.spec, self.startup_timeout))
        pool = self.workers[: min(num_workers, len(jobs))]
        out: list = [None] * len(jobs)
        queue = deque(range(len(jobs)))
        while queue or any(w.job is not None for w in pool):
            for k, w in enumerate(pool):
                if w.ready and w.job is None and queue:
                    i = queue.popleft()
                    try:
                        w.give(i, jobs[i], self.timeout_s)
                    except OSError:  # it died while idle: a fresh one takes the job
                        pool[k], w.job = self._replace(w), None
                        queue.appendleft(i)
            waiting = [w for w in pool if not w.ready or w.job is not None]
            wait([w.conn for w in waiting], max(0.0, min(w.deadline for w in waiting) - time.monotonic()))
            for k, w in enumerate(pool):
                if w not in waiting:
                    continue
                reply = self._reply(w)
                if reply is None and time.monotonic() < w.deadline:
                    continue
                if reply is not None and reply[0] == "ready":
                    w.ready = True
                elif reply is not None and reply[0] == "done":
                    out[w.job], w.job = reply[1], None
                elif not w.ready:  # it could not load the function, died loading it, or is still loading
                    self.workers.remove(w)
                    w.kill()
                    if reply is None:
                        why = f"its worker process did not start in {self.startup_timeout:.0f} s"
                    elif reply[0] == "fatal":
                        raise RunFailed(reply[1])
                    else:
                        why = "its worker process exited while loading it"
                    raise RunFailed(f"reward function '{self.spec.label}': {why}")
                else:  # past its deadline, or dead
                    pool[k] = self._replace(w)
                    if reply is None:
                        out[w.job] = failed(f"timed out after {self.timeout_s:g} s", True)
                    else:
                        out[w.job] = failed(f"its worker process exited (code {w.proc.returncode})", False)
        return out

    @staticmethod
    def _reply(w: _Worker):
        """The worker's message if one is waiting, ("died", None) if its process is gone, else None."""
        try:
            return w.conn.recv() if w.conn.poll() else None
        except (EOFError, OSError):
            w.proc.wait()
            return ("died", None)

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        self.restarts += 1
        fresh = _Worker(self.spec, self.startup_timeout)
        self.workers[self.workers.index(w)] = fresh
        return fresh

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---- a reward server ---------------------------------------------------------------------------
class HttpRunner:
    """One POST per call to `url` (retried `retries` times with doubling backoff on a refused
    connection, a timeout or a 5xx/429 answer); RunFailed naming the URL when it stays down or
    answers what is not `{"rewards": [one per item]}`. An entry is a number or a dict like a
    function's; null or another type fails that row only."""

    def __init__(self, url: str, timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.5):
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s

    def _opener(self):
        host = urlparse(self.url).hostname or ""
        if host in ("localhost", "::1") or host.startswith("127."):  # a proxy from the environment never sees it
            return urllib.request.build_opener(urllib.request.ProxyHandler({}))
        return urllib.request.build_opener()

    def run(self, prompts: list[str], responses: list[str], rows: list[dict]) -> list[Outcome]:
        items = [{"prompt": p, "response": r, "row": row} for p, r, row in zip(prompts, responses, rows)]
        body = json.dumps({"items": items}, default=str).encode()
        answer = self._post(body)
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list) or len(rewards) != len(items):
            got = f"{len(rewards)} rewards" if isinstance(rewards, list) else f"{str(answer)[:80]!r}"
            raise RunFailed(
                f'reward server {self.url} answered {got}; expected {{"rewards": [...]}} with {len(items)} entries'
            )
        return [outcome_of(v) for v in rewards]

    def _post(self, body: bytes):
        opener, last = self._opener(), ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 8.0))
            request = urllib.request.Request(
                self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with opener.open(request, timeout=self.timeout_s) as response:
                    text = response.read()
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} {e.reason}"
                if e.code < 500 and e.code != 429:
                    raise RunFailed(f"reward server {self.url} answered {last}") from None
                continue
            except (urllib.error.URLError, OSError) as e:
                last = " ".join(str(getattr(e, "reason", e)).split()) or type(e).__name__
                continue
            try:
                return json.loads(text)
            except ValueError:
                raise RunFailed(f"reward server {self.url} answered what is not JSON: {text[:80]!r}") from None
        raise RunFailed(
            f"reward server {self.url} did not answer after {self.retries + 1} tries "
            f"({last}; reward.retries, reward.timeout_s)"
        )

    def close(self) -> None:
        pass


class TaskRunner:
    """The task's own reward (`task.reward(row, response)`), in this process."""

    def __init__(self, task):
        self.task = task

    def run(self, prompts: list[str], responses: list[str], rows: list[dict]) -> list[Outcome]:
        return [call_outcome(lambda p, r, row: self.task.reward(row, r), *x) for x in zip(prompts, responses, rows)]

    def close(self) -> None:
        pass


# ---- errors, metrics and the stop rule ----------------------------------------------------------
class RewardScorer:
    """Rewards from a runner, faults scored `on_error` and counted. `score` raises RunFailed when
    the rows that failed over the last `error_window` calls reach `max_error_rate` of them."""

    def __init__(self, runner, label: str, on_error=0.0, max_error_rate=1.0, error_window=3):
        self.runner, self.label, self.on_error = runner, label, float(on_error)
        self.max_error_rate, self.window = max_error_rate, deque(maxlen=error_window)
        self.last_error = ""
        self._reset()

    def _reset(self) -> None:
        self.errors, self.timeouts = 0, 0
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def run(self, prompts: list[str], responses: list[str], rows: list[dict]) -> list[Outcome]:
        """Each row's Outcome, nothing counted (`rlsys reward check`)."""
        return self.runner.run(list(prompts), list(responses), list(rows))

    def score(self, prompts: list[str], responses: list[str], rows: list[dict]) -> list[float]:
        return [o.reward for o in self.score_rows(prompts, responses, rows)]

    def score_rows(self, prompts: list[str], responses: list[str], rows: list[dict]) -> list[Outcome]:
        """Each row's Outcome, counted in the step's metrics, a failed row's reward `on_error`."""
        outcomes = self.run(prompts, responses, rows)
        failed = [o for o in outcomes if o.error is not None]
        self.errors += len(failed)
        self.timeouts += sum(o.timed_out for o in outcomes)
        for o in outcomes:
            for key, value in o.metrics.items():
                self.sums[key] += value
                self.counts[key] += 1
        if failed:
            self.last_error = failed[-1].error
            print(
                f"rlsys: {self.label} failed on {len(failed)} of {len(outcomes)} rows, scored {self.on_error:g} "
                f"(first: {failed[0].error})",
                file=sys.stderr,
                flush=True,
            )
        self.window.append((len(failed), len(outcomes)))
        self._check_window()
        return [self.scored(o) for o in outcomes]

    def scored(self, outcome: Outcome) -> Outcome:
        """The outcome with `on_error` as the reward of a row that failed."""
        return outcome._replace(reward=self.on_error) if outcome.error is not None else outcome

    def _check_window(self) -> None:
        failed, total = (sum(x) for x in zip(*self.window))
        if len(self.window) == self.window.maxlen and total and failed / total >= self.max_error_rate:
            raise RunFailed(
                f"{self.label} failed on {failed} of {total} rows over the last {len(self.window)} scoring calls "
                f"(reward.max_error_rate {self.max_error_rate:g}); last error: {self.last_error}"
            )

    def take_metrics(self) -> dict[str, float]:
        """`reward/errors`, `reward/timeouts` and the extra metrics' means since the last call."""
        out = {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts)}
        for key in self.sums:
            out[self.metric_name(key)] = self.sums[key] / self.counts[key]
        self._reset()
        return out

    @staticmethod
    def metric_name(key: str) -> str:
        """What a function's extra metric `key` is logged as: `reward/<key>` (`reward/metric_<key>`
        where the loop or this module has a `reward/<key>` of its own)."""
        return f"reward/{key}" if key not in RESERVED_METRICS else f"reward/metric_{key}"

    def close(self) -> None:
        self.runner.close()


# ---- from the config -----------------------------------------------------------------------------
def answer_key(reward_cfg, task=None) -> str:
    """reward.answer_key, else the task's answer column (a dataset task's task.answer_key), else "answer"."""
    return reward_cfg.answer_key or getattr(task, "answer_key", None) or "answer"


def function_spec(reward_cfg, task=None, sandbox_cfg=None) -> FunctionSpec:
    """`reward.function` as a FunctionSpec with the built-ins' options: the answer key, the
    pattern, and for `code` the sandbox backend and limits (`sandbox_cfg`, else the task's, else
    the defaults)."""
    from rlsys.config import ConfigError  # pydantic: the worker processes import this module without it

    options = {"answer_key": answer_key(reward_cfg, task), "pattern": reward_cfg.pattern or ""}
    if reward_cfg.function == "code":
        from sandbox import Limits  # the sandbox package: only the code reward loads it

        if sandbox_cfg is not None:
            backend = sandbox_cfg.backend
            limits = Limits(
                wall_time_s=sandbox_cfg.wall_time_s, cpu_time_s=sandbox_cfg.cpu_time_s, memory_mb=sandbox_cfg.memory_mb
            )
        else:
            backend, limits = getattr(task, "sandbox_backend", "bwrap"), getattr(task, "limits", None) or Limits()
        options |= {"backend": backend, "limits": dataclasses.asdict(limits)}
    try:
        return FunctionSpec.parse(reward_cfg.function, reward_cfg.batched, options)
    except FunctionLoadError as e:
        raise ConfigError(f"config error: reward.function: {e}") from None


def check_function(spec: FunctionSpec) -> None:
    """A config error now, not a failed row per step later: a user's function is imported here
    once; `math` needs math-verify; `code` needs a usable sandbox backend."""
    from rlsys.config import ConfigError  # pydantic: the worker processes import this module without it

    if spec.kind != "builtin":
        try:
            load_function(spec)
        except FunctionLoadError as e:
            raise ConfigError(f"config error: reward.function: {e}") from None
    elif spec.target == "math" and importlib.util.find_spec("math_verify") is None:
        raise ConfigError(
            "config error: reward.function 'math' needs the math-verify package (pip install math-verify)"
        )
    elif spec.target == "code":
        from sandbox import unavailable  # the sandbox package: only the code reward loads it

        why = unavailable(spec.options["backend"])
        if why:
            raise RunFailed(
                f"reward.function 'code' runs the row's tests in the {spec.options['backend']} sandbox, which is "
                f"unavailable here: {why} (set up the engines: .ci/setup_sandbox.sh; or set sandbox.backend)"
            )


def build_scorer(reward_cfg, task=None, sandbox_cfg=None) -> RewardScorer | None:
    """The scorer of `reward.source: http` or of `reward.function`; None for the task's own rule
    reward (and for a reward model or a judge)."""
    if reward_cfg.source == "http":
        runner, label = (
            HttpRunner(reward_cfg.url, reward_cfg.timeout_s, reward_cfg.retries),
            f"reward server {reward_cfg.url}",
        )
    elif reward_cfg.source == "rule" and reward_cfg.function:
        spec = function_spec(reward_cfg, task, sandbox_cfg)
        check_function(spec)
        timeout = reward_cfg.timeout_s
        if spec.target == "code":  # a row's tests get the sandbox's own wall time, and then some
            timeout = max(timeout, spec.options["limits"]["wall_time_s"] + 10.0)
        runner, label = FunctionRunner(spec, reward_cfg.workers, timeout), f"reward function '{spec.label}'"
    else:
        return None
    return RewardScorer(runner, label, reward_cfg.on_error, reward_cfg.max_error_rate, reward_cfg.error_window)
