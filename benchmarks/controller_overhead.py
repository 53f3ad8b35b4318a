"""The controller's cost per step as rollout workers are added: the same minimal job (a tiny
model, one new token, one prompt per worker) with 1, 2, 4 and 8 rollout workers, in one command,
side by side. Each step is then almost all fixed per-call cost: the controller's fan-out and
fan-in of generate calls, the buffer, the reward and reference calls, the weight sync to every
worker and the learner's step. Prints per worker count the median step time and its phases (after
two warm-up steps) and the growth per added worker (least-squares slope), against 1 worker.

    .venv/bin/python benchmarks/controller_overhead.py             # 10 steps per worker count
    .venv/bin/python benchmarks/controller_overhead.py --steps 20 --workers 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("generate", "reward", "buffer", "train", "sync")
MINIMAL = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "task.num_train=200",
    "task.num_eval=8",
    "task.max_value=9",
    "sft.steps=0",
    "trainer.eval_every=0",
    "rollout.max_new_tokens=1",
    "algorithm.group_size=2",
    "algorithm.kl_coef=0",
]


def measure(workers: int, steps: int, out: Path) -> dict[str, float]:
    """Median step time and phase times of a minimal run with `workers` rollout workers."""
    from rlsys.config import load_config
    from rlsys.run.controller import Controller
    from rlsys.tracking import read_jsonl

    name = f"w{workers}"
    overrides = [*MINIMAL, f"rollout.num_workers={workers}", f"trainer.prompts_per_step={workers}"]
    overrides += [f"trainer.steps={steps}", f"run.output_dir={out}", f"run.name={name}"]
    controller = Controller(load_config(ROOT / "configs" / "quickstart.yaml", overrides), out / name, progress=False)
    controller.run()
    controller.shutdown()
    rows = read_jsonl(out / name / "metrics.jsonl")[2:]  # the first steps warm up the actors
    return {key: statistics.median(r[f"time/{key}"] for r in rows) for key in ("step", *PHASES)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per worker count (the first 2 not counted)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args(argv)
    from rlsys.cluster import init_ray

    init_ray(num_cpus=max(4, max(args.workers)))  # logical CPUs: each worker asks for half of one
    out = Path(tempfile.mkdtemp(prefix="rlsys-overhead-"))
    results = {n: measure(n, args.steps, out) for n in args.workers}
    base = results[args.workers[0]]["step"]
    print("| rollout workers | step ms | vs 1 worker | " + " | ".join(f"{p} ms" for p in PHASES) + " |")
    print("|---|---|---|" + "---|" * len(PHASES))
    for n, r in results.items():
        phases = " | ".join(f"{1e3 * r[p]:.1f}" for p in PHASES)
        print(f"| {n} | {1e3 * r['step']:.1f} | {r['step'] / base:.2f}x | {phases} |")
    slope = np.polyfit(list(results), [r["step"] for r in results.values()], 1)[0]
    print(f"growth per added rollout worker: {1e3 * slope:.1f} ms a step (least squares over {args.workers})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
