"""Vocab-matching attack vs plain, permuted and Cascade views: token recovery rate and search
cost per token, as markdown tables, and recovery per kind of Cascade party with its worst prompt.

Two tiny Qwen2 models over one BPE: a random-init one and the same one briefly trained on
templated English, so the proposal (the model's own next-token distribution) means something.
Held-out prompts are sentences of the same template, tokenised and cut to --length tokens;
low-entropy prompts are repeated tokens, repeated sentences, a fixed form letter with two slots
and the trained model's own greedy text. Every view is attacked under the same budget (whole
vocabulary per observed position). Cascade parties: every compute party and diagonal attention
party (i, i), and a seeded sample of --parties off-diagonal attention parties (i, j), per prompt.

    .venv/bin/python benchmarks/privacy.py [--prompts 8] [--length 24] [--layer 2] [--train-steps 300]
        [--batch-size 32] [--parties 12]
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch

from rlsys.models import TinyModelSpec, build_tiny_model, train_tokenizer
from rlsys.privacy.attack import AttackConfig
from rlsys.privacy.evaluate import (
    COMPUTE_PARTY,
    ViewScore,
    attack_cascade_parties,
    evaluate,
    percent,
)

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


FORM_LETTER = "{who} sees {what} in the garden. {who} likes {what} every morning. {who} sells {what} at the station."
FORM_SLOTS = [("the farmer", "a blue boat"), ("her sister", "an old book"), ("the king", "a warm coat")]
REPEATED_SENTENCES = ["the cat sees a red ball.", "a dog follows the tall tree by the sea."]
REPEATED_WORD = "the"
GREEDY_STARTS = ["the cat", "a dog"]


def tiled(ids: torch.Tensor, length: int) -> torch.Tensor:
    """ids repeated end to end and cut to `length` tokens."""
    return ids.repeat(math.ceil(length / ids.numel()))[:length]


@torch.no_grad()
def greedy_text(model, start: torch.Tensor, length: int) -> torch.Tensor:
    """`start` extended by the model's most likely next token to `length` tokens."""
    ids = start.clone()
    while ids.numel() < length:
        ids = torch.cat([ids, model(ids[None]).logits[0, -1].argmax()[None]])
    return ids[:length]


def low_entropy_prompts(tok, model, length: int) -> list[tuple[str, torch.Tensor]]:
    """(label, ids) of prompts with few distinct tokens: a word repeated, a sentence repeated, a
    fixed form letter with two slots filled, and the model's own greedy text (the least surprising
    text to the model by construction)."""
    prompts = [(f"'{REPEATED_WORD}' repeated", tiled(token_stream(tok, [REPEATED_WORD])[:1], length))]
    prompts += [(f"'{s}' repeated", tiled(token_stream(tok, [s]), length)) for s in REPEATED_SENTENCES]
    prompts += [
        (f"form letter ({who} / {what})", tiled(token_stream(tok, [FORM_LETTER.format(who=who, what=what)]), length))
        for who, what in FORM_SLOTS
    ]
    prompts += [
        (f"the model's greedy text after '{start}'", greedy_text(model, token_stream(tok, [start]), length))
        for start in GREEDY_STARTS
    ]
    return prompts


@torch.no_grad()
def bits_per_token(model, prompts: list[torch.Tensor]) -> float:
    """The model's mean next-token cross-entropy over the prompts, in bits per token."""
    return sum(float(model(ids[None], labels=ids[None]).loss) for ids in prompts) / len(prompts) / math.log(2)


def party_rows(
    model, prompts: list[torch.Tensor], layer: int, at_layer: list[ViewScore], args
) -> list[tuple[str, ViewScore]]:
    """(what the party holds, score) per party type, at hidden state / decoder layer 0 (attacked
    here) and at `layer` (`at_layer`, from the evaluation), compute party first."""
    at_zero, _, _ = attack_cascade_parties(
        model,
        prompts,
        0,
        AttackConfig(batch_size=args.batch_size),
        args.c,
        args.delta,
        max_parties=args.parties,
        seed=args.seed,
    )
    by_name = {s.view: s for s in at_layer}
    rows = []
    for zero in at_zero:
        holds = "hidden state {}" if zero.view == COMPUTE_PARTY else "layer {} K/V + Q"
        rows += [(holds.format(0), zero), (holds.format(layer), by_name[zero.view])]
    return rows


def print_party_table(settings, layer: int, args) -> None:
    """Recovery per party type, mean and worst prompt, for each (model, prompt set)."""
    print(
        "| model | prompts | view | rows held | tokens recovered (mean) | worst prompt | worst prompt's recovery "
        "| held positions recovered | matched under epsilon |"
    )
    print("|---|---|---|---|---:|---|---:|---:|---:|")
    for model_name, model, set_name, prompts, labels, ev in settings:
        by_name = {s.view: s for s in ev.scores}
        parties = party_rows(model, prompts, layer, ev.scores, args)
        rows = [(f"hidden state {layer}", by_name[v]) for v in ("plain", "rows + entries permuted")]
        rows += parties + [("nothing", by_name["no view (chance)"])]
        for holds, s in rows:
            print(
                f"| {model_name} | {set_name} | {s.view} | {holds} | {percent(s.recovery)} | {labels[s.worst_prompt]} "
                f"| {percent(s.worst_recovery)} | {percent(s.held_recovery)} | {percent(s.matched)} |"
            )


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
    p.add_argument(
        "--parties", type=int, default=12, help="Cascade parties of each type attacked per prompt (seeded sample)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    tok = train_tokenizer(sentences(4000, seed=args.seed), vocab_size=512)
    spec = TinyModelSpec()
    random_model = build_tiny_model(spec, tok, seed=args.seed).eval()
    trained = build_tiny_model(spec, tok, seed=args.seed)
    t0 = time.perf_counter()
    loss = train(trained, token_stream(tok, sentences(4000, seed=args.seed)), args.train_steps, seed=args.seed)
    train_s = time.perf_counter() - t0
    held_out = prompts_from(tok, sentences(400, seed=args.seed + 1), args.prompts, args.length)
    held_out_labels = [f"held-out #{i}" for i in range(len(held_out))]
    low = low_entropy_prompts(tok, trained, args.length)
    low_labels, low_prompts = [label for label, _ in low], [ids for _, ids in low]

    print(
        f"tiny Qwen2 ({spec.num_hidden_layers} layers, d={spec.hidden_size}, V={len(tok)}); "
        f"trained {args.train_steps} steps in {train_s:.0f} s to loss {loss:.2f}; "
        f"{args.prompts} held-out prompts ({bits_per_token(trained, held_out):.2f} bits/token under the trained "
        f"model) and {len(low_prompts)} low-entropy prompts ({bits_per_token(trained, low_prompts):.2f} bits/token) "
        f"x {args.length} tokens; hidden state {args.layer}; "
        f"budget = whole vocabulary per observed position, batches of {args.batch_size}; "
        f"Cascade (c={args.c}, delta={args.delta}), {args.parties} parties of each type per prompt; torch threads 1\n"
    )
    print(
        "| model | prompts | proposal | view | tokens recovered | matched under epsilon "
        "| worst single view | candidates / token | ms / token |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    runs = [
        ("random init", random_model, "held-out", held_out, held_out_labels, "model"),
        ("trained", trained, "held-out", held_out, held_out_labels, "model"),
        ("trained", trained, "held-out", held_out, held_out_labels, "vocab"),
        ("trained", trained, "low-entropy", low_prompts, low_labels, "model"),
    ]
    settings = []
    for name, model, set_name, prompts, labels, proposal in runs:
        ev = evaluate(
            model,
            prompts,
            args.layer,
            AttackConfig(batch_size=args.batch_size, proposal=proposal),
            args.c,
            args.delta,
            seed=args.seed,
            max_parties=args.parties,
        )
        if proposal == "model":
            settings.append((name, model, set_name, prompts, labels, ev))
        for s in ev.scores:
            print(
                f"| {name} | {set_name} | {proposal} | {s.view} | {percent(s.recovery)} "
                f"| {percent(s.matched)} | {percent(s.worst_recovery)} "
                f"| {s.candidates_per_token:.1f} | {s.ms_per_token:.2f} |"
            )
    print(
        f"\nCascade: {ev.n_parties} compute parties per prompt; "
        f"sharded logits max |diff| vs plain {ev.cascade_max_logit_diff:.1e}"
    )

    print(
        "\nRecovery per party type (proposal = model): mean over prompts and parties; worst prompt = the prompt "
        "on which one party of that type recovers most. Layer 0 rows depend on each token and its position "
        "alone.\n"
    )
    print_party_table(settings, args.layer, args)
    print("\nLow-entropy prompts (distinct tokens; bits/token under the trained model):")
    for label, ids in low:
        print(f"- {label} ({ids.unique().numel()}; {bits_per_token(trained, [ids]):.2f}): {tok.decode(ids.tolist())!r}")

    print("\nOne Cascade compute party's view vs the sharding (trained model, held-out prompts, proposal = model):\n")
    print(
        "| c | delta | compute parties | tokens recovered "
        "| matched under epsilon | worst single view | candidates / token |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for c, delta in [(2, 1), (2, 2), (2, 3), (2, 4), (4, 3), (args.length, 1)]:
        (s,), _, parties = attack_cascade_parties(
            trained,
            held_out,
            args.layer,
            AttackConfig(batch_size=args.batch_size),
            c,
            delta,
            party_types=(COMPUTE_PARTY,),
        )
        print(
            f"| {c} | {delta} | {parties} | {percent(s.recovery)} "
            f"| {percent(s.matched)} | {percent(s.worst_recovery)} "
            f"| {s.candidates_per_token:.1f} |"
        )
    print(f"\nwall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
