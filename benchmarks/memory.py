"""The learner's memory features, each side by side with its baseline in the same command.
Prints one markdown table per section and writes them to OUT/memory.md.

    .venv/bin/python benchmarks/memory.py --sections packing [--budgets 1024,4096] [--repeats 3]
    .venv/bin/python benchmarks/memory.py --sections lora,sync,e2e [--shapes 55M,Qwen2.5-0.5B]

Sections:

lora: learner.lora and learner.gradient_checkpointing. Each learner setting (full, full +
checkpointing, LoRA r=16 on every attention and MLP projection, LoRA + checkpointing) is built in
a fresh Python process of its own, which then runs a warm-up and --repeats timed GRPO steps on 16
rows x (32 prompt + 128 response) tokens (55M; 4 x (32 + 64) on the 0.5B shape); the table has
the process's peak resident set (VmHWM: the model, its gradients, AdamW's moments and the activations: everything
the learner holds) and the median step, side by side for each model shape (--shapes: a 55M
Qwen2, and Qwen2.5-0.5B's shape, 494M with its 151936-token tied embedding; random weights from
the config). A setting that fails (out of memory included) shows its error.

sync: bytes and seconds of one object-store weight sync, full weights vs LoRA adapters, on the
same model: the learner's `weights()` (what every sync mode sends), put in a local Ray cluster's
object store, and a rollout worker actor's `load_weights` of them (adopting the full arrays, or
merging the adapters onto its initial weights), timed from the learner's call to the worker's answer.

largest: the largest Qwen2.5 shape (0.5B, 1.5B, 3B; random weights from the config) on which
each --largest-settings learner takes one GRPO step (4 rows x (32 + 64) tokens), found by trying
each shape in a fresh process on the whole machine, that process marked as the kernel's first
choice when memory runs out (oom_score_adj 1000), so a shape that does not fit ends only itself.

e2e: GRPO steps end to end on Qwen2.5-0.5B's shape on a local Ray cluster (rollout worker,
reference, reward, learner, weight sync), full fine-tuning and LoRA, each with and without
activation checkpointing: the mean step time after the first and each actor's peak RSS.

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

SECTIONS = ("packing", "lora", "sync", "e2e", "largest")
LEARNER_SETTINGS = {  # name -> (learner.lora.rank, learner.gradient_checkpointing)
    "full": (0, False),
    "full + checkpointing": (0, True),
    "LoRA r=16": (16, False),
    "LoRA r=16 + checkpointing": (16, True),
}
BATCHES = {"55M": (16, 32, 128)}  # the lora section's rows, prompt and response tokens (others: 4, 32, 64)
SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
SHAPES = {  # Qwen2 sizes and vocabulary; the Qwen2.5 ones are their configs'
    name: dict(zip(SIZES, sizes), vocab_size=vocab)
    for name, sizes, vocab in (
        ("55M", (640, 1792, 10, 10, 2), 16384),
        ("Qwen2.5-0.5B", (896, 4864, 24, 14, 2), 151936),
        ("Qwen2.5-1.5B", (1536, 8960, 28, 12, 2), 151936),
        ("Qwen2.5-3B", (2048, 11008, 36, 16, 2), 151936),
    )
}
LARGEST = ("Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-3B")  # the largest section tries them in this order
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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


# ---- lora, sync, e2e ---------------------------------------------------------------------------
def shaped_policy(shape: str, out: Path, tokenizer=None) -> str:
    """A Qwen2 of `shape` (random weights from its config, tied embeddings as Qwen2.5-0.5B has),
    saved once under `out`, with `tokenizer` beside it when given (a small local one: the ids
    past it decode to nothing)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlsys.models import find_tokenizer_dir, save_tokenizer

    path = out / f"policy-{shape}"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = Qwen2Config(  # Qwen2.5's special ids: <|endoftext|> starts nothing here and ends a response
            **SHAPES[shape],
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151643,
        )
        model = Qwen2ForCausalLM(config)
        print(f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters", flush=True)
        model.save_pretrained(path)
        del model
    if tokenizer is not None and find_tokenizer_dir(path) is None:
        save_tokenizer(tokenizer, path)
    return str(path)


def lora_settings(rank: int) -> dict:
    return dict(rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules=TARGETS, export="merged")


def fixed_batch(rows: int, prompt: int, response: int, vocab: int):
    """A GRPO TrainBatch of `rows` rows, 4 sharing each prompt, every row with an advantage."""
    import numpy as np
    import torch

    from rlsys.batch import collate_ids

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, prompt).tolist() for _ in range(-(-rows // 4))]
    responses = [rng.integers(3, vocab, response).tolist() for _ in range(rows)]
    batch = collate_ids([prompts[i // 4] for i in range(rows)], responses)
    mask = batch.response_mask
    batch.old_logprobs = torch.full(mask.shape, -float(np.log(vocab))) * mask
    batch.advantages = torch.from_numpy(rng.choice([-1.0, 1.0], rows)).float()[:, None] * mask
    return batch


def learner_child(spec: dict) -> dict:
    """One learner setting in this (fresh) process: a warm-up and `repeats` timed GRPO steps;
    the process's peak RSS and the median step."""
    with open("/proc/self/oom_score_adj", "w") as f:  # out of memory, the kernel ends this process first
        f.write("1000")
    import torch

    from actors.learner import Learner
    from algorithms.grpo import GRPO
    from rlsys.cluster import free_port

    torch.set_num_threads(spec["threads"])
    rank, checkpointing = LEARNER_SETTINGS[spec["setting"]]
    learner = Learner(
        spec["policy"],
        GRPO(GRPO.Config(group_size=4, kl_coef=0.0)),
        lr=1e-5,
        threads=spec["threads"],
        master_port=free_port(),
        gradient_checkpointing=checkpointing,
        lora=lora_settings(rank),
    )
    batch = fixed_batch(*BATCHES.get(spec["shape"], (4, 32, 64)), SHAPES[spec["shape"]]["vocab_size"])
    times = []
    for _ in range(spec["repeats"] + 1):
        start = time.perf_counter()
        learner.train_step(batch.select(slice(None)))
        times.append(time.perf_counter() - start)
    trained = sum(p.numel() for g in learner.optimizer.param_groups for p in g["params"])
    return {"peak_gib": peak_rss_gib(), "step_s": statistics.median(times[1:] or times), "trained": trained}


def peak_rss_gib() -> float:
    """This process's peak resident set (VmHWM; getrusage's ru_maxrss would carry the forking
    parent's peak across exec), GiB."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def in_child(spec: dict) -> dict:
    """`learner_child(spec)` in a fresh Python process (its own peak RSS); a failure, out of
    memory included, comes back as {"error": ...}."""
    import json
    import subprocess

    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode == -9:
        return {"error": "killed by the kernel: out of memory"}
    if done.returncode != 0 or not last.startswith("{"):
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"error": f"exit {done.returncode}: {tail[:160]}"}
    return json.loads(last)


def lora(args, out: Path) -> str:
    lines = [
        "| model | learner | trained parameters | peak RSS GiB | ratio to full | step s | ratio to full |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for shape in args.shapes:
        policy = shaped_policy(shape, out)
        results = {}
        for setting in LEARNER_SETTINGS:
            spec = dict(policy=policy, shape=shape, setting=setting, threads=args.threads, repeats=args.repeats)
            results[setting] = r = in_child(spec)
            print(f"{shape} {setting}: {r}", flush=True)
        full = results["full"]
        for setting, r in results.items():
            if "error" in r:
                lines.append(f"| {shape} | {setting} | | {r['error']} | | | |")
                continue
            ratio = lambda key: f"{r[key] / full[key]:.2f}x" if "error" not in full else ""
            lines.append(
                f"| {shape} | {setting} | {r['trained'] / 1e6:.2f}M | {r['peak_gib']:.2f} | {ratio('peak_gib')} "
                f"| {r['step_s']:.2f} | {ratio('step_s')} |"
            )
    return "\n".join(lines)


def sync(args, out: Path) -> str:
    import ray
    import torch

    from actors.learner import Learner
    from actors.rollout import RolloutWorker
    from algorithms.grpo import GRPO
    from rlsys.cluster import free_port

    torch.set_num_threads(args.threads)
    lines = [
        "| model | sync | tensors | MiB sent | seconds per sync | ratio of bytes | ratio of seconds |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for shape in args.shapes:
        policy = shaped_policy(shape, out)
        sent, seconds = {}, {}
        for name, rank in (("full weights", 0), ("LoRA r=16 adapters", 16)):
            learner = Learner(policy, GRPO(), threads=args.threads, master_port=free_port(), lora=lora_settings(rank))
            worker = ray.remote(RolloutWorker).options(num_cpus=0.5).remote(policy, "hf", 64, args.threads)
            weights = learner.weights()
            sent[name] = sum(w.nbytes for w in {id(w): w for w in weights.values()}.values())
            version = iter(range(1, 10**6))
            one_sync = lambda: ray.get(worker.load_weights.remote(next(version), ray.put(learner.weights())))
            seconds[name] = timed_pair([one_sync], args.repeats)[0]
            lines.append(
                f"| {shape} | {name} | {len(weights)} | {sent[name] / 2**20:.1f} | {seconds[name]:.3f} "
                f"| {sent[name] / sent['full weights']:.4f} | {seconds[name] / seconds['full weights']:.3f} |"
            )
            ray.kill(worker)
    return "\n".join(lines)


def largest(args, out: Path) -> str:
    """Each of --largest-settings tries one GRPO step (4 rows x (32 + 64) tokens) on the Qwen2.5
    shapes in order, each in a fresh process that the kernel ends first when memory runs out
    (oom_score_adj 1000), until one fails: the largest that passed, with its peak RSS."""
    lines = ["| learner | shape | result | peak RSS GiB | step s |", "|---|---|---|---:|---:|"]
    for setting in args.largest_settings:
        for shape in LARGEST:
            policy = shaped_policy(shape, out)
            spec = dict(policy=policy, shape=shape, setting=setting, threads=args.threads, repeats=0)
            r = in_child(spec)
            print(f"largest {setting} {shape}: {r}", flush=True)
            if "error" in r:
                lines.append(f"| {setting} | {shape} | fails: {r['error']} | | |")
                break
            lines.append(f"| {setting} | {shape} | one step | {r['peak_gib']:.2f} | {r['step_s']:.1f} |")
    return "\n".join(lines)


def actor_peak_gib(actor) -> float:
    """An actor process's peak resident set (VmHWM), GiB."""
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _self: peak_rss_gib()))


def e2e(args, out: Path) -> str:
    from envs.arithmetic import ArithmeticTask
    from rlsys.config import load_config
    from rlsys.models import train_tokenizer
    from rlsys.run.controller import Controller
    from rlsys.tracking import read_jsonl

    task = ArithmeticTask.create(out / "task", 4000, 4, 0, 49, ["+"], 0)  # the quickstart's task, as the run makes it
    tokenizer = train_tokenizer(task.corpus(), 512)
    policy = shaped_policy("Qwen2.5-0.5B", out, tokenizer)
    lines = [
        "| learner | step s (mean after the first) | learner peak GiB | rollout worker GiB | reference GiB "
        "| all actors GiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for setting in args.e2e_settings:
        rank, checkpointing = LEARNER_SETTINGS[setting]
        name = setting.replace(" ", "").replace("+", "-").replace("=", "")
        overrides = [
            f"model.path={policy}",
            "sft.steps=0",
            "task.num_eval=4",
            "trainer.prompts_per_step=2",
            "algorithm.group_size=2",
            "rollout.max_new_tokens=16",
            f"trainer.steps={args.e2e_steps}",
            "trainer.eval_every=0",
            f"learner.lora.rank={rank}",
            f"learner.lora.alpha={2 * rank or 16}",
            f"learner.gradient_checkpointing={str(checkpointing).lower()}",
            f"learner.threads={args.threads}",
            f"run.output_dir={out}",
            f"run.name=e2e-{name}",
        ]
        cfg = load_config("configs/quickstart.yaml", overrides)
        c = Controller(cfg, out / f"e2e-{name}", progress=False)
        try:
            c.run()
            steps = [r["time/step"] for r in read_jsonl(out / f"e2e-{name}" / "metrics.jsonl")]
            peaks = {
                "learner": actor_peak_gib(c.learners[0]),
                "worker": actor_peak_gib(c.workers[0]),
                "reference": actor_peak_gib(c.reference) if c.reference else 0.0,  # LoRA: the learner's base
            }
            total = sum(peaks.values()) + actor_peak_gib(c.reward) + actor_peak_gib(c.buffer)
            step = statistics.mean(steps[1:]) if len(steps) > 1 else steps[0]
            lines.append(
                f"| {setting} | {step:.1f} | {peaks['learner']:.2f} | {peaks['worker']:.2f} "
                f"| {peaks['reference']:.2f} | {total:.2f} |"
            )
            print(lines[-1], flush=True)
        finally:
            c.shutdown()
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument(
        "--budgets", default="1024,4096", help="packing: learner.max_tokens_per_microbatch values, comma-separated"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed train steps per learner, after a warm-up")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--shapes", default="55M,Qwen2.5-0.5B", help=f"lora, sync: model shapes of {','.join(SHAPES)}")
    p.add_argument("--e2e-steps", type=int, default=3, help="e2e: GRPO steps per setting")
    p.add_argument(
        "--largest-settings",
        default="full,LoRA r=16 + checkpointing",
        help=f"largest: comma-separated learner settings of {', '.join(LEARNER_SETTINGS)}",
    )
    p.add_argument(
        "--e2e-settings",
        default=",".join(LEARNER_SETTINGS),
        help=f"e2e: comma-separated learner settings of {', '.join(LEARNER_SETTINGS)}",
    )
    p.add_argument("--out", type=Path, default=Path("runs/bench-memory"))
    p.add_argument("--child", help=argparse.SUPPRESS)  # lora: one learner setting, run by in_child
    args = p.parse_args(argv)
    if args.child:
        import json

        from actors.modeling import quiet_transformers

        quiet_transformers()
        print(json.dumps(learner_child(json.loads(args.child))))
        return
    args.shapes = args.shapes.split(",")
    for option in ("largest_settings", "e2e_settings"):
        setattr(args, option, getattr(args, option).split(","))
        if set(getattr(args, option)) - set(LEARNER_SETTINGS):
            flag = "--" + option.replace("_", "-")
            p.error(f"{flag}: unknown {sorted(set(getattr(args, option)) - set(LEARNER_SETTINGS))}")
    sections = args.sections.split(",")
    if set(sections) - set(SECTIONS):
        p.error(f"--sections: unknown {sorted(set(sections) - set(SECTIONS))} (choose from {', '.join(SECTIONS)})")
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    from actors.modeling import quiet_transformers

    quiet_transformers()
    start = time.perf_counter()
    tables = []
    models = args.out / "models"  # the shaped policies, built once and kept between runs
    models.mkdir(exist_ok=True)

    def add(title: str, table: str) -> None:  # each table printed and written as soon as it is done
        tables.append(f"{title}\n\n{table}")
        print(f"\n{tables[-1]}\n", flush=True)
        head = f"benchmarks/memory.py {' '.join(argv)} ({time.perf_counter() - start:.0f} s)"
        (args.out / "memory.md").write_text("\n\n".join([head, *tables]) + "\n")

    with tempfile.TemporaryDirectory(prefix="rlsys-bench-memory-") as tmp:
        if "packing" in sections:
            add("packing (learner.max_tokens_per_microbatch)", packing(args, Path(tmp)))
        if "lora" in sections:
            add("lora (learner.lora, learner.gradient_checkpointing)", lora(args, models))
        if {"sync", "e2e"} & set(sections):
            from rlsys.cluster import init_ray

            init_ray()
        if "sync" in sections:
            add("sync (full weights vs LoRA adapters)", sync(args, models))
        if "largest" in sections:
            add("largest (one GRPO step by Qwen2.5 shape)", largest(args, models))
        if "e2e" in sections:
            add("e2e (GRPO on Qwen2.5-0.5B's shape, a local Ray cluster)", e2e(args, models))
    print(f"written: {args.out / 'memory.md'}")


if __name__ == "__main__":
    main(sys.argv[1:])
