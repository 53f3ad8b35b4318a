"""Writes the example job's dataset: word problems with numeric answers, in the conversational
format of HF datasets (one user message), one JSON object a line.

    {"prompt": [{"role": "user", "content": "Mia has 7 apples. She buys 5 more. ..."}],
     "answer": "12", "steps": 1, "kind": "add"}

One-step problems (add, take away, groups of, share) and two-step ones (buy then give, packs
then eat), numbers small enough for a ~1M-parameter model. Train and eval never share a
problem. The same seed writes the same files:

    python configs/examples/make_word_problems.py            # configs/examples/data/*.jsonl
    python configs/examples/make_word_problems.py --train 2000 --out /tmp/wp
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = [("Mia", "She"), ("Leo", "He"), ("Ana", "She"), ("Sam", "He"), ("Zoe", "She"), ("Ben", "He")]
FRIENDS = ["Ivy", "Max", "Eva", "Tom"]
ITEMS = ["apples", "pens", "stickers", "marbles", "cards", "shells"]


def add(rng: random.Random, name: str, he: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    return f"{name} has {a} {item}. {he} buys {b} more. How many {item} does {name} have now?", a + b


def take_away(rng: random.Random, name: str, he: str, item: str) -> tuple[str, int]:
    a = rng.randint(10, 60)
    b = rng.randint(1, a - 1)
    friend = rng.choice(FRIENDS)
    return f"{name} had {a} {item} and gave {b} to {friend}. How many {item} does {name} have left?", a - b


def groups(rng: random.Random, name: str, he: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?", a * b


def share(rng: random.Random, name: str, he: str, item: str) -> tuple[str, int]:
    each, friends = rng.randint(2, 9), rng.randint(2, 6)
    return (
        f"{name} shares {each * friends} {item} equally among {friends} friends. How many {item} does each friend get?",
        each,
    )


def buy_then_give(rng: random.Random, name: str, he: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    c = rng.randint(1, a + b - 1)
    friend = rng.choice(FRIENDS)
    return (
        f"{name} has {a} {item}. {he} buys {b} more and then gives {c} to {friend}. "
        f"How many {item} does {name} have now?",
        a + b - c,
    )


def packs_then_eat(rng: random.Random, name: str, he: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(2, 6), rng.randint(2, 9)
    c = rng.randint(1, a * b - 1)
    return (
        f"{name} buys {a} packs of {b} {item} and loses {c} of them. How many {item} does {name} have left?",
        a * b - c,
    )


KINDS = {  # kind -> (steps, generator)
    "add": (1, add),
    "take_away": (1, take_away),
    "groups": (1, groups),
    "share": (1, share),
    "buy_then_give": (2, buy_then_give),
    "packs_then_eat": (2, packs_then_eat),
}


def problem(rng: random.Random) -> dict:
    """One random problem as a dataset row."""
    kind = rng.choice(list(KINDS))
    steps, make = KINDS[kind]
    name, he = rng.choice(NAMES)
    text, answer = make(rng, name, he, rng.choice(ITEMS))
    return {"prompt": [{"role": "user", "content": text}], "answer": str(answer), "steps": steps, "kind": kind}


def generate(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Distinct problems (by text), the first n_eval held out."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < n_train + n_eval:
        row = problem(rng)
        text = row["prompt"][0]["content"]
        if text not in seen:
            seen.add(text)
            rows.append(row)
    return rows[n_eval:], rows[:n_eval]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=4000, help="training problems")
    parser.add_argument("--eval", type=int, default=100, help="held-out problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    args = parser.parse_args(argv)
    train, held_out = generate(args.train, args.eval, args.seed)
    for split, rows in (("train", train), ("eval", held_out)):
        print(write_jsonl(rows, args.out / f"word_problems_{split}.jsonl"), len(rows))


if __name__ == "__main__":
    main()
