"""GRPO (Shao et al. 2024): group-relative advantages, no critic, k3 KL to the reference as a loss.

For G responses to one prompt with rewards r_1..r_G,
    A_i = (r_i - mean(r)) / (std(r) + 1e-6)        (Dr.GRPO: no std division)
shared by every token of response i, in the PPO clipped surrogate, plus
    kl_coef * k3(pi, ref),  k3 = exp(ref - logp) - (ref - logp) - 1.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field

from algorithms.base import register, rewards_of, sample_groups
from algorithms.common import (
    broadcast_to_tokens,
    clipped_policy_loss_with_kl,
    group_stats,
    grpo_advantages,
    rows_with_gradient,
)
from rlsys.batch import TrainBatch, collate
from rlsys.contract import (
    Algorithm,
    AlgorithmConfig,
    ModelOutputs,
    ReportsPrepareMetrics,
    SkipsRowsWithoutGradient,
    TrainsOnStaleRows,
)


class GRPOConfig(AlgorithmConfig):
    """GRPO (Shao et al. 2024): group-relative advantages, no critic, k3 KL to the reference as a loss."""

    group_size: int = Field(
        4, ge=2, description="responses sampled per prompt (G); a step's rows are trainer.prompts_per_step times this"
    )
    clip_eps: float = Field(
        0.2, gt=0, lt=1, description="PPO clip range of the ratio to the rollout policy: [1 - eps, 1 + eps]"
    )
    kl_coef: float = Field(
        0.04,
        ge=0,
        description="weight of the k3 KL to the reference in the loss (0: no reference logprobs are computed)",
    )
    std_normalize: bool = Field(
        True, description="divide the advantages by the group's reward std; false gives Dr.GRPO's unscaled advantages"
    )


@register("grpo")
class GRPO(Algorithm, ReportsPrepareMetrics, SkipsRowsWithoutGradient, TrainsOnStaleRows):
    Config = GRPOConfig
    needs_value_head = False

    def __init__(self, config: GRPOConfig | None = None):
        self.config = config or self.Config()

    def rollout(self, ctx, prompts) -> pa.Table:
        return sample_groups(ctx, prompts, self.config.group_size, with_ref=self.config.kl_coef > 0)

    def prepare(self, table: pa.Table) -> TrainBatch:
        advantages = grpo_advantages(rewards_of(table), table.column("group").to_pylist(), self.config.std_normalize)
        return sequence_advantage_batch(table, advantages)

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        return group_stats(rewards_of(table).tolist(), table.column("group").to_pylist())

    def gradient_rows(self, batch: TrainBatch) -> torch.Tensor:
        return rows_with_gradient(batch, self.config.kl_coef)

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        return clipped_policy_loss_with_kl(outputs.logprobs, batch, self.config.clip_eps, self.config.kl_coef)


def sequence_advantage_batch(table: pa.Table, advantages: np.ndarray) -> TrainBatch:
    """The rows collated, each response's advantage on every one of its tokens."""
    batch = collate(table)
    batch.advantages = broadcast_to_tokens(torch.tensor(advantages, dtype=torch.float32), batch.response_mask)
    return batch
