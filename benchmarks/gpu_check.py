"""The GPU path, checked and timed on a machine with CUDA. One script, one table.

    .venv/bin/python benchmarks/gpu_check.py            # on a GPU machine
    .venv/bin/python benchmarks/gpu_check.py --cpu      # the same code paths on CPU (gloo, fp32): plumbing only

Without a CUDA device (and without --cpu) it prints one line saying nothing was measured
and exits 0. On CUDA it runs, each side by side with a baseline in the same run:
1. the transformers rollout backend on the GPU vs on the CPU: tokens/s;
2. the DeepSpeed learner on CUDA, bf16 + ZeRO-2 and ZeRO-3 vs fp32 ZeRO-0: train_step time,
   tokens/s, and the cosine of its update with the fp32 one; the bf16 learner's weights come out
   of `Learner.weights()` as float32 numpy;
3. weight handoff without NCCL (Learner.weights() -> numpy -> HF backend on GPU) and the
   broadcast path (actors/weight_broadcast.py) from the CUDA learner to a receiver process:
   gloo always; NCCL when a second GPU is visible (NCCL cannot put two ranks on one GPU);
   the received tensors are checked bit-identical by hash, and the version must advance;
4. the vLLM backend when `vllm` is importable: tokens/s vs the transformers backend on the
   GPU, and `load_weights` (collective_rpc into the worker extension) time.
The policy is the quickstart's model family (tiny Qwen2 + BPE tokenizer from the task,
no SFT), sized up by --hidden/--layers on CUDA. Needs no Ray (the GPU image has none).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.perf import timed, train_batch  # noqa: E402  (the same timing and batch as perf.py)


def tokens_per_s(backend, requests, reps: int) -> float:
    """Generated tokens / second of `backend.generate(requests)`, median of `reps` timed runs
    after a warm-up (tokens counted per run: sampling stops at eos at different lengths)."""
    backend.generate(requests)
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        gens = backend.generate(requests)
        _sync()
        rates.append(sum(len(g.response_ids) for g in gens) / (time.perf_counter() - t))
    return statistics.median(rates)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tensor_hash(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _receiver(port: int, manifest, versions: list[int], backend: str, device: str, queue) -> None:
    """A broadcast group member in its own process: receives every version, reports the hashes of the last."""
    import torch

    from actors.weight_broadcast import BroadcastGroup

    torch.set_num_threads(1)
    group = BroadcastGroup("127.0.0.1", port, 1, 2, backend, 300.0, device=device)
    for v in versions:
        received = group.receive(v, manifest)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        queue.put(("ack", v))
    queue.put(("hashes", [tensor_hash(t) for _, t in received]))


class Check:
    def __init__(self, args):
        import torch

        from algorithms.base import build_algorithm
        from envs.registry import make_task
        from rlsys.config import load_config
        from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer

        self.args, self.cuda = args, not args.cpu
        self.device = "cuda" if self.cuda else "cpu"
        out = Path(tempfile.mkdtemp(prefix="rlsys-gpu-check-"))
        size = [
            f"model.hidden_size={args.hidden}",
            f"model.intermediate_size={args.hidden * 3}",
            f"model.num_hidden_layers={args.layers}",
            f"model.num_attention_heads={max(2, args.hidden // 64)}",
            f"model.num_key_value_heads={max(1, args.hidden // 256)}",
            "model.max_position_embeddings=512",
            "model.vocab_size=1024",
        ]
        self.cfg = load_config(
            ROOT / "configs" / "quickstart.yaml",
            [f"run.output_dir={out}", "run.name=gpu", "sft.steps=0", "algorithm.kl_coef=0", *size],
        )
        # the policy as Controller.prepare_policy builds it (no SFT), without Ray: the GPU image has none
        self.algorithm = build_algorithm(self.cfg)
        self.task = make_task(self.cfg.task, out / "data", self.cfg.run.seed)
        self.tok = train_tokenizer(self.task.corpus(), self.cfg.model.vocab_size)
        model = build_tiny_model(TinyModelSpec.from_config(self.cfg.model), self.tok, seed=self.cfg.run.seed)
        self.policy_dir = str(out / "policy")
        save_model_dir(model, self.tok, self.policy_dir)
        self.prompts = [
            self.tok(self.task.prompt_text(r), add_special_tokens=False)["input_ids"] for r in self.task.rows("train")
        ]
        self.rows: list[tuple[str, str, str, str]] = []
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(
            f"gpu_check: {torch.cuda.get_device_name(0) if self.cuda else 'cpu'}, {torch.cuda.device_count()} GPU(s), "
            f"torch {torch.__version__}, policy {params:.0f}M parameters",
            file=sys.stderr,
        )

    def add(self, figure: str, measured: str, baseline: str, ratio: str) -> None:
        self.rows.append((figure, measured, baseline, ratio))
        print(f"  {figure}: {measured} | baseline {baseline} | {ratio}", file=sys.stderr, flush=True)

    def requests(self, batch: int, new: int, temperature: float = 1.0):
        from rlsys.generation import GenerationRequest, SamplingParams

        params = SamplingParams(
            max_new_tokens=new, temperature=temperature, seed=0, stop_token_ids=(self.tok.eos_token_id,)
        )
        return [GenerationRequest(list(self.prompts[i % len(self.prompts)]), params) for i in range(batch)]

    # ---- 1. transformers backend on the GPU ----------------------------------------------
    def hf_backend(self, batch: int, new: int):
        from actors.rollout import HFBackend

        gpu = HFBackend(self.policy_dir, batch_size=batch, device=self.device)
        cpu = HFBackend(self.policy_dir, batch_size=batch)
        cpu_batch = min(batch, 32)  # the CPU baseline on fewer sequences: tokens/s, not wall time, is compared
        gpu_rate = tokens_per_s(gpu, self.requests(batch, new), self.args.reps)
        cpu_rate = tokens_per_s(cpu, self.requests(cpu_batch, new), 1)
        self.add(
            f"hf backend tokens/s, {self.device} batch {batch} vs cpu batch {cpu_batch} (<= {new} new)",
            f"{gpu_rate:.0f}",
            f"{cpu_rate:.0f}",
            f"{gpu_rate / cpu_rate:.1f}x",
        )
        self.hf = gpu
        self.lean_vs_generate(gpu, batch, new)
        return gpu

    def lean_vs_generate(self, lean, batch: int, new: int):
        """The backend's lean decode loop (actors/lean_decode.py) against `model.generate` on the same
        device: greedy tokens must agree, then sampled tokens/s side by side."""
        from actors.rollout import HFBackend

        plain = HFBackend(self.policy_dir, batch_size=batch, device=self.device, decode="generate")
        greedy = self.requests(min(batch, 64), min(new, 32), temperature=0.0)
        a, b = lean.generate(greedy), plain.generate(greedy)
        same = sum(x.response_ids == y.response_ids for x, y in zip(a, b))
        assert same >= 0.9 * len(a), (
            f"lean decode's greedy tokens differ from generate's in {len(a) - same} of {len(a)} rows"
        )
        worst = max(
            abs(p - q) for x, y in zip(a, b) if x.response_ids == y.response_ids for p, q in zip(x.logprobs, y.logprobs)
        )
        reqs = self.requests(batch, new)
        lean_rate, plain_rate = tokens_per_s(lean, reqs, self.args.reps), tokens_per_s(plain, reqs, self.args.reps)
        self.add(
            f"lean decode vs model.generate tokens/s on {self.device} (batch {batch}, <= {new} new; greedy rows "
            f"identical {same}/{len(a)}, max logprob gap {worst:.1e})",
            f"{lean_rate:.0f}",
            f"{plain_rate:.0f}",
            f"{lean_rate / plain_rate:.2f}x",
        )

    # ---- 2. learner on CUDA ----------------------------------------------------------------

    def learner(self, gens):
        """bf16 ZeRO-2 and ZeRO-3 (fp32 on the --cpu plumbing run) against fp32 ZeRO-0, each trained
        the same steps on the same batch from the same weights: step time, and the cosine between
        each learner's total update and the fp32 one (does the fast learner learn the same thing);
        then ZeRO-2 in packed micro-batches of a quarter of the batch's tokens (the packed path on
        the device: rlsys/packing.py)."""
        import numpy as np

        from actors.learner import Learner
        from rlsys.cluster import free_port

        l = self.cfg.learner
        batch = train_batch(self.algorithm, gens)
        make = lambda stage, bf16, **extra: Learner(
            self.policy_dir,
            self.algorithm,
            lr=l.lr,
            grad_clip=l.grad_clip,
            zero_stage=stage,
            bf16=bf16,
            threads=4,
            master_port=free_port(),
            **extra,
        )
        base = make(0, False)
        initial = {k: a.copy() for k, a in base.weights().items()}  # weights() may be views of the live tensors
        t_base = timed(lambda: (base.train_step(batch), _sync()), self.args.reps)
        base_update = np.concatenate([(a - initial[k]).ravel() for k, a in base.weights().items()])
        budget = max(1, batch.num_tokens() // 4)
        for stage, extra in ((2, {}), (3, {}), (2, {"max_tokens_per_microbatch": budget})):
            fast = make(stage, self.cuda, **extra)
            assert fast.device.type == self.device, f"learner on {fast.device}, expected {self.device}"
            t_fast = timed(lambda: (fast.train_step(batch), _sync()), self.args.reps)
            weights = fast.weights()
            assert all(a.dtype in (np.float32, np.int64) for a in weights.values()), "weights() must give numpy fp32"
            update = np.concatenate([(a - initial[k]).ravel() for k, a in weights.items()])
            cosine = float(update @ base_update / (np.linalg.norm(update) * np.linalg.norm(base_update)))
            packed = f", packed by {budget} tokens" if extra else ""
            label = f"{'bf16' if self.cuda else 'fp32'} ZeRO-{stage}{packed}"
            self.add(
                f"learner step ms, {label} vs fp32 ZeRO-0 on {self.device} (batch {len(batch)}, "
                f"{batch.input_ids.shape[1]} tokens; update cosine vs fp32 {cosine:.3f})",
                f"{t_fast * 1e3:.1f} ({batch.num_tokens() / t_fast:.0f} resp tok/s)",
                f"{t_base * 1e3:.1f}",
                f"{t_base / t_fast:.2f}x",
            )
            if stage == 2 and not extra:
                self.learner_ = fast  # the config's learner (configs/gpu.yaml) does the handoff and broadcast
        return self.learner_

    # ---- 3. weight handoff and broadcast -------------------------------------------------------
    def handoff(self):
        """NCCL-free: what trainer.weight_sync=object_store does minus Ray: weights() -> numpy -> load."""
        state = self.learner_.weights()
        mb = sum(a.nbytes for a in state.values()) / 2**20
        t_get = timed(self.learner_.weights, self.args.reps)
        t_load = timed(lambda: self.hf.load_weights(state), self.args.reps)
        self.add(
            f"handoff ms ({mb:.0f} MB fp32): learner.weights() + hf load_weights on {self.device}",
            f"{(t_get + t_load) * 1e3:.1f}",
            f"weights() {t_get * 1e3:.1f}",
            f"{mb / (t_get + t_load):.0f} MB/s",
        )

    def shared_memory(self):
        """trainer.weight_sync=shared_memory minus Ray: the learner writes a slot of its /dev/shm file
        (in its own dtype: bf16 on the device), the backend on the device loads the slot's arrays; the
        backend's weights must then equal the learner's."""
        import numpy as np

        from actors.shared_weights import SharedWeights

        layout = self.learner_.share_weights("gpu-check")
        assert not isinstance(layout, str), layout
        reader = SharedWeights(layout)
        t_write = timed(lambda: self.learner_.write_shared(0), self.args.reps)
        t_load = timed(lambda: (self.hf.load_weights(reader.arrays(0)), _sync()), self.args.reps)
        expected = self.learner_.weights()
        got = {k: v.detach().float().cpu().numpy() for k, v in self.hf.model.state_dict().items()}
        assert all(np.array_equal(got[k], expected[k].astype(np.float32)) for k in expected if k in got), (
            "the backend's weights differ from the learner's after the shared-memory load"
        )
        self.learner_.close_shared()
        mb = layout.file_bytes / 2 / 2**20
        dtypes = "/".join(sorted({dtype for _, _, dtype, _ in layout.entries}))
        self.add(
            f"shared-memory sync ms ({mb:.0f} MB {dtypes} slot): learner {self.learner_.device} write_shared + hf "
            f"load_weights on {self.device}, weights equal",
            f"{(t_write + t_load) * 1e3:.1f}",
            f"write {t_write * 1e3:.1f}",
            f"{mb / (t_write + t_load):.0f} MB/s",
        )

    def broadcast(self, backend: str, receiver_device: str):
        from rlsys.cluster import free_port

        learner = self.learner_
        manifest = learner.weight_manifest()
        port, versions = free_port(), list(range(1, self.args.reps + 2))
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_receiver, args=(port, manifest, versions, backend, receiver_device, queue))
        proc.start()
        learner.weight_broadcast = None
        learner.open_weight_broadcast("127.0.0.1", port, 2, backend, 300.0)
        learner.broadcast_weights(versions[0])  # warm-up (connections, NCCL communicator)
        assert queue.get(timeout=300) == ("ack", versions[0])
        start = time.perf_counter()
        sent = 0
        for v in versions[1:]:
            sent = learner.broadcast_weights(v)
            assert queue.get(timeout=300) == ("ack", v)  # the version advanced on the receiver
        per_sync = (time.perf_counter() - start) / (len(versions) - 1)
        kind, hashes = queue.get(timeout=300)
        proc.join(timeout=60)
        with learner._full_policy() as policy:
            expected = [tensor_hash(t) for t in policy.state_dict().values()]
        assert kind == "hashes" and hashes == expected, "broadcast weights are not bit-identical"
        dtype = next(iter(manifest)).dtype
        self.add(
            f"broadcast sync ms, {backend} {learner.device} -> {receiver_device} ({sent / 2**20:.0f} MB {dtype}, "
            f"bit-identical, version {versions[-1]})",
            f"{per_sync * 1e3:.1f}",
            "-",
            f"{sent / 2**20 / per_sync:.0f} MB/s",
        )

    # ---- 4. vLLM ------------------------------------------------------------------------------
    def vllm(self, batch: int, new: int):
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            self.add("vllm backend", "not measured", "-", f"vllm not importable ({e})")
            return
        from actors.vllm_backend import VLLMBackend

        backend = VLLMBackend(self.policy_dir, gpu_memory_utilization=self.args.vllm_memory, dtype="bfloat16")
        reqs = self.requests(batch, new)
        vllm_rate = tokens_per_s(backend, reqs, self.args.reps)
        hf_rate = tokens_per_s(self.hf, reqs, self.args.reps)
        self.add(
            f"vllm tokens/s vs hf backend on GPU (batch {batch}, <= {new} new)",
            f"{vllm_rate:.0f}",
            f"{hf_rate:.0f}",
            f"{vllm_rate / hf_rate:.1f}x",
        )
        state = self.learner_.weights()
        t_load = timed(lambda: backend.load_weights(state), self.args.reps)
        self.add("vllm load_weights ms (collective_rpc + reset_prefix_cache)", f"{t_load * 1e3:.1f}", "-", "-")

    def table(self) -> str:
        lines = ["| figure | measured | baseline | ratio |", "|---|---|---|---|"]
        return "\n".join(lines + [f"| {' | '.join(r)} |" for r in self.rows])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu", action="store_true", help="run the same paths on CPU (plumbing check, not a measurement)"
    )
    parser.add_argument(
        "--hidden", type=int, default=None, help="model hidden size (default 1024 on CUDA, 64 with --cpu)"
    )
    parser.add_argument("--layers", type=int, default=None, help="layers (default 12 on CUDA, 2 with --cpu)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per generate (default 256 / 8)")
    parser.add_argument("--new", type=int, default=None, help="max new tokens (default 128 / 8)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vllm-memory", type=float, default=0.3, help="gpu_memory_utilization of the vLLM engine")
    args = parser.parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; nothing was measured")
        return 0
    cuda = not args.cpu
    args.hidden = args.hidden or (1024 if cuda else 64)
    args.layers = args.layers or (12 if cuda else 2)
    batch, new = args.batch or (256 if cuda else 8), args.new or (128 if cuda else 8)
    if args.cpu:
        args.reps = min(args.reps, 2)
    check = Check(args)
    hf = check.hf_backend(batch, new)
    check.learner(hf.generate(check.requests(min(batch, 64), new)))
    check.handoff()
    check.shared_memory()
    check.broadcast("gloo", "cpu")
    if cuda and torch.cuda.device_count() >= 2:
        check.broadcast("nccl", "cuda:1")
    else:
        check.add(
            "broadcast sync, nccl",
            "not measured",
            "-",
            "needs 2 GPUs (NCCL cannot place two ranks on one GPU)" if cuda else "no CUDA (--cpu)",
        )
    if cuda:
        check.vllm(batch, new)
    print(check.table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
