"""Bradley-Terry reward model training: `rlsys rm train CONFIG --out DIR [overrides]`.

Preference pairs come from the config's task: for each problem, the correct answer is
preferred over a wrong one (a near miss of the number, or another problem's answer). A
sequence-classification model r(x, y) (Qwen2 with a one-logit head, built from the
config's `model` section, or `--init DIR` from any local causal LM dir, e.g. a warmed-up
policy) is trained on
    P(y_w > y_l | x) = sigmoid(r(x, y_w) - r(x, y_l)),   loss = -log sigmoid(r_w - r_l)
(Bradley & Terry 1952; the reward-model loss of Ouyang et al. 2022, eq. 1), then saved with
`save_pretrained` (its tokenizer beside it in DIR) for `reward.source: model` and the
evaluators' `metric: reward_model`. Pairs of held-out problems measure its accuracy.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from actors.modeling import quiet_transformers
from actors.reward import encode_pairs, prompt_lengths, reward_scores, sequence_scores
from envs.registry import make_task
from rlsys.config import ConfigError, load_config
from rlsys.models import TinyModelSpec, init_model, load_tokenizer, save_model_dir, train_tokenizer


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-mean log sigmoid(r_w - r_l) over pairs."""
    return -F.logsigmoid(chosen - rejected).mean()


def wrong_answer(answer: str, rng: random.Random, pool: Sequence[str]) -> str:
    """A wrong answer: half the time the number off by 1..10, else another row's answer."""
    candidates = [a for a in pool if a != answer]
    try:
        value = int(answer)
    except ValueError:
        value = None
    if value is not None and (rng.random() < 0.5 or not candidates):
        return str(value + rng.choice([d for d in range(-10, 11) if d]))
    if not candidates:
        raise ValueError("cannot make a wrong answer: every row has the same non-numeric answer")
    return rng.choice(candidates)


def preference_pairs(rows: Sequence[dict], prompt_text: Callable[[dict], str], per_row: int, seed: int) -> list[dict]:
    """{prompt, chosen, rejected} pairs: the row's answer over `per_row` distinct wrong ones."""
    rng = random.Random(seed)
    pool = sorted({str(r["answer"]).strip() for r in rows})
    pairs = []
    for row in rows:
        answer, seen = str(row["answer"]).strip(), set()
        for _ in range(per_row):
            wrong = wrong_answer(answer, rng, pool)
            if wrong in seen:
                continue
            seen.add(wrong)
            pairs.append({"prompt": prompt_text(row), "chosen": answer, "rejected": wrong})
    return pairs


def build_reward_model(tokenizer, spec, seed: int = 0, init_dir: Optional[str] = None):
    """A one-logit sequence classifier (Qwen2's by default): random from `spec`
    (rlsys.models.TinyModelSpec), or the backbone of a local causal LM dir (`from_pretrained`,
    a fresh score head)."""
    from transformers import AutoModelForSequenceClassification

    if init_dir is not None:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return AutoModelForSequenceClassification.from_pretrained(
                init_dir, num_labels=1, local_files_only=True, pad_token_id=tokenizer.pad_token_id
            )
    config = spec.config(len(tokenizer), tokenizer, num_labels=1, tie_word_embeddings=False)
    return init_model(AutoModelForSequenceClassification.from_config, config, tokenizer, seed)


def train_reward_model(
    model,
    tokenizer,
    pairs: Sequence[dict],
    steps: int,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """AdamW on the Bradley-Terry loss over random minibatches of pairs; returns the losses."""
    prompts = [p["prompt"] for p in pairs]
    chosen = encode_pairs(tokenizer, prompts, [p["chosen"] for p in pairs])
    rejected = encode_pairs(tokenizer, prompts, [p["rejected"] for p in pairs])
    chosen_lens, rejected_lens = (
        prompt_lengths(tokenizer, prompts, chosen),
        prompt_lengths(tokenizer, prompts, rejected),
    )
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        idx = torch.randint(len(pairs), (min(batch_size, len(pairs)),), generator=gen).tolist()
        scores = sequence_scores(
            model,
            [chosen[i] for i in idx] + [rejected[i] for i in idx],  # a pair's prompt runs once
            [chosen_lens[i] for i in idx] + [rejected_lens[i] for i in idx],
        )
        loss = bradley_terry_loss(scores[: len(idx)], scores[len(idx) :])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if on_step:
            on_step(step, losses[-1])
    model.eval()
    return losses


def pairwise_accuracy(model, tokenizer, pairs: Sequence[dict]) -> float:
    """Share of pairs with r(chosen) > r(rejected)."""
    prompts = [p["prompt"] for p in pairs]
    rc = reward_scores(model, tokenizer, prompts, [p["chosen"] for p in pairs])
    rr = reward_scores(model, tokenizer, prompts, [p["rejected"] for p in pairs])
    return sum(c > r for c, r in zip(rc, rr)) / len(pairs)


def train_from_config(
    cfg,
    out: Path,
    steps: int,
    batch_size: int,
    lr: float,
    per_row: int,
    init_dir: Optional[str] = None,
    log: Callable[[str], None] = lambda s: None,
) -> dict:
    """The whole job: task, tokenizer (trained on the task, or the init dir's), pairs, training,
    held-out accuracy, `save_pretrained` to `out`. Returns the report saved as out/rm_train.json."""
    start = time.perf_counter()
    out = Path(out)
    task = make_task(cfg.task, out / "data", cfg.run.seed)
    tokenizer = load_tokenizer(init_dir) if init_dir else train_tokenizer(task.corpus(), cfg.model.vocab_size)
    train = preference_pairs(task.rows("train"), task.prompt_text, per_row, cfg.run.seed)
    held_out = preference_pairs(task.rows("eval"), task.prompt_text, per_row, cfg.run.seed + 1)
    model = build_reward_model(tokenizer, TinyModelSpec.from_config(cfg.model), cfg.run.seed, init_dir)
    before = pairwise_accuracy(model, tokenizer, held_out)
    losses = train_reward_model(
        model,
        tokenizer,
        train,
        steps,
        batch_size,
        lr,
        cfg.run.seed,
        on_step=lambda s, l: (s + 1) % 50 == 0 and log(f"step {s + 1}/{steps} loss {l:.4f}"),
    )
    report = {
        "train_pairs": len(train),
        "held_out_pairs": len(held_out),
        "steps": steps,
        "first_loss": losses[0] if losses else None,
        "last_loss": float(sum(losses[-20:]) / max(len(losses[-20:]), 1)),
        "held_out_accuracy_before": before,
        "held_out_accuracy": pairwise_accuracy(model, tokenizer, held_out),
        "train_accuracy": pairwise_accuracy(model, tokenizer, train[:512]),
        "seconds": time.perf_counter() - start,
    }
    save_model_dir(model, tokenizer, out)
    (out / "rm_train.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlsys rm", description="reward models")
    sub = p.add_subparsers(dest="action", required=True)
    t = sub.add_parser("train", help="train a Bradley-Terry reward model on the config's task")
    t.add_argument("config", help="a job config: its task and model sections are used")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. task.max_value=9")
    t.add_argument("--out", required=True, help="directory to save_pretrained the reward model to")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--pairs-per-problem", type=int, default=2)
    t.add_argument("--init", default=None, help="start from a local causal LM dir (and its tokenizer)")
    t.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "pairs_per_problem", "threads"):
        if getattr(args, name) < 1:
            raise ConfigError(f"rm error: --{name.replace('_', '-')} = {getattr(args, name)}: must be at least 1")
    if not args.lr > 0:
        raise ConfigError(f"rm error: --lr = {args.lr}: must be positive")
    if args.init and not (Path(args.init) / "config.json").exists():
        raise ConfigError(f"rm error: --init = {args.init!r}: not a model directory (no config.json)")
    cfg = load_config(args.config, args.overrides)
    quiet_transformers()
    torch.set_num_threads(args.threads)
    report = train_from_config(
        cfg,
        Path(args.out),
        args.steps,
        args.batch_size,
        args.lr,
        args.pairs_per_problem,
        args.init,
        log=lambda s: print(s, file=sys.stderr),
    )
    print(
        f"reward model saved to {args.out}: held-out pairwise accuracy {report['held_out_accuracy']:.3f} "
        f"({report['held_out_pairs']} pairs; {report['held_out_accuracy_before']:.3f} before training), "
        f"{report['seconds']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
