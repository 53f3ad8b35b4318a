"""Synchronous vs overlapped vs asynchronous training, side by side in one command: GRPO on the
reasoning task (configs/reasoning.yaml: responses of ~40-128 tokens whose lengths vary within and
across batches) with 2 rollout workers and 1 learner, from the same warmed-up policy, each mode for
the same number of steps (equal samples) and seeds, interleaved mode by mode within a seed so the
machine's drift hits all of them. Prints one markdown table (also OUT/async.md; the rows in
OUT/async.jsonl): training samples/s and its ratio to sync, held-out greedy accuracy after the
steps, the rows' staleness and the batches dropped, and the CPU time the machine spent (busy cores,
CPU ms a sample); under the table, the work ceiling: the samples/s that the least CPU time a
sample of any mode allows on this machine's cores, against the best sync mode.

    .venv/bin/python benchmarks/async.py   # sync (1-, 2-thread, 2-rank learner), overlap, async k = 1 2 4, ...
    .venv/bin/python benchmarks/async.py --steps 6 --seeds 0 --warm runs/reasoning/policy_init
    .venv/bin/python benchmarks/async.py --long-tail     # 2x1 ... 4x4 digits: responses of ~45-350 tokens

Arguments with `=` override the config for every mode.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlsys.cluster import init_ray  # noqa: E402  (before anything imports ray)

MODES = {
    "sync": ["trainer.mode=sync"],
    # sync's learner alone on the machine while it trains: both cores to it, as a sync user would set
    "sync, 2-thread learner": ["trainer.mode=sync", "learner.threads=2"],
    # or a learner rank per core, the faster of the two on this CPU (docs/benchmarks.md)
    "sync, learner ranks": ["trainer.mode=sync", "learner.num_ranks=2", "learner.threads=1"],
    "overlap": ["trainer.mode=overlap", "buffer.max_staleness=1"],
    "async k=1": ["trainer.mode=async", "buffer.max_staleness=1"],
    "async k=2": ["trainer.mode=async", "buffer.max_staleness=2"],
    "async k=4": ["trainer.mode=async", "buffer.max_staleness=4"],
    "async k=2, partial": ["trainer.mode=async", "buffer.max_staleness=2", "rollout.inflight_update=resume"]
    + ["rollout.inflight_chunk_tokens=32"],
    "async k=2, continue": ["trainer.mode=async", "buffer.max_staleness=2", "rollout.inflight_update=continue"],
    "async k=2, learner ranks": ["trainer.mode=async", "buffer.max_staleness=2", "learner.num_ranks=2"]
    + ["learner.threads=1"],
}


PHASES = ("generate", "reward", "reference", "train", "sync")
# --long-tail: the shapes of the problems (digits of each factor) and their shares: most answers
# short, a few several times longer (worked solutions of ~45, 95, 130, 200, 245 and 340 tokens)
LONG_TAIL_MIX = {(2, 1): 0.15, (2, 2): 0.55, (3, 2): 0.15, (3, 3): 0.08, (4, 3): 0.04, (4, 4): 0.03}


def long_tail_data(out: Path) -> list[str]:
    """The long-tail problems written to OUT/data, and the overrides that train on them (longer
    responses allowed; a shorter warm-up, its rows being longer; the learner and the reference in
    packed micro-batches, which a tail would otherwise pad to its longest row)."""
    from envs.datasets import write_rows
    from envs.long_multiplication import generate

    paths = {}
    for split, rows in generate(4000, 200, mix=LONG_TAIL_MIX).items():
        paths[split] = write_rows(rows, out / "data" / f"multiplication_{split}.jsonl")
    return [f"task.train_path={paths['train']}", f"task.eval_path={paths['eval']}"] + [
        "rollout.max_new_tokens=512",
        "model.max_position_embeddings=640",
        "sft.steps=600",
        "learner.max_tokens_per_microbatch=4096",
    ]


def reasoning_bench():
    """benchmarks/reasoning.py as a module: its warm-up and its start of a run from the warm policy."""
    spec = importlib.util.spec_from_file_location("reasoning_bench", ROOT / "benchmarks" / "reasoning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_seconds() -> float:
    """CPU time (user + system) used so far by this process and every process under it: the driver
    and the local Ray cluster it started (raylet, GCS, the actors' workers). A process that ends
    between two readings drops out of the second (its time is then not counted)."""
    import psutil

    me, total = psutil.Process(), 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def run_mode(bench, config, overrides, mode, seed, warm_dir, out, steps) -> dict:
    """`steps` training steps of one mode and seed; their wall time (the first rollout included:
    a pipeline's fill is part of its cost) and the CPU time the machine's processes spent in them,
    then the held-out greedy accuracy."""
    settings = [*overrides, *MODES[mode], f"trainer.steps={steps}", "trainer.eval_every=0", "rollout.num_workers=2"]
    c = bench.start_method(config, settings, "grpo", seed, warm_dir, out / "".join(ch for ch in mode if ch.isalnum()))
    rows = []
    try:
        start, cpu_start = time.perf_counter(), cpu_seconds()
        for _ in range(steps):
            rows.append(c.train_step())
        wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
        accuracy = c.evaluate(greedy=True)["accuracy"]
    finally:
        c.shutdown()
    samples = sum(r["samples"] for r in rows)
    return {
        "mode": mode,
        "seed": seed,
        "steps": steps,
        "samples": samples,
        "wall_s": wall,
        "samples_per_s": samples / wall,
        "cpu_s": cpu,
        "busy_cores": cpu / wall,  # the cores' time the run kept busy, averaged over its wall time
        "heldout_greedy": accuracy,
        "train_reward_last_half": float(np.mean([r["reward/mean"] for r in rows[steps // 2 :]])),
        "response_length": float(np.mean([r["response_length"] for r in rows])),
        "response_length_max": float(max(r["response_length/max"] for r in rows)),
        "staleness_mean": float(np.mean([r["staleness/mean"] for r in rows])),
        "staleness_max": float(max(r["staleness/max"] for r in rows)),
        "dropped_batches": float(rows[-1].get("staleness/dropped_batches", 0.0)),
        "mixed_rows": float(np.mean([r.get("staleness/mixed_rows", 0.0) for r in rows])),
        "learner_wait_s": float(sum(r.get("time/rollout_wait", 0.0) for r in rows)),
        # seconds a step, per phase (under overlap and async the rollout phases run beside training)
        **{f"{phase}_s": float(np.mean([r.get(f"time/{phase}", 0.0) for r in rows])) for phase in PHASES},
    }


def work_ceiling(results: list[dict], cores: int) -> str:
    """What any schedule could make of the work: the least CPU time a sample of any mode took
    (the machine's processes' user + system time over the run's samples) bounds the samples/s of
    `cores` cores kept busy with nothing but that work; against the best sync mode's samples/s."""
    modes = {r["mode"] for r in results}
    per_sample = {m: np.mean([r["cpu_s"] / r["samples"] for r in results if r["mode"] == m]) for m in modes}
    speed = {m: np.mean([r["samples_per_s"] for r in results if r["mode"] == m]) for m in modes}
    least = min(per_sample, key=per_sample.get)
    ceiling = cores / per_sample[least]
    synced = [m for m in modes if m.startswith("sync")]
    line = (
        f"Work ceiling: the least CPU time a sample took is {per_sample[least] * 1e3:.1f} ms ({least}); "
        f"{cores} cores busy with nothing else make at most {ceiling:.1f} samples/s of that work"
    )
    if synced:
        best = max(synced, key=speed.get)
        line += f", {ceiling / speed[best]:.2f}x the best sync ({best}, {speed[best]:.1f})"
    return line + "."


def table(results: list[dict]) -> str:
    """One row per mode: means over seeds (and the range of samples/s)."""
    synced = [r["samples_per_s"] for r in results if r["mode"] == "sync"]
    sync = np.mean(synced) if synced else None  # the ratios' base, when this run has sync
    lines = [
        "| mode | samples/s (range) | vs sync | held-out greedy | train reward (2nd half) "
        "| response tokens mean / max | staleness mean / max | rows of 2+ versions | batches dropped "
        "| s a step: generate / train | busy cores | CPU ms / sample | wall s | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        rs = [r for r in results if r["mode"] == mode]
        if not rs:
            continue
        speed = [r["samples_per_s"] for r in rs]
        mean = lambda key: float(np.mean([r[key] for r in rs]))  # noqa: E731
        longest = max(r["response_length_max"] for r in rs)
        lines.append(
            f"| {mode} | {np.mean(speed):.1f} ({min(speed):.1f}-{max(speed):.1f}) "
            f"| {f'{np.mean(speed) / sync:.2f}x' if sync else '-'} "
            f"| {mean('heldout_greedy'):.3f} | {mean('train_reward_last_half'):.3f} "
            f"| {mean('response_length'):.0f} / {longest:.0f} "
            f"| {mean('staleness_mean'):.2f} / {max(r['staleness_max'] for r in rs):.0f} | {mean('mixed_rows'):.2f} "
            f"| {sum(r['dropped_batches'] for r in rs):.0f} | {mean('generate_s'):.2f} / {mean('train_s'):.2f} "
            f"| {mean('busy_cores'):.2f} | {1e3 * mean('cpu_s') / mean('samples'):.1f} "
            f"| {mean('wall_s'):.0f} | {len(rs)} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/reasoning.yaml")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), metavar="MODE")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=16, help="training steps per run (equal samples for every mode)")
    p.add_argument("--out", type=Path, default=Path("runs/bench-async"))
    p.add_argument("--warm", type=Path, help="a warmed-up policy dir to start from (a run's policy_init)")
    p.add_argument("--long-tail", action="store_true", help="problems of 2x1 to 4x4 digits (LONG_TAIL_MIX)")
    args, overrides = p.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.long_tail:
        overrides = [*long_tail_data(args.out), *overrides]
    init_ray(num_cpus=4)  # logical: 2 workers and 2 learner ranks beside the reference
    bench = reasoning_bench()
    warm_dir = args.warm or bench.warm_policy(args.config, overrides, args.out)[0]
    results = []
    with (args.out / "async.jsonl").open("w") as log:
        for seed in args.seeds:
            for mode in args.modes:
                r = run_mode(bench, args.config, overrides, mode, seed, warm_dir, args.out, args.steps)
                results.append(r)
                log.write(json.dumps(r) + "\n")
                log.flush()
                speed, greedy = r["samples_per_s"], r["heldout_greedy"]
                print(f"  {mode} s{seed}: {speed:.1f} samples/s, greedy {greedy:.3f}", flush=True)
    text = table(results) + "\n\n" + work_ceiling(results, os.cpu_count())
    (args.out / "async.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
