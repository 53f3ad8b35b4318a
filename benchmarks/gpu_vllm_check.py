"""vLLM on the GPU machine: the rollout backend, its in-place weight loading and its agreement
with the transformers backend, on tiny models built here (no downloads; no Ray needed).

    python3 benchmarks/gpu_vllm_check.py     # on the GPU machine, vllm carried there (benchmarks/vllm_carry/)

Without a CUDA device, or without an importable vllm, it prints one line and exits 0. On a GPU,
for a tiny Llama and a tiny Qwen2 (random weights, head_dim 64, a BPE tokenizer trained here):
1. `VLLMBackend` (enforce_eager, a small gpu_memory_utilization) generates greedily from token ids
   with logprobs; the transformers backend on the same GPU, from the same dir, does the same: the
   rows whose greedy tokens agree, and the largest logprob gap on them (`agreement`);
2. new weights (the model perturbed, `perturbed_weights`) through `load_weights`, in place: vLLM's
   greedy tokens change, and agree with the transformers backend given the same weights;
3. tokens/s of vLLM vs the transformers backend's lean decode loop at batch 64 and 256;
4. where Ray and DeepSpeed import, 3 steps of the quickstart with `rollout.backend=vllm`.
Tolerance: vLLM runs in `--dtype` (bfloat16 by default) against the transformers backend in
float32; rows agree where the greedy tokens are the same, and the check passes when at least
`--min-agree` of the rows do (bf16 flips near-ties late in a row) and the logprob gap on agreeing
rows is under `--max-gap`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_check import tokens_per_s  # noqa: E402  (the same timing as the other GPU check)

CORPUS = [f"{a}+{b}={a + b}" for a in range(100) for b in range(0, 100, 7)]


def build_policy(out_dir: Path, architecture: str, hidden: int = 256, layers: int = 4, seed: int = 0) -> str:
    """A tiny `architecture` decoder (head_dim 64, random weights; embeddings tied for qwen2 only)
    and a BPE trained on sums, saved as a model dir; returns its path."""
    from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer

    tokenizer = train_tokenizer(CORPUS, vocab_size=512)
    heads = max(1, hidden // 64)
    spec = TinyModelSpec(
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=1024,
        tie_word_embeddings=architecture == "qwen2",  # as the families ship (Qwen2.5-0.5B ties, Llama does not)
        architecture=architecture,
    )
    path = Path(out_dir) / architecture
    save_model_dir(build_tiny_model(spec, tokenizer, seed=seed), tokenizer, path)
    return str(path)


def perturbed_weights(model_dir: str, scale: float = 0.5, seed: int = 1) -> dict[str, np.ndarray]:
    """The dir's weights with Gaussian noise of `scale` x each tensor's std: new weights whose
    greedy tokens differ from the old ones'."""
    from actors.modeling import state_dict_numpy
    from actors.vllm_backend import tied_embeddings
    from rlsys.models import load_model

    rng = np.random.default_rng(seed)
    weights = state_dict_numpy(load_model(model_dir))
    new = {k: (v + scale * (v.std() + 1e-3) * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in weights.items()}
    if tied_embeddings(model_dir) and "lm_head.weight" in new:  # still one tensor under two names
        new["lm_head.weight"] = new["model.embed_tokens.weight"]
    return new


@dataclass
class Agreement:
    rows: int
    identical: int  # rows with the same greedy tokens
    max_logprob_gap: float  # over the identical rows' tokens (nan: none identical)

    def ok(self, min_agree: float, max_gap: float) -> bool:
        return self.identical >= min_agree * self.rows and self.max_logprob_gap <= max_gap

    def __str__(self) -> str:
        return f"greedy rows identical {self.identical}/{self.rows}, max logprob gap {self.max_logprob_gap:.1e}"


def agreement(a, b) -> Agreement:
    """How two backends' generations of the same requests agree (`Generation` lists, same order)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} generations against {len(b)}")
    same = [(x, y) for x, y in zip(a, b) if list(x.response_ids) == list(y.response_ids)]
    gaps = [abs(p - q) for x, y in same for p, q in zip(x.logprobs, y.logprobs)]
    return Agreement(len(a), len(same), max(gaps, default=0.0) if same else float("nan"))


def changed_row(a, b, tol: float = 1e-2) -> bool:
    """The row's greedy tokens, or their logprobs by more than `tol`, differ (a tied random model
    tends to repeat its last token whatever its weights: its logprobs still move)."""
    return list(a.response_ids) != list(b.response_ids) or max(abs(p - q) for p, q in zip(a.logprobs, b.logprobs)) > tol


def requests(model_dir: str, batch: int, new: int, temperature: float = 0.0):
    """`batch` requests over the corpus's prompts (`a+b=`), greedy unless `temperature`."""
    from rlsys.generation import GenerationRequest, SamplingParams
    from rlsys.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    prompts = [tok(text.split("=")[0] + "=", add_special_tokens=False)["input_ids"] for text in CORPUS[:batch]]
    params = SamplingParams(max_new_tokens=new, temperature=temperature, seed=0)  # no stop ids: rows run to `new`
    return [GenerationRequest(list(prompts[i % len(prompts)]), params) for i in range(batch)]


def check_model(model_dir: str, args, report) -> bool:
    """Steps 1-3 for one model dir; False where vLLM and transformers disagree past tolerance."""
    from actors.rollout import HFBackend
    from actors.vllm_backend import VLLMBackend

    name = Path(model_dir).name
    vllm = VLLMBackend(
        model_dir, gpu_memory_utilization=args.memory, dtype=args.dtype, enforce_eager=True, max_model_len=1024
    )
    hf = HFBackend(model_dir, batch_size=256, device="cuda")
    greedy = requests(model_dir, 64, args.new)
    before = vllm.generate(greedy)
    first = agreement(before, hf.generate(greedy))
    report(f"{name}: vllm vs transformers, same weights", str(first), first.ok(args.min_agree, args.max_gap))
    new = perturbed_weights(model_dir)
    vllm.load_weights(new)
    hf.load_weights(new)
    after = vllm.generate(greedy)
    changed = sum(changed_row(x, y) for x, y in zip(before, after))
    second = agreement(after, hf.generate(greedy))
    report(f"{name}: load_weights in place changes vllm's greedy rows", f"{changed}/{len(after)}", changed > 0)
    report(f"{name}: vllm vs transformers, new weights", str(second), second.ok(args.min_agree, args.max_gap))
    for batch in (64, 256):
        sampled = requests(model_dir, batch, args.new, temperature=1.0)
        fast, lean = tokens_per_s(vllm, sampled, args.reps), tokens_per_s(hf, sampled, args.reps)
        report(f"{name}: tokens/s at batch {batch}, vllm vs lean decode", f"{fast:.0f} vs {lean:.0f}", None)
        report(f"{name}: ratio at batch {batch}", f"{fast / lean:.2f}x", None)
    del vllm
    return first.ok(args.min_agree, args.max_gap) and second.ok(args.min_agree, args.max_gap) and changed > 0


def quickstart_steps(out_dir: Path, report) -> None:
    """Three quickstart steps with the vLLM backend, where Ray and DeepSpeed can be imported."""
    missing = [m for m in ("ray", "deepspeed") if subprocess.run([sys.executable, "-c", f"import {m}"]).returncode]
    if missing:
        report("quickstart with rollout.backend=vllm", f"not run: {', '.join(missing)} not importable", None)
        return
    command = [sys.executable, "-m", "rlsys.run.cli", "run", "configs/quickstart.yaml", "rollout.backend=vllm"]
    command += ["trainer.steps=3", "sft.steps=50", f"run.output_dir={out_dir}", "run.name=vllm"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    last = (done.stdout.strip() or done.stderr.strip()).splitlines()[-1:] or [""]
    report("quickstart with rollout.backend=vllm, 3 steps", last[0][:200], done.returncode == 0)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", help="the vLLM engine's dtype (default bfloat16)")
    parser.add_argument("--memory", type=float, default=0.3, help="gpu_memory_utilization of the engine")
    parser.add_argument("--new", type=int, default=64, help="new tokens per row")
    parser.add_argument("--reps", type=int, default=3, help="timed generate calls per figure (median)")
    parser.add_argument("--min-agree", type=float, default=0.9, help="share of greedy rows that must be identical")
    parser.add_argument("--max-gap", type=float, default=0.1, help="largest logprob gap allowed on identical rows")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_vllm_check: no CUDA device visible; nothing was run")
        return 0
    try:
        import vllm
    except ImportError as e:
        print(f"gpu_vllm_check: vllm cannot be imported ({e}); nothing was run (benchmarks/vllm_carry/ carries it)")
        return 0
    print(f"gpu_vllm_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, vllm {vllm.__version__}")
    failed = []

    def report(what: str, result: str, ok: bool | None) -> None:
        print(f"  {what}: {result}{'' if ok is None else ' OK' if ok else ' FAILED'}", flush=True)
        if ok is False:
            failed.append(what)

    out = Path(tempfile.mkdtemp(prefix="rlsys-vllm-check-"))
    for architecture in ("llama", "qwen2"):
        try:
            check_model(build_policy(out, architecture), args, report)
        except Exception as e:  # the exact point where it failed, then the next model
            report(f"{architecture}: the check", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", False)
    quickstart_steps(out, report)
    print(f"gpu_vllm_check: {'all passed' if not failed else 'FAILED: ' + '; '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
