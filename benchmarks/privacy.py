"""Vocab-matching attack vs plain, permuted and Cascade views: token recovery rate and search
cost per token, as a markdown table.

Two tiny Qwen2 models over one BPE: a random-init one and the same one briefly trained on
templated English, so the proposal (the model's own next-token distribution) means something.
Prompts are held-out sentences of the same template, tokenised and cut to --length tokens.
Every view is attacked under the same budget (whole vocabulary per observed position).

    .venv/bin/python benchmarks/privacy.py [--prompts 8] [--length 24] [--layer 2] [--train-steps 300] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from rlsys.models import TinyModelSpec, build_tiny_model, train_tokenizer
from rlsys.privacy.attack import AttackConfig
from rlsys.privacy.evaluate import attack_cascade_parties, evaluate

SUBJECTS = [
    "the cat",
    "a dog",
    "my friend",
    "the old man",
    "our teacher",
    "a small bird",
    "the farmer",
    "her sister",
    "the king",
    "a young girl",
]
VERBS = ["sees", "likes", "finds", "carries", "paints", "follows", "feeds", "watches", "builds", "sells"]
OBJECTS = [
    "a red ball",
    "the green house",
    "some fresh bread",
    "an old book",
    "the tall tree",
    "a blue boat",
    "the quiet river",
    "two white stones",
    "a warm coat",
    "the big box",
]
PLACES = [
    "in the garden",
    "near the market",
    "after dinner",
    "every morning",
    "by the sea",
    "at the station",
    "under the bridge",
    "in the snow",
]


def sentences(n: int, seed: int) -> list[str]:
    """n sentences of the template subject verb object [place]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        if rng.random() < 0.7:
            s += f" {rng.choice(PLACES)}"
        out.append(s + ".")
    return out


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    return torch.tensor([i for t in texts for i in tok(" " + t)["input_ids"]])


def train(model, stream: torch.Tensor, steps: int, seqlen: int = 32, batch: int = 32, seed: int = 0) -> float:
    """Next-token training on random windows of `stream`; returns the last loss."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(0, stream.numel() - seqlen - 1, (batch,), generator=g)
        x = torch.stack([stream[s : s + seqlen] for s in starts.tolist()])
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def prompts_from(tok, texts: list[str], n: int, length: int) -> list[torch.Tensor]:
    """n prompts of `length` tokens, each cut from consecutive held-out sentences."""
    stream = token_stream(tok, texts)
    return [stream[i * length : (i + 1) * length] for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--length", type=int, default=24)
    p.add_argument("--layer", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--c", type=int, default=2)
    p.add_argument("--delta", type=int, default=3)
    p.add_argument(
        "--batch-size", type=int, default=32, help="candidates per forward pass; cost is counted in whole batches"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    tok = train_tokenizer(sentences(4000, seed=args.seed), vocab_size=512)
    spec = TinyModelSpec()
    random_model = build_tiny_model(spec, tok, seed=args.seed).eval()
    trained = build_tiny_model(spec, tok, seed=args.seed)
    t0 = time.perf_counter()
    loss = train(trained, token_stream(tok, sentences(4000, seed=args.seed)), args.train_steps, seed=args.seed)
    train_s = time.perf_counter() - t0
    prompts = prompts_from(tok, sentences(400, seed=args.seed + 1), args.prompts, args.length)

    print(
        f"tiny Qwen2 ({spec.num_hidden_layers} layers, d={spec.hidden_size}, V={len(tok)}); "
        f"trained {args.train_steps} steps in {train_s:.0f} s to loss {loss:.2f}; "
        f"{args.prompts} held-out prompts x {args.length} tokens; hidden state {args.layer}; "
        f"budget = whole vocabulary per observed position, batches of {args.batch_size}; "
        f"Cascade (c={args.c}, delta={args.delta}); torch threads 1\n"
    )
    print(
        "| model | proposal | view | tokens recovered | matched under epsilon "
        "| worst single view | candidates / token | ms / token |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    runs = [("random init", random_model, "model"), ("trained", trained, "model"), ("trained", trained, "vocab")]
    for name, model, proposal in runs:
        ev = evaluate(
            model,
            prompts,
            args.layer,
            AttackConfig(batch_size=args.batch_size, proposal=proposal),
            args.c,
            args.delta,
            seed=args.seed,
        )
        for s in ev.scores:
            print(
                f"| {name} | {proposal} | {s.view} | {100 * s.recovery:.1f}% "
                f"| {100 * s.matched:.1f}% | {100 * s.worst_recovery:.1f}% "
                f"| {s.candidates_per_token:.1f} | {s.ms_per_token:.2f} |"
            )
    print(
        f"\nCascade: {ev.n_parties} compute parties per prompt; "
        f"sharded logits max |diff| vs plain {ev.cascade_max_logit_diff:.1e}"
    )

    print("\nOne Cascade compute party's view vs the sharding (trained model, proposal = model):\n")
    print(
        "| c | delta | compute parties | tokens recovered "
        "| matched under epsilon | worst single view | candidates / token |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for c, delta in [(2, 1), (2, 2), (2, 3), (2, 4), (4, 3), (args.length, 1)]:
        s, _, parties = attack_cascade_parties(
            trained, prompts, args.layer, AttackConfig(batch_size=args.batch_size), c, delta
        )
        print(
            f"| {c} | {delta} | {parties} | {100 * s.recovery:.1f}% "
            f"| {100 * s.matched:.1f}% | {100 * s.worst_recovery:.1f}% "
            f"| {s.candidates_per_token:.1f} |"
        )


if __name__ == "__main__":
    main()
