"""SpeCache vs the full KV cache on a trained tiny model with long prompts.

    .venv/bin/python benchmarks/kvcache.py [--retrain] [--train-seconds 240] [--model-dir runs/kvcache-bench/model]

The model is a 2-layer Qwen2-style decoder trained here, on generated text, for
`--train-seconds` (one thread): a sparse Markov chain of words (local structure) with a
needle word planted every 64-256 words; each query mark `?` is followed by the most recent
needle (see `Language`). The trained model is saved to `--model-dir` and reused by later
runs (`--retrain` trains again). The prompts are ~1k tokens (left-padded); a needle answer
generated in a decode step has to be retrieved from far back, past the recent window.

Prints one markdown table, the full cache first (same run, same prompts): fast-tier bytes
(the low-bit copy, the recent window and the prefetched top-k; all layers, whole batch),
compression vs the full cache, greedy agreement with the full cache (position-wise, and the
mean common prefix as a share of the new tokens), needle answers
(correct/total answers after the query marks the model generated),
how often the speculative token equalled the real next token, the share of prefetches
complete when their layer needed them, and tokens/s (generated tokens of the whole batch
per second of generate, prefill included).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlsys.kvcache import SpeCacheStats, full_cache_generate, specache_generate
from rlsys.models import TinyModelSpec, build_tiny_model, load_model, load_tokenizer, save_model_dir, train_tokenizer

SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
QUERY = "?"


def word_pool(seed: int = 0, size: int = 160) -> list[str]:
    words = ["".join(p) for p in itertools.product(SYLLABLES, repeat=2)]
    random.Random(seed).shuffle(words)
    return words[:size]


@dataclass
class Language:
    """Haystack words follow a sparse Markov chain (4 successors with probabilities
    0.6/0.25/0.1/0.05: local structure the model learns quickly and predicts confidently).
    Every 64-256 words a needle word is planted. "Asking" haystack words are always followed
    by the query mark `?` and then the most recently planted needle, so answering means
    finding that needle, often hundreds of tokens back, among older ones."""

    haystack: list[str]
    needles: list[str]
    asking: set[str]
    successors: dict[str, list[str]]
    weights: tuple[float, ...] = (0.6, 0.25, 0.1, 0.05)

    @classmethod
    def make(cls, words: list[str], n_needles: int = 32, n_asking: int = 16, seed: int = 0) -> "Language":
        rng = random.Random(seed)
        haystack, needles = words[n_needles:], words[:n_needles]
        return cls(
            haystack, needles, set(rng.sample(haystack, n_asking)), {w: rng.sample(haystack, 4) for w in haystack}
        )

    def document(self, rng: random.Random, n_words: int) -> tuple[list[str], str | None]:
        """About `n_words` words and the needle that answers a query at the end."""
        state, out, needle, plant = rng.choice(self.haystack), [], None, rng.randint(0, 64)
        while len(out) < n_words:
            if len(out) >= plant:
                needle = rng.choice(self.needles)
                out.append(needle)
                plant = len(out) + rng.randint(64, 256)
            else:
                state = rng.choices(self.successors[state], self.weights)[0]
                out += [state, QUERY, needle] if state in self.asking and needle is not None else [state]
        return out, needle

    def needle_hits(self, tokens: list[str], needle: str) -> tuple[int, int]:
        """(correct, total) answers after `?` in generated `tokens`, tracking newly planted needles."""
        hits = total = 0
        for prev, tok in zip([""] + tokens, tokens):
            if prev == QUERY:
                hits, total = hits + (tok == needle), total + 1
            elif tok in self.needles:
                needle = tok
        return hits, total


def encode(tok, words: list[str]) -> list[int]:
    return [tok.bos_token_id] + tok(" " + " ".join(words))["input_ids"]


def train(args, lang: Language):
    rng = random.Random(1)
    vocab = lang.haystack + lang.needles + [QUERY]
    tok = train_tokenizer([" " + " ".join(vocab)] * 8, vocab_size=1024)
    assert all(len(tok(" " + w)["input_ids"]) == 1 for w in vocab), "every word must be one token"
    spec = TinyModelSpec(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    model = build_tiny_model(spec, tok, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    query_id = tok.convert_tokens_to_ids("Ġ" + QUERY)
    start, step, losses, hits = time.perf_counter(), 0, [], []
    while time.perf_counter() - start < args.train_seconds:
        x = torch.tensor(
            [encode(tok, lang.document(rng, args.train_len)[0])[: args.train_len] for _ in range(args.train_batch)]
        )
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 50)
        out = model(input_ids=x, labels=x)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        at_query = x[:, :-1] == query_id
        hits.append((out.logits[:, :-1].argmax(-1) == x[:, 1:])[at_query].float().mean().item())
        losses.append(out.loss.item())
        step += 1
        if step % 50 == 0:
            print(
                f"train step {step} ({time.perf_counter() - start:.0f}s) loss {sum(losses[-50:]) / 50:.3f} "
                f"needle acc {sum(hits[-50:]) / 50:.3f}",
                flush=True,
            )
    model.eval()
    info = {
        "steps": step,
        "seconds": round(time.perf_counter() - start),
        "final_loss": round(sum(losses[-50:]) / min(50, len(losses)), 3),
        "needle_acc": round(sum(hits[-50:]) / min(50, len(hits)), 3),
        "train_len": args.train_len,
        "hidden": args.hidden,
    }
    save_model_dir(model, tok, args.model_dir)
    (Path(args.model_dir) / "training.json").write_text(json.dumps(info))
    return model, tok, info


def prompts(tok, lang: Language, batch: int, prompt_words: int, seed: int):
    """Left-padded prompts (lengths vary by up to 10%) and the needle each one ends with."""
    rng = random.Random(seed)
    rows, needles = [], []
    for _ in range(batch):
        words, needle = lang.document(rng, rng.randint(int(prompt_words * 0.9), prompt_words))
        rows.append(encode(tok, words))
        needles.append(needle)
    width = max(map(len, rows))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return input_ids, mask, needles


def needle_accuracy(tok, lang: Language, new: torch.Tensor, needles: list[str]) -> str:
    """Correct answers after the generated query marks, over all prompts: "hits/total"."""
    hits = total = 0
    for row, needle in zip(new.tolist(), needles):
        h, t = lang.needle_hits([w.removeprefix("Ġ") for w in tok.convert_ids_to_tokens(row)], needle)
        hits, total = hits + h, total + t
    return f"{hits}/{total}"


def row(
    name: str,
    new: torch.Tensor,
    full_new: torch.Tensor,
    seconds: float,
    fast_bytes: int,
    full_bytes: int,
    needle_acc: str,
    stats: SpeCacheStats | None,
) -> str:
    same = new == full_new
    prefix = same.long().cumprod(1).sum(1).float().mean().item() / new.shape[1]
    spec = f"{stats.spec_accuracy:.3f} | {stats.fetch_overlap:.2f}" if stats is not None else "- | -"
    return (
        f"| {name} | {fast_bytes / 2**20:.2f} | {full_bytes / fast_bytes:.1f}x | {same.float().mean().item():.3f} "
        f"| {prefix:.3f} | {needle_acc} | {spec} | {new.numel() / seconds:.0f} |"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="runs/kvcache-bench/model")
    p.add_argument("--retrain", action="store_true")
    p.add_argument("--train-seconds", type=float, default=240)
    p.add_argument("--train-len", type=int, default=512)
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lang = Language.make(word_pool())

    if args.retrain or not (Path(args.model_dir) / "config.json").exists():
        model, tok, info = train(args, lang)
    else:
        model, tok = load_model(args.model_dir).eval(), load_tokenizer(args.model_dir)
        info = json.loads((Path(args.model_dir) / "training.json").read_text())
    input_ids, mask, needles = prompts(tok, lang, args.batch, args.prompt_words, seed=7)
    prompt_len = input_ids.shape[1]
    common = dict(max_new_tokens=args.new_tokens, eos_token_id=[])

    start = time.perf_counter()
    full_seq, _, full_stats = full_cache_generate(model, input_ids, mask, **common)
    full_seconds = time.perf_counter() - start
    full_new, full_bytes = full_seq[:, prompt_len:], full_stats.fast_tier_bytes

    configs = [  # (name, bits, k, window)
        ("specache 1-bit, k=L (exact)", 1, prompt_len + args.new_tokens, 32),
        ("specache 2-bit, k=64, w=32", 2, 64, 32),
        ("specache 1-bit, k=64, w=32", 1, 64, 32),
        ("specache 1-bit, k=16, w=8", 1, 16, 8),
        ("low-bit only: 1-bit, k=0, w=8", 1, 0, 8),
    ]
    print(
        f"\nmodel: 2 layers, hidden {info['hidden']}, 4 heads / 2 KV heads, trained {info['steps']} steps "
        f"({info['seconds']}s, loss {info['final_loss']}, train needle acc {info['needle_acc']}); batch {args.batch}, "
        f"prompts of {prompt_len} slots (left-padded), {args.new_tokens} new tokens, greedy, {args.threads} thread(s)\n"
    )
    print(
        "| cache | fast tier MiB | compression | token agreement | common prefix | needle answers "
        "| spec-token acc | prefetch ready | tokens/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        row(
            "full cache (DynamicCache)",
            full_new,
            full_new,
            full_seconds,
            full_bytes,
            full_bytes,
            needle_accuracy(tok, lang, full_new, needles),
            None,
        ),
        flush=True,
    )
    for name, bits, k, window in configs:
        start = time.perf_counter()
        seq, _, stats = specache_generate(model, input_ids, mask, k=k, bits=bits, window=window, **common)
        new = seq[:, prompt_len:]
        print(
            row(
                name,
                new,
                full_new,
                time.perf_counter() - start,
                stats.fast_tier_bytes,
                full_bytes,
                needle_accuracy(tok, lang, new, needles),
                stats,
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
