"""The reasoning task's data: long multiplication worked out in written steps, each line a step,
the final answer in \\boxed{}, in the conversational format of HF datasets (one JSON object a line):

    {"prompt": [{"role": "user", "content": "Compute 47 * 38 step by step."}], "answer": "1786",
     "solution": "47 * 8 = 40 * 8 + 7 * 8 = 320 + 56 = 376.\\n47 * 30 = ... = 1410.\\n
                  376 + 1410 = 1786.\\nThe answer is \\\\boxed{1786}.",
     "flawed_solution": "...", "flaw_step": 1}

One line per digit of the second factor (its partial product, split over the first factor's
digits), then the partial products summed line by line, then the boxed answer: 4 lines (3 steps
for VinePPO's `split_steps`, which merges the answer line into the last step) for 2-digit by
2-digit, ~80-100 tokens with a digit-level tokenizer. The flawed solution, as imperfect SFT data,
drops the carries of one step's addition (`flaw_step`, 0-based; a step with no carry gets one
added instead) and carries the wrong value through the later steps, so its final answer is wrong.
Train and eval never share a problem. The same seed writes the same files:

    python -m envs.long_multiplication                     # configs/data/multiplication_{train,eval}.jsonl
    python -m envs.long_multiplication --digits 3 2 --train 2000 --out /tmp/mul
    python -m envs.long_multiplication --mix 2x2:0.7 3x3:0.2 4x4:0.1 --out /tmp/mul   # lengths with a long tail
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from envs.datasets import write_rows

PROMPT = "Compute {a} * {b} step by step."


def add_without_carry(x: int, y: int) -> int:
    """x + y digit by digit, each digit's carry dropped (the flaw of written addition); when
    nothing carries, the sum with a carry added to its tens (still a plausible slip, still wrong)."""
    digits, place, a, b = 0, 1, x, y
    while a or b:
        digits += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return digits if digits != x + y else x + y + 10


def partial_line(a: int, digit: int, place: int, flawed: bool = False) -> tuple[str, int]:
    """'a * (digit * place) = sum of a's digit parts times it = ... = value.', the value (the flawed
    one when `flawed`: the parts added with their carries dropped)."""
    m = digit * place
    parts = [int(d) * 10 ** (len(str(a)) - 1 - i) for i, d in enumerate(str(a))]
    parts = [p for p in parts if p] or [0]
    products = [p * m for p in parts]
    value = sum(products)
    if flawed:
        value = products[0]
        for p in products[1:]:
            value = add_without_carry(value, p)
        if value == sum(products):  # a single part: nothing to add, the slip is in the product
            value += 10 * place
    split = " + ".join(f"{p} * {m}" for p in parts)
    summed = " + ".join(str(p) for p in products)
    text = f"{a} * {m} = {split} = {summed} = {value}." if len(parts) > 1 else f"{a} * {m} = {value}."
    return text, value


def solution(a: int, b: int, flaw_step: int | None = None) -> tuple[str, int]:
    """The worked solution of a * b, its lines joined by newlines, and its final answer; with
    `flaw_step`, that step is wrong and every later one uses its wrong value."""
    lines, partials, step = [], [], 0
    for i, d in enumerate(reversed(str(b))):
        text, value = partial_line(a, int(d), 10**i, flawed=step == flaw_step)
        lines.append(text)
        partials.append(value)
        step += 1
    total = partials[0]
    for p in partials[1:]:
        right = total + p
        value = add_without_carry(total, p) if step == flaw_step else right
        lines.append(f"{total} + {p} = {value}.")
        total, step = value, step + 1
    lines.append(f"The answer is \\boxed{{{total}}}.")
    return "\n".join(lines), total


def num_steps(b: int) -> int:
    """The steps of a solution whose second factor is b: a partial product per digit, then one
    addition fewer than the digits."""
    return 2 * len(str(b)) - 1


def problems(n: int, digits: tuple[int, int], rng: random.Random, exclude: set = frozenset()) -> list[tuple[int, int]]:
    """n distinct (a, b) with the given digit counts, none in `exclude`."""
    lo = [10 ** (d - 1) for d in digits]
    hi = [10**d - 1 for d in digits]
    space = (hi[0] - lo[0] + 1) * (hi[1] - lo[1] + 1) - len(exclude)
    if n > space:
        raise ValueError(f"{n} problems asked of {digits}-digit factors, {space} exist")
    out: dict[tuple[int, int], None] = {}
    while len(out) < n:
        pair = (rng.randint(lo[0], hi[0]), rng.randint(lo[1], hi[1]))
        if pair not in exclude:
            out[pair] = None
    return list(out)


def row(a: int, b: int, rng: random.Random) -> dict:
    text, answer = solution(a, b)
    assert answer == a * b, (a, b, answer)
    flaw = rng.randrange(num_steps(b))
    flawed, _ = solution(a, b, flaw)
    return {
        "prompt": [{"role": "user", "content": PROMPT.format(a=a, b=b)}],
        "answer": str(answer),
        "solution": text,
        "flawed_solution": flawed,
        "flaw_step": flaw,
    }


def generate(
    n_train: int, n_eval: int, digits: tuple[int, int] = (2, 2), seed: int = 0, mix: dict | None = None
) -> dict[str, list[dict]]:
    """The train and eval rows (eval drawn first, train never among them). `mix`: {(A, B) digits:
    share} instead of one `digits`, each shape's rows in its share of each split, shuffled."""
    rng = random.Random(seed)
    shares = mix or {digits: 1.0}
    splits = {"train": [], "eval": []}
    for shape, share in shares.items():
        held_out = problems(round(n_eval * share), shape, rng)
        splits["eval"] += held_out
        splits["train"] += problems(round(n_train * share), shape, rng, exclude=set(held_out))
    if mix:
        for pairs in splits.values():
            rng.shuffle(pairs)
    return {split: [row(a, b, rng) for a, b in pairs] for split, pairs in splits.items()}


def digit_mix(specs: list[str]) -> dict[tuple[int, int], float]:
    """'AxB:share' strings (e.g. 2x2:0.4) as {(A, B): share}, the shares summing to 1."""
    mix = {}
    for spec in specs:
        try:
            shape, share = spec.split(":")
            a, b = shape.lower().split("x")
            mix[(int(a), int(b))] = float(share)
        except ValueError:
            raise ValueError(f"--mix {spec!r}: write each as AxB:share, e.g. 2x2:0.4") from None
    if abs(sum(mix.values()) - 1) > 1e-6:
        raise ValueError(f"--mix shares sum to {sum(mix.values()):g}, not 1")
    return mix


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=4000, help="training problems")
    p.add_argument("--eval", type=int, default=200, help="held-out problems (never among the training ones)")
    p.add_argument("--digits", type=int, nargs=2, default=(2, 2), metavar=("A", "B"), help="digits of each factor")
    p.add_argument("--mix", nargs="+", metavar="AxB:SHARE", help="several shapes in these shares, e.g. 2x2:0.6 4x4:0.4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("configs/data"), help="directory of the two .jsonl files")
    args = p.parse_args(argv)
    mix = digit_mix(args.mix) if args.mix else None
    for split, rows in generate(args.train, args.eval, tuple(args.digits), args.seed, mix).items():
        print(write_rows(rows, args.out / f"multiplication_{split}.jsonl"))


if __name__ == "__main__":
    main()
