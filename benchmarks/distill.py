"""DA-KD side by side with full-data KD: sample-steps for the DA-KD student to reach the
full-data KD student's final held-out loss (../shared/papers/dakd.md; goal: at most half).

A tiny teacher is trained on the arithmetic task (SFT warm-up), then two identical smaller
students are distilled with the same BDL loss, optimizer and batch size for E epochs: one on
every sample each epoch (`schedule: full`), one with DA-KD's cosine keep ratio and stratified
subset, and, as an ablation, one with the same schedule on random instead of DDS scores.
Both go through the plug-in's own rollout -> prepare -> loss (algorithms/distill.py),
with the teacher and the live student served in-process. The held-out loss is the BDL of the
student to the teacher over the eval split's answer tokens.

    .venv/bin/python benchmarks/distill.py      # ~1.5 min on 2 idle CPU cores (one thread), ~3.5 loaded

`--student-pretrain-steps N --student-pretrain-data {train,easy,half}` starts all three students
from the same pretrained student (N SFT steps on the ground truth of: every training row, the 100
single-digit sums, or a random half of the training rows), as the paper's students are pretrained
LMs that already match the teacher on part of the data. The headline figure is "sample-steps
to target": the first held-out evaluation (every `--eval-every` steps and at the end) at which a
student's BDL is at or below full-data KD's final held-out BDL.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.modeling import PolicyOnly, per_response_tokens  # noqa: E402
from actors.reference import ReferenceWorker  # noqa: E402
from algorithms.distill import DAKD, schedule_steps  # noqa: E402
from envs.arithmetic import ArithmeticTask  # noqa: E402
from rlsys.contract import ModelOutputs  # noqa: E402
from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer  # noqa: E402


class RandomSubset(DAKD):
    """Ablation: DA-KD's schedule and stratified split, on random scores instead of DDS."""

    def _scores(self, ctx):
        return np.random.default_rng(ctx.next_seed()).random(len(self._training_ids(ctx)[0]))


class LiveContext:
    """The RolloutContext DA-KD needs: the teacher worker and the student being trained."""

    def __init__(self, task, tokenizer, teacher: ReferenceWorker, student, seed: int):
        self.task, self.tokenizer, self.teacher, self.student = task, tokenizer, teacher, student
        self.policy_version, self.rng, self.scored = 0, np.random.default_rng(seed), 0

    def next_seed(self):
        return int(self.rng.integers(0, 2**31 - 1))

    def policy_logprobs(self, table):
        self.scored += table.num_rows
        self.student.eval()
        out = per_response_tokens(lambda ids, mask, span, packed: self.student(ids, mask, 1.0, span, packed)[1], table)
        self.student.train()
        return out

    def teacher_logprobs(self, table):
        return self.teacher.logprobs(table)

    def teacher_top_logprobs(self, table, k=0):
        return self.teacher.top_logprobs(table, k)


@torch.no_grad()
def heldout_loss(algo: DAKD, ctx: LiveContext, batch) -> tuple[float, float]:
    """(BDL to the teacher, NLL of the ground-truth answers) over the eval split's answer tokens;
    the NLL is the figure no arm's training loss is: it compares arms trained on different losses."""
    ctx.student.eval()
    logits, logprobs, _ = ctx.student(batch.input_ids, batch.attention_mask)
    ctx.student.train()
    nll = -(logprobs * batch.response_mask).sum() / batch.response_mask.sum()
    return algo.loss(ModelOutputs(logits, logprobs), batch)[0].item(), nll.item()


def distill(schedule: str, args, task, tok, teacher, eval_rows) -> tuple[list[tuple[int, float]], float]:
    """(samples seen, held-out loss) after every `eval_every` steps of one student, and its
    final held-out accuracy."""
    from rlsys.models import load_model

    label, lam = schedule, args.lam
    if schedule == "kd":  # the paper's KD baseline: forward KL(p || q) (BDL at lambda 0) on all data
        schedule, lam = "full", 0.0
    cls, schedule = (RandomSubset, "cosine") if schedule == "random" else (DAKD, schedule)
    algo = cls(DAKD.Config(epochs=args.epochs, schedule=schedule, tau=args.tau, bdl_lambda=lam, top_k=args.top_k))
    student = PolicyOnly(load_model(args.student_dir))
    ctx = LiveContext(task, tok, teacher, student, args.seed)
    heldout = DAKD(algo.config.model_copy(update={"bdl_lambda": args.lam}))  # every arm scored on the same BDL
    heldout_batch = heldout.prepare(heldout_table(heldout, ctx, eval_rows))
    trained, begin_epoch = [], algo._begin_epoch

    def traced_epoch(c):  # which rows each epoch trains on, for the single-digit share below
        begin_epoch(c)
        trained.extend(algo.order)

    algo._begin_epoch = traced_epoch
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr)
    steps = schedule_steps(len(algo._training_ids(ctx)[0]), args.epochs, args.batch, schedule)
    decay = (lambda s: 0.5 * (1 + math.cos(math.pi * s / steps))) if args.lr_schedule == "cosine" else (lambda s: 1.0)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(opt, decay)  # the paper: AdamW, cosine decay over the run
    curve, samples = [(0, *heldout_loss(heldout, ctx, heldout_batch))], 0
    student.train()
    for step in range(1, steps + 1):
        batch = algo.prepare(algo.rollout(ctx, [None] * args.batch))
        logits, logprobs, _ = student(batch.input_ids, batch.attention_mask)
        loss, _ = algo.loss(ModelOutputs(logits, logprobs), batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        lr_schedule.step()
        samples += len(batch)
        if step % args.eval_every == 0 or step == steps:
            curve.append((samples, *heldout_loss(heldout, ctx, heldout_batch)))
    easy = np.array([single_digit(r) for r in task.rows("train")])
    print(
        f"  {label:>6}: {steps} steps, {samples} sample-steps, {ctx.scored} scoring forwards, "
        f"final held-out BDL {curve[-1][1]:.4f}, answer NLL {curve[-1][2]:.4f}, single-digit share of trained samples "
        f"{easy[trained].mean():.3f} (of the data {easy.mean():.3f})",
        file=sys.stderr,
    )
    return curve, accuracy(student.policy, task, tok, eval_rows)


SINGLE_DIGIT_SUMS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


def single_digit(row) -> bool:
    return all(len(t.strip()) == 1 for t in row["prompt"].rstrip("=").split("+"))


def heldout_table(algo: DAKD, ctx, rows):
    """The eval split as DA-KD rows, with the teacher's distribution (same code path as training)."""
    from algorithms.sft import sft_ids

    algo._data = sft_ids(ctx.tokenizer, rows, ctx.task)
    algo.order, algo.position, algo.epoch = list(range(len(rows))), 0, 0
    return algo.rollout(ctx, [None] * len(rows))


@torch.no_grad()
def accuracy(model, task, tok, rows) -> float:
    """Greedy held-out accuracy through the rollout worker's transformers backend."""
    from actors.rollout import HFBackend
    from rlsys.generation import GenerationRequest, SamplingParams

    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    requests = [
        GenerationRequest(tok(task.prompt_text(r), add_special_tokens=False)["input_ids"], params) for r in rows
    ]
    gens = HFBackend("", model=model.eval()).generate(requests)
    texts = tok.batch_decode([g.response_ids for g in gens], skip_special_tokens=True)
    return float(np.mean([task.is_correct(rows[g.request_index], t) for g, t in zip(gens, texts)]))


def with_easy_rows(task: ArithmeticTask, data_dir: Path, fraction: float, seed: int) -> ArithmeticTask:
    """The task with `fraction` of each split's rows replaced by single-digit sums drawn with
    replacement from the 100 there are: data whose difficulty varies, and whose easy part
    repeats, as real distillation corpora do."""
    from envs.datasets import write_rows

    rng = np.random.default_rng(seed)

    def mixed(rows):
        n_easy = int(round(fraction * len(rows)))
        picked = [SINGLE_DIGIT_SUMS[i] for i in rng.integers(0, len(SINGLE_DIGIT_SUMS), n_easy)]
        out = rows[: len(rows) - n_easy] + picked
        return [out[i] for i in rng.permutation(len(out))]

    return ArithmeticTask(
        write_rows(mixed(task.rows("train")), data_dir / "train.parquet"),
        write_rows(mixed(task.rows("eval")), data_dir / "eval.parquet"),
    )


def pretrain_rows(task: ArithmeticTask, which: str, seed: int) -> list[dict]:
    """The student's pretraining rows: the training split, the 100 single-digit sums, or a
    random half of the training split."""
    if which == "easy":
        return SINGLE_DIGIT_SUMS
    rows = task.rows("train")
    if which == "half":
        rows = [rows[i] for i in np.random.default_rng(seed + 4).permutation(len(rows))[: len(rows) // 2]]
    return rows


def first_reaching(curve, target: float, column: int = 1):
    """Sample-steps of the first evaluation at which `column` (1: BDL, 2: answer NLL) is <= target."""
    return next((point[0] for point in curve if point[column] <= target), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-train", type=int, default=1024)
    p.add_argument("--num-eval", type=int, default=200)
    p.add_argument("--max-value", type=int, default=49)
    p.add_argument(
        "--easy-fraction",
        type=float,
        default=0.0,
        help="share of rows replaced by repeated single-digit sums (data of mixed difficulty)",
    )
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine")
    p.add_argument("--tau", type=float, default=0.1)
    p.add_argument("--lam", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--teacher", default="128,384,2", help="hidden,intermediate,layers of the teacher")
    p.add_argument("--student", default="48,144,2", help="hidden,intermediate,layers of the student")
    p.add_argument("--teacher-steps", type=int, default=1500)
    p.add_argument(
        "--student-pretrain-steps",
        "--student-sft-steps",
        dest="student_pretrain_steps",
        type=int,
        default=0,
        help="SFT steps of the student before distillation (the same start for all three arms)",
    )
    p.add_argument(
        "--student-pretrain-data",
        choices=["train", "easy", "half"],
        default="train",
        help="what the student is pretrained on: every training row, the 100 single-digit sums, "
        "or a random half of the training rows",
    )
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--curves", action="store_true", help="print both held-out loss curves")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging

    from algorithms.sft import warmup

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="dakd-bench-"))
    task = ArithmeticTask.create(root / "data", args.num_train, args.num_eval, 0, args.max_value, ["+"], args.seed)
    args.num_train = len(task.rows("train"))  # fewer when the problem space is smaller than asked for
    if args.easy_fraction:
        task = with_easy_rows(task, root / "mixed", args.easy_fraction, args.seed)
    tok = train_tokenizer(task.corpus(), 512)

    def spec(text):
        h, i, l = map(int, text.split(","))
        return TinyModelSpec(
            hidden_size=h, intermediate_size=i, num_hidden_layers=l, num_attention_heads=4, num_key_value_heads=2
        )

    teacher_model = build_tiny_model(spec(args.teacher), tok, seed=args.seed + 1)
    losses = warmup(teacher_model, tok, task, task.rows("train"), args.teacher_steps, 32, 3e-3, args.seed)
    teacher_dir = save_model_dir(teacher_model, tok, root / "teacher")
    student_model = build_tiny_model(spec(args.student), tok, seed=args.seed + 2)
    pretrain_losses = []
    if args.student_pretrain_steps:  # the paper's students start pretrained: SFT on (part of) the task
        pretrain_losses = warmup(
            student_model,
            tok,
            task,
            pretrain_rows(task, args.student_pretrain_data, args.seed),
            args.student_pretrain_steps,
            32,
            3e-3,
            args.seed + 3,
        )
    args.student_dir = save_model_dir(student_model, tok, root / "student")
    teacher = ReferenceWorker(str(teacher_dir), threads=args.threads)
    print(
        f"teacher {args.teacher} trained {args.teacher_steps} steps (SFT loss {np.mean(losses[-20:]):.3f}) "
        f"in {time.perf_counter() - t0:.0f} s; student {args.student}"
        + (
            f" pretrained {args.student_pretrain_steps} SFT steps on '{args.student_pretrain_data}' rows "
            f"(SFT loss {np.mean(pretrain_losses[-20:]):.3f})"
            if pretrain_losses
            else " from random init"
        ),
        file=sys.stderr,
    )
    eval_rows = task.rows("eval")
    (full, full_acc), (dakd, dakd_acc), (rand, rand_acc), (kd, kd_acc) = (
        distill(s, args, task, tok, teacher, eval_rows) for s in ("full", "cosine", "random", "kd")
    )
    teacher_acc = accuracy(teacher.model, task, tok, eval_rows)
    target = full[-1][1]
    full_total, full_reach = full[-1][0], first_reaching(full, target)
    dakd_reach, rand_reach = first_reaching(dakd, target), first_reaching(rand, target)
    print(
        f"\nDA-KD vs full-data KD, {args.epochs} epochs of {args.num_train} samples, batch {args.batch}, "
        f"BDL lambda {args.lam}, tau {args.tau}; target = full-data KD's final held-out BDL {target:.4f}"
    )
    print(f"{'':24}{'full-data KD':>14}{'DA-KD':>10}{'random subset':>15}")
    print(f"{'held-out BDL at start':24}{full[0][1]:>14.4f}{dakd[0][1]:>10.4f}{rand[0][1]:>15.4f}")
    print(f"{'sample-steps in total':24}{full_total:>14}{dakd[-1][0]:>10}{rand[-1][0]:>15}")
    print(f"{'final held-out BDL':24}{target:>14.4f}{dakd[-1][1]:>10.4f}{rand[-1][1]:>15.4f}")
    budget = next((point[1] for point in full if point[0] >= dakd[-1][0]), full[-1][1])
    print(
        f"{'BDL at DA-KD budget':24}{budget:>14.4f}{dakd[-1][1]:>10.4f}   "
        f"(full-data KD after {dakd[-1][0]} sample-steps)"
    )
    print(f"{'held-out accuracy':24}{full_acc:>14.3f}{dakd_acc:>10.3f}{rand_acc:>15.3f}   (teacher {teacher_acc:.3f})")
    never = lambda x: "never" if x is None else x  # noqa: E731
    print(
        f"{'sample-steps to target':24}{full_reach:>14}{never(dakd_reach):>10}{never(rand_reach):>15}"
        f"   (held-out BDL every {args.eval_every} steps)"
    )
    ratio = lambda x: "never" if x is None else f"{x / full_total:.3f}"  # noqa: E731
    print(f"{'ratio to full-data KD':24}{1.0:>14.3f}{ratio(dakd_reach):>10}{ratio(rand_reach):>15}   (goal <= 0.5)")
    # the paper's comparison: its KD baseline trains on forward KL, DA-KD on BDL, so the two are
    # compared on what neither trains on, the held-out NLL of the ground-truth answers
    nll_target = kd[-1][2]
    reach = {
        name: first_reaching(curve, nll_target, column=2)
        for name, curve in (("kd", kd), ("full", full), ("dakd", dakd), ("random", rand))
    }
    print(
        f"\nvs the paper's KD baseline (forward KL on all data, {kd[-1][0]} sample-steps); "
        f"target = its final held-out answer NLL {nll_target:.4f}"
    )
    print(f"{'':24}{'KD (fwd KL)':>14}{'full BDL':>10}{'DA-KD':>10}{'random subset':>15}")
    print(f"{'final answer NLL':24}{kd[-1][2]:>14.4f}{full[-1][2]:>10.4f}{dakd[-1][2]:>10.4f}{rand[-1][2]:>15.4f}")
    print(f"{'held-out accuracy':24}{kd_acc:>14.3f}{full_acc:>10.3f}{dakd_acc:>10.3f}{rand_acc:>15.3f}")
    print(
        f"{'sample-steps to target':24}{never(reach['kd']):>14}{never(reach['full']):>10}{never(reach['dakd']):>10}"
        f"{never(reach['random']):>15}"
    )
    print(
        f"{'ratio to KD':24}{ratio(reach['kd']):>14}{ratio(reach['full']):>10}{ratio(reach['dakd']):>10}"
        f"{ratio(reach['random']):>15}   (goal <= 0.5)"
    )
    if args.curves:
        for name, curve in (("full", full), ("DA-KD", dakd), ("random", rand), ("KD", kd)):
            print(f"{name:>6} curve: " + " ".join(f"{point[0]}:{point[1]:.3f}/{point[2]:.3f}" for point in curve))
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
