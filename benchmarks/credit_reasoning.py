"""Credit assignment on the reasoning task (configs/reasoning.yaml): PPO's trained critic and
VinePPO's Monte Carlo value estimate (K continuations) against a high-K Monte Carlo ground truth,
per step position (../shared/papers/vineppo.md: the paper's value-prediction diagnostic).

PPO trains from the warmed-up policy (benchmarks/reasoning.py's `start_method`) for `--samples`
training samples. At the start (value head as initialised: zero), at the end (and, with `--evals`
above 2, at evenly spaced points between), on `--prompts` held-out prompts (the eval split, a fixed
subset):

1. one response per prompt from the current policy at the rollout temperature;
2. its value states by VinePPO's own functions (`response_steps`, `value_state_prefixes`): the
   prompt, then the prefix after each step but the last; step position p is the state before step p;
3. per state: the critic, PPO's value head at that state (`ctx.values` of the response: the value
   at response index j is the state after j response tokens, GAE's V_j); the MC estimate, K
   continuations (`VinePPO._mc_returns`, K = vineppo's `algorithm.mc_rollouts`) and
   `mc_value_estimates`; the truth, the same with `--truth-k` continuations and another seed. The
   continuations come from the current policy and are scored by the run's reward (`ctx.score`; cut
   off by the length limit: 0), all with fixed seeds that leave the run's own seed stream alone.

Prints, and writes to OUT/credit_reasoning.md, a table per evaluation point (estimator x step
position: mean absolute error against the truth, MSE in brackets; as a reference the error of the
truth's own mean at each position as a constant estimate; states per position, mean values, the
truth's own standard error); OUT/credit_reasoning.png (MAE against step position); the per-state
values to OUT/credit_reasoning.jsonl; and the wall seconds of each part (`--from JSONL` redraws the
tables and plot of an earlier run).

    .venv/bin/python benchmarks/credit_reasoning.py --warm runs/reasoning/policy_init --out /tmp/credit
    .venv/bin/python benchmarks/credit_reasoning.py --evals 3 ...                            # and a middle point
    .venv/bin/python benchmarks/credit_reasoning.py --samples 256 --prompts 4 --truth-k 16   # a smoke run

Arguments with `=` override the config (for PPO and for the VinePPO estimator's keys).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlsys.cluster import init_ray  # noqa: E402  (before anything imports ray)

ESTIMATORS = ("critic", "mc")


def reasoning_bench():
    """benchmarks/reasoning.py as a module (its warm-up and its method start are shared)."""
    spec = importlib.util.spec_from_file_location("reasoning_bench", ROOT / "benchmarks" / "reasoning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FixedSeeds:
    """The run's context with `next_seed` from a generator of its own: the diagnostic's sampling
    is fixed by `seed`, and the run's seed stream (its training rollouts) is left as it was."""

    def __init__(self, ctx, seed: int):
        self._ctx, self._rng = ctx, np.random.default_rng(seed)

    def next_seed(self) -> int:
        return int(self._rng.integers(0, 2**31 - 1))

    def __getattr__(self, name):
        return getattr(self._ctx, name)


# ---- pure pieces ------------------------------------------------------------------------------
def state_positions(prefixes: list[int]) -> list[tuple[int, int]]:
    """(step position, prefix length) of a response's value states: position p (1-based) is the
    state before step p, the prompt alone being position 1."""
    return [(p, j) for p, j in enumerate(prefixes, start=1)]


def position_errors(records: list[dict], estimators=ESTIMATORS) -> dict[str, dict]:
    """Per estimator, per step position (and "all"): states n, mean absolute error and MSE against
    `truth`, and the estimator's mean, from records with `position`, `truth` and a value per
    estimator. Also "constant", a reference: the truth's own mean at each state's position as the
    estimate (what a critic that knew only the position's mean value would score); and under
    "truth", its mean and mean standard error (`truth_se`) per position."""
    groups: dict = defaultdict(list)
    for r in records:
        groups[r["position"]].append(r)
    means = {k: float(np.mean([r["truth"] for r in g])) for k, g in groups.items()}
    records = [{**r, "constant": means[r["position"]]} for r in records]
    groups = defaultdict(list, {"all": records})
    for r in records:
        groups[r["position"]].append(r)
    keys = sorted((k for k in groups if k != "all"), key=int) + ["all"]
    out: dict[str, dict] = {e: {} for e in (*estimators, "constant", "truth")}
    for k in keys:
        truth = np.array([r["truth"] for r in groups[k]], dtype=np.float64)
        for e in (*estimators, "constant"):
            value = np.array([r[e] for r in groups[k]], dtype=np.float64)
            err = value - truth
            out[e][k] = {
                "n": len(err),
                "mae": float(np.abs(err).mean()),
                "mse": float((err**2).mean()),
                "mean": float(value.mean()),
            }
        se = [r.get("truth_se", float("nan")) for r in groups[k]]
        out["truth"][k] = {"n": len(truth), "mean": float(truth.mean()), "se": float(np.mean(se))}
    return out


def binomial_se(returns: list[float]) -> float:
    """Standard error of the mean of the returns (sample std / sqrt(n); 0 for one return)."""
    r = np.asarray(returns, dtype=np.float64)
    return float(r.std(ddof=1) / np.sqrt(len(r))) if len(r) > 1 else 0.0


def table(errors: dict[str, dict], labels: dict[str, str]) -> str:
    """Markdown: a row per estimator (`labels`: its name in the table) and the constant reference,
    a column per step position and one over all states; cells "MAE (MSE)"; then the states per
    position, the mean value of the truth and of each estimator, and the truth's standard error."""
    keys = list(errors["truth"])
    head = [f"step {k}" if k != "all" else "all states" for k in keys]
    row = lambda name, cells: f"| {name} | " + " | ".join(cells) + " |"  # noqa: E731
    lines = [row("estimator: MAE (MSE) vs truth", head), "|---" + "|---:" * len(keys) + "|"]
    named = {**labels, "constant": "(reference: the truth's mean at the position)"}
    for e, label in named.items():
        lines.append(row(label, [f"{errors[e][k]['mae']:.3f} ({errors[e][k]['mse']:.3f})" for k in keys]))
    truth = errors["truth"]
    lines.append(row("states", [str(truth[k]["n"]) for k in keys]))
    lines.append(row("mean V: truth", [f"{truth[k]['mean']:.3f}" for k in keys]))
    for e, label in labels.items():
        lines.append(row(f"mean V: {label}", [f"{errors[e][k]['mean']:.3f}" for k in keys]))
    lines.append(row("truth: mean s.e.", [f"{truth[k]['se']:.3f}" for k in keys]))
    return "\n".join(lines)


def point_title(samples: int, steps: int) -> str:
    return f"after {samples} samples ({steps} PPO steps)" + (": critic untrained" if steps == 0 else "")


def by_point(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """The records of each evaluation point (its title, its states), in order."""
    points: dict = {}
    for r in records:
        points.setdefault((r["samples"], r["ppo_steps"]), []).append(r)
    return [(point_title(*key), got) for key, got in points.items()]


def report(records: list[dict], header: str, out: Path, wall: dict[str, float] | None = None) -> str:
    """The tables (printed and OUT/credit_reasoning.md) and the plot (OUT/credit_reasoning.png)."""
    labels = {"critic": "PPO critic", "mc": f"MC K={records[0]['k']} (VinePPO)"}
    points = [(title, position_errors(got)) for title, got in by_point(records)]
    sections = [header] + [f"**{title}**\n\n{table(errors, labels)}" for title, errors in points]
    if wall:
        sections.append("wall s: " + ", ".join(f"{name} {s:.0f}" for name, s in wall.items()))
    text = "\n\n".join(sections)
    (out / "credit_reasoning.md").write_text(text + "\n")
    print(text)
    drawn = plot(points, labels, out / "credit_reasoning.png")
    print(f"tables: {out / 'credit_reasoning.md'}" + (f", plot: {out / 'credit_reasoning.png'}" if drawn else ""))
    return text


def plot(points: list[tuple[str, dict]], labels: dict[str, str], path: Path) -> bool:
    """MAE against step position, a line per estimator and one for the constant reference, a panel
    per evaluation point. False where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(points), figsize=(4.5 * len(points), 3.8), sharey=True, squeeze=False)
    for ax, (title, errors) in zip(axes[0], points):
        keys = [k for k in errors["truth"] if k != "all"]
        for e, label in labels.items():
            ax.plot([int(k) for k in keys], [errors[e][k]["mae"] for k in keys], marker="o", label=label)
        ax.plot(
            [int(k) for k in keys],
            [errors["constant"][k]["mae"] for k in keys],
            ls="--",
            color="gray",
            label="reference: the truth's mean at the position",
        )
        for k in keys:
            ax.annotate(
                f"n={errors['truth'][k]['n']}",
                (int(k), 0),
                textcoords="offset points",
                xytext=(0, 4),
                ha="center",
                fontsize=7,
                color="gray",
            )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step position (value state before step p)")
        ax.set_xticks([int(k) for k in keys])
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MAE vs high-K Monte Carlo truth")
    axes[0][0].set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


# ---- one evaluation point -----------------------------------------------------------------------
def held_out_prompts(c, n: int, seed: int) -> list:
    """n prompts of the eval split, a fixed subset (by `seed`), as the run builds them."""
    from rlsys.contract import Prompt
    from rlsys.prompts import prompt_ids

    rows = c.task.rows("eval")
    pick = np.sort(np.random.default_rng(seed).choice(len(rows), size=min(n, len(rows)), replace=False))
    return [Prompt(f"eval-{i}", *prompt_ids(c.task, c.tokenizer, rows[i]), rows[i]) for i in pick]


def measure(c, prompts, vineppo, k: int, truth_k: int, seed: int, timings: dict) -> list[dict]:
    """The value states of one sampled response per prompt, each with the critic's value, the MC
    estimate from `k` continuations and the truth from `truth_k`; seconds of each part added to
    `timings`."""
    from algorithms.vineppo import mc_value_estimates, response_steps, value_state_prefixes
    from rlsys.experience import make_experience, new_uid
    from rlsys.generation import GenerationRequest

    ctx, cfg = c.ctx, vineppo.config
    start = time.perf_counter()
    params = ctx.sampling(n=1, seed=seed)
    gens = ctx.generate([GenerationRequest(list(p.prompt_ids), params) for p in prompts])
    rows = [
        dict(
            uid=new_uid(),
            group=prompts[g.request_index].uid,
            prompt_ids=list(g.prompt_ids),
            response_ids=list(g.response_ids),
            logprobs=g.logprobs,
            reward=0.0,
            policy_version=g.policy_version,
            meta={**prompts[g.request_index].meta, "finish_reason": g.finish_reason},
        )
        for g in gens
        if g.response_ids
    ]
    sampled = make_experience(rows)
    rewards = ctx.score(sampled)
    timings["responses"] += time.perf_counter() - start

    start = time.perf_counter()
    critic = ctx.values(sampled)  # critic[i][j]: V of the state after j response tokens
    timings["critic"] += time.perf_counter() - start

    states = []  # (row index, position, prefix length, key)
    for i, row in enumerate(rows):
        ends = response_steps(ctx.tokenizer, row["response_ids"], cfg.min_step_chars, cfg.max_value_steps)
        for position, j in state_positions(value_state_prefixes(ends)):
            states.append((i, position, j, len(ends), (tuple(row["prompt_ids"]), tuple(row["response_ids"][:j]))))
    state_meta = {key: rows[i]["meta"] for i, *_, key in states}

    estimates = {}
    for name, kk, offset in (("mc", k, 1), ("truth", truth_k, 2)):
        start = time.perf_counter()
        estimator = type(vineppo)(cfg.model_copy(update={"mc_rollouts": kk}))
        estimates[name] = estimator._mc_returns(FixedSeeds(ctx, seed + offset), state_meta)
        timings[name] += time.perf_counter() - start
    mc, truth = (mc_value_estimates(estimates[name]) for name in ("mc", "truth"))
    return [
        {
            "prompt": rows[i]["group"],
            "position": position,
            "prefix_tokens": j,
            "response_tokens": len(rows[i]["response_ids"]),
            "response_steps": steps,
            "response_reward": float(rewards[i]),
            "critic": float(critic[i][j]),
            "mc": mc[key],
            "truth": truth[key],
            "truth_se": binomial_se(estimates["truth"][key]),
        }
        for i, position, j, steps, key in states
    ]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/reasoning.yaml")
    p.add_argument("--samples", type=int, default=3200, help="PPO training samples (rows trained on)")
    p.add_argument("--evals", type=int, default=2, help="evaluation points, evenly spaced from 0 to --samples")
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts per evaluation point")
    p.add_argument("--k", type=int, help="continuations of the MC estimate (default: vineppo's mc_rollouts)")
    p.add_argument("--truth-k", type=int, default=128, help="continuations of the ground truth")
    p.add_argument("--seed", type=int, default=0, help="the PPO run's seed")
    p.add_argument("--diag-seed", type=int, default=12345, help="seed of the diagnostic's prompts and sampling")
    p.add_argument("--out", type=Path, default=Path("runs/bench-credit-reasoning"))
    p.add_argument(
        "--warm", type=Path, help="a warmed-up policy dir to start from (a run's policy_init); default: warm up"
    )
    p.add_argument("--from", dest="from_", type=Path, help="no run: the tables and plot of a credit_reasoning.jsonl")
    args, overrides = p.parse_known_args(argv)
    if args.evals < 2:
        p.error("--evals: at least 2 (the start and the end)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_:
        records = [json.loads(line) for line in args.from_.read_text().splitlines()]
        report(records, f"from {args.from_}", args.out)
        return
    from algorithms.base import build_algorithm
    from rlsys.config import load_config

    bench = reasoning_bench()
    vineppo = build_algorithm(load_config(args.config, [*overrides, "algorithm.name=vineppo"]))
    k = args.k or vineppo.config.mc_rollouts
    init_ray()
    wall: dict[str, float] = defaultdict(float)
    if args.warm:
        warm_dir = args.warm
        print(f"warm-up: {warm_dir} (made before)", flush=True)
    else:
        warm_dir, wall["warm-up"] = bench.warm_policy(args.config, overrides, args.out)
        print(f"warm-up: {wall['warm-up']:.0f} s", flush=True)
    start = time.perf_counter()
    c = bench.start_method(args.config, overrides, "ppo", args.seed, warm_dir, args.out)
    wall["actors start"] = time.perf_counter() - start
    targets = [round(args.samples * i / (args.evals - 1)) for i in range(args.evals)]
    prompts = held_out_prompts(c, args.prompts, args.diag_seed)
    records, samples, steps = [], 0, 0
    try:
        for target in targets:
            while samples < target:
                start = time.perf_counter()
                samples, steps = samples + int(c.train_step()["samples"]), steps + 1
                wall["PPO training"] += time.perf_counter() - start
            got = measure(c, prompts, vineppo, k, args.truth_k, args.diag_seed, wall)
            records += [{"samples": samples, "ppo_steps": steps, "k": k, "truth_k": args.truth_k, **r} for r in got]
            print(f"{point_title(samples, steps)}: {len(got)} states, {sum(wall.values()):.0f} s so far", flush=True)
    finally:
        c.shutdown()
    with (args.out / "credit_reasoning.jsonl").open("w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    header = (
        f"{' '.join([args.config, *overrides])}: PPO (seed {args.seed}) from the warm policy; per point, "
        f"{args.prompts} held-out prompts x 1 response at the rollout temperature, its VinePPO value "
        f"states; truth = MC with K={args.truth_k}; MAE (MSE) against it."
    )
    report(records, header, args.out, wall)
    print(f"values: {args.out / 'credit_reasoning.jsonl'}")


if __name__ == "__main__":
    main(sys.argv[1:])
