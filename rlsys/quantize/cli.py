"""`rlsys quantize MODEL_DIR --bits 2 --group 128 --out DIR`: SliM-LLM post-training
quantisation of a local model directory. Bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from rlsys.models import find_tokenizer_dir, load_model, load_tokenizer, save_tokenizer

from .calib import calibration_from_model, calibration_from_text
from .model import METHODS, QuantConfig, average_bits, check_config, quantize_model, save_quantized

PROG = "rlsys quantize"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise _UsageError(message)


class _UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="SliM-LLM mixed-precision quantisation of a local model directory.")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="directory with config.json and weights (as saved by rlsys)")
    p.add_argument("--bits", type=int, default=2, help="average bits per weight, 1..8 (default 2)")
    p.add_argument("--group", type=int, default=128, help="group size in input columns (default 128)")
    p.add_argument("--out", required=True, help="output directory for the quantised model")
    p.add_argument("--method", choices=METHODS, default="slim", help="slim (default), gptq (uniform) or rtn")
    p.add_argument("--calib-file", help="text file for calibration; default: text sampled from the model")
    p.add_argument("--calib-samples", type=int, default=128, help="calibration sequences (default 128)")
    p.add_argument("--seqlen", type=int, default=128, help="tokens per calibration sequence (default 128)")
    p.add_argument(
        "--sba-uniform",
        action="store_true",
        help="let a layer keep uniform bits where no mixed map has a lower output KL (not in the paper)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _quiet_load(load_model, path: Path):
    """`load_model` without transformers' progress bar (the CLI prints one line)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return load_model(path).eval()
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def run(args: argparse.Namespace) -> str:
    """Quantise as `args` says; return the summary line. Raises ValueError/FileNotFoundError."""
    src, out = Path(args.model_dir), Path(args.out)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is not a model directory (no config.json)")
    if args.calib_samples < 1 or args.seqlen < 2:
        raise ValueError("--calib-samples must be >= 1 and --seqlen >= 2")
    if args.calib_file and not Path(args.calib_file).is_file():
        raise FileNotFoundError(f"calibration file {args.calib_file} not found")
    if not 1 <= args.bits <= 8:
        raise ValueError(f"--bits must be in 1..8, got {args.bits}")
    if args.group < 1:
        raise ValueError(f"--group must be positive, got {args.group}")
    cfg = QuantConfig(
        bits=args.bits, group_size=args.group, method=args.method, seed=args.seed, sba_uniform=args.sba_uniform
    )
    model = _quiet_load(load_model, src)
    check_config(model, cfg)
    calib = None
    if cfg.method != "rtn":
        if args.calib_file:
            tok = load_tokenizer(src)
            text = Path(args.calib_file).read_text(encoding="utf-8")
            calib = calibration_from_text(tok, text, args.calib_samples, args.seqlen, args.seed)
        else:
            calib = calibration_from_model(model, args.calib_samples, args.seqlen, args.seed)
    fp_bytes = _dir_bytes(src)
    qweights = quantize_model(model, calib, cfg)
    save_quantized(model, qweights, cfg, out)
    if find_tokenizer_dir(src) is not None:  # the tokenizer beside the weights, as in any model dir
        save_tokenizer(load_tokenizer(src), out)
    q_bytes = _dir_bytes(out)
    ratio = f", {fp_bytes / q_bytes:.1f}x smaller" if fp_bytes else ""
    return (
        f"quantized {len(qweights)} linears of {src} -> {out}: method {cfg.method}, "
        f"avg {average_bits(qweights):.3f} bits, group {cfg.group_size}, "
        f"{q_bytes} bytes (was {fp_bytes}{ratio})"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    try:
        with torch.no_grad():
            print(run(args))
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
