"""CISPO (MiniMax 2025, "MiniMax-M1", section 3.1): REINFORCE on every token, weighted by a clipped
importance weight with no gradient through it.

For G responses o_1..o_G to one prompt with rewards R_1..R_G (the paper's eq. 4-5),
    A_i = (R_i - mean(R)) / (std(R) + 1e-6)                          (GRPO's, algorithms/grpo.py)
    r_i,t = pi_theta(o_i,t) / pi_old(o_i,t)
    w_i,t = sg(clip(r_i,t, 1 - eps_low, 1 + eps_high))
    loss = -1/sum_i |o_i| * sum_{i,t} w_i,t * A_i * log pi_theta(o_i,t)
over a minibatch's responses (a token mean), plus kl_coef * k3(pi, ref) as a token mean when
kl_coef > 0. The gradient on token t of response i is -w_i,t * A_i / sum_i |o_i| * grad log pi_theta:
the clip bounds the weight, never removes the token. PPO's clipped surrogate min(r A, clip(r) A) has
no gradient on a token whose ratio is past the clip on the side A pushes it; here every token keeps
one, the point of the method (low-probability "fork" tokens keep being trained after the first update).

Defaults: the paper sets no lower bound ("we did not impose a lower bound on the IS weight by
setting eps_low to a large value; instead we only tuned eps_high"): eps_low 1.0 (a lower bound of 0,
none for a positive ratio). The paper gives no value of eps_high; 3.0 (a weight of at most 4) is the
cap of Tinker's CISPO loss (clip_high_threshold 4.0), one order above PPO's 1.2 so that the weight
truncates only outliers. No KL term (kl_coef 0), as the paper's objective has none.

The importance weight corrects rows a policy version old (TrainsOnStaleRows). A row whose advantage
is 0 adds nothing without the KL term and is left out of the forward (SkipsRowsWithoutGradient;
the loss is a token mean).
"""

from __future__ import annotations

import pyarrow as pa
import torch
from pydantic import Field

from algorithms.base import register, rewards_of, sample_groups
from algorithms.common import group_stats, grpo_advantages, k3_kl, masked_mean, rows_with_gradient
from algorithms.grpo import sequence_advantage_batch
from rlsys.batch import TrainBatch
from rlsys.contract import (
    Algorithm,
    AlgorithmConfig,
    ModelOutputs,
    PlaysEpisodes,
    ReportsPrepareMetrics,
    SkipsRowsWithoutGradient,
    TrainsOnStaleRows,
)


class CISPOConfig(AlgorithmConfig):
    """CISPO (MiniMax-M1, 2025): token-level REINFORCE weighted by a clipped, stop-gradient importance weight."""

    group_size: int = Field(4, ge=2, description="responses sampled per prompt (G)")
    clip_eps_low: float = Field(
        1.0,
        ge=0,
        le=1,
        description="lower clip of the importance weight: 1 - clip_eps_low (1.0: no lower bound, the paper's)",
    )
    clip_eps_high: float = Field(
        3.0,
        gt=0,
        description="upper clip of the importance weight: 1 + clip_eps_high (the paper gives no value; 3.0 caps "
        "the weight at 4, Tinker's CISPO default)",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="weight of the k3 KL to the reference in the loss, a token mean (0, the paper's: no reference "
        "logprobs are computed)",
    )


def clipped_weight(logprobs, old_logprobs, eps_low: float, eps_high: float) -> torch.Tensor:
    """sg(clip(pi_theta / pi_old, 1 - eps_low, 1 + eps_high)) per token."""
    with torch.no_grad():
        return torch.clamp(torch.exp(logprobs - old_logprobs), 1.0 - eps_low, 1.0 + eps_high)


def cispo_policy_loss(logprobs, old_logprobs, advantages, mask, eps_low: float, eps_high: float):
    """-1/sum|o_i| * sum_{i,t} w_i,t * A_i,t * log pi_theta over the masked tokens. Returns (loss,
    the token fraction whose weight was clipped)."""
    weight = clipped_weight(logprobs, old_logprobs, eps_low, eps_high)
    loss = masked_mean(-weight * advantages * logprobs, mask)
    with torch.no_grad():
        ratio = torch.exp(logprobs - old_logprobs)
        clip_frac = masked_mean(((ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)).float(), mask)
    return loss, clip_frac


@register("cispo")
class CISPO(Algorithm, ReportsPrepareMetrics, SkipsRowsWithoutGradient, TrainsOnStaleRows, PlaysEpisodes):
    Config = CISPOConfig
    needs_value_head = False

    def __init__(self, config: CISPOConfig | None = None):
        self.config = config or self.Config()

    def rollout(self, ctx, prompts) -> pa.Table:
        return sample_groups(ctx, prompts, self.config.group_size, with_ref=self.config.kl_coef > 0)

    def prepare(self, table: pa.Table) -> TrainBatch:
        return sequence_advantage_batch(table, grpo_advantages(rewards_of(table), table.column("group").to_pylist()))

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        return group_stats(rewards_of(table).tolist(), table.column("group").to_pylist())

    def gradient_rows(self, batch: TrainBatch) -> torch.Tensor:
        return rows_with_gradient(batch, self.config.kl_coef)

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        c, mask = self.config, batch.response_mask
        loss, clip_frac = cispo_policy_loss(
            outputs.logprobs, batch.old_logprobs, batch.advantages, mask, c.clip_eps_low, c.clip_eps_high
        )
        metrics = {"loss/policy": loss.item(), "clip_frac": clip_frac.item()}
        if c.kl_coef > 0:
            kl = k3_kl(outputs.logprobs, batch.ref_logprobs)
            loss = loss + c.kl_coef * masked_mean(kl, mask)
            metrics["kl_ref"] = masked_mean(kl.detach(), mask).item()
        return loss, metrics
