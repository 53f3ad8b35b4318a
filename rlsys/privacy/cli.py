"""`rlsys privacy attack [--model DIR] [--layer L] [--budget B] ...`: run the vocab-matching
attack against a plain server's, a permuting server's and each kind of Cascade party's view of
the same prompts under one search budget, and print recovery rates. Without --model a tiny
random-init Qwen2 is built. Bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from rlsys.models import TinyModelSpec, build_tiny_model, load_model, load_tokenizer

from .attack import PROPOSALS, AttackConfig
from .cascade import BACKENDS
from .evaluate import evaluate, markdown_table, random_prompts

PROG = "rlsys privacy"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Hidden-state inversion attack and Cascade.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    a = sub.add_parser("attack", help="attack plain, permuted and Cascade views; print recovery rates")
    a.add_argument("--model", help="local model directory (default: a tiny random-init Qwen2)")
    a.add_argument("--layer", type=int, help="hidden state index the views expose (default: half the depth)")
    a.add_argument("--budget", type=int, help="candidates tried per observed position (default: the whole vocabulary)")
    a.add_argument("--batch-size", type=int, default=128, help="candidates per forward pass (default 128)")
    a.add_argument(
        "--epsilon", type=float, help="absolute L1 threshold (default: 1e-3 x the mean L1 norm of the observed rows)"
    )
    a.add_argument(
        "--proposal",
        choices=PROPOSALS,
        default="model",
        help="candidate order (default: the model's next-token distribution)",
    )
    a.add_argument("--prompts", type=int, default=4, help="random prompts to attack (default 4)")
    a.add_argument("--length", type=int, default=24, help="tokens per random prompt (default 24)")
    a.add_argument(
        "--text",
        action="append",
        help="attack this text instead of random prompts (needs the model's tokenizer); repeatable",
    )
    a.add_argument("--c", type=int, default=2, help="Cascade: positions per compute party (default 2)")
    a.add_argument("--delta", type=int, default=3, help="Cascade: spacing of a party's positions (default 3)")
    a.add_argument(
        "--parties",
        type=int,
        help="Cascade: attack at most this many parties of each type per prompt, a seeded sample (default: all)",
    )
    a.add_argument(
        "--backend", choices=BACKENDS, default="ray", help="Cascade parties as Ray actors (default) or in-process"
    )
    a.add_argument(
        "--hosts",
        type=int,
        default=4,
        help="Ray actor processes the parties are spread over (default 4; 0: one actor per party)",
    )
    a.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the attack's many small ops run fastest on one)",
    )
    a.add_argument("--seed", type=int, default=0)
    return p


def _model_and_prompts(args):
    if args.model:
        model = load_model(args.model).eval()
    else:
        model = build_tiny_model(TinyModelSpec(), seed=args.seed).eval()
    if args.text:
        if not args.model:
            raise ValueError("--text needs --model (a directory with the model's tokenizer)")
        tok = load_tokenizer(args.model)
        prompts = [torch.tensor(tok(t)["input_ids"]) for t in args.text]
        if any(p.numel() == 0 for p in prompts):
            raise ValueError("--text: every text must tokenise to at least one token")
        return model, prompts
    if args.prompts < 1 or args.length < 1:
        raise ValueError("--prompts and --length must be >= 1")
    return model, random_prompts(args.prompts, args.length, model.config.vocab_size, args.seed)


def _init_ray():
    """An embedded single-machine Ray for the Cascade parties."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=min(2, os.cpu_count() or 1),
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=tempfile.mkdtemp(prefix="rlsys-privacy-ray-"),
        )
    return ray


def run(args: argparse.Namespace) -> str:
    """Run the attack as `args` says; return the report. Raises ValueError/FileNotFoundError."""
    if args.hosts < 0:
        raise ValueError("--hosts must be >= 0")
    if args.threads < 1:
        raise ValueError("--threads must be >= 1")
    config = AttackConfig(budget=args.budget, batch_size=args.batch_size, epsilon=args.epsilon, proposal=args.proposal)
    model, prompts = _model_and_prompts(args)
    layer = model.config.num_hidden_layers // 2 if args.layer is None else args.layer
    if not 0 <= layer <= model.config.num_hidden_layers:
        raise ValueError(f"--layer {layer}: the model has hidden states 0..{model.config.num_hidden_layers}")
    if args.c < 1 or args.delta < 1:
        raise ValueError("--c and --delta must be >= 1")
    if args.parties is not None and args.parties < 1:
        raise ValueError("--parties must be >= 1")
    torch.set_num_threads(args.threads)
    ray = _init_ray() if args.backend == "ray" else None
    try:
        ev = evaluate(
            model, prompts, layer, config, args.c, args.delta, args.backend, args.seed, args.hosts or None, args.parties
        )
    finally:
        if ray is not None:
            ray.shutdown()
    budget = config.budget or model.config.vocab_size
    head = (
        f"vocab-matching attack at hidden state {layer}: {len(prompts)} prompt(s), "
        f"budget {budget} candidates/position, "
        f"proposal={config.proposal}; Cascade c={args.c} delta={args.delta}: {ev.n_parties} compute parties, "
        f"logits max |diff| vs plain {ev.cascade_max_logit_diff:.2e}"
    )
    return head + "\n" + markdown_table(ev.scores)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        print(run(args))
        return 0
    except (_UsageError, ValueError, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
