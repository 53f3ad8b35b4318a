"""Speed of rlsys's hot paths, each side by side with its plain baseline in the same run,
on the quickstart's model and task or at the reasoning task's shape. Prints one markdown table of ratios.

    .venv/bin/python benchmarks/perf.py                      # 7 timed repeats per figure
    .venv/bin/python benchmarks/perf.py --quick              # 3 repeats, shorter SFT and TRL runs
    .venv/bin/python benchmarks/perf.py --shape reasoning    # configs/reasoning.yaml: ~100-token responses
    .venv/bin/python benchmarks/perf.py --only learner,e2e --bf16   # both sides in bf16 mixed precision

Figures: rollout tokens/s (rlsys's HF backend vs plain `model.generate` sampling the same
distribution: every row for all its tokens, and rows ending at eos at different lengths), learner step
(DeepSpeed Learner.train_step vs plain torch fwd+bwd+AdamW, same GRPO clipped loss),
weight sync (learner -> shared memory or object store -> rollout worker vs raw ray.put + ray.get), 1 vs 2
rollout workers, cost growth with batch and response length (generate + train), and,
when `trl` is installed, end-to-end GRPO samples/s against TRL's GRPOTrainer; and the learner's
achieved FLOP/s against the machine's fp32 matmul peak measured in the same command.

The policy is built as the controller's `prepare_policy` builds it (tokenizer trained on
the task, the tiny Qwen2 of the shape's config) but without the SFT warm-up
(`sft.steps=0`). In the first rollout figure the plain baseline is told `min_new_tokens =
max_new_tokens` (every row runs every step: batch x new tokens); the random-init policy
samples eos in a few rows, which rlsys stops, so rlsys is counted by the tokens it produced
(counting it as batch x new too would favour it by a few percent).
Every timing is the median of interleaved repeats after one warm-up each; torch uses one
thread in the driver and in every actor, except TRL, which runs with the threads torch gives it by
default (all cores), and rlsys's end-to-end run without overlap, which gives generation (a worker
per core) and training (a thread per core) every core in turn. With `--bf16` both sides of the
end-to-end figure train and generate in bf16 (TRL's default, `bf16=True`, autocast around the model's
forward; rlsys's `learner.bf16: true`, torch autocast on a CPU, and `rollout.dtype: bfloat16`, the lean
decoder in bf16), the learner figure adds the bf16 learner's step against the fp32 one's, and the
rollout figure the bf16 lean decoder against `generate` of the model cast to bf16 and against the
fp32 decoder.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlsys.cluster import init_ray  # noqa: E402  (before anything imports ray)


@dataclass(frozen=True)
class Shape:
    """A workload's sizes: its config, the rollout and learner figures' response length, and the
    end-to-end run's."""

    config: str
    new: int  # tokens a response in the rollout, learner and growth figures
    e2e_prompts: int
    e2e_group: int
    e2e_new: int
    sft_steps: int  # the end-to-end run's warm-up (--quick: a third)
    figures: tuple[str, ...]  # what runs without --only


# end to end under overlap, rlsys's steps are timed in blocks of this many (the first block left out)
OVERLAP_BLOCK = 6

SHAPES = {
    "quickstart": Shape(
        config=str(ROOT / "configs" / "quickstart.yaml"),
        new=64,
        e2e_prompts=16,
        e2e_group=4,
        e2e_new=32,
        sft_steps=800,
        figures=("rollout", "reference", "reward", "learner", "flops", "ray", "growth", "e2e"),
    ),
    "reasoning": Shape(
        config=str(ROOT / "configs" / "reasoning.yaml"),
        new=128,
        e2e_prompts=16,
        e2e_group=8,
        e2e_new=128,
        sft_steps=1000,
        figures=("rollout", "learner", "flops", "e2e"),
    ),
}


def timed(fn, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs after one warm-up run."""
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def train_batch(algorithm, gens):
    """The algorithm's TrainBatch of generations in groups of 4, two of each group rewarded 1 (in
    seeded random places): no group has equal rewards, so the learner computes every row (it
    leaves out rows without a gradient; the end-to-end figure shows what that buys)."""
    import numpy as np

    from rlsys.experience import make_experience, new_uid

    rng = np.random.default_rng(0)
    rewards = np.concatenate([rng.permutation([0.0, 0.0, 1.0, 1.0]) for _ in range(0, len(gens), 4)])
    rows = [
        dict(
            uid=new_uid(),
            group=str(i // 4),
            prompt_ids=g.prompt_ids,
            response_ids=g.response_ids,
            logprobs=g.logprobs,
            reward=float(rewards[i]),
            policy_version=0,
            meta={},
        )
        for i, g in enumerate(gens)
    ]
    return algorithm.prepare(make_experience(rows))


def whole_machine(cores: int, learner_ranks: bool = False) -> list[str]:
    """rlsys's end-to-end run without overlap on every core: generation and training take turns, so
    each gets them all (a rollout worker per core, one thread each; the learner on `cores` threads,
    or with `learner_ranks` as `cores` ranks of one thread each)."""
    learner = [f"learner.num_ranks={cores}", "learner.threads=1"] if learner_ranks else [f"learner.threads={cores}"]
    return [f"rollout.num_workers={cores}", "rollout.threads_per_worker=1", *learner]


def rule_reward(cfg, task):
    """(row, response text) -> the run's rule reward: `reward.function` (a built-in such as `math`,
    or the user's) where the config names one, else the task's own."""
    if not cfg.reward.function:
        return task.reward
    from envs.reward_functions import load_function
    from envs.reward_runner import function_spec

    fn = load_function(function_spec(cfg.reward, task, cfg.sandbox))
    return lambda row, text: float(fn("", text, row))


def matmul_peak_flops(threads: int, n: int = 1024, reps: int = 20) -> float:
    """The fp32 matmul FLOP/s of this machine on `threads` torch threads: n x n @ n x n, the fastest
    of `reps` runs after a warm-up (a peak: what the cores reach at best)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    fastest = min(timed(lambda: a @ b, 1) for _ in range(reps))
    return 2 * n**3 / fastest


def paired(a, b, reps: int) -> tuple[float, float]:
    """Medians of two callables timed in alternation (drift on a shared machine hits both)."""
    a(), b()
    ta, tb = [], []
    for _ in range(reps):
        for fn, acc in ((a, ta), (b, tb)):
            t = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


class Bench:
    def __init__(self, reps: int, shape: Shape, bf16: bool = False):
        import torch

        from rlsys.config import load_config
        from rlsys.prompts import prompt_ids
        from rlsys.run.controller import Controller

        self.default_threads = torch.get_num_threads()  # what a library left alone runs with (TRL)
        torch.set_num_threads(1)
        self.reps, self.shape, self.bf16 = reps, shape, bf16
        out = Path(tempfile.mkdtemp(prefix="rlsys-bench-perf-"))
        self.cfg = load_config(
            shape.config, [f"run.output_dir={out}", "run.name=perf", "sft.steps=0", "algorithm.kl_coef=0"]
        )
        self.controller = Controller(self.cfg, out / "perf", progress=False)
        self.policy_dir = str(self.controller.prepare_policy())
        self.task, self.tok = self.controller.task, self.controller.tokenizer
        self.prompts = [prompt_ids(self.task, self.tok, r)[0] for r in self.task.rows("train")]
        self.rows: list[tuple[str, str, str, str, str]] = []

    def add(self, figure: str, rlsys: str, baseline: str, ratio: float, goal: str) -> None:
        self.rows.append((figure, rlsys, baseline, f"{ratio:.2f}x", goal))
        print(
            f"  {figure}: rlsys {rlsys} | baseline {baseline} | {ratio:.2f}x (goal {goal})", file=sys.stderr, flush=True
        )

    def requests(self, batch: int, new_tokens: int, seed: int = 0):
        from rlsys.generation import GenerationRequest, SamplingParams

        params = SamplingParams(
            max_new_tokens=new_tokens, temperature=1.0, seed=seed, stop_token_ids=(self.tok.eos_token_id,)
        )
        return [GenerationRequest(list(p), params) for p in self.prompts[:batch]]

    # ---- 1. rollout -------------------------------------------------------------------
    def rollout(self, batch: int = 32, new: int = 64):
        """rlsys's HF backend vs plain `generate` told `min_new_tokens = new`: every plain row runs
        every step; the few rows of the random-init policy that sample eos stop in rlsys."""
        from actors.rollout import RolloutWorker

        worker = RolloutWorker(self.policy_dir, "hf", batch_size=64, threads=1)
        _, plain_tokens = self.rollout_figure(worker, batch, new, f"{new} new", min_new_tokens=new)
        assert plain_tokens == batch * new
        self.worker = worker
        return worker

    def rollout_variable_length(self, batch: int = 32, new: int = 64, stop_rate: float = 1 / 32):
        """The same batch when responses end at eos at different lengths, as a policy's do in RL:
        the policy's eos logit is raised by a bias on lm_head (one model for both sides) until a
        row of the first step stops with probability `stop_rate` (mean length ~1/stop_rate, capped
        at `new`). rlsys drops finished rows; plain `generate` runs every row until the last one ends."""
        import torch

        from actors.modeling import pad_sequences
        from actors.rollout import RolloutWorker

        worker = RolloutWorker(self.policy_dir, "hf", batch_size=64, threads=1)
        model, eos = worker.backend.model, self.tok.eos_token_id
        ids, mask = pad_sequences([r.prompt_ids for r in self.requests(batch, new)], self.tok.pad_token_id, left=True)
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask).logits[:, -1].float()
            lo, hi = -50.0, 50.0  # bisect the eos bias on the first step's mean stop probability
            for _ in range(60):
                mid = (lo + hi) / 2
                first[:, eos] += mid
                p = first.softmax(-1)[:, eos].mean().item()
                first[:, eos] -= mid
                lo, hi = (mid, hi) if p < stop_rate else (lo, mid)
            model.lm_head.bias = torch.nn.Parameter(
                torch.zeros(model.lm_head.out_features).index_fill_(0, torch.tensor([eos]), lo), requires_grad=False
            )
        self.rollout_figure(worker, batch, new, f"<= {new} new, stopping at eos")

    def rollout_architecture(self, architecture: str, batch: int = 32, new: int = 64):
        """The fixed-length figure on a random-init model of another family with the quickstart
        policy's sizes (Qwen3's per-head norms, Phi-3's fused projections, Gemma's norms and
        activation all run in the lean loop)."""
        import dataclasses

        from actors.rollout import RolloutWorker
        from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir

        spec = dataclasses.replace(TinyModelSpec.from_config(self.cfg.model), architecture=architecture)
        model_dir = save_model_dir(
            build_tiny_model(spec, self.tok), self.tok, Path(self.policy_dir).parent / architecture
        )
        worker = RolloutWorker(str(model_dir), "hf", batch_size=64, threads=1)
        assert worker.stats()["lean_decode"]
        self.rollout_figure(worker, batch, new, f"{new} new, a {architecture} of the same sizes", min_new_tokens=new)

    def rollout_bf16(self, batch: int = 32, new: int = 64):
        """`rollout.dtype: bfloat16` (the lean decoder in bf16) vs plain `generate` of the model cast to
        bf16 (every weight bf16: faster than TRL's bf16 generation, autocast around an fp32 model's
        forward, which casts every weight at every step), every row for `new` tokens; then the same
        batch, the bf16 lean decoder vs the fp32 one."""
        import copy

        import torch

        from actors.rollout import RolloutWorker

        mixed = RolloutWorker(self.policy_dir, "hf", batch_size=64, threads=1, dtype="bfloat16")
        self.rollout_figure(
            mixed,
            batch,
            new,
            f"{new} new, rollout.dtype bfloat16 vs generate of the model in bf16",
            plain_model=copy.deepcopy(mixed.backend.model).to(torch.bfloat16),
            min_new_tokens=new,
        )
        reqs = self.requests(batch, new)
        t_mixed, t_fp32 = paired(lambda: mixed.generate(reqs), lambda: self.worker.generate(reqs), self.reps)
        self.add(
            f"rollout, rollout.dtype bfloat16 vs float32, the lean decoder both (batch {batch}, <= {new} new; "
            f"tokens/s ratio)",
            f"{t_mixed * 1e3:.0f} ms",
            f"{t_fp32 * 1e3:.0f} ms",
            t_fp32 / t_mixed,
            "speed-up",
        )

    def rollout_figure(
        self, worker, batch: int, new: int, label: str, plain_model=None, **plain_kwargs
    ) -> tuple[float, float]:
        """Tokens/s of `worker.generate` vs plain `generate` with the worker's model (or `plain_model`),
        sampling the same distribution (no top-k: `generate` defaults to 50), each side counted by its
        own response tokens up to and including eos. Returns the mean tokens per run (rlsys, plain)."""
        import torch

        from actors.modeling import pad_sequences

        model, eos = plain_model or worker.backend.model, self.tok.eos_token_id
        reqs = self.requests(batch, new)
        ids, mask = pad_sequences([r.prompt_ids for r in reqs], self.tok.pad_token_id, left=True)
        counts = {"ours": [], "plain": []}

        def ours():
            counts["ours"].append(sum(len(g.response_ids) for g in worker.generate(reqs)))

        @torch.no_grad()
        def plain():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                do_sample=True,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                eos_token_id=eos,
                pad_token_id=self.tok.pad_token_id,
                use_cache=True,
                **plain_kwargs,
            )
            response = out[:, ids.shape[1] :]
            ended = (response == eos).int().cumsum(-1)
            counts["plain"].append(int(((ended == 0) | ((ended == 1) & (response == eos))).sum()))

        t_ours, t_plain = paired(ours, plain, self.reps)
        mean_ours, mean_plain = (statistics.mean(counts[k]) for k in ("ours", "plain"))
        self.add(
            f"rollout tokens/s (batch {batch}, {label}; tokens a row {mean_ours / batch:.1f} / "
            f"{mean_plain / batch:.1f})",
            f"{mean_ours / t_ours:.0f}",
            f"{mean_plain / t_plain:.0f}",
            (mean_ours / t_ours) / (mean_plain / t_plain),
            ">= 2x",
        )
        return mean_ours, mean_plain

    def step_table(self, few_shot: int = 0, prompts: int = 32, group: int = 8, new: int = 6):
        """An Experience table of the quickstart's step shape: `prompts` x `group` samples, each
        prompt after `few_shot` solved training problems (a longer shared prompt, as a system
        prompt or few-shot examples make it)."""
        from rlsys.experience import make_experience, new_uid
        from rlsys.generation import GenerationRequest, SamplingParams

        shots = (
            "".join(f"{r['prompt']}{r['answer']}\n" for r in self.task.rows("train")[-few_shot:]) if few_shot else ""
        )
        shot_ids = self.tok(shots, add_special_tokens=False)["input_ids"] if shots else []
        params = SamplingParams(
            max_new_tokens=new, temperature=1.0, n=group, seed=0, stop_token_ids=(self.tok.eos_token_id,)
        )
        gens = self.worker.generate([GenerationRequest(shot_ids + list(p), params) for p in self.prompts[:prompts]])
        return make_experience(
            [
                dict(
                    uid=new_uid(),
                    group=str(g.request_index),
                    prompt_ids=g.prompt_ids,
                    response_ids=g.response_ids,
                    logprobs=g.logprobs,
                    reward=0.0,
                    policy_version=0,
                )
                for g in gens
            ]
        )

    def reference(self):
        """The reference worker's logprobs on the quickstart's step shape (each group's prompt run
        once) vs the plain forward over every row, same table, in-process."""
        from actors.modeling import per_response_tokens
        from actors.reference import ReferenceWorker
        from rlsys.logprobs import forward_logprobs

        worker = ReferenceWorker(self.policy_dir)
        plain = lambda ids, mask, span, packed: forward_logprobs(worker.model, ids, mask)[1]  # noqa: E731
        for shots in (0, 8):
            table = self.step_table(shots)
            t_ours, t_plain = paired(
                lambda: worker.logprobs(table), lambda: per_response_tokens(plain, table), self.reps
            )
            self.add(
                f"reference logprobs ms (32 prompts x 8, {self.prompt_share(table)})",
                f"{t_ours * 1e3:.1f}",
                f"{t_plain * 1e3:.1f}",
                t_ours / t_plain,
                "(time: < 1x is faster)",
            )

    def reward(self):
        """A reward model (`reward.source: model`, a random-init Qwen2 scorer of the policy's size
        with its own tokenizer, as `rlsys rm train` saves one) scoring the quickstart's step: the
        reward worker (each group's prompt run once) vs the same decoded and re-encoded texts
        through the plain forward, in-process."""
        import torch

        from actors.reward import RewardWorker, encode_pairs, sequence_scores
        from rlsys.models import TinyModelSpec, save_model_dir
        from rlsys.reward_model import build_reward_model

        rm_dir = save_model_dir(
            build_reward_model(self.tok, TinyModelSpec.from_config(self.cfg.model), seed=1),
            self.tok,
            Path(self.policy_dir).parent / "rm",
        )
        worker = RewardWorker(self.policy_dir, reward_model_dir=str(rm_dir))

        @torch.no_grad()
        def plain(table):
            prompts = self.tok.batch_decode(table.column("prompt_ids").to_pylist(), skip_special_tokens=True)
            seqs = encode_pairs(worker.reward_model.tokenizer, prompts, worker.decode(table))
            return [
                x for s in range(0, len(seqs), 32) for x in sequence_scores(worker.model, seqs[s : s + 32]).tolist()
            ]

        for shots in (0, 8):
            table = self.step_table(shots)
            assert max(abs(a - b) for a, b in zip(worker.score(table), plain(table))) < 1e-4
            t_ours, t_plain = paired(lambda: worker.score(table), lambda: plain(table), self.reps)
            self.add(
                f"reward-model scores ms (32 prompts x 8, {self.prompt_share(table)})",
                f"{t_ours * 1e3:.1f}",
                f"{t_plain * 1e3:.1f}",
                t_ours / t_plain,
                "(time: < 1x is faster)",
            )
        self.reward_and_reference(rm_dir)

    def reward_and_reference(self, rm_dir: Path):
        """The controller asking the reward-model and reference actors for one step's table at once
        (`score_and_ref_logprobs`, what `sample_groups` calls) vs one after the other."""
        import ray

        from actors.reference import ReferenceWorker
        from actors.reward import RewardWorker
        from rlsys.run.context import ActorContext, PolicyActors
        from rlsys.run.weight_sync import ObjectStoreSync

        reward = ray.remote(RewardWorker).options(num_cpus=0.25).remote(self.policy_dir, reward_model_dir=str(rm_dir))
        reference = ray.remote(ReferenceWorker).options(num_cpus=0.25).remote(self.policy_dir)
        policies = {"policy": PolicyActors([], [])}
        ctx = ActorContext(
            self.cfg,
            self.tok,
            self.task,
            policies,
            reference,
            reward,
            ObjectStoreSync(policies, 60.0, ray.get, self.cfg.trainer.sync_bucket_mb),
            0,
        )
        table = self.step_table()
        together, apart = paired(
            lambda: ctx.score_and_ref_logprobs(table), lambda: (ctx.score(table), ctx.ref_logprobs(table)), self.reps
        )
        self.add(
            "reward model + reference logprobs ms, one step's table (32 prompts x 8), both actors at once vs "
            "one after the other",
            f"{together * 1e3:.1f}",
            f"{apart * 1e3:.1f}",
            together / apart,
            "(time: < 1x is faster)",
        )
        for a in (reward, reference):
            ray.kill(a)

    @staticmethod
    def prompt_share(table) -> str:
        prompt = sum(map(len, table.column("prompt_ids").to_pylist()))
        response = sum(map(len, table.column("response_ids").to_pylist()))
        return f"{table.num_rows} rows, prompts {prompt / (prompt + response):.0%} of the policy's tokens"

    # ---- 2. learner -------------------------------------------------------------------
    def train_batch(self, gens):
        return train_batch(self.controller.algorithm, gens)

    def learner(self, gens):
        import torch

        from actors.learner import Learner
        from algorithms.common import clipped_policy_loss
        from rlsys.cluster import free_port
        from rlsys.models import load_model

        l = self.cfg.learner
        learner = Learner(
            self.policy_dir,
            self.controller.algorithm,
            lr=l.lr,
            grad_clip=l.grad_clip,
            threads=1,
            master_port=free_port(),
        )
        batch = self.train_batch(gens)
        model = load_model(self.policy_dir)
        opt = torch.optim.AdamW(model.parameters(), lr=l.lr)
        model.train()

        def plain():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
            loss = clipped_policy_loss(logp, batch.old_logprobs, batch.advantages, batch.response_mask)[0]
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), l.grad_clip)
            opt.step()

        t_ours, t_plain = paired(lambda: learner.train_step(batch), plain, self.reps)
        self.add(
            f"learner step, ms (batch {len(batch)}, {batch.input_ids.shape[1]} tokens)",
            f"{t_ours * 1e3:.0f}",
            f"{t_plain * 1e3:.0f}",
            t_ours / t_plain,
            "<= 1.15x",
        )
        self.in_process_learner, self.learner_batch, self.plain_learner_step = learner, batch, plain
        if self.bf16:
            algorithm, port = self.controller.algorithm, free_port()
            mixed = Learner(self.policy_dir, algorithm, lr=l.lr, grad_clip=l.grad_clip, bf16=True, master_port=port)
            t_mixed, t_fp32 = paired(lambda: mixed.train_step(batch), lambda: learner.train_step(batch), self.reps)
            self.add(
                f"learner step under learner.bf16 (torch autocast on the CPU), ms, vs the fp32 learner "
                f"(batch {len(batch)}, {batch.input_ids.shape[1]} tokens, 1 thread)",
                f"{t_mixed * 1e3:.0f}",
                f"{t_fp32 * 1e3:.0f}",
                t_fp32 / t_mixed,
                "speed-up",
            )
        return learner

    def flops(self):
        """The learner's achieved FLOP/s (its step's matmul and attention FLOPs, forward and
        backward, counted by torch's FlopCounterMode, over the step's time) against the fp32 matmul
        peak of the same threads, on one thread and on every core; the plain torch step beside it."""
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        learner, batch, plain = self.in_process_learner, self.learner_batch, self.plain_learner_step
        counted = {}
        for name, step in (("rlsys", lambda: learner.train_step(batch)), ("plain", plain)):
            with FlopCounterMode(display=False) as counter:
                step()
            counted[name] = counter.get_total_flops()
        for threads in sorted({1, self.default_threads}):
            peak = matmul_peak_flops(threads)
            t_ours, t_plain = paired(lambda: learner.train_step(batch), plain, self.reps)
            ours, theirs = counted["rlsys"] / t_ours, counted["plain"] / t_plain
            self.add(
                f"learner GFLOP/s on {threads} thread(s) vs the fp32 matmul peak of {threads} (batch {len(batch)} x "
                f"{batch.input_ids.shape[1]} tokens, {counted['rlsys'] / 1e9:.1f} GFLOP a step; plain torch "
                f"{theirs / 1e9:.0f} GFLOP/s, {theirs / peak:.2f} of the peak)",
                f"{ours / 1e9:.0f}",
                f"{peak / 1e9:.0f}",
                ours / peak,
                ">= 0.5",
            )
        self.step_flops = counted["rlsys"]
        torch.set_num_threads(1)

    def learner_ranks(self, flat_groups: int = 3, layouts: int = 5):
        """Every core as that many learner ranks of one thread each (Ray actors, each rank's shard
        from `rank_shards`, gradients all-reduced): the flops figure's FLOPs over the step's time
        as the run sees it, against the matmul peak of as many threads. Then the shards balanced by
        the tokens each rank trains vs `TrainBatch.split`'s contiguous halves, on the batch with
        `flat_groups` of its groups without gradient (kl_coef 0: left out of the forward), in
        `layouts` random placements: the median ratio of their step times."""
        import numpy as np
        import ray

        from actors.learner import Learner
        from rlsys.cluster import free_port
        from rlsys.run.actors import rank_shards

        n, l, algorithm, batch = self.default_threads, self.cfg.learner, self.controller.algorithm, self.learner_batch
        port = free_port()
        ranks = [
            ray.remote(Learner)
            .options(num_cpus=1)
            .remote(
                self.policy_dir,
                algorithm,
                lr=l.lr,
                grad_clip=l.grad_clip,
                threads=1,
                rank=rank,
                world_size=n,
                master_port=port,
            )
            for rank in range(n)
        ]
        step = lambda shards: ray.get([r.train_step.remote(s) for r, s in zip(ranks, shards)])
        shards = rank_shards(batch, n, algorithm)
        t_ranks, peak = timed(lambda: step(shards), self.reps), matmul_peak_flops(n)
        self.add(
            f"the flops figure's batch on {n} learner ranks of 1 thread each vs the fp32 matmul peak of {n} threads "
            f"(the step's time as the run sees it: Ray calls, the gradient all-reduce)",
            f"{self.step_flops / t_ranks / 1e9:.0f}",
            f"{peak / 1e9:.0f}",
            self.step_flops / t_ranks / peak,
            ">= 0.5",
        )
        groups, size = len(batch) // 4, 4
        ratios = []
        for seed in range(layouts):
            flat = batch.select(slice(None))
            flat.advantages = flat.advantages.clone()
            for g in np.random.default_rng(seed).choice(groups, flat_groups, replace=False):
                flat.advantages[g * size : (g + 1) * size] = 0
            balanced, halves = rank_shards(flat, n, algorithm), flat.split(n)
            t_balanced, t_halves = paired(lambda: step(balanced), lambda: step(halves), self.reps)
            ratios.append(t_balanced / t_halves)
        self.add(
            f"learner step on {n} ranks, shards balanced by the tokens each trains vs contiguous halves ({flat_groups} "
            f"of {groups} groups without gradient, {layouts} random layouts, the median ratio; time)",
            "-",
            "-",
            statistics.median(ratios),
            "(time)",
        )
        for r in ranks:
            ray.kill(r)

    # ---- 3. weight sync, 4. scaling (Ray actors) --------------------------------------
    def weight_sync(self, learner, worker) -> dict:
        """Controller.sync_weights' two paths vs a raw ray.put + ray.get of the same dict: through
        shared memory (what `trainer.weight_sync: auto` picks with the workers on learner rank 0's
        node: the learner copies its weights into a /dev/shm slot, the worker adopts the slot's
        arrays) and through the object store (learner.weights() ref -> worker.load_weights, the
        path across nodes), and the object store's floor: one actor returns the dict, another
        receives it. Returns the state dict."""
        import ray

        from actors.shared_weights import SLOTS

        version = iter(range(1, 10**6))
        layout = ray.get(learner.share_weights.remote("perf"))

        def shared_path():
            v = next(version)
            ray.get(worker.load_shared.remote(v, layout, v % SLOTS, learner.write_shared.remote(v % SLOTS)))

        def store_path():  # as the run's sync: the weights and their checksums (rlsys/weight_digest.py)
            ref, digest = learner.weights_and_digest.options(num_returns=2).remote()
            ray.get(worker.load_weights.remote(next(version), ref, digest))

        state = ray.get(learner.weights.remote())
        mb = sum(a.nbytes for a in state.values()) / 2**20
        raw = lambda: ray.get(ray.put(state))
        times = {}
        for path, fn in (("shared memory", shared_path), ("object store", store_path)):
            times[path], t_raw = paired(fn, raw, self.reps * 3)
            self.add(
                f"weight sync, {path}, ms ({mb:.1f} MB; ms/MB: {times[path] * 1e3 / mb:.2f} vs {t_raw * 1e3 / mb:.2f})",
                f"{times[path] * 1e3:.1f}",
                f"{t_raw * 1e3:.1f}",
                times[path] / t_raw,
                "<= 1.2x",
            )
        ray.get(learner.close_shared.remote())
        t_store = times["object store"]

        @ray.remote(num_cpus=0.1)
        class Hop:
            def __init__(self, state=None):
                self.state = state

            def get(self):
                return self.state

            def take(self, state):
                return len(state)

        src, dst = Hop.remote(state), Hop.remote()
        t_hop = timed(lambda: ray.get(dst.take.remote(src.get.remote())), self.reps * 3)
        self.add(
            f"weight sync, object store, vs its two-actor-hop floor ({mb:.1f} MB: actor -> store -> actor), ms",
            f"{t_store * 1e3:.1f}",
            f"{t_hop * 1e3:.1f}",
            t_store / t_hop,
            "(what bounds it)",
        )
        ray.kill(src), ray.kill(dst)
        return state

    def bigger_policy(self) -> str:
        """An 8 x 512 Qwen2 (~100 MB fp32) with the task's tokenizer, saved beside the policy."""
        from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir

        spec = TinyModelSpec(
            hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4
        )
        path = Path(self.policy_dir).parent / "policy_8x512"
        return str(save_model_dir(build_tiny_model(spec, self.tok), self.tok, path))

    def weight_sync_at(self, policy_dir: str) -> None:
        import ray

        from actors.learner import Learner
        from actors.rollout import RolloutWorker
        from rlsys.cluster import free_port

        learner = (
            ray.remote(Learner)
            .options(num_cpus=0.5)
            .remote(policy_dir, self.controller.algorithm, lr=self.cfg.learner.lr, threads=1, master_port=free_port())
        )
        worker = ray.remote(RolloutWorker).options(num_cpus=0.5).remote(policy_dir, "hf", 64, 1, 9)
        ray.get([learner.ready.remote(), worker.policy_version.remote()])
        self.weight_sync(learner, worker)
        ray.kill(learner), ray.kill(worker)

    def ray_figures(self, batch: int = 64, new: int = 64):
        import ray

        from actors.learner import Learner
        from actors.rollout import RolloutWorker
        from rlsys.cluster import free_port
        from rlsys.run.context import ActorContext, PolicyActors
        from rlsys.run.weight_sync import ObjectStoreSync

        l = self.cfg.learner
        learner = (
            ray.remote(Learner)
            .options(num_cpus=0.5)
            .remote(self.policy_dir, self.controller.algorithm, lr=l.lr, threads=1, master_port=free_port())
        )
        workers = [
            ray.remote(RolloutWorker).options(num_cpus=0.5).remote(self.policy_dir, "hf", 64, 1, i) for i in range(2)
        ]
        ray.get([learner.ready.remote()] + [w.policy_version.remote() for w in workers])
        state = self.weight_sync(learner, workers[0])
        ray.get(workers[0].load_weights.remote(0, state))  # back to version 0, as ActorContext expects
        reqs = self.requests(batch, new)
        policies = [{"policy": PolicyActors(workers[:n], [])} for n in (1, 2)]
        ctxs = [
            ActorContext(
                self.cfg,
                self.tok,
                self.task,
                p,
                None,
                None,
                ObjectStoreSync(p, 60.0, ray.get, self.cfg.trainer.sync_bucket_mb),
                0,
            )
            for p in policies
        ]
        t_one, t_two = paired(lambda: ctxs[0].generate(reqs), lambda: ctxs[1].generate(reqs), self.reps)
        one, two = batch * new / t_one, batch * new / t_two
        self.add(
            f"scaling: rollout tokens/s, 2 vs 1 workers (batch {batch}, {new} new)",
            f"{two:.0f}",
            f"{one:.0f}",
            two / one,
            ">= 1.7x",
        )
        # the same per-worker batch: a second worker generates a second batch in the same time
        double = self.requests(2 * batch, new)
        t_one, t_two = paired(lambda: ctxs[0].generate(reqs), lambda: ctxs[1].generate(double), self.reps)
        one, two = batch * new / t_one, 2 * batch * new / t_two
        self.add(
            f"scaling: rollout tokens/s, 2 workers x batch {batch} vs 1 x {batch} ({new} new)",
            f"{two:.0f}",
            f"{one:.0f}",
            two / one,
            ">= 1.7x",
        )
        for a in [learner, *workers]:
            ray.kill(a)
        self.weight_sync_at(self.bigger_policy())  # fixed per-call costs amortise: the per-MB figure

    # ---- 5. cost growth ---------------------------------------------------------------
    def growth(self):
        """generate + train_step per sample; compared with the growth in tokens per step."""
        worker, learner = self.worker, self.in_process_learner
        base = None
        for batch, new in [(16, 64), (32, 64), (64, 64), (32, 32), (32, 128)]:
            reqs = self.requests(batch, new)
            step = lambda: learner.train_step(self.train_batch(worker.generate(reqs)))
            per_sample = timed(step, max(1, self.reps // 2)) / batch
            if (batch, new) in [(16, 64), (32, 32)]:
                base = (batch, new, per_sample)
            b0, n0, s0 = base
            tokens_growth = new / n0  # per sample, tokens grow with the response length only
            self.add(
                f"cost growth: ms/sample at batch {batch}, response {new} (vs batch {b0}, response {n0})",
                f"{per_sample * 1e3:.1f}",
                f"{s0 * 1e3:.1f}",
                (per_sample / s0) / tokens_growth,
                f"<= 1x the per-sample token growth ({tokens_growth:g}x)",
            )

    # ---- 6. end to end against TRL ---------------------------------------------------
    def end_to_end(self, steps: int, sft_steps: int) -> str:
        """GRPO samples/s: rlsys's Controller (Ray actors, as `rlsys run`) vs TRL's GRPOTrainer
        (in-process, CPU, no vllm, fp32, torch on the threads it gets by default: every core), from
        the same SFT-warmed policy with the same prompts, reward, G, max length, lr and its schedule,
        clipping, no KL term in either (TRL's default beta=0). rlsys without overlap gives every
        core to generation and to training in turn (`whole_machine`); with overlap (both busy at
        once) its one rollout worker and its learner have a thread each. The runs alternate step
        by step; samples/s is the median step's, the first step of each left out. The overlapped
        run goes in blocks of OVERLAP_BLOCK steps back to back (each step but a block's last queues
        the next one's training behind its own), its samples/s the median block's (the first block
        left out). Reward after the same samples: the mean train reward, and each final policy's
        greedy held-out accuracy.
        Returns rlsys's per-phase split of the timed steps."""
        import ray
        import torch
        from datasets import Dataset
        from transformers import PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        from actors.modeling import state_dict_numpy
        from rlsys.config import load_config
        from rlsys.models import load_model
        from rlsys.prompts import prompt_ids
        from rlsys.run.controller import Controller

        prompts, group, new, whole = (
            self.shape.e2e_prompts,
            self.shape.e2e_group,
            self.shape.e2e_new,
            self.default_threads,
        )
        run_dir = self.controller.run_dir.parent / "e2e"
        common = [
            f"run.output_dir={run_dir.parent}",
            "sft.demo_error=0",
            "algorithm.kl_coef=0",
            f"algorithm.group_size={group}",
            f"rollout.max_new_tokens={new}",
            f"trainer.prompts_per_step={prompts}",
            f"trainer.steps={steps}",
            *(["learner.bf16=true", "rollout.dtype=bfloat16"] if self.bf16 else []),
        ]  # the lr schedule's length (TRL's: max_steps)
        c = Controller(
            load_config(
                self.shape.config,
                [*common, "run.name=e2e", f"sft.steps={sft_steps}", *whole_machine(whole)],
            ),
            run_dir,
            progress=False,
        )
        torch.set_num_threads(whole)  # the warm-up (not timed) on every core
        policy_dir = c.prepare_policy()
        torch.set_num_threads(1)  # the driver: rlsys's controller thread
        c.start_actors(policy_dir)
        # the same policy, generating step t+1's rows while the learner trains on step t's
        over = Controller(
            load_config(
                self.shape.config,
                [
                    *common,
                    "run.name=e2e-overlap",
                    f"model.path={policy_dir}",
                    "sft.steps=0",
                    "trainer.mode=overlap",
                    "buffer.max_staleness=1",
                ],
            ),
            run_dir.parent / "e2e-overlap",
            progress=False,
        )
        over.start_actors(over.prepare_policy())
        # the same policy without overlap, the learner as a rank per core (one thread each)
        ranks = Controller(
            load_config(
                self.shape.config,
                [*common, "run.name=e2e-ranks", f"model.path={policy_dir}", "sft.steps=0", *whole_machine(whole, True)],
            ),
            run_dir.parent / "e2e-ranks",
            progress=False,
        )
        ranks.start_actors(ranks.prepare_policy())
        start_accuracy = c.evaluate(greedy=True)["accuracy"]
        cfg = c.cfg
        ours, overlapped, theirs, rewards, over_rewards, phases, lengths, threads = [], [], [], [], [], {}, [], set()
        block = min(OVERLAP_BLOCK, max(1, steps // 2))  # the overlapped run's steps timed together
        split, split_rewards = [], []

        class Interleave(TrainerCallback):  # one step of each rlsys run after each TRL step: drift hits all alike
            def on_step_begin(self, *a, **k):
                self.t = time.perf_counter()

            def on_step_end(self, *a, **k):
                theirs.append(time.perf_counter() - self.t)
                threads.add(torch.get_num_threads())
                # a step's time includes the weight sync it sent (settled here, not during TRL's step)
                start = time.perf_counter()
                m = c.train_step()
                c.ctx.settle_sync()
                ours.append(time.perf_counter() - start)
                lengths.append(m["response_length"])
                rewards.append(m["reward/mean"])
                for key, v in m.items():
                    if key.startswith("time/") and key != "time/step":
                        phases[key[5:]] = phases.get(key[5:], 0.0) + v
                # the overlapped run in blocks of steps back to back: each step queues the next one's
                # training behind its own, but a block's last step does not (nothing of the run works
                # on between blocks; its controller round trip is then the block's cost)
                if len(theirs) - len(over_rewards) >= block or len(theirs) == steps:
                    todo, start = len(theirs) - len(over_rewards), time.perf_counter()
                    for i in range(todo):
                        over_rewards.append(over.train_step(queue_next=i < todo - 1)["reward/mean"])
                    over.ctx.settle_sync()
                    overlapped.append((time.perf_counter() - start) / todo)
                start = time.perf_counter()
                m = ranks.train_step()
                ranks.ctx.settle_sync()
                split.append(time.perf_counter() - start)
                split_rewards.append(m["reward/mean"])

        task, tok = c.task, c.tokenizer
        tok.padding_side = "left"
        rows = task.rows("train")
        # the prompt text rlsys gives the model (the chat template applied), which TRL tokenizes again
        data = Dataset.from_list([{"prompt": prompt_ids(task, tok, r)[1], "row": i} for i, r in enumerate(rows)])
        score = rule_reward(c.cfg, task)
        reward = lambda prompts, completions, row, **_: [score(rows[i], x) for x, i in zip(completions, row)]
        args = GRPOConfig(
            output_dir=str(run_dir / "trl"),
            use_cpu=True,
            bf16=self.bf16,  # TRL's default is True; without --bf16 both sides train in fp32
            fp16=False,
            gradient_checkpointing=False,
            use_vllm=False,
            num_generations=group,
            per_device_train_batch_size=prompts * group,
            max_completion_length=new,
            temperature=1.0,
            learning_rate=cfg.learner.lr,
            max_grad_norm=cfg.learner.grad_clip,
            beta=0.0,
            lr_scheduler_type="cosine_with_min_lr",  # rlsys's: cosine to min_lr_ratio over the run
            lr_scheduler_kwargs={"min_lr_rate": cfg.learner.min_lr_ratio},
            warmup_steps=cfg.learner.warmup_steps,
            max_steps=steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            dataloader_num_workers=0,
            seed=0,
            disable_tqdm=True,
            log_level="error",
        )
        trainer = GRPOTrainer(
            model=load_model(policy_dir),
            reward_funcs=reward,
            args=args,
            train_dataset=data,
            processing_class=tok,
            callbacks=[Interleave()],
        )
        trainer.remove_callback(PrinterCallback)  # no per-step log dicts on stdout
        torch.set_num_threads(whole)  # TRL's default (an earlier figure set the driver to one thread)
        trainer.train()
        torch.set_num_threads(1)
        # "equal or better reward after the same number of samples": each run's final policy,
        # greedy on the held-out split, through the same rollout worker (TRL's weights loaded into it)
        accuracy = {
            "rlsys": c.evaluate(greedy=True)["accuracy"],
            "overlap": over.evaluate(greedy=True)["accuracy"],
            "ranks": ranks.evaluate(greedy=True)["accuracy"],
        }
        ray.get([w.load_weights.remote(c.ctx.policy_version, state_dict_numpy(trainer.model)) for w in c.workers])
        accuracy["trl"] = c.evaluate(greedy=True)["accuracy"]
        c.shutdown(), over.shutdown(), ranks.shutdown()
        samples = prompts * group
        ours_sps, theirs_sps = samples / statistics.median(ours[1:]), samples / statistics.median(theirs[1:])
        over_sps = samples / statistics.median(overlapped[1:])
        split_sps = samples / statistics.median(split[1:])
        trl_reward = [h["reward"] for h in trainer.state.log_history if "reward" in h]
        trl_length = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
        print(
            f"  e2e: mean response length {statistics.mean(lengths):.1f} vs TRL {statistics.mean(trl_length):.1f}; "
            f"torch threads in the TRL process {sorted(threads)}",
            file=sys.stderr,
        )
        self.add(
            f"end-to-end GRPO samples/s vs TRL GRPOTrainer (G={group}, {prompts} prompts/step, <= {new} new, "
            f"mean response {statistics.mean(lengths):.0f} vs {statistics.mean(trl_length):.0f} tokens, "
            f"{whole} cores each, {'bf16 mixed' if self.bf16 else 'fp32'} on both sides, {sft_steps} SFT steps, "
            f"{steps} steps each, interleaved; mean train reward "
            f"{statistics.mean(rewards):.2f} vs {statistics.mean(trl_reward):.2f}; held-out greedy accuracy after "
            f"the run {accuracy['rlsys']:.3f} vs {accuracy['trl']:.3f}, from {start_accuracy:.3f})",
            f"{ours_sps:.1f}",
            f"{theirs_sps:.1f}",
            ours_sps / theirs_sps,
            ">= 1.5x",
        )
        self.add(
            f"end-to-end, trainer.mode=overlap (next step's rollout during training, 1 thread per actor; "
            f"mean train reward "
            f"{statistics.mean(over_rewards):.2f} vs TRL {statistics.mean(trl_reward):.2f}; held-out greedy accuracy "
            f"{accuracy['overlap']:.3f} vs {accuracy['trl']:.3f})",
            f"{over_sps:.1f}",
            f"{theirs_sps:.1f}",
            over_sps / theirs_sps,
            ">= 2x",
        )
        self.add(
            f"end-to-end without overlap, the learner as {whole} ranks of 1 thread each (mean train reward "
            f"{statistics.mean(split_rewards):.2f} vs TRL {statistics.mean(trl_reward):.2f}; held-out greedy accuracy "
            f"{accuracy['ranks']:.3f} vs {accuracy['trl']:.3f})",
            f"{split_sps:.1f}",
            f"{theirs_sps:.1f}",
            split_sps / theirs_sps,
            ">= 1.5x",
        )
        total = sum(ours)
        return "rlsys end-to-end step split: " + ", ".join(
            f"{k} {v / total:.0%}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])
        )

    def table(self) -> str:
        lines = ["| figure | rlsys | baseline | ratio | goal |", "|---|---|---|---|---|"]
        return "\n".join(lines + [f"| {' | '.join(r)} |" for r in self.rows])


FIGURES = ("rollout", "reference", "reward", "learner", "flops", "ray", "growth", "e2e")


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 repeats per figure instead of 7, shorter end-to-end runs")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="quickstart", help="the workload's config and sizes")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(FIGURES)} (default: the shape's figures)")
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision on both sides (TRL's default)")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    only = set(args.only.split(",")) if args.only else set(shape.figures)
    if only - set(FIGURES):
        ap.error(f"--only: unknown figures {sorted(only - set(FIGURES))} (choose from {', '.join(FIGURES)})")
    init_ray(num_cpus=12)  # logical: the e2e figure runs three controllers' actors side by side
    bench = Bench(reps=3 if args.quick else 7, shape=shape, bf16=args.bf16)
    t0 = time.perf_counter()
    # end to end first: the other figures' in-process learner and workers leave this process slower
    # for TRL's in-process steps after them (docs/benchmarks.md)
    note = ""
    if "e2e" in only:
        try:
            import trl  # noqa: F401
        except ImportError:
            note = (
                "\nTRL GRPOTrainer end-to-end: not measured (trl is not installed: pip install -c constraints.txt trl)"
            )
        else:
            sft = shape.sft_steps // 3 if args.quick else shape.sft_steps
            note = "\n" + bench.end_to_end(steps=4 if args.quick else 30, sft_steps=sft)
    if only & {"rollout", "reference", "reward", "learner", "flops", "growth"}:
        worker = bench.rollout(new=shape.new)
    if "rollout" in only and args.bf16:
        bench.rollout_bf16(new=shape.new)
    if "rollout" in only:
        bench.rollout_variable_length(new=shape.new, stop_rate=2 / shape.new)
        if args.shape == "quickstart":
            for architecture in ("qwen3", "phi3", "gemma"):
                bench.rollout_architecture(architecture)
    if "reference" in only:
        bench.reference()
    if "reward" in only:
        bench.reward()
    if only & {"learner", "flops", "growth"}:
        bench.learner(worker.generate(bench.requests(32, shape.new)))
    if "flops" in only:
        bench.flops()
        if bench.default_threads > 1:
            bench.learner_ranks()
    if "ray" in only:
        bench.ray_figures()
    if "growth" in only:
        bench.growth()
    print(f"\nbenchmarks/perf.py {' '.join(argv)} ({time.perf_counter() - t0:.0f} s); ratio = rlsys / baseline\n")
    print(bench.table())
    print(note)


if __name__ == "__main__":
    main(sys.argv[1:])
