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

from algorithms.base import AlgorithmConfig, ModelOutputs, StatelessMixin, register, rewards_of, sample_groups
from algorithms.common import (broadcast_to_tokens, clipped_policy_loss_with_kl, grpo_advantages, group_stats,
                               rows_with_gradient)
from rlsys.batch import TrainBatch, collate


class GRPOConfig(AlgorithmConfig):
    group_size: int = Field(4, ge=2, description="responses sampled per prompt (G)")
    clip_eps: float = Field(0.2, gt=0, lt=1)
    kl_coef: float = Field(0.04, ge=0)
    std_normalize: bool = Field(True, description="False gives Dr.GRPO's unscaled advantages")


@register("grpo")
class GRPO(StatelessMixin):
    Config = GRPOConfig
    needs_value_head = False
    allows_overlap = True  # rows a version old are corrected by the clipped ratio to their rollout logprobs

    def __init__(self, config: GRPOConfig | None = None):
        self.config = config or self.Config()

    def rollout(self, ctx, prompts) -> pa.Table:
        return sample_groups(ctx, prompts, self.config.group_size, with_ref=self.config.kl_coef > 0)

    def advantages(self, table: pa.Table) -> np.ndarray:
        return grpo_advantages(rewards_of(table), table.column("group").to_pylist(), self.config.std_normalize)

    def prepare(self, table: pa.Table) -> TrainBatch:
        batch = collate(table)
        per_sequence = torch.tensor(self.advantages(table), dtype=torch.float32)
        batch.advantages = broadcast_to_tokens(per_sequence, batch.response_mask)
        return batch

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        return group_stats(rewards_of(table).tolist(), table.column("group").to_pylist())

    def gradient_rows(self, batch: TrainBatch) -> torch.Tensor:
        return rows_with_gradient(batch, self.config.kl_coef)

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        return clipped_policy_loss_with_kl(outputs.logprobs, batch, self.config.clip_eps, self.config.kl_coef)
