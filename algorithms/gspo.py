"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", Qwen): GRPO with one importance
ratio per response, clipped per response.

For G responses y_1..y_G to one prompt x with rewards r_1..r_G (the paper's eq. 5-7),
    A_i = (r_i - mean(r)) / (std(r) + 1e-6)                          (GRPO's, algorithms/grpo.py)
    s_i = (pi_theta(y_i|x) / pi_old(y_i|x)) ^ (1/|y_i|)
        = exp(1/|y_i| * sum_t (log pi_theta(y_i,t) - log pi_old(y_i,t)))    (a geometric mean)
    loss = -1/B * sum_i min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)
over a minibatch of B responses (a mean over responses, not tokens), plus, when kl_coef > 0,
    kl_coef * 1/B * sum_i 1/|y_i| * sum_t k3(pi, ref)_{i,t}        (GRPO's paper's per-response mean)
The gradient flows through s_i: d s_i / d log pi_theta(y_i,t) = s_i / |y_i|, the paper's eq. 10
(every token of response i weighted alike); where the clip binds in the min, response i has none.

Defaults: eps_low 3e-4, eps_high 4e-4, the paper's section 5.1 ("we set the left and right clipping
ranges in Equation (5) to 3e-4 and 4e-4"): a sequence ratio is a per-token mean in log space, so it
moves far less than a token's, and its clip range is two orders of magnitude narrower than PPO's 0.2.
No KL term (kl_coef 0), as the paper's objective has none.

The clipped ratio corrects rows a policy version old (TrainsOnStaleRows). With kl_coef 0 a response
whose advantage is 0 (a group with equal rewards) adds nothing to the gradient and is left out of the
forward (SkipsRowsWithoutGradient; the learner rescales the rest by their share of the responses).
"""

from __future__ import annotations

import pyarrow as pa
import torch
from pydantic import Field

from algorithms.base import register, rewards_of, sample_groups
from algorithms.common import group_stats, grpo_advantages, k3_kl, rows_with_gradient
from algorithms.grpo import sequence_advantage_batch
from rlsys.batch import TrainBatch
from rlsys.contract import (
    Algorithm,
    AlgorithmConfig,
    AveragesLossOver,
    ModelOutputs,
    PlaysEpisodes,
    ReportsPrepareMetrics,
    SkipsRowsWithoutGradient,
    TrainsOnStaleRows,
)


class GSPOConfig(AlgorithmConfig):
    """GSPO (Zheng et al. 2025): GRPO's advantages with a clipped sequence-level importance ratio."""

    group_size: int = Field(4, ge=2, description="responses sampled per prompt (G)")
    clip_eps_low: float = Field(
        3e-4,
        gt=0,
        lt=1,
        description="lower clip of the sequence ratio s_i: 1 - clip_eps_low (the paper's 3e-4, section 5.1)",
    )
    clip_eps_high: float = Field(
        4e-4, gt=0, description="upper clip of the sequence ratio s_i: 1 + clip_eps_high (the paper's 4e-4)"
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="weight of the k3 KL to the reference, each response's token mean averaged over the responses "
        "(0, the paper's: no reference logprobs are computed)",
    )


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean of x over its masked tokens, [B] (0 for an empty row)."""
    return (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def sequence_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s_i = exp(mean_t (log pi_theta - log pi_old)) over row i's masked tokens, [B]: the
    length-normalised ratio of the response's probabilities (1 for an empty row)."""
    return torch.exp(sequence_mean(logprobs - old_logprobs, mask))


def gspo_policy_loss(logprobs, old_logprobs, advantages, mask, eps_low: float, eps_high: float):
    """-1/B * sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i); `advantages` is [B]
    (one per response). Returns (loss, fraction of responses whose ratio is outside the range)."""
    s = sequence_ratio(logprobs, old_logprobs, mask)
    clipped = torch.clamp(s, 1.0 - eps_low, 1.0 + eps_high)
    loss = -torch.min(s * advantages, clipped * advantages).mean()
    with torch.no_grad():
        clip_frac = ((s < 1.0 - eps_low) | (s > 1.0 + eps_high)).float().mean()
    return loss, clip_frac


def row_advantages(batch: TrainBatch) -> torch.Tensor:
    """Each row's advantage A_i, [B], from `batch.advantages` (A_i on every token of row i)."""
    return sequence_mean(batch.advantages, batch.response_mask)


@register("gspo")
class GSPO(
    Algorithm, ReportsPrepareMetrics, AveragesLossOver, SkipsRowsWithoutGradient, TrainsOnStaleRows, PlaysEpisodes
):
    Config = GSPOConfig
    needs_value_head = False

    def __init__(self, config: GSPOConfig | None = None):
        self.config = config or self.Config()

    def rollout(self, ctx, prompts) -> pa.Table:
        return sample_groups(ctx, prompts, self.config.group_size, with_ref=self.config.kl_coef > 0)

    def prepare(self, table: pa.Table) -> TrainBatch:
        return sequence_advantage_batch(table, grpo_advantages(rewards_of(table), table.column("group").to_pylist()))

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        return group_stats(rewards_of(table).tolist(), table.column("group").to_pylist())

    def gradient_rows(self, batch: TrainBatch) -> torch.Tensor:
        return rows_with_gradient(batch, self.config.kl_coef)

    def loss_denominator(self, batch: TrainBatch) -> float:
        return float(len(batch))  # a mean over responses

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        c, mask = self.config, batch.response_mask
        loss, clip_frac = gspo_policy_loss(
            outputs.logprobs, batch.old_logprobs, row_advantages(batch), mask, c.clip_eps_low, c.clip_eps_high
        )
        metrics = {"loss/policy": loss.item(), "clip_frac": clip_frac.item()}
        if c.kl_coef > 0:
            kl = sequence_mean(k3_kl(outputs.logprobs, batch.ref_logprobs), mask)
            loss = loss + c.kl_coef * kl.mean()
            metrics["kl_ref"] = kl.detach().mean().item()
        return loss, metrics
