"""The training loop: sample -> prepare -> train -> sync -> evaluate -> checkpoint -> log (-> stop),
once per step.

`run` is the Controller (rlsys/run/controller.py): it owns the actors and the objects each phase
calls: `rollouts` (prompt stream, buffer, overlap prefetch or the async producer), `learner_group` (the ranks of every
trained policy), `weights` (the weight-sync strategy), `attached` (evaluators), `ctx` (the
RolloutContext, its timings and the policy version).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import chain

import numpy as np
import pyarrow as pa

from algorithms.episodes import episode_metrics
from rlsys.contract import ReportsPrepareMetrics, RestartsPolicy
from rlsys.errors import RunFailed
from rlsys.experience import response_token_versions
from rlsys.run.rollouts import AsyncRollouts
from rlsys.run.stop import stop_at_boundary
from rlsys.tracking import Tracker, rollout_samples


def train(run, tracker: Tracker, bar, last_eval: dict) -> dict:
    """Steps until trainer.steps; returns the last held-out evaluation."""
    cfg = run.cfg
    while run.step < cfg.trainer.steps:
        metrics, rows, staleness = update(run)  # sample -> prepare -> train -> sync
        last_step = run.step == cfg.trainer.steps
        # evaluate: attached evaluators at every step boundary, the held-out split as due
        handoff = time.perf_counter()
        # this step's weights, asked only when one is due; none while the next step trains (the learner is past them)
        current_weights = None if run.queued is not None else lambda: run.weights.weights_ref(run.ctx.main_policy)
        for row in run.attached.poll(run.step, run.ctx.policy_version, current_weights):
            tracker.log_eval(*row)
        metrics["time/eval_handoff"] = time.perf_counter() - handoff
        if cfg.trainer.eval_every and run.step % cfg.trainer.eval_every == 0 or last_step:
            last_eval = run.evaluate()
            tracker.log_eval(run.step, "heldout", last_eval, run.ctx.policy_version)
        # checkpoint: with no evaluation in flight
        every = cfg.trainer.checkpoint_every
        if every and (run.step % every == 0 or last_step):
            for row in run.attached.drain():
                tracker.log_eval(*row)
            with run.ctx.timed("checkpoint"):
                run.save_checkpoint(metrics)
            metrics["time/checkpoint"] = run.ctx.timings_snapshot()["checkpoint"]
        # log
        tracker.log(run.step, metrics)
        tracker.log_histograms(run.step, {"staleness": staleness})
        shown = rows.slice(0, cfg.trainer.log_samples)
        extra = run.row_reward_metrics(shown.column("uid").to_pylist())  # a reward function's, per row
        tracker.log_samples(run.step, rollout_samples(shown, run.tokenizer, extra))
        bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", eval_acc=f"{last_eval['accuracy']:.2f}", refresh=False)
        bar.update()
        # stop: a SIGTERM or Ctrl-C during the step ends the run here (checkpointed as configured),
        # or once the next step, queued behind it, has trained
        if run.stop.signum is not None and run.queued is None:
            raise stop_at_boundary(run, run.stop.signum, metrics)
    return last_eval


@dataclass
class QueuedStep:
    """The next step, already sent to the learner behind this one's training (trainer.mode overlap):
    its rows, their batches and prepare-phase metrics, and its train calls."""

    table: pa.Table
    batches: dict
    metrics: dict[str, float]
    training: dict[str, list]


def update(run, queue_next: bool = True) -> tuple[dict[str, float], pa.Table, np.ndarray]:
    """One policy update: sample -> prepare -> train -> sync. Returns the step's metrics, its rows
    and each of their tokens' staleness (policy versions behind the learner). `queue_next` False:
    the next step is not queued behind this one (see `may_queue_next`)."""
    ctx, version = run.ctx, run.ctx.policy_version + 1
    ctx.reset_timings()
    start, tokens_before = time.perf_counter(), ctx.tokens_generated
    queued, run.queued = run.queued, None
    # sample: this step's rows (under overlap and async, sampled while earlier steps trained)
    run.learner_group.step = run.step + 1  # the step a learner rank's death is reported in
    table = queued.table if queued is not None else run.rollouts.take()
    lag = ctx.policy_version - np.asarray(table.column("policy_version").to_pylist())  # versions behind the learner
    versions = response_token_versions(table)  # each response token's policy version
    staleness = ctx.policy_version - np.asarray(list(chain.from_iterable(versions)), dtype=int)
    # prepare: a batch per trained policy; None from the algorithm: no update for it this step
    batches, metrics = (queued.batches, queued.metrics) if queued is not None else prepare(run, table)
    if not batches and isinstance(run.rollouts, AsyncRollouts):
        raise RunFailed(
            f"algorithm '{run.cfg.algorithm.name}' skipped the update of step {run.step + 1} (prepare gave no "
            "batch): trainer.mode=async counts its staleness bound in policy versions, one per step; use sync"
        )
    if batches:
        # train: every rank, not awaited (a ReST round first goes back to the initial policy)
        if queued is not None:
            training = queued.training
        else:
            if isinstance(run.algorithm, RestartsPolicy) and run.algorithm.restarts_policy(table):
                with ctx.timed("restart"):
                    run.learner_group.restart(run.policy_dir)
            training = run.learner_group.train(batches, version, run.weights, run.step + 1)
        # sync: sent with the step where the strategy allows (the workers' loads wait on the
        # learner, not on us); under overlap and async, once trained (rows are sampled meanwhile),
        # or under overlap before the next step's training, queued behind this one's
        prefetched = run.rollouts.prefetch(run.step)
        sent_early = (not prefetched or (queue_next and may_queue_next(run))) and run.weights.sends_with_step
        if sent_early:
            run.sync_weights(version, training)
        if sent_early and prefetched:
            run.queued = queue_next_step(run, version + 1)
        with ctx.timed("train"):
            metrics |= run.learner_group.wait(training)
        if not sent_early:
            run.sync_weights(version, training)
    run.step += 1
    metrics |= step_metrics(run, table, lag, time.perf_counter() - start, ctx.tokens_generated - tokens_before)
    metrics["perf/next_step_queued"] = float(run.queued is not None)
    if "episode/correct" in metrics:  # an episode is right by its final answer, whatever its turns' rewards
        metrics["accuracy/train"] = metrics["episode/correct"]
    per_token = "token_versions" in table.column_names  # rollout.inflight_update resume | continue
    metrics |= staleness_metrics(staleness) | (mixed_version_rows(versions) if per_token else {})
    metrics |= run.rollouts.metrics()
    return metrics, table, staleness


def prepare(run, table: pa.Table) -> tuple[dict, dict[str, float]]:
    """The step's batch per trained policy (those the algorithm gives None left out) and the
    prepare-phase metrics: the algorithm's, the reward source's, multi-turn episodes'."""
    with run.ctx.timed("prepare"):
        batches = {name: run.algorithm.prepare(rows) for name, rows in run.rows_per_policy(table).items()}
        batches = {name: b for name, b in batches.items() if b is not None}
        metrics = run.algorithm.prepare_metrics(table) if isinstance(run.algorithm, ReportsPrepareMetrics) else {}
        metrics |= run.reward_metrics()
        if run.ctx.episodes is not None:  # multi-turn rows: their episode/* and tools/* rates
            metrics |= episode_metrics(table)
    return batches, metrics


def may_queue_next(run) -> bool:
    """Whether the next step's training may be queued behind this one's (its rows are prefetched):
    the learner would then be past this step's weights at its boundary, so not where the boundary
    reads them from the learner (a checkpoint, an attached evaluation due, a stop asked for) or the
    next step restarts the policy, and not under async (its producer owns the rows)."""
    every, step = run.cfg.trainer.checkpoint_every, run.step + 1
    return not (
        isinstance(run.rollouts, AsyncRollouts)
        or isinstance(run.algorithm, RestartsPolicy)
        or (every and step % every == 0)
        or (run.attached is not None and run.attached.due(step))
        or run.stop.signum is not None
    )


def queue_next_step(run, version: int) -> QueuedStep:
    """The next step's prefetched rows, prepared and sent to the learner now: it starts them as
    soon as this step's training ends, with no wait on the controller in between (no train call
    when the algorithm gives no batch: the next step then makes no update, as it would anyway)."""
    table = run.rollouts.take()
    batches, metrics = prepare(run, table)
    training = run.learner_group.train(batches, version, run.weights, run.step + 2) if batches else {}
    run.learner_group.step = run.step + 1  # a rank's death while this step trains is still this step's
    return QueuedStep(table, batches, metrics, training)


def staleness_metrics(staleness: np.ndarray) -> dict[str, float]:
    """`staleness/mean` and `staleness/max` of the step's response tokens, in policy versions
    behind the learner (each token's own version where the rows record one, else its row's)."""
    if not len(staleness):
        return {"staleness/mean": 0.0, "staleness/max": 0.0}
    return {"staleness/mean": float(staleness.mean()), "staleness/max": float(staleness.max())}


def mixed_version_rows(versions: list[list[int]]) -> dict[str, float]:
    """`staleness/mixed_rows`: the share of the step's rows whose tokens (`versions`: each row's
    tokens' policy versions) more than one policy version sampled."""
    if not versions:
        return {}
    return {"staleness/mixed_rows": float(np.mean([len(set(v)) > 1 for v in versions]))}


def step_metrics(run, table, lag: np.ndarray, seconds: float, generated: int) -> dict[str, float]:
    """What every step logs of its rows, its phases and its speed."""
    ctx = run.ctx
    rewards = np.asarray(table.column("reward").to_pylist())
    lengths = [len(x) for x in table.column("response_ids").to_pylist()]
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "response_length": float(np.mean(lengths)),
        "response_length/max": float(max(lengths)),
        "policy_lag": float(lag.mean()) if len(lag) else 0.0,
        "samples": float(table.num_rows),
        "policy_version": float(ctx.policy_version),
        "workers/restarted": float(ctx.restarted_workers),  # rollout workers Ray recreated (a crash, a lost node)
    }
    if run.cfg.reward.source == "rule":  # a rule reward >= 1 is a correct answer; model and judge scores are not
        metrics["accuracy/train"] = float((rewards >= 1.0).mean())
    timings = ctx.timings_snapshot()  # under async the producer's thread adds to them meanwhile
    metrics |= {f"time/{phase}": s for phase, s in timings.items()}
    metrics["time/step"] = seconds
    metrics["perf/tokens_per_s"] = generated / max(timings.get("generate", 0.0), 1e-9)
    metrics["perf/samples_per_s"] = table.num_rows / seconds
    return metrics
