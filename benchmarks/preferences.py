"""Vanilla online DPO vs PILAF sampling under the same labelling budget
(../shared/papers/pilaf.md), side by side in one process on the quickstart-style task.

Both runs start from the same warm-started policy (one SFT, copied), get the same prompts
in the same order and the same number of labelled pairs per step (one per prompt: the
budget is pairs sent to the labeller, ties included), and their steps are interleaved so
machine load hits both alike. At each budget point the script measures, on held-out
problems: greedy accuracy, the mean reward of `--samples` responses per prompt at the
rollout temperature, KL(pi || pi_ref) of those responses (Monte Carlo: the mean over
responses of sum_t log pi - log pi_ref, from the sampler's and the reference actor's
logprobs) and the paper's oracle objective J = reward - beta * KL. Then the mean time
per step of each sampler and their ratio (PILAF's interpolated pairs cost a reference
forward pass per token).

    .venv/bin/python benchmarks/preferences.py                       # defaults below
    .venv/bin/python benchmarks/preferences.py --init DIR learner.lr=5e-5   # reuse a warm-up, other lr
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.cluster import init_ray  # noqa: E402  (before anything imports ray)

ROOT = Path(__file__).resolve().parents[1]

# the quickstart task, model and warm-up (800 SFT steps at lr 1e-3: ~0.86 greedy, ~0.67 sampled at T=1);
# DPO at lr 1e-4: the configs' 5e-4 drove both samplers to 0 accuracy within 640 pairs here
DEFAULTS = [
    "sft.steps=800",
    "sft.lr=0.001",
    "sft.demo_error=0",
    "learner.lr=1e-4",
    "task.num_eval=200",
    "trainer.prompts_per_step=32",
    "trainer.eval_every=0",
]


def heldout(controller, samples: int, beta: float) -> dict[str, float]:
    """Greedy accuracy; reward, KL to the reference and J = reward - beta*KL of sampled responses."""
    from rlsys.experience import make_experience, new_uid
    from rlsys.generation import GenerationRequest

    ctx, task = controller.ctx, controller.task
    rows = task.rows("eval")
    prompts = [controller._prompt(f"eval-{i}", row) for i, row in enumerate(rows)]
    greedy = controller.evaluate(greedy=True)["accuracy"]
    params = ctx.sampling(n=samples, seed=4242)
    gens = ctx.generate([GenerationRequest(p.prompt_ids, params) for p in prompts])
    texts = controller.tokenizer.batch_decode([g.response_ids for g in gens], skip_special_tokens=True)
    rewards = np.array([task.reward(prompts[g.request_index].meta, t) for g, t in zip(gens, texts)], dtype=np.float64)
    table = make_experience(
        [
            dict(
                uid=new_uid(),
                group=str(g.request_index),
                prompt_ids=g.prompt_ids,
                response_ids=g.response_ids,
                logprobs=g.logprobs,
                reward=0.0,
                policy_version=g.policy_version,
            )
            for g in gens
        ]
    )
    ref = ctx.ref_logprobs(table)
    kl = float(np.mean([sum(g.logprobs) - sum(r) for g, r in zip(gens, ref)]))
    reward = float(rewards.mean())
    return {
        "greedy_acc": greedy,
        "reward": reward,
        "reward_se": float(rewards.std() / np.sqrt(len(rewards))),
        "kl": kl,
        "J": reward - beta * kl,
    }


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="DPO steps per sampler")
    ap.add_argument("--every", type=int, default=20, help="held-out evaluation every N steps")
    ap.add_argument("--samples", type=int, default=8, help="sampled responses per held-out prompt")
    ap.add_argument(
        "--init",
        help="a warmed-up policy dir to start both runs from (e.g. a previous run's "
        "policy_init, printed at the end) instead of the SFT warm-up",
    )
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value) for both runs")
    args = ap.parse_args(argv)
    init_ray(num_cpus=4)  # logical CPUs: two sets of actors share the machine
    from rlsys.config import load_config
    from rlsys.run.controller import Controller

    out = Path(tempfile.mkdtemp(prefix="rlsys-bench-preferences-"))
    common = [*DEFAULTS, *args.overrides, f"trainer.steps={args.steps}", f"run.output_dir={out}"]
    cfgs = {
        "vanilla": load_config(ROOT / "configs/online_dpo.yaml", [*common, "run.name=vanilla"]),
        "pilaf": load_config(ROOT / "configs/pilaf.yaml", [*common, "run.name=pilaf"]),
    }
    runs = {name: Controller(cfg, out / name, progress=False) for name, cfg in cfgs.items()}
    t0 = time.perf_counter()
    if args.init:  # the task's rows are regenerated from the seed; the tokenizer comes with the policy
        shutil.copytree(args.init, out / "vanilla" / "policy_init")
    policy = runs["vanilla"].prepare_policy()
    shutil.copytree(policy, out / "pilaf" / "policy_init")  # the same warm-started policy for both
    for name, c in runs.items():
        c.start_actors(c.prepare_policy() if name != "vanilla" else policy)
    setup_s = time.perf_counter() - t0
    print(f"[{setup_s:.0f} s] warm-up done, actors of both runs started", file=sys.stderr)

    beta = cfgs["pilaf"].algorithm_params()["beta"]
    pairs_per_step = cfgs["pilaf"].trainer.prompts_per_step
    table, step_s, gen_s = [], {n: [] for n in runs}, {n: [] for n in runs}
    for step in range(args.steps + 1):
        if step % args.every == 0 or step == args.steps:
            for name, c in runs.items():
                table.append((step * pairs_per_step, name, heldout(c, args.samples, beta)))
                print(f"[{time.perf_counter() - t0:.0f} s] step {step} {name}: {table[-1][2]}", file=sys.stderr)
        if step == args.steps:
            break
        for name, c in runs.items():  # interleaved: both see the same machine load
            m = c.train_step()
            step_s[name].append(m["time/step"])
            gen_s[name].append(m.get("time/generate", 0.0))

    cfg = cfgs["pilaf"]
    print(
        f"online DPO, vanilla vs PILAF sampling: {args.steps} steps x {pairs_per_step} labelled pairs, "
        f"beta {beta}, rule-reward labeller (exact answer), {cfg.task.num_eval} held-out problems "
        f"x {args.samples} samples at T={cfg.rollout.temperature:g}; warm-up {cfg.sft.steps} SFT steps; "
        f"setup {setup_s:.0f} s, total {time.perf_counter() - t0:.0f} s"
    )
    print(
        f"{'labelled pairs':>14} {'sampler':>8} {'greedy acc':>11} "
        f"{'reward (+-se)':>15} {'KL(pi|ref)':>11} {'J=r-b*KL':>9}"
    )
    for pairs, name, r in table:
        reward = f"{r['reward']:.3f} +-{r['reward_se']:.3f}"
        print(f"{pairs:>14} {name:>8} {r['greedy_acc']:>11.3f} {reward:>15} {r['kl']:>11.3f} {r['J']:>9.3f}")
    skip = 1 if args.steps > 1 else 0  # the first step pays one-off costs
    mean = {n: float(np.mean(v[skip:])) for n, v in step_s.items()}
    gen = {n: float(np.mean(v[skip:])) for n, v in gen_s.items()}
    print(f"{'time per step (s)':>24} {'vanilla':>8} {'pilaf':>8} {'pilaf/vanilla':>14}")
    print(f"{'whole step':>24} {mean['vanilla']:>8.2f} {mean['pilaf']:>8.2f} {mean['pilaf'] / mean['vanilla']:>14.2f}")
    print(
        f"{'generate':>24} {gen['vanilla']:>8.2f} {gen['pilaf']:>8.2f} "
        f"{gen['pilaf'] / max(gen['vanilla'], 1e-9):>14.2f}"
    )
    print(f"warmed-up policy (for --init): {policy}")


if __name__ == "__main__":
    main(sys.argv[1:])
