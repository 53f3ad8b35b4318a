"""Stand-ins for tests about an algorithm's own rollout logic, not about sampling (they say so)."""

import dataclasses

import numpy as np
import torch

from rlsys.batch import collate_ids
from rlsys.generation import Generation, SamplingParams

# a tiny model, task and warm-up (overrides of a config in configs/), the base of the tests' jobs
TINY_JOB = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "task.num_train=200",
    "task.num_eval=16",
    "task.max_value=9",
    "sft.steps=5",
    "trainer.prompts_per_step=4",
]

# a two-step job on them, one rollout worker
TINY_ONE_WORKER = [
    *TINY_JOB,
    "trainer.eval_every=2",
    "rollout.max_new_tokens=4",
    "rollout.num_workers=1",
    "trainer.steps=2",
]


def rows_sharing_prompts(seed: int = 0):
    """Three prompts of different lengths, three responses each of different lengths, and a
    multi-turn row (environment tokens, mask 0, inside its response)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 2, 7)]
    rows = [
        (p, torch.randint(3, 64, (1 + (i + k) % 4,), generator=g).tolist())
        for i, p in enumerate(prompts)
        for k in range(3)
    ]
    rows.append((prompts[0], [9, 10, 11, 12, 13]))
    masks = [None] * (len(rows) - 1) + [[1, 1, 0, 0, 1]]
    return prompts, collate_ids([p for p, _ in rows], [r for _, r in rows], masks)


class TwoTokenContext:
    """A RolloutContext that records the requests and answers each sample with a random token
    (3..8) then eos (2); `embedding_dim` > 0 adds a random embedding to every generation.
    Subclasses give `score` (and `ref_logprobs` where the algorithm asks for them)."""

    policy_version = 0
    tokenizer = None
    task = None
    embedding_dim = 0

    def __init__(self):
        self.rng = np.random.default_rng(0)
        self.requests = []

    def sampling(self, **overrides):
        return dataclasses.replace(SamplingParams(max_new_tokens=3), **overrides)

    def next_seed(self):
        return int(self.rng.integers(2**31 - 1))

    def generate(self, requests):
        self.requests += requests
        return [
            Generation(
                i,
                list(r.prompt_ids),
                [int(self.rng.integers(3, 9)), 2],
                [-1.0, -0.5],
                "stop",
                embedding=self.rng.standard_normal(self.embedding_dim).tolist() if self.embedding_dim else None,
            )
            for i, r in enumerate(requests)
            for _ in range(r.params.n)
        ]

    def score_and_ref_logprobs(self, table):
        return self.score(table), self.ref_logprobs(table)


def assert_same_update(want: dict, got: dict, initial: dict, lr: float) -> None:
    """`got`'s weights (name -> array) took the same optimizer step(s) from `initial` as `want`'s.
    AdamW moves a weight ~lr a step whatever its gradient's size, so a weight whose gradient is
    near 0 (float noise apart, which differs with the summation order and the CPU's kernels) can
    move by any share of lr: fewer than 1 in 10^4 do, the rest within 2% of lr, ~0.01% on average
    (a wrong token weight or a lost micro-batch moves most weights by ~lr)."""
    moved = [np.abs(want[name] - np.asarray(initial[name])).max() for name in want]
    assert max(moved) > lr  # the steps moved the weights, by about lr a step
    assert got.keys() == want.keys()
    gaps = np.concatenate([np.abs(got[name] - w).ravel() for name, w in want.items()])
    assert (gaps > 2e-4).mean() < 1e-4 and gaps.max() < 2 * lr and gaps.mean() < 2e-6
