"""RLEF machinery on HumanEval: episodes/s, the sandbox's share of a step, the turn-count
distribution, and whether reward rises on the warm-up problems.

A tiny policy is warmed up (SFT, deliberately short) on the canonical solutions of a few
short HumanEval problems, then trained with RLEF on the same problems (a tiny model will not
solve unseen HumanEval problems; what is measured is the machinery). Every public-test run of
a turn goes to the SandboxPool at once; the last step's runs are replayed one at a time on
one in-process backend, the baseline the concurrent pool is compared with.

    eval "$(bash .ci/setup_sandbox.sh)"   # or: set -a; source /tmp/rlsys-sandbox/env; set +a
    .venv/bin/python benchmarks/code_rl.py [trainer.steps=8 ...]
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.cluster import init_ray  # noqa: E402  (before anything imports ray)

WARMUP_PROBLEMS = [23, 53, 2, 28, 45, 27, 16, 34]  # HumanEval ids with short prompts and solutions
SETTINGS = [
    "model.hidden_size=64",
    "model.intermediate_size=192",
    "model.num_hidden_layers=2",
    "model.max_position_embeddings=512",
    "model.vocab_size=512",
    "sft.steps=100",
    "sft.batch_size=8",
    "sft.lr=0.003",
    "rollout.max_new_tokens=32",
    "learner.lr=0.0001",
    "learner.epochs=2",
    "learner.minibatches=4",
    "trainer.steps=10",
    "trainer.prompts_per_step=8",
    "trainer.eval_every=0",
    "algorithm.samples_per_prompt=4",
    "algorithm.feedback_chars=300",
    "sandbox.workers=2",
]


def fixed_seed_episodes(c, repeats: int = 2, seed: int = 777) -> dict[str, float]:
    """Private pass and reward over `repeats` x (every warm-up prompt x samples_per_prompt)
    episodes, sampled with the same seeds each time it is called (before and after RL)."""
    import numpy as np

    from rlsys.experience import meta_of

    rng, c.ctx.rng = c.ctx.rng, np.random.default_rng(seed)
    try:
        metas = [m for _ in range(repeats) for m in meta_of(c.algorithm.rollout(c.ctx, c.stream.prompts))]
    finally:
        c.ctx.rng = rng
    return {
        "episodes": len(metas),
        "private_pass": float(np.mean([bool(m["private_passed"]) for m in metas])),
        "first_turn_pass": float(np.mean([len(m["answer_lengths"]) == 1 and bool(m["public_passed"]) for m in metas])),
        "reward": float(np.mean([sum(m["turn_rewards"]) for m in metas])),
    }


def main(argv: list[str]) -> None:
    from envs.code import humaneval_rows
    from envs.datasets import write_rows

    out = Path(tempfile.mkdtemp(prefix="rlsys-bench-code-rl-"))
    rows = humaneval_rows()
    data = write_rows([rows[i] for i in WARMUP_PROBLEMS], out / "warmup.jsonl")
    init_ray()
    from rlsys.config import load_config
    from rlsys.run.controller import Controller
    from sandbox import make_backend

    cfg = load_config(
        "configs/rlef.yaml",
        [
            *SETTINGS,
            *argv,
            "task.name=code",
            f"task.train_path={data}",
            f"task.eval_path={data}",
            f"run.output_dir={out}",
            "run.name=code_rl",
        ],
    )
    c = Controller(cfg, out / "code_rl", progress=False)
    t0 = time.perf_counter()
    c.start_actors(c.prepare_policy())
    setup_s = time.perf_counter() - t0
    before = fixed_seed_episodes(c)

    recorded: list = []
    execute = c.ctx.execute
    c.ctx.execute = lambda requests: recorded.append(list(requests)) or execute(requests)
    steps, turns = [], Counter()
    for step in range(cfg.trainer.steps):
        recorded.clear()
        m = c.train_step()
        steps.append(m)
        n = m["samples"]
        for k in range(1, cfg.algorithm_params().get("max_turns", 3) + 1):
            turns[k] += round(m.get(f"rlef/turns_{k}", 0.0) * n)
    runs = [r for batch in recorded for r in batch]  # the last step's sandbox runs
    c.ctx.execute = execute
    after = fixed_seed_episodes(c)

    print(
        f"RLEF on {len(WARMUP_PROBLEMS)} HumanEval warm-up problems "
        f"({', '.join(f'HumanEval/{i}' for i in WARMUP_PROBLEMS)}), "
        f"{cfg.trainer.steps} steps x {cfg.trainer.prompts_per_step} prompts x "
        f"{cfg.algorithm_params().get('samples_per_prompt', 1)} episodes, sandbox {cfg.sandbox.backend} x "
        f"{cfg.sandbox.workers} workers; tokenizer + warm-up + actor start {setup_s:.0f} s"
    )
    print(
        f"{'step':>4}{'reward':>8}{'private':>9}{'public':>8}{'turns':>7}{'episodes/s':>12}{'step s':>8}"
        f"{'sandbox s':>11}{'share':>7}{'runs':>6}"
    )
    for i, m in enumerate(steps, 1):
        sb = m.get("time/sandbox", 0.0)
        print(
            f"{i:>4}{m['reward/mean']:>8.2f}{m['rlef/private_pass']:>9.2f}{m['rlef/public_pass']:>8.2f}"
            f"{m['rlef/turns_mean']:>7.2f}{m['samples'] / m['time/step']:>12.2f}{m['time/step']:>8.1f}"
            f"{sb:>11.2f}{sb / m['time/step']:>7.0%}{int(m.get('rlef/sandbox_runs', 0)):>6}"
        )
    total = sum(m["time/step"] for m in steps)
    sandbox = sum(m.get("time/sandbox", 0.0) for m in steps)
    episodes = sum(m["samples"] for m in steps)
    k = max(1, len(steps) // 3)
    first = sum(m["reward/mean"] for m in steps[:k]) / k
    last = sum(m["reward/mean"] for m in steps[-k:]) / k
    print(
        f"episodes/s {episodes / total:.2f}; sandbox share of step time {sandbox / total:.1%}; "
        f"turn counts {dict(sorted(turns.items()))}"
    )
    print(f"reward, mean of the first {k} steps -> last {k}: {first:+.2f} -> {last:+.2f} ({last - first:+.2f})")
    print(
        f"{after['episodes']} episodes at T={cfg.rollout.temperature:g} with the same seeds, "
        "after warm-up -> after RL: "
        + ", ".join(f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in ("private_pass", "first_turn_pass", "reward"))
    )

    if runs:
        t = time.perf_counter()
        c.ctx.sandbox.run_many(runs)
        pooled = time.perf_counter() - t
        backend = make_backend(cfg.sandbox.backend)
        t = time.perf_counter()
        for r in runs:
            backend.run(r)
        one_by_one = time.perf_counter() - t
        backend.close()
        print(
            f"last step's {len(runs)} sandbox runs: pool of {cfg.sandbox.workers} (all at once) {pooled:.2f} s vs one "
            f"at a time in-process {one_by_one:.2f} s: x{one_by_one / max(pooled, 1e-9):.2f}"
        )
    c.ctx.sandbox.close()


if __name__ == "__main__":
    main(sys.argv[1:])
