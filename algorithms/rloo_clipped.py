"""RLOO's leave-one-out advantage in GRPO's objective (not the paper's RLOO: that is algorithms/rloo.py).

For k responses to one prompt with task rewards r_1..r_k,
    A_i = r_i - mean_{j != i} r_j,
shared by every token of response i, in the PPO clipped surrogate on the ratio to the rollout policy,
plus kl_coef * k3(pi, ref) as a loss, both a token mean over the minibatch: GRPO's loss
(algorithms/grpo.py) with the advantage of Ahmadian et al. 2024 and no KL in the reward. The clipped
ratio corrects rows one policy version old, so several epochs or minibatches per step and
`trainer.mode: overlap` are sound here, where the paper's REINFORCE is on-policy.
"""

from __future__ import annotations

import pyarrow as pa
import torch
from pydantic import Field

from algorithms.base import register, rewards_of, sample_groups
from algorithms.common import clipped_policy_loss_with_kl, group_stats, rloo_advantages, rows_with_gradient
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


class RLOOClippedConfig(AlgorithmConfig):
    """The leave-one-out advantage of RLOO (Ahmadian et al. 2024) in GRPO's clipped surrogate and k3 KL loss
    (not the paper's RLOO, which is `rloo`)."""

    group_size: int = Field(
        4, ge=2, description="responses sampled per prompt (k); each one's baseline is the mean reward of the other k-1"
    )
    clip_eps: float = Field(
        0.2, gt=0, lt=1, description="PPO clip range of the ratio to the rollout policy: [1 - eps, 1 + eps]"
    )
    kl_coef: float = Field(
        0.04,
        ge=0,
        description="weight of the k3 KL to the reference in the loss (0: no reference logprobs are computed)",
    )


@register("rloo_clipped")
class RLOOClipped(Algorithm, ReportsPrepareMetrics, SkipsRowsWithoutGradient, TrainsOnStaleRows, PlaysEpisodes):
    Config = RLOOClippedConfig
    needs_value_head = False

    def __init__(self, config: RLOOClippedConfig | None = None):
        self.config = config or self.Config()

    def rollout(self, ctx, prompts) -> pa.Table:
        return sample_groups(ctx, prompts, self.config.group_size, with_ref=self.config.kl_coef > 0)

    def prepare(self, table: pa.Table) -> TrainBatch:
        return sequence_advantage_batch(table, rloo_advantages(rewards_of(table), table.column("group").to_pylist()))

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        return group_stats(rewards_of(table).tolist(), table.column("group").to_pylist())

    def gradient_rows(self, batch: TrainBatch) -> torch.Tensor:
        return rows_with_gradient(batch, self.config.kl_coef)

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        return clipped_policy_loss_with_kl(outputs.logprobs, batch, self.config.clip_eps, self.config.kl_coef)
