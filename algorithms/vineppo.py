"""VinePPO (Kazemnejad et al. 2024): PPO whose critic is replaced by Monte Carlo value estimates
(../shared/papers/vineppo.md).

A language environment can be reset to any prefix, so the value of an intermediate state is
estimated by sampling continuations from it:

1. sample trajectories (group_size per prompt);
2. split each response into reasoning steps (`split_steps`: math spans protected, cuts at
   newlines and at ". " before a capital, short parts merged forward, the last step merged
   with the final answer), aligned to token boundaries (`step_token_ends`);
3. value states: the prompt s_0 and the prefix after each step but the last (terminal value
   0), deduplicated across the batch;
4. V_hat(s) = (1/K) sum_k R(rollout_k from s)  (`mc_value_estimates`), all states in one
   batched generate call with the same sampler; a rollout cut off by the length limit scores 0;
5. gamma = 1, step rewards 0 but the last (the score):  A_i = r_i + V_hat(s_{i+1}) - V_hat(s_i)
   (`step_advantages`), given to every token of step i;
6. PPO update without a critic: advantages whitened over the batch, clip 0.2, k3 KL to the
   reference as a loss (coef 1e-4); the paper's 2 epochs are `learner.epochs` (configs/vineppo.yaml).
"""

from __future__ import annotations

import json
import re
from typing import Hashable, Sequence

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field

from algorithms.base import register, sample_groups, set_rewards, set_token_column
from algorithms.common import clipped_policy_loss_with_kl, masked_whiten, rows_with_gradient
from rlsys.batch import TrainBatch, collate
from rlsys.contract import Algorithm, AlgorithmConfig, ModelOutputs, ReportsPrepareMetrics, SkipsRowsWithoutGradient
from rlsys.experience import make_experience, meta_of, new_uid
from rlsys.generation import GenerationRequest

# $$..$$, $..$, \[..\], \(..\) and \begin{env}..\end{env}: never cut inside these
MATH_SPAN = re.compile(r"\$\$.*?\$\$|\$.*?\$|\\\[.*?\\\]|\\\(.*?\\\)|\\begin\{([^}]*)\}.*?\\end\{\1\}", re.S)
CUT_POINT = re.compile(r"\n|\. (?=[A-Z])")  # the cut falls just after the match


class VinePPOConfig(AlgorithmConfig):
    """VinePPO (Kazemnejad et al. 2024): PPO whose critic is Monte Carlo value estimates at each reasoning step."""

    group_size: int = Field(8, ge=1, description="trajectories sampled per prompt")
    mc_rollouts: int = Field(9, ge=1, description="K: Monte Carlo continuations per value state")
    max_value_steps: int = Field(
        32,
        ge=1,
        description="at most this many steps (value states) per response; "
        "longer responses have neighbouring steps merged",
    )
    min_step_chars: int = Field(
        20, ge=0, description="a step shorter than this many characters that does not end in '.' merges into the next"
    )
    clip_eps: float = Field(
        0.2, gt=0, lt=1, description="PPO clip range of the ratio to the rollout policy: [1 - eps, 1 + eps]"
    )
    kl_coef: float = Field(1e-4, ge=0, description="k3 KL to the reference, as a loss")
    whiten_advantages: bool = Field(True, description="whiten the step advantages over the batch's response tokens")


def split_steps(text: str, min_chars: int = 20) -> list[str]:
    """Reasoning steps whose concatenation is `text`: cut after newlines and after ". " when a
    capital follows, never inside a math span; a part shorter than `min_chars` that does not end
    with "." merges into the next; the last step merges with the final answer before it."""
    spans = [m.span() for m in MATH_SPAN.finditer(text)]
    cuts = [m.end() for m in CUT_POINT.finditer(text) if not any(a < m.end() < b for a, b in spans)]
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if b > a]
    steps, carry = [], ""
    for part in parts:
        carry += part
        if len(carry) >= min_chars or carry.rstrip().endswith("."):
            steps.append(carry)
            carry = ""
    if carry:
        steps.append(carry)
    if len(steps) > 1:
        steps[-2:] = [steps[-2] + steps[-1]]
    return steps or [text]


def step_token_ends(steps: Sequence[str], prefix_chars: Sequence[int]) -> list[int]:
    """Token index where each step ends, given prefix_chars[j] = length of the text of the
    first j response tokens. A step ends at the first token boundary at or after its last
    character; steps that would be empty merge into the next; the last end is the response."""
    n = len(prefix_chars) - 1
    chars = np.maximum.accumulate(np.asarray(prefix_chars))
    ends = []
    for end in np.cumsum([len(s) for s in steps])[:-1]:
        j = int(np.searchsorted(chars, end, side="left"))
        if 0 < j < n and (not ends or j > ends[-1]):
            ends.append(j)
    return [*ends, n]


def cap_steps(ends: list[int], max_steps: int) -> list[int]:
    """Merge neighbouring steps so there are at most `max_steps` (nearly equal numbers each)."""
    if len(ends) <= max_steps:
        return ends
    return [ends[chunk[-1]] for chunk in np.array_split(np.arange(len(ends)), max_steps)]


def value_state_prefixes(ends: Sequence[int]) -> list[int]:
    """Response-token prefix lengths of the value states s_0..s_{m-1}: 0 and each step end but the last."""
    return [0, *ends[:-1]]


def mc_value_estimates(returns: dict[Hashable, Sequence[float]]) -> dict[Hashable, float]:
    """V_hat(s) = (1/K) * sum_k R(rollout_k from s): the mean of each state's rollout returns."""
    return {s: float(np.mean(r)) for s, r in returns.items()}


def step_advantages(step_values: Sequence[float], reward: float) -> np.ndarray:
    """A_i = r_i + V(s_{i+1}) - V(s_i), gamma = 1, r_i = 0 but the last step's r = R(tau), and
    V = 0 at the terminal state. Their sum telescopes to R(tau) - V(s_0)."""
    v = np.append(np.asarray(step_values, dtype=np.float64), 0.0)
    r = np.zeros(len(step_values))
    r[-1] = reward
    return r + v[1:] - v[:-1]


def per_token(per_step: Sequence[float], ends: Sequence[int]) -> list[float]:
    """Every token of step i gets per_step[i]."""
    return [float(x) for x, a, b in zip(per_step, [0, *ends[:-1]], ends) for _ in range(b - a)]


def response_steps(tokenizer, response_ids: list[int], min_chars: int, max_steps: int) -> list[int]:
    """Step ends (token indices) of one response, decoded without special tokens."""
    prefix_chars = [
        len(tokenizer.decode(response_ids[:j], skip_special_tokens=True)) for j in range(len(response_ids) + 1)
    ]
    text = tokenizer.decode(response_ids, skip_special_tokens=True)
    return cap_steps(step_token_ends(split_steps(text, min_chars), prefix_chars), max_steps)


def score_from(finish_reason: str, reward: float) -> float:
    """A response cut off by the length limit scores 0."""
    return 0.0 if finish_reason == "length" else float(reward)


@register("vineppo")
class VinePPO(Algorithm, ReportsPrepareMetrics, SkipsRowsWithoutGradient):
    Config = VinePPOConfig
    needs_value_head = False

    def __init__(self, config: VinePPOConfig | None = None):
        self.config = config or self.Config()

    def rollout(self, ctx, prompts) -> pa.Table:
        c = self.config
        table = sample_groups(ctx, prompts, c.group_size, with_ref=c.kl_coef > 0)
        prompt_ids, responses = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
        metas = meta_of(table)
        rewards = [score_from(m["finish_reason"], r) for m, r in zip(metas, table.column("reward").to_pylist())]
        ends = [response_steps(ctx.tokenizer, r, c.min_step_chars, c.max_value_steps) for r in responses]
        states = [
            [(tuple(p), tuple(r[:j])) for j in value_state_prefixes(e)] for p, r, e in zip(prompt_ids, responses, ends)
        ]
        state_meta = {s: m for row, m in zip(states, metas) for s in row}  # deduplicated across the batch
        values = mc_value_estimates(self._mc_returns(ctx, state_meta))
        step_values = [[values[s] for s in row] for row in states]
        advantages = [per_token(step_advantages(v, r), e) for v, r, e in zip(step_values, rewards, ends)]
        table = set_token_column(table, "advantages", advantages)
        table = set_token_column(table, "values", [per_token(v, e) for v, e in zip(step_values, ends)])
        metas = [{**m, "step_ends": e, "step_values": v} for m, e, v in zip(metas, ends, step_values)]
        table = set_rewards(table, rewards)
        return table.set_column(table.schema.get_field_index("meta"), "meta", pa.array([json.dumps(m) for m in metas]))

    def _mc_returns(self, ctx, state_meta: dict) -> dict:
        """K continuations from every value state, all in one generate call, each scored as a
        full response (prefix + continuation) within the original length budget."""
        base = ctx.sampling(n=self.config.mc_rollouts, seed=ctx.next_seed())
        keys = list(state_meta)
        requests = [
            GenerationRequest(
                [*p, *prefix], ctx.sampling(n=base.n, seed=base.seed, max_new_tokens=base.max_new_tokens - len(prefix))
            )
            for p, prefix in keys
        ]
        generations = ctx.generate(requests)
        rows = [
            dict(
                uid=new_uid(),
                group="mc",
                prompt_ids=list(keys[g.request_index][0]),
                response_ids=[*keys[g.request_index][1], *g.response_ids],
                logprobs=[],
                reward=0.0,
                policy_version=g.policy_version,
                meta=state_meta[keys[g.request_index]],
            )
            for g in generations
        ]
        scores = ctx.score(make_experience(rows))
        returns: dict = {k: [] for k in keys}
        for g, score in zip(generations, scores):
            returns[keys[g.request_index]].append(score_from(g.finish_reason, score))
        return returns

    def prepare(self, table: pa.Table) -> TrainBatch:
        batch = collate(table)
        if self.config.whiten_advantages:
            batch.advantages = masked_whiten(batch.advantages, batch.response_mask)
        return batch

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        metas = meta_of(table)
        return {
            "vineppo/steps_mean": float(np.mean([len(m["step_ends"]) for m in metas])),
            "vineppo/value_s0": float(np.mean([m["step_values"][0] for m in metas])),
        }

    def gradient_rows(self, batch: TrainBatch) -> torch.Tensor:
        return rows_with_gradient(batch, self.config.kl_coef)

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        return clipped_policy_loss_with_kl(outputs.logprobs, batch, self.config.clip_eps, self.config.kl_coef)
