"""SpeCache vs the full KV cache on a trained tiny model with long prompts.

    .venv/bin/python benchmarks/kvcache.py [--train-seconds 120] [--model-dir runs/kvcache-bench/model]

The model is a 2-layer Qwen2-style decoder trained here on generated text in which
attention matters: a block of distinct words repeated (the continuation is a copy of the
block, so every next token has to be found one block back). The trained model is saved to
`--model-dir` and reused by later runs (`--retrain` to train again). Prompts are ~1k tokens
whose block (150-250 words) is longer than any recent window, so the tokens to copy are
always in the quantised part of the cache.

Prints one markdown table: fast-tier bytes per config (the low-bit copy, the recent window
and the prefetched top-k, all layers and the whole batch), compression vs the full cache,
greedy token agreement with the full cache (position-wise, and the mean common prefix),
how often the speculative token equalled the real next token, how many prefetches were
complete when the layer needed them, and tokens/s (batch, prefill included), with the full
cache in the same run. `copy acc` is the share of generated tokens that continue the block
correctly (the model's own skill, full cache included).
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from pathlib import Path

import torch

from rlsys.kvcache import full_cache_generate, specache_generate
from rlsys.models import TinyModelSpec, build_tiny_model, load_model, load_tokenizer, save_model_dir, train_tokenizer

SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def word_pool(seed: int = 0, size: int = 320) -> list[str]:
    words = ["".join(p) for p in itertools.product(SYLLABLES, repeat=2)]
    random.Random(seed).shuffle(words)
    return words[:size]


def repeated_block(rng: random.Random, words: list[str], block_len: int, n_words: int) -> list[str]:
    """A block of `block_len` distinct words repeated, cut to `n_words` words."""
    block = rng.sample(words, block_len)
    return (block * (n_words // block_len + 1))[:n_words]


def encode(tok, words: list[str]) -> list[int]:
    return [tok.bos_token_id] + tok(" " + " ".join(words))["input_ids"]


def train(args, words: list[str]):
    rng = random.Random(1)
    tok = train_tokenizer([" " + " ".join(words)] * 8, vocab_size=2048)
    assert all(len(tok(" " + w)["input_ids"]) == 1 for w in words), "every word must be one token"
    spec = TinyModelSpec(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=2048)
    model = build_tiny_model(spec, tok, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start, step, losses = time.perf_counter(), 0, []
    while time.perf_counter() - start < args.train_seconds:
        rows = [encode(tok, repeated_block(rng, words, rng.randint(16, 250), args.train_len))[: args.train_len] for _ in range(args.train_batch)]
        x = torch.tensor(rows)
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 50)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 50 == 0:
            print(f"train step {step} ({time.perf_counter() - start:.0f}s) loss {sum(losses[-50:]) / 50:.3f}", flush=True)
    model.eval()
    info = {"steps": step, "seconds": round(time.perf_counter() - start), "final_loss": round(sum(losses[-50:]) / min(50, len(losses)), 3),
            "train_len": args.train_len, "train_batch": args.train_batch, "lr": args.lr}
    save_model_dir(model, tok, args.model_dir)
    (Path(args.model_dir) / "training.json").write_text(json.dumps(info))
    return model, tok, info


def prompts(tok, words: list[str], batch: int, prompt_words: int, new_tokens: int, seed: int):
    """Left-padded prompts (lengths vary by up to 10%) and each one's true continuation."""
    rng = random.Random(seed)
    rows, targets = [], []
    for _ in range(batch):
        n = rng.randint(int(prompt_words * 0.9), prompt_words)
        seq = repeated_block(rng, words, rng.randint(150, 250), n + new_tokens)
        ids = encode(tok, seq)
        rows.append(ids[: n + 1])
        targets.append(ids[n + 1 :])
    width = max(map(len, rows))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return input_ids, mask, torch.tensor(targets)


def row(name, seq, stats, seconds, full_new, target, prompt_len, full_bytes):
    new = seq[:, prompt_len:]
    same = new == full_new
    prefix = same.long().cumprod(1).sum(1).float().mean().item() / new.shape[1]
    tps = new.numel() / seconds
    return (f"| {name} | {stats.fast_tier_bytes / 2**20:.2f} | {full_bytes / max(stats.fast_tier_bytes, 1):.1f}x "
            f"| {same.float().mean().item():.3f} | {prefix:.3f} | {(new == target).float().mean().item():.3f} "
            f"| {stats.spec_accuracy:.3f} | {stats.fetch_overlap:.2f} | {tps:.0f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="runs/kvcache-bench/model")
    p.add_argument("--retrain", action="store_true")
    p.add_argument("--train-seconds", type=float, default=120)
    p.add_argument("--train-len", type=int, default=512)
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    words = word_pool()

    if args.retrain or not (Path(args.model_dir) / "config.json").exists():
        model, tok, info = train(args, words)
    else:
        model, tok = load_model(args.model_dir).eval(), load_tokenizer(args.model_dir)
        info = json.loads((Path(args.model_dir) / "training.json").read_text())
    input_ids, mask, target = prompts(tok, words, args.batch, args.prompt_words, args.new_tokens, seed=7)
    prompt_len = input_ids.shape[1]
    common = dict(max_new_tokens=args.new_tokens, eos_token_id=[])

    start = time.perf_counter()
    full_seq, _, full_stats = full_cache_generate(model, input_ids, mask, **common)
    full_seconds = time.perf_counter() - start
    full_new = full_seq[:, prompt_len:]
    full_bytes = full_stats.fast_tier_bytes

    configs = [  # (name, bits, k, window)
        ("specache 1-bit, k=L (exact)", 1, prompt_len + args.new_tokens, 32),
        ("specache 2-bit, k=64, w=32 (~5x)", 2, 64, 32),
        ("specache 1-bit, k=64, w=32", 1, 64, 32),
        ("specache 1-bit, k=16, w=8 (~10x)", 1, 16, 8),
        ("low-bit only: 1-bit, k=0, w=8", 1, 0, 8),
    ]
    print(f"\nmodel: 2 layers, hidden 128, 4 heads / 2 KV heads, trained {info['steps']} steps "
          f"({info['seconds']}s, loss {info['final_loss']}); batch {args.batch}, prompts {prompt_len} slots "
          f"(left-padded), {args.new_tokens} new tokens, greedy, {args.threads} thread(s)\n")
    print("| cache | fast tier MiB | compression | token agreement | common prefix | copy acc | spec-token acc | prefetch ready | tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    full_stats.spec_hits = full_stats.spec_tokens = 0
    print(row("full cache (DynamicCache)", full_seq, full_stats, full_seconds, full_new, target, prompt_len, full_bytes)
          .replace(f"| {full_stats.spec_accuracy:.3f} | {full_stats.fetch_overlap:.2f} |", "| - | - |"))
    for name, bits, k, window in configs:
        start = time.perf_counter()
        seq, _, stats = specache_generate(model, input_ids, mask, k=k, bits=bits, window=window, **common)
        print(row(name, seq, stats, time.perf_counter() - start, full_new, target, prompt_len, full_bytes), flush=True)


if __name__ == "__main__":
    main()
