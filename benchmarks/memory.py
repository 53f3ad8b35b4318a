"""The learner's memory features, each side by side with its baseline in the same command.
Prints one markdown table per section and writes them to OUT/memory.md.

    .venv/bin/python benchmarks/memory.py --sections packing [--budgets 1024,4096] [--repeats 3]

Sections:

packing: learner.max_tokens_per_microbatch. Learner tokens/s (the batch's response tokens over
the seconds of one `Learner.train_step`, one optimizer step) on a GRPO batch of 8 groups of 4
rows sharing a 32-token prompt, response lengths spread over 16-512 tokens (uniform, and
log-uniform: many short, a few long), a Qwen2 of ~3.7M parameters (4 x 256, vocab 2048).
Padded (the key null, as before it existed): the minibatch in one padded forward, each group's
prompt run once. Packed: micro-batches of at most the budget's tokens (a group larger than the
budget alone), each one sequence without padding (SDPA causal on each row's span), the gradients
accumulated into the same one step. Both learners are in this process (one DeepSpeed
rank, ZeRO-0, fp32), timed in alternation (median of --repeats after a warm-up each); torch
uses --threads threads. On a CUDA machine the table adds each step's peak GPU memory.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo's packages before benchmarks/ (its sandbox.py is a script)

SECTIONS = ("packing",)


def packing_policy(out: Path) -> str:
    from rlsys.models import TinyModelSpec, build_tiny_model, num_parameters, save_model_dir

    spec = TinyModelSpec(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model = build_tiny_model(spec, seed=0)
    print(f"policy: Qwen2 4 x 256, vocab 2048, {num_parameters(model) / 1e6:.1f}M parameters", flush=True)
    return str(save_model_dir(model, None, out / "policy_4x256"))


def spread_batch(lengths: str, groups: int = 8, group_size: int = 4, prompt: int = 32, seed: int = 0):
    """A GRPO TrainBatch: `groups` prompts of `prompt` tokens, `group_size` responses each of
    16-512 tokens (`lengths`: uniform or loguniform), a non-zero advantage on every row (every
    row has a gradient, so the learner leaves none out)."""
    import numpy as np
    import torch

    from rlsys.batch import collate_ids

    rng = np.random.default_rng(seed)
    n = groups * group_size
    sizes = rng.uniform(16, 512, n) if lengths == "uniform" else np.exp(rng.uniform(np.log(16), np.log(512), n))
    prompts = [rng.integers(3, 2048, prompt).tolist() for _ in range(groups)]
    rows = [(prompts[i // group_size], rng.integers(3, 2048, int(s)).tolist()) for i, s in enumerate(sizes)]
    batch = collate_ids([p for p, _ in rows], [r for _, r in rows])
    mask = batch.response_mask
    batch.old_logprobs = torch.full(mask.shape, -7.6) * mask  # about log(1/2048): ratios near 1
    batch.advantages = torch.from_numpy(rng.choice([-1.0, 1.0], n)).float()[:, None] * mask
    return batch


def timed_pair(fns: list, repeats: int) -> list[float]:
    """Median seconds of each callable, run in alternation after one warm-up each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def packing(args, out: Path) -> str:
    import torch

    from actors.learner import Learner
    from algorithms.grpo import GRPO
    from rlsys.cluster import free_port
    from rlsys.packing import microbatches

    torch.set_num_threads(args.threads)
    policy = packing_policy(out)
    algo = GRPO(GRPO.Config(group_size=4, kl_coef=0.0))
    variants = [None, *args.budgets]
    learners = [
        Learner(policy, algo, lr=1e-5, threads=args.threads, master_port=free_port(), max_tokens_per_microbatch=b)
        for b in variants
    ]
    cuda = torch.cuda.is_available()
    lines = [
        "| response lengths | rows | response tokens | real / padded tokens | learner | micro-batches | tokens/s "
        f"| ratio to padded | goal |{' peak GPU MiB |' if cuda else ''}",
        f"|---|---:|---:|---:|---|---:|---:|---:|---|{'---:|' if cuda else ''}",
    ]
    for lengths in ("uniform", "loguniform"):
        batch = spread_batch(lengths)
        real, padded = int(batch.attention_mask.sum()), batch.attention_mask.numel()
        steps = [lambda learner=learner: learner.train_step(batch.select(slice(None))) for learner in learners]
        seconds = timed_pair(steps, args.repeats)
        peaks = []
        if cuda:
            for step in steps:
                torch.cuda.reset_peak_memory_stats()
                step()
                peaks.append(torch.cuda.max_memory_allocated() / 2**20)
        tokens = batch.num_tokens()
        for i, (budget, s) in enumerate(zip(variants, seconds)):
            name = "padded (null)" if budget is None else f"packed, {budget} tokens"
            parts = 1 if budget is None else len(microbatches(batch, budget))
            ratio = seconds[0] / s
            lines.append(
                f"| {lengths} 16-512 | {len(batch)} | {tokens} | {real / padded:.2f} | {name} | {parts} "
                f"| {tokens / s:.0f} | {ratio:.2f}x | {'' if budget is None else '>= 1.5x'} |"
                + (f" {peaks[i]:.0f} |" if cuda else "")
            )
        print(f"{lengths}: " + ", ".join(f"{v}: {s:.2f} s" for v, s in zip(variants, seconds)), flush=True)
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument(
        "--budgets", default="1024,4096", help="packing: learner.max_tokens_per_microbatch values, comma-separated"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed train steps per learner, after a warm-up")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", type=Path, default=Path("runs/bench-memory"))
    args = p.parse_args(argv)
    sections = args.sections.split(",")
    if set(sections) - set(SECTIONS):
        p.error(f"--sections: unknown {sorted(set(sections) - set(SECTIONS))} (choose from {', '.join(SECTIONS)})")
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    from actors.modeling import quiet_transformers

    quiet_transformers()
    start = time.perf_counter()
    tables = []
    with tempfile.TemporaryDirectory(prefix="rlsys-bench-memory-") as tmp:
        if "packing" in sections:
            tables.append("packing (learner.max_tokens_per_microbatch)\n\n" + packing(args, Path(tmp)))
    text = f"benchmarks/memory.py {' '.join(argv)} ({time.perf_counter() - start:.0f} s)\n\n" + "\n\n".join(tables)
    (args.out / "memory.md").write_text(text + "\n")
    print("\n" + text)
    print(f"\nwritten: {args.out / 'memory.md'}")


if __name__ == "__main__":
    main(sys.argv[1:])
