"""The methods on a reasoning task with steps (configs/reasoning.yaml: long multiplication worked
out line by line): every method from the same warmed-up policy, at an equal budget of training
samples (the rows a step trains on), over seeds, with the wall time of training recorded; held-out
greedy accuracy and pass@k (k samples at the rollout temperature) against samples and against
wall-clock. Prints one table (markdown, also written to OUT/reasoning.md) and writes the curves to
OUT/reasoning.jsonl and, where matplotlib is installed, OUT/reasoning.png.

    .venv/bin/python benchmarks/reasoning.py                         # grpo rloo ppo vineppo, seeds 0 1 2
    .venv/bin/python benchmarks/reasoning.py --methods grpo vineppo --seeds 0 --samples 3200 \\
        --set vineppo:algorithm.mc_rollouts=4 --warm runs/reasoning/policy_init --out /tmp/reasoning

Arguments with `=` override the config for every method; `--set METHOD:key=value` for one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.cluster import init_ray  # noqa: E402  (before anything imports ray)

METHODS = ("grpo", "rloo", "ppo", "vineppo")


def evaluate(controller, pass_k: int) -> dict[str, float]:
    """Held-out greedy accuracy and, at the rollout temperature, pass@1..pass@k."""
    sampled = controller.evaluate(greedy=False, samples=pass_k)
    return {"greedy": controller.evaluate(greedy=True)["accuracy"], "pass@1": sampled["accuracy"]} | {
        k: v for k, v in sampled.items() if k.startswith("pass@")
    }


def warm_policy(config: str, overrides: list[str], out: Path) -> tuple[Path, float]:
    """The warmed-up policy every method starts from (made once), and the seconds it took."""
    from rlsys.config import load_config
    from rlsys.run.controller import Controller

    cfg = load_config(config, [*overrides, f"run.output_dir={out}", "run.name=warm"])
    start = time.perf_counter()
    policy_dir = Controller(cfg, out / "warm", progress=False).prepare_policy()
    return policy_dir, time.perf_counter() - start


def teacher_from_warm(config: str, overrides: list[str], warm_dir: Path, out: Path, steps: int) -> Path:
    """OPD's teacher (--methods opd): the warm policy given `steps` more warm-up steps on the correct
    worked solutions only (the warm-up's quarter of flawed ones left out), saved once to OUT/teacher."""
    import torch

    from algorithms.sft import warmup
    from rlsys.config import load_config
    from rlsys.models import load_model, save_model_dir
    from rlsys.run.controller import Controller

    target = out / "teacher"
    if (target / "config.json").exists():
        return target
    cfg = load_config(config, [*overrides, f"run.output_dir={out}", "run.name=teacher-data"])
    shutil.rmtree(out / "teacher-data", ignore_errors=True)
    shutil.copytree(warm_dir, out / "teacher-data" / "policy_init")
    c = Controller(cfg, out / "teacher-data", progress=False)
    c.prepare_policy()  # the task and the tokenizer, as every method's run has them
    model = load_model(warm_dir)
    torch.set_num_threads(2)
    warmup(model, c.tokenizer, c.task, c.task.rows("train"), steps, cfg.sft.batch_size, cfg.sft.lr, cfg.run.seed + 1)
    save_model_dir(model, c.tokenizer, target)
    return target


def start_method(config, overrides, method, seed, warm_dir, out):
    """A Controller of `method` and `seed` with its actors started from a copy of the warm policy
    (OUT/METHOD-sSEED/policy_init, which prepare_policy reuses: every method starts the same).
    `method`: an algorithm's name, or a variant's label (its algorithm.name is in `overrides`,
    after this one, so it wins)."""
    from rlsys.config import load_config
    from rlsys.run.controller import Controller

    name = f"{method}-s{seed}"
    cfg = load_config(
        config,
        [f"algorithm.name={method}", *overrides, f"run.seed={seed}", f"run.output_dir={out}", f"run.name={name}"],
    )
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(warm_dir, run_dir / "policy_init")
    c = Controller(cfg, run_dir, progress=False)
    c.start_actors(c.prepare_policy())
    return c


def run_method(config, overrides, method, seed, warm_dir, out, budget, eval_every, pass_k) -> list[dict]:
    """One method and seed from the warm policy until `budget` training samples; the curve of
    held-out evaluations every `eval_every` samples (and at 0 and at the end)."""
    name = f"{method}-s{seed}"
    c = start_method(config, overrides, method, seed, warm_dir, out)
    point = lambda samples, wall, steps, extra: {  # noqa: E731
        "method": method,
        "seed": seed,
        "samples": samples,
        "wall_s": wall,
        "steps": steps,
        **extra,
        **evaluate(c, pass_k),
    }
    curve, samples, wall, steps, next_eval = [point(0, 0.0, 0, {})], 0, 0.0, 0, eval_every
    lengths = []
    try:
        while samples < budget:
            start = time.perf_counter()
            metrics = c.train_step()
            wall += time.perf_counter() - start
            samples, steps = samples + int(metrics["samples"]), steps + 1
            lengths.append(metrics["response_length"])
            if samples >= next_eval or samples >= budget:
                extra = {"response_length": float(np.mean(lengths)), "train_reward": metrics["reward/mean"]}
                extra |= {k: v for k, v in metrics.items() if k.startswith("vineppo/")}
                curve.append(point(samples, wall, steps, extra))
                lengths, next_eval = [], next_eval + eval_every
                print(f"  {name}: {samples} samples, {wall:.0f} s, greedy {curve[-1]['greedy']:.3f}", flush=True)
    finally:
        c.shutdown()
    return curve


def read_curves(paths: list[Path]) -> dict[tuple[str, int], list[dict]]:
    """(method, seed) -> its evaluations, in order, from reasoning.jsonl files."""
    curves: dict[tuple[str, int], list[dict]] = {}
    for path in paths:
        read: dict[tuple[str, int], list[dict]] = {}
        for line in path.read_text().splitlines():
            point = json.loads(line)
            read.setdefault((point["method"], point["seed"]), []).append(point)
        if twice := sorted(set(read) & set(curves)):
            raise ValueError(f"{path}: {twice[0][0]} seed {twice[0][1]} is in an earlier curves file too")
        curves |= read
    return curves


def at_wall_time(curve: list[dict], seconds: float) -> dict:
    """The last evaluation at or before `seconds` of training."""
    return [p for p in curve if p["wall_s"] <= seconds + 1e-9][-1]


def table(curves: dict[tuple[str, int], list[dict]], pass_k: int) -> str:
    """Method x {held-out greedy accuracy and pass@k at the equal sample budget, greedy accuracy at
    the equal wall time (the fastest method's), wall time, seeds}, means over seeds (min-max)."""
    methods = list(dict.fromkeys(m for m, _ in curves))
    fastest = min(
        float(np.mean([c[-1]["wall_s"] for (m, _), c in curves.items() if m == method])) for method in methods
    )
    spread = lambda xs: f"{np.mean(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"  # noqa: E731
    lines = [
        f"| method | start greedy | greedy at equal samples | pass@{pass_k} at equal samples "
        f"| greedy at {fastest:.0f} s | train reward (last) | response tokens (last) | training wall s | seeds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method in methods:
        runs = [c for (m, _), c in curves.items() if m == method]
        lines.append(
            f"| {method} | {spread([c[0]['greedy'] for c in runs])} | {spread([c[-1]['greedy'] for c in runs])} "
            f"| {spread([c[-1][f'pass@{pass_k}'] for c in runs])} "
            f"| {spread([at_wall_time(c, fastest)['greedy'] for c in runs])} "
            f"| {np.mean([c[-1]['train_reward'] for c in runs]):.3f} "
            f"| {np.mean([c[-1]['response_length'] for c in runs]):.1f} "
            f"| {np.mean([c[-1]['wall_s'] for c in runs]):.0f} | {len(runs)} |"
        )
    return "\n".join(lines)


def plot(curves: dict[tuple[str, int], list[dict]], path: Path, pass_k: int) -> bool:
    """Greedy accuracy and pass@k against samples and against wall-clock, and the training reward
    and response length against samples (each the mean since the evaluation before), a line per
    method (the mean over seeds at each evaluation). False where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    axes = axes.ravel()
    for method in dict.fromkeys(m for m, _ in curves):
        runs = [c for (m, _), c in curves.items() if m == method]
        n = min(len(c) for c in runs)
        mean = lambda key, first=0: np.mean([[p[key] for p in c[first:n]] for c in runs], axis=0)  # noqa: E731
        axes[0].plot(mean("samples"), mean("greedy"), marker="o", label=method)
        axes[1].plot(mean("wall_s"), mean("greedy"), marker="o", label=method)
        axes[2].plot(mean("samples"), mean(f"pass@{pass_k}"), marker="o", label=method)
        axes[3].plot(mean("samples", 1), mean("train_reward", 1), marker="o", label=method)  # none before training
        axes[4].plot(mean("samples", 1), mean("response_length", 1), marker="o", label=method)
    axes[5].axis("off")
    for ax, (x, y) in zip(
        axes,
        [
            ("training samples", "held-out greedy accuracy"),
            ("training wall s", "held-out greedy accuracy"),
            ("training samples", f"held-out pass@{pass_k}"),
            ("training samples", "training reward"),
            ("training samples", "response tokens"),
        ],
    ):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/reasoning.yaml")
    p.add_argument("--methods", nargs="*", default=list(METHODS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--samples", type=int, default=12800, help="training samples per run (rows trained on)")
    p.add_argument("--eval-every", type=int, default=3200, help="training samples between held-out evaluations")
    p.add_argument("--pass-k", type=int, default=8, help="samples per held-out prompt for pass@k (a power of 2)")
    p.add_argument("--set", action="append", default=[], metavar="METHOD:KEY=VALUE", help="an override for one method")
    p.add_argument(
        "--variant",
        nargs=2,
        action="append",
        default=[],
        metavar=("LABEL", "ALGORITHM"),
        help="one more method: ALGORITHM under the name LABEL, with its own --set LABEL:KEY=VALUE overrides "
        "(e.g. --variant grpo+cosine grpo --set 'grpo+cosine:task.shaping=[{cosine_length: {max_length: 128}}]')",
    )
    p.add_argument(
        "--teacher-steps",
        type=int,
        default=1000,
        help="opd's teacher (unless --set opd:algorithm.teacher.path=DIR): the warm policy after this many more "
        "warm-up steps on correct solutions only",
    )
    p.add_argument("--out", type=Path, default=Path("runs/bench-reasoning"))
    p.add_argument(
        "--warm", type=Path, help="a warmed-up policy dir to start from (a run's policy_init); default: warm up"
    )
    p.add_argument(
        "--with-curves",
        type=Path,
        action="append",
        default=[],
        help="a reasoning.jsonl of earlier runs (other seeds) to put in the table and plot beside these "
        "(repeat for several; a method and seed run again here replaces its earlier curve)",
    )
    args, overrides = p.parse_known_args(argv)
    per_method = {label: [f"algorithm.name={algorithm}"] for label, algorithm in args.variant}
    args.methods += [label for label, _ in args.variant]
    for item in args.set:
        method, override = item.split(":", 1)
        per_method.setdefault(method, []).append(override)
    args.out.mkdir(parents=True, exist_ok=True)
    init_ray()
    if args.warm:
        warm_dir = args.warm
        print(f"warm-up: {warm_dir} (made before)", flush=True)
    else:
        warm_dir, warm_s = warm_policy(args.config, overrides, args.out)
        print(f"warm-up: {warm_s:.0f} s ({args.config} {' '.join(overrides)})", flush=True)
    if "opd" in args.methods and not any(o.startswith("algorithm.teacher.path=") for o in per_method.get("opd", [])):
        start = time.perf_counter()
        teacher = teacher_from_warm(args.config, overrides, warm_dir, args.out, args.teacher_steps)
        per_method.setdefault("opd", []).append(f"algorithm.teacher.path={teacher}")
        judge = start_method(args.config, overrides, "grpo", 0, teacher, args.out / "teacher-eval")
        try:
            accuracy = judge.evaluate(greedy=True)["accuracy"]
        finally:
            judge.shutdown()
        print(f"teacher: {teacher} ({time.perf_counter() - start:.0f} s), held-out greedy {accuracy:.3f}", flush=True)
    rerun = {(method, seed) for method in args.methods for seed in args.seeds}
    curves = {key: curve for key, curve in read_curves(args.with_curves).items() if key not in rerun}
    with (args.out / "reasoning.jsonl").open("w") as log:
        log.write("".join(json.dumps(point) + "\n" for curve in curves.values() for point in curve))
        for method in args.methods:
            for seed in args.seeds:
                curve = run_method(
                    args.config,
                    [*overrides, *per_method.get(method, [])],
                    method,
                    seed,
                    warm_dir,
                    args.out,
                    args.samples,
                    args.eval_every,
                    args.pass_k,
                )
                curves[(method, seed)] = curve
                log.write("".join(json.dumps(point) + "\n" for point in curve))
                log.flush()
    text = table(curves, args.pass_k)
    (args.out / "reasoning.md").write_text(text + "\n")
    print(text)
    drawn = plot(curves, args.out / "reasoning.png", args.pass_k)
    print(f"curves: {args.out / 'reasoning.jsonl'}" + (f", plot: {args.out / 'reasoning.png'}" if drawn else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
