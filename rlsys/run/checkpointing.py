"""A run's checkpoints: everything a resumed run needs to go on bit-identically, written atomically."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import ray

from rlsys import checkpoint
from rlsys.config import dump_config
from rlsys.contract import Stateful, algorithm_state


def save(run, metrics: dict | None = None) -> Path:
    """Learner (DeepSpeed: model, optimizer, scheduler on every rank), buffer, data cursor, RNG
    states, algorithm state, step/version, config and an HF export; atomically. `metrics`: the
    step's row, logged after the checkpoint; kept in it so a run killed in between gets the row
    back on resume. `run`: the Controller."""
    run.rollouts.pause()  # async: no batch in flight, so rows, cursor and RNG are saved together
    try:
        return _save(run, metrics)
    finally:
        run.rollouts.unpause()


def _save(run, metrics: dict | None) -> Path:
    ctx = run.ctx
    ctx.settle_sync()  # a checkpoint is written only after its weights reached the workers
    root = run.run_dir / "checkpoints"
    tmp = checkpoint.staging_dir(root, run.step)
    for name, p in run.policies.items():  # the run's policy in learner/ and hf/, the others beside it
        ray.get([l.save.remote(str(tmp / policy_subdir("learner", name, ctx.main_policy))) for l in p.learners])
        ray.get([l.export_hf.remote(str(tmp / policy_subdir("hf", name, ctx.main_policy))) for l in p.learners])
    run.rollouts.call(run.buffer.save.remote(str(tmp / "buffer.parquet")))
    if ctx.reference_version is not None:  # a moved KL anchor (BRiTE's theta_t)
        ray.get(run.reference.save.remote(str(tmp / "reference")))
    state = {
        "step": run.step,
        "policy_version": ctx.policy_version,
        "reference_version": ctx.reference_version,
        "data_cursor": run.stream.state(),
        "controller_rng": ctx.rng.bit_generator.state,
        "buffer_rng": ray.get(run.buffer.rng_state.remote()),
        "reward": ray.get(run.reward.state.remote()),  # a sampling judge's seed counter
        "algorithm": algorithm_state(run.algorithm),
        "evaluators": run.attached.specs() if run.attached else [],
        "metrics": {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float, np.number))},
    }
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    (tmp / "config.yaml").write_text(dump_config(run.cfg))
    return checkpoint.commit(root, tmp, run.step, run.cfg.trainer.keep_checkpoints)


def restore(run) -> tuple[Path, dict]:
    """Load the newest readable checkpoint into the run's actors and its own state; say so in
    one line for each one skipped. Returns the checkpoint and its state."""
    tried = checkpoint.candidates(run.run_dir / "checkpoints")
    if not tried:
        raise checkpoint.CheckpointError(f"no checkpoint to resume from in {run.run_dir / 'checkpoints'}")
    main = run.ctx.main_policy
    for i, path in enumerate(tried):
        try:
            checkpoint.verify(path)
            state = json.loads((path / "state.json").read_text())
            ray.get(
                [
                    l.load.remote(str(path / policy_subdir("learner", name, main)))
                    for name, p in run.policies.items()
                    for l in p.learners
                ]
            )
            ray.get(run.buffer.load.remote(str(path / "buffer.parquet")))
            anchor = run.policy_dir if state.get("reference_version") is None else path / "reference"
            if run.reference is not None:
                ray.get(run.reference.load_weights.remote(None, str(anchor)))
            elif state.get("reference_version") is not None:  # None: the learner's base is the reference
                raise checkpoint.CheckpointError("it holds a moved reference, but this run has no reference worker")
        except Exception as e:  # any unreadable part: report it and try the previous one
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            nxt = f"falling back to {tried[i + 1].name}" if i + 1 < len(tried) else "no older checkpoint left"
            print(f"rlsys: checkpoint {path.name} is unreadable ({reason[:200]}); {nxt}", file=sys.stderr)
            continue
        run.step = state["step"]
        run.ctx.reference_version = state.get("reference_version")
        run.stream.load_state(state["data_cursor"])
        run.ctx.rng.bit_generator.state = state["controller_rng"]
        ray.get(run.buffer.set_rng_state.remote(state["buffer_rng"]))
        ray.get(run.reward.load_state.remote(state.get("reward", {})))
        try:  # overlap, async: the rows made ahead were saved with it
            run.rollouts.restored(run.step, ray.get(run.buffer.stats.remote()))
        except checkpoint.CheckpointError as e:
            raise checkpoint.CheckpointError(f"checkpoint {path.name}: {e}") from None
        if isinstance(run.algorithm, Stateful):
            run.algorithm.load_state(state["algorithm"])
        run.sync_weights(state["policy_version"])
        return path, state
    raise checkpoint.CheckpointError(f"no readable checkpoint in {run.run_dir / 'checkpoints'}")


def policy_subdir(kind: str, policy: str, main_policy: str) -> str:
    """A checkpoint's directory of one policy's `kind` (learner, hf): `kind` for the run's
    policy, `kind-<name>` for a further one."""
    return kind if policy == main_policy else f"{kind}-{policy}"
