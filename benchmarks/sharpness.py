"""How large a step does the warmed-up policy tolerate? A one-step probe of the GRPO gradient.

Warms the quickstart policy up (clean demonstrations), samples one GRPO batch in-process
(the real HF rollout backend, the task's reward), takes the gradient of GRPO's loss and
steps along it, the whole gradient and each parameter group alone, by a range of step norms.
Prints the mean probability of the right answers on the batch's prompts after each step:
the step norm where it stops rising is the largest useful update.

    .venv/bin/python benchmarks/sharpness.py [--sft-steps 800] [--prompts 128]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUPS = {
    "all": lambda n: True,
    "embeddings": lambda n: "embed" in n,
    "attention": lambda n: "self_attn" in n,
    "mlp": lambda n: ".mlp." in n,
    "norms": lambda n: "norm" in n,
}
STEP_NORMS = (0.003, 0.01, 0.03, 0.1)


class InProcessContext:
    """GRPO's rollout needs: generation (HF backend) and the task's rule reward, in this process."""

    def __init__(self, policy_dir, tokenizer, task, max_new_tokens: int):
        from actors.rollout import HFBackend

        self.backend, self.tokenizer, self.task, self.policy_version = HFBackend(str(policy_dir)), tokenizer, task, 0
        self.max_new_tokens, self.rng = max_new_tokens, np.random.default_rng(0)

    def sampling(self, **overrides):
        from rlsys.generation import SamplingParams

        base = SamplingParams(max_new_tokens=self.max_new_tokens, stop_token_ids=(self.tokenizer.eos_token_id,))
        return SamplingParams(**{**base.__dict__, **overrides})

    def generate(self, requests):
        return self.backend.generate(requests)

    def next_seed(self):
        return int(self.rng.integers(0, 2**31 - 1))

    def score(self, table):
        texts = self.tokenizer.batch_decode(table.column("response_ids").to_pylist(), skip_special_tokens=True)
        return [self.task.reward(json.loads(m), t) for m, t in zip(table.column("meta").to_pylist(), texts)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sft-steps", type=int, default=800)
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--group-size", type=int, default=8)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from actors.modeling import PolicyOnly
    from algorithms.grpo import GRPO
    from rlsys.batch import collate_ids
    from rlsys.config import load_config
    from rlsys.contract import ModelOutputs, Prompt
    from rlsys.models import load_model
    from rlsys.run.controller import Controller

    out = Path(tempfile.mkdtemp(prefix="rlsys-sharpness-"))
    cfg = load_config(
        "configs/quickstart.yaml",
        [f"sft.steps={args.sft_steps}", "sft.demo_error=0", f"run.output_dir={out}", "run.name=probe"],
    )
    t0 = time.time()
    controller = Controller(cfg, out / "probe", progress=False)
    policy_dir = controller.prepare_policy()
    tok, task = controller.tokenizer, controller.task
    rows = task.rows("train")[: args.prompts]
    prompts = [
        Prompt(f"p{i}", tok(r["prompt"], add_special_tokens=False)["input_ids"], r["prompt"], r)
        for i, r in enumerate(rows)
    ]
    algo = GRPO(GRPO.Config(group_size=args.group_size, kl_coef=0.0))
    table = algo.rollout(InProcessContext(policy_dir, tok, task, cfg.rollout.max_new_tokens), prompts)
    batch = algo.prepare(table)
    gold = collate_ids(
        [p.prompt_ids for p in prompts],
        [tok(r["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in rows],
    )

    @torch.no_grad()
    def p_right(model) -> float:
        _, logprobs, _ = PolicyOnly(model.eval())(gold.input_ids, gold.attention_mask)
        return torch.exp((logprobs * gold.response_mask).sum(1)).mean().item()

    base = load_model(policy_dir)
    model = copy.deepcopy(base).train()
    logits, logprobs, _ = PolicyOnly(model)(batch.input_ids, batch.attention_mask)
    loss, _ = algo.loss(ModelOutputs(logits, logprobs, None), batch)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    print(
        f"warm-up {args.sft_steps} steps + one GRPO batch ({table.num_rows} samples, reward "
        f"{np.mean(table.column('reward').to_pylist()):.3f}) in {time.time() - t0:.0f}s"
    )
    print(f"P(right answer) on the batch's {len(rows)} prompts before the step: {p_right(base):.4f}\n")
    print("| gradient of | grad norm | " + " | ".join(f"step {s:g}" for s in STEP_NORMS) + " |")
    print("|---|---:|" + "---:|" * len(STEP_NORMS))
    for name, member in GROUPS.items():
        chosen = {n: g for n, g in grads.items() if member(n)}
        norm = torch.sqrt(sum((g**2).sum() for g in chosen.values())).item()
        cells = []
        for step in STEP_NORMS:
            stepped = copy.deepcopy(base)
            with torch.no_grad():
                for n, param in stepped.named_parameters():
                    if n in chosen:
                        param -= step * chosen[n] / norm
            cells.append(f"{p_right(stepped):.4f}")
        print(f"| {name} | {norm:.3f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
