"""Multi-turn tool-using episodes: episodes/s of the example agent task (configs/agent.yaml) with
the python tool running in a SandboxPool of 2 workers, the episodes played side by side (one
`play_episodes` call over every prompt, as a run's rollout plays them) vs the same episodes played
one at a time (`play_episodes` on one prompt, n=1, prompt after prompt), in one command.

    eval "$(bash .ci/setup_sandbox.sh)"     # or: set -a; source /tmp/rlsys-sandbox/env; set +a
    .venv/bin/python benchmarks/agents.py [--quick] [--episodes 32] [--policy DIR] [--save-policy DIR]

The policy: the agent config's ~0.85M-parameter Qwen2 and a tokenizer trained on its data, the
data being envs/agent_arithmetic.py's in its python form (`tool="python"`: each demonstration
calls `python` with `print(<expression>)`), warmed up with the run's SFT warm-up
(`algorithms/sft.py` `warmup`, the prompts listing the python tool's schema as the episodes'
do) for --warmup-steps steps without flawed demonstrations, so the greedy policy calls the tool;
or --policy DIR, a model dir saved by --save-policy, skipping all that.

The episodes: the first --episodes held-out problems, one episode each, greedy (temperature 0,
so both modes should write the same turns), the config's env (max_turns 3, max_tokens 256, 40 new
tokens a turn, the calls' timeout) with `env.tools: [python]`; the env factory is the run's
(`make_env_factory`), the python tool's runs go through the context's `execute` (ActorContext's:
concurrent episodes' calls share the pool's workers) to a real SandboxPool of `sandbox.workers` (2)
workers with the config's sandbox limits, the backend the config's (`sandbox.backend`, bwrap;
--backend picks another). The policy is the rollout worker's HFBackend in this process (torch on
--threads threads). Both modes use the same pool; two episodes first warm it and the model up,
untimed. Each mode is timed --repeat times, alternating which goes first; each cell is the best.

Prints one markdown table: per mode the wall seconds, episodes/s, generation calls (and the
mean episodes per call), the seconds spent generating and in the sandbox, policy turns, tool
calls run (each status), the well-formed share of the calls, and the episodes answered right;
and the ratio side by side / one at a time. Then whether every timing of both modes wrote the same
token ids for every episode (they should under greedy decoding).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo's packages before benchmarks/ (its sandbox.py is a script)

MODES = ("side by side", "one at a time")


def load_job(data_dir: Path, args):
    """The agent config with the python tool, the python-form data, the warm-up's steps and the
    sandbox backend and workers asked for."""
    from rlsys.config import load_config

    overrides = [
        f"task.train_path={data_dir / 'agent_arithmetic_train.jsonl'}",
        f"task.eval_path={data_dir / 'agent_arithmetic_eval.jsonl'}",
        "env.tools=[python]",
        f"env.max_turns={args.max_turns}",
        f"sft.steps={args.warmup_steps}",
        "sft.demo_error=0.0",
        f"sandbox.workers={args.workers}",
    ]
    return load_config(
        ROOT / "configs" / "agent.yaml", overrides + ([f"sandbox.backend={args.backend}"] if args.backend else [])
    )


def well_formed_share(counts: dict[str, int]) -> float:
    """The share of calls that were not malformed (0 when there were none)."""
    calls = sum(counts.values())
    return (calls - counts.get("malformed", 0)) / calls if calls else 0.0


def mode_row(name: str, episodes: list, correct: list[bool], wall_s: float, timings: dict, calls: list[int]) -> dict:
    """What the table shows of one mode's episodes."""
    from collections import Counter

    statuses = Counter()
    for e in episodes:
        statuses.update({k: v for k, v in e.tool_counts.counts.items() if v})
    return {
        "mode": name,
        "episodes": len(episodes),
        "wall_s": wall_s,
        "per_s": len(episodes) / wall_s,
        "generate_calls": len(calls),
        "batch_mean": sum(calls) / len(calls) if calls else 0.0,
        "generate_s": timings.get("generate", 0.0),
        "sandbox_s": timings.get("sandbox", 0.0),
        "turns": sum(e.turns for e in episodes),
        "tool_calls": sum(statuses.values()),
        "statuses": dict(statuses),
        "well_formed": well_formed_share(statuses),
        "correct": sum(correct),
    }


def table(rows: list[dict]) -> str:
    """The modes side by side, with the first mode's episodes/s over the second's."""
    lines = [
        "| mode | episodes | wall s | episodes/s | generation calls (episodes each) | generate s | sandbox s "
        "| policy turns | tool calls run (status) | well-formed calls | right answers | x one at a time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    base = next((r["per_s"] for r in rows if r["mode"] == MODES[1]), None)
    for r in rows:
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items())) or "-"
        ratio = f"{r['per_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {r['mode']} | {r['episodes']} | {r['wall_s']:.2f} | {r['per_s']:.2f} | "
            f"{r['generate_calls']} ({r['batch_mean']:.1f}) | {r['generate_s']:.2f} | {r['sandbox_s']:.2f} | "
            f"{r['turns']} | {r['tool_calls']} ({statuses}) | {r['well_formed']:.2f} | "
            f"{r['correct']}/{r['episodes']} | {ratio} |"
        )
    return "\n".join(lines)


def same_transcripts(a: list, b: list) -> tuple[int, list[int]]:
    """(how many episodes wrote the same token ids in both modes, the indices of those that did not)."""
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if list(x.conversation.ids) != list(y.conversation.ids)]
    return len(a) - len(differ), differ


def make_context_class():
    """The run's ActorContext (its `execute`: the sandbox pool shared by the episodes, timed; its `sampling`)
    with generation in this process on the rollout worker's HFBackend (`generate` counted)."""
    from actors.rollout import HFBackend
    from rlsys.run.context import ActorContext, PolicyActors

    class LocalContext(ActorContext):
        def __init__(self, cfg, tokenizer, task, policy_dir: Path, pool, episodes):
            super().__init__(cfg, tokenizer, task, {"policy": PolicyActors([], [])}, None, None, None, cfg.run.seed)
            self.backend = HFBackend(str(policy_dir))
            self.sandbox, self.episodes = pool, episodes
            self.batches: list[int] = []  # the episodes of each generation call

        def generate(self, requests, policy=None):
            with self.timed("generate"):
                gens = self.backend.generate(requests)
            for g in gens:
                g.policy_version = self.policy_version
            self.batches.append(len(requests))
            return gens

        def reset_counts(self) -> None:
            self.timings.clear()
            self.batches = []

    return LocalContext


def prepare_policy(cfg, task, schemas, out: Path, progress: bool) -> Path:
    """The config's tiny Qwen2 with a tokenizer trained on the task's corpus, warmed up as the
    controller does (`warmup`, the episodes' tool schemas in the prompts), saved at `out`."""
    from algorithms.sft import warmup
    from envs.dataset_task import fit_to_model
    from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer

    tokenizer = train_tokenizer(task.corpus(), cfg.model.vocab_size)
    model = build_tiny_model(TinyModelSpec.from_config(cfg.model), tokenizer, seed=cfg.run.seed)
    fit_to_model(task, tokenizer, cfg, model.config.to_dict())
    s, t0 = cfg.sft, time.monotonic()

    def report(step: int, loss: float) -> None:
        if progress and (step + 1) % 50 == 0:
            print(
                f"# warm-up step {step + 1}/{s.steps}: loss {loss:.3f}, {time.monotonic() - t0:.0f} s", file=sys.stderr
            )

    warmup(model, tokenizer, task, task.rows("train"), s.steps, s.batch_size, s.lr, cfg.run.seed, report, 0.0, schemas)
    print(f"# warm-up: {s.steps} steps in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return save_model_dir(model, tokenizer, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 episodes after a 150-step warm-up: a check that it runs")
    p.add_argument("--episodes", type=int, default=None, help="held-out problems, one episode each (default 32)")
    p.add_argument("--warmup-steps", type=int, default=None, help="SFT warm-up steps (default 300)")
    p.add_argument("--policy", type=Path, default=None, help="a warmed-up model dir (--save-policy's): no warm-up")
    p.add_argument("--save-policy", type=Path, default=None, help="where to keep the warmed-up policy")
    p.add_argument("--max-turns", type=int, default=3, help="env.max_turns")
    p.add_argument("--workers", type=int, default=2, help="sandbox.workers: the pool's workers (both modes)")
    p.add_argument("--backend", default=None, help="sandbox.backend (default: the config's, bwrap)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine may be shared)")
    p.add_argument("--repeat", type=int, default=3, help="best of this many timings per mode")
    args = p.parse_args(argv)
    args.episodes = args.episodes or (8 if args.quick else 32)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (150 if args.quick else 300)

    import torch

    from envs.agent_arithmetic import generate
    from envs.datasets import write_rows
    from envs.registry import make_env_factory, make_task
    from envs.reward_functions import math_reward
    from envs.tools import sandbox_limits
    from sandbox.base import unavailable

    torch.set_num_threads(args.threads)
    out = Path(tempfile.mkdtemp(prefix="rlsys-bench-agents-"))
    n_eval = max(args.episodes + 2, 200)
    for split, rows in generate(2000, n_eval, seed=0, tool="python").items():
        write_rows(rows, out / "data" / f"agent_arithmetic_{split}.jsonl")
    cfg = load_job(out / "data", args)
    why = unavailable(cfg.sandbox.backend)
    if why:  # as the controller says it (Controller._check_sandbox)
        print(
            f"benchmarks/agents.py: env.tools' python runs code in the {cfg.sandbox.backend} sandbox, which is "
            f'unavailable here: {why} (set up the engines: eval "$(bash .ci/setup_sandbox.sh)"; or --backend)',
            file=sys.stderr,
        )
        return 2

    from rlsys.cluster import init_ray  # before anything imports ray

    init_ray()
    import ray

    from algorithms.episodes import EpisodeSettings, play_episodes
    from envs.dataset_task import fit_to_model
    from rlsys.contract import Prompt
    from rlsys.models import load_tokenizer
    from rlsys.prompts import context_length, prompt_ids
    from sandbox.pool import SandboxPool

    pool = None
    try:
        task = make_task(cfg.task, out / "task", cfg.run.seed)
        LocalContext = make_context_class()
        ctx_box: list = []  # the env factory's runner reaches the context made after it
        envs = make_env_factory(
            cfg.env, task, run=lambda requests: ctx_box[0].execute(requests), limits=sandbox_limits(cfg.sandbox)
        )
        policy_dir = args.policy or prepare_policy(
            cfg, task, envs.tool_schemas, args.save_policy or out / "policy", progress=True
        )
        tokenizer = load_tokenizer(policy_dir)
        model_config = json.loads((Path(policy_dir) / "config.json").read_text())
        if args.policy:
            fit_to_model(task, tokenizer, cfg, model_config)  # as prepare_policy does before its warm-up
        context = context_length(model_config)
        budget = min(cfg.env.max_tokens, context) if context else cfg.env.max_tokens
        settings = EpisodeSettings.for_tokenizer(tokenizer, envs.make, cfg.env.max_turns, budget, envs.tool_schemas)
        pool = SandboxPool(cfg.sandbox.backend, workers=cfg.sandbox.workers)
        ctx = LocalContext(cfg, tokenizer, task, Path(policy_dir), pool, settings)
        ctx_box.append(ctx)
        rows = task.rows("eval")
        prompts = [Prompt(f"eval-{i}", *prompt_ids(task, tokenizer, r), r) for i, r in enumerate(rows)]
        warm, timed = prompts[: args.episodes + 2][-2:], prompts[: args.episodes]
        params = ctx.sampling(n=1, temperature=0.0, seed=cfg.run.seed)
        print(
            f"# {args.episodes} episodes, {cfg.sandbox.backend} pool of {cfg.sandbox.workers} workers (both modes), "
            f"{args.threads} torch thread(s), {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}; "
            f"policy {policy_dir}",
            file=sys.stderr,
        )
        play_episodes(ctx, warm, 1, params)  # the pool's workers and the model warmed up, untimed

        def side_by_side():
            return play_episodes(ctx, timed, 1, params)

        def one_at_a_time():
            return [e for prompt in timed for e in play_episodes(ctx, [prompt], 1, params)]

        runs = {MODES[0]: side_by_side, MODES[1]: one_at_a_time}
        best: dict[str, tuple] = {}
        played: list[list] = []  # every timing's episodes
        for attempt in range(args.repeat):
            for name in MODES if attempt % 2 == 0 else MODES[::-1]:
                ctx.reset_counts()
                t0 = time.perf_counter()
                episodes = runs[name]()
                wall = time.perf_counter() - t0
                played.append(episodes)
                if name not in best or wall < best[name][1]:
                    best[name] = (episodes, wall, dict(ctx.timings), list(ctx.batches))
        table_rows = []
        for name in MODES:
            episodes, wall, timings, batches = best[name]
            correct = [isinstance(e.answer, str) and math_reward("", e.answer, e.prompt.meta) == 1.0 for e in episodes]
            table_rows.append(mode_row(name, episodes, correct, wall, timings, batches))
        print(table(table_rows))
        differ = sorted({i for episodes in played[1:] for i in same_transcripts(played[0], episodes)[1]})
        if differ:
            print(
                f"\nThe timings did NOT all write the same transcripts: {len(timed) - len(differ)}/{len(timed)} "
                f"episodes' token ids equal in every one (differ: episodes {', '.join(map(str, differ[:10]))}"
                f"{' ...' if len(differ) > 10 else ''})."
            )
        else:
            print(
                f"\nThe two modes wrote the same transcripts: all {len(timed)} episodes' token ids equal in every "
                f"timing ({len(played)})."
            )
        return 0
    finally:
        if pool is not None:
            pool.close()
        ray.shutdown()
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
