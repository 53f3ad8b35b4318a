"""SliM-LLM side by side: a tiny Qwen2 model trained on generated task text, then held-out
perplexity and model bytes for FP32, round-to-nearest, GPTQ-style uniform and SliM-LLM at
2 and 3 bits; then the quickstart's warmed-up arithmetic policy, scored by held-out
exact-answer accuracy (greedy) at 2, 3 and 4 bits, where the methods separate. Every
quantised model goes through save -> load_quantized before it is scored.

    .venv/bin/python benchmarks/quantize.py            # trains (~1-3 min on 2 CPU cores)
    .venv/bin/python benchmarks/quantize.py --model-dir /tmp/qbench/fp32   # reuse a trained model
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.models import TinyModelSpec, build_tiny_model, load_model, load_tokenizer, save_model_dir, train_tokenizer  # noqa: E402
from rlsys.quantize import QuantConfig, average_bits, load_quantized, quantize_model, save_quantized  # noqa: E402
from rlsys.quantize.calib import calibration_from_text  # noqa: E402

NOUNS = ["cat", "dog", "bird", "fox", "cow", "fish", "frog", "bear", "mouse", "horse"]
ADJS = ["red", "big", "small", "quick", "lazy", "old", "young", "green", "tall", "happy"]
VERBS = ["sees", "likes", "chases", "follows", "helps", "finds", "meets", "feeds"]
SYLLABLES = ["ka", "zo", "ri", "mu", "te", "lo", "vi", "na", "shu", "pe", "dra", "gim"]
CITIES = ["north bay", "stone hill", "red rock", "clear lake", "old mill", "sun vale", "iron gate", "west end"]


def fact_table(n: int = 160, seed: int = 1234) -> list[tuple[str, str, int]]:
    """A fixed table of invented facts (name, city, age): the knowledge the model memorises."""
    rng = random.Random(seed)
    names = sorted({"".join(rng.sample(SYLLABLES, 3)) for _ in range(4 * n)})[:n]
    return [(name, rng.choice(CITIES), rng.randrange(10, 90)) for name in names]


FACTS = fact_table()


def task_line(rng: random.Random) -> str:
    """One line of generated task text: small-number arithmetic, a fact from the table,
    counting, or a templated sentence."""
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(20), rng.randrange(20)
        return f"{a} + {b} = {a + b}"
    if kind in (1, 2):
        name, city, age = rng.choice(FACTS)
        return f"{name} lives in {city} and is {age} years old" if kind == 1 else f"{name} is {age} and lives in {city}"
    if kind == 3:
        s = rng.randrange(90)
        return "count: " + " ".join(str(s + i) for i in range(rng.randrange(3, 8)))
    n1, n2 = rng.sample(NOUNS, 2)
    return f"the {rng.choice(ADJS)} {n1} {rng.choice(VERBS)} the {rng.choice(ADJS)} {n2} ."


def task_text(lines: int, seed: int) -> str:
    rng = random.Random(seed)
    return "\n".join(task_line(rng) for _ in range(lines))


def windows(ids: torch.Tensor, seqlen: int) -> torch.Tensor:
    n = ids.numel() // seqlen
    return ids[: n * seqlen].reshape(n, seqlen)


def train(model, data: torch.Tensor, steps: int, batch: int, lr: float, seed: int) -> float:
    """AdamW with warmup + cosine decay on random windows; returns the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        scale = min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        x = data[torch.randint(0, data.shape[0], (batch,), generator=gen)]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step:4d} loss {loss.item():.3f}", flush=True)
    model.eval()
    return loss.item()


@torch.no_grad()
def perplexity(model, data: torch.Tensor, batch: int = 16) -> float:
    """exp of the mean next-token NLL over all held-out windows."""
    nll, count = 0.0, 0
    for x in data.split(batch):
        logits = model(input_ids=x).logits[:, :-1]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    return math.exp(nll / count)


def file_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="trained FP32 model dir to reuse; trained and saved here if missing")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seqlen", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--bits", type=int, nargs="+", default=[2, 3])
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    p.add_argument(
        "--policy-steps",
        type=int,
        default=800,
        help="warm-up steps of the quickstart policy for the accuracy table (0 skips it)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    work = Path(tempfile.mkdtemp(prefix="qbench-"))
    fp_dir = Path(args.model_dir) if args.model_dir else work / "fp32"
    train_text = task_text(20000, seed=args.seed)
    heldout_text = task_text(3000, seed=args.seed + 1000)
    t0 = time.time()
    if (fp_dir / "config.json").exists():
        print(f"reusing {fp_dir}")
        tok, model = load_tokenizer(fp_dir), load_model(fp_dir).eval()
    else:
        tok = train_tokenizer(train_text.split("\n"), vocab_size=512)
        spec = TinyModelSpec(
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        model = build_tiny_model(spec, tok, seed=args.seed)
        data = windows(torch.tensor(tok(train_text)["input_ids"]), args.seqlen)
        print(f"training {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {args.steps} steps")
        train(model, data, args.steps, args.batch, args.lr, args.seed)
        save_model_dir(model, tok, fp_dir)
    print(f"model ready in {time.time() - t0:.0f}s")

    heldout = windows(torch.tensor(tok(heldout_text)["input_ids"]), args.seqlen)
    calib = calibration_from_text(tok, train_text, args.calib_samples, args.seqlen, seed=args.seed)
    fp_bytes = file_bytes(fp_dir)
    rows = [("FP32", "32", "-", perplexity(model, heldout), fp_bytes, "-")]
    names = {"rtn": "round-to-nearest", "gptq": "GPTQ uniform", "slim": "SliM-LLM"}
    ppl = {}
    for bits in args.bits:
        for method in ("rtn", "gptq", "slim"):
            t = time.time()
            cfg = QuantConfig(bits=bits, group_size=args.group, method=method, seed=args.seed)
            qmodel = copy.deepcopy(model)
            qweights = quantize_model(qmodel, calib, cfg)
            out = save_quantized(qmodel, qweights, cfg, work / f"{method}-w{bits}")
            ppl[method, bits] = perplexity(load_quantized(out), heldout)
            rows.append(
                (
                    names[method],
                    str(bits),
                    f"{average_bits(qweights):.3f}",
                    ppl[method, bits],
                    file_bytes(out),
                    f"{time.time() - t:.1f}",
                )
            )
            print(f"  {method} w{bits}: ppl {ppl[method, bits]:.3f}", flush=True)

    print(
        f"\nheld-out perplexity, {heldout.numel()} tokens; group {args.group}; "
        f"calibration {args.calib_samples} x {args.seqlen} tokens\n"
    )
    print("| method | bits | avg bits | perplexity | bytes | vs FP32 | quantise s |")
    print("|---|---|---|---|---|---|---|")
    for name, bits, avg, pp, nbytes, secs in rows:
        print(f"| {name} | {bits} | {avg} | {pp:.3f} | {nbytes:,} | {fp_bytes / nbytes:.2f}x | {secs} |")
    for bits in args.bits:
        print(
            f"\nw{bits}: RTN / SliM-LLM perplexity = {ppl['rtn', bits] / ppl['slim', bits]:.2f}x, "
            f"GPTQ / SliM-LLM = {ppl['gptq', bits] / ppl['slim', bits]:.2f}x"
        )
    if args.policy_steps:
        policy_accuracy_table(work, args)
    return 0


def greedy_accuracy(model, tokenizer, task, rows) -> float:
    """Held-out exact-answer accuracy of greedy answers (the RL loop's evaluation, in-process)."""
    from actors.rollout import HFBackend
    from rlsys.generation import GenerationRequest, SamplingParams

    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    gens = HFBackend("unused", model=model.eval(), batch_size=len(rows)).generate(
        [GenerationRequest(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"], params) for r in rows]
    )
    texts = tokenizer.batch_decode([g.response_ids for g in gens], skip_special_tokens=True)
    return sum(task.is_correct(r, t) for r, t in zip(rows, texts)) / len(rows)


def policy_accuracy_table(work: Path, args) -> None:
    """The quickstart's model warmed up on clean demonstrations (`--policy-steps` SFT steps),
    quantised by each method at 2/3/4 bits, scored on the 200 held-out problems."""
    from rlsys.config import load_config
    from rlsys.run.controller import Controller

    cfg = load_config(
        "configs/quickstart.yaml",
        ["sft.demo_error=0", f"sft.steps={args.policy_steps}", f"run.output_dir={work}", "run.name=policy"],
    )
    t0 = time.time()
    controller = Controller(cfg, work / "policy", progress=False)
    policy_dir = controller.prepare_policy()
    task, tok, model = controller.task, load_tokenizer(policy_dir), load_model(policy_dir).eval()
    rows = task.rows("eval")
    text = "\n".join(r["prompt"] + r["answer"] for r in task.rows("train"))
    calib = calibration_from_text(tok, text, args.calib_samples, args.seqlen, seed=args.seed)
    print(
        f"\nquickstart policy ({args.policy_steps} warm-up steps, {time.time() - t0:.0f}s): held-out greedy accuracy, "
        f"{len(rows)} problems; group {args.group}\n"
    )
    print("| bits | FP32 | round-to-nearest | GPTQ uniform | SliM-LLM | SliM-LLM, SBA with k = 0 (`--sba-uniform`) |")
    print("|---|---|---|---|---|---|")
    fp = greedy_accuracy(model, tok, task, rows)
    for bits in (2, 3, 4):
        cells = []
        for method, uniform in (("rtn", False), ("gptq", False), ("slim", False), ("slim", True)):
            cfg_q = QuantConfig(bits=bits, group_size=args.group, method=method, seed=args.seed, sba_uniform=uniform)
            qmodel = copy.deepcopy(model)
            out = save_quantized(
                qmodel, quantize_model(qmodel, calib, cfg_q), cfg_q, work / f"policy-{method}{'-u' * uniform}-w{bits}"
            )
            cells.append(f"{greedy_accuracy(load_quantized(out), tok, task, rows):.3f}")
        print(f"| {bits} | {fp:.3f} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
