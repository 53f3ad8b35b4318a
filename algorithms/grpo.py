"""GRPO (Shao et al. 2024): group-relative advantages, no critic, k3 KL to the reference as a loss.

For G responses to one prompt with rewards r_1..r_G,
    A_i = (r_i - mean(r)) / (std(r) + 1e-6)                         (std_normalize: true)
shared by every token of response i, in the PPO clipped surrogate, plus
    kl_coef * k3(pi, ref),  k3 = exp(ref - logp) - (ref - logp) - 1,
per token l_{i,t}, reduced over a minibatch of B responses (loss_normalizer)
    token_mean:  sum_{i,t} l_{i,t} / sum_i |o_i|                    (the minibatch's response tokens)
    constant:    sum_{i,t} l_{i,t} / (B * max_tokens).

Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") is `std_normalize: false` with
`loss_normalizer: constant` and `max_tokens` the generation budget (rollout.max_new_tokens):
A_i = r_i - mean(r), and each response's token sum divided by that constant, averaged over the
responses, as the authors' code computes it (sail-sg/oat, algorithms/ppo.py: `masked_sum(...,
constant_normalizer=generate_max_length)` per response, then the minibatch mean; the k3 term alike).

Both are exact per minibatch, on one rank or several: the learner weighs each rank's loss by its
share of the denominator (`loss_denominator`) before DeepSpeed averages the ranks' gradients. With
kl_coef 0 both leave the rows of a group with equal rewards out of the forward (`gradient_rows`):
the learner rescales the others' loss by their share of the denominator.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, model_validator

from algorithms.base import register, rewards_of, sample_groups
from algorithms.common import (
    OffPolicyCorrectionConfig,
    broadcast_to_tokens,
    clipped_policy_loss_with_kl,
    group_stats,
    grpo_advantages,
    masked_mean,
    masked_sum_over_constant,
    rows_with_gradient,
)
from rlsys.batch import TrainBatch, collate
from rlsys.contract import (
    Algorithm,
    AveragesLossOver,
    ModelOutputs,
    PlaysEpisodes,
    ReportsPrepareMetrics,
    SkipsRowsWithoutGradient,
    TrainsOnStaleRows,
    UsesProximalLogprobs,
)


class GRPOConfig(OffPolicyCorrectionConfig):
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
        True,
        description="divide the advantages by the group's reward std (false: A_i = r_i - mean(r), one half of "
        "Dr.GRPO; the other is loss_normalizer: constant)",
    )
    loss_normalizer: Literal["token_mean", "constant"] = Field(
        "token_mean",
        description="how a minibatch's per-token loss (surrogate and k3 KL) is averaged: token_mean: over its "
        "response tokens; constant: each response's token sum over max_tokens, averaged over its responses "
        "(Dr.GRPO's, no length bias)",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="the constant of loss_normalizer: constant (needed there, unused otherwise); Dr.GRPO uses the "
        "generation budget, rollout.max_new_tokens",
    )

    @model_validator(mode="after")
    def _max_tokens_with_constant(self):
        if self.loss_normalizer == "constant" and self.max_tokens is None:
            raise ValueError("loss_normalizer 'constant' needs max_tokens (e.g. rollout.max_new_tokens)")
        if self.loss_normalizer != "constant" and self.max_tokens is not None:
            raise ValueError(f"max_tokens ({self.max_tokens}) is used only by loss_normalizer 'constant'")
        return self


@register("grpo")
class GRPO(
    Algorithm,
    ReportsPrepareMetrics,
    SkipsRowsWithoutGradient,
    AveragesLossOver,
    TrainsOnStaleRows,
    UsesProximalLogprobs,
    PlaysEpisodes,
):
    Config = GRPOConfig
    needs_value_head = False

    def __init__(self, config: GRPOConfig | None = None):
        self.config = config or self.Config()
        self._aggregate = loss_aggregate(self.config)

    def rollout(self, ctx, prompts) -> pa.Table:
        return sample_groups(ctx, prompts, self.config.group_size, with_ref=self.config.kl_coef > 0)

    def prepare(self, table: pa.Table) -> TrainBatch:
        advantages = grpo_advantages(rewards_of(table), table.column("group").to_pylist(), self.config.std_normalize)
        return sequence_advantage_batch(table, advantages)

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        return group_stats(rewards_of(table).tolist(), table.column("group").to_pylist())

    def gradient_rows(self, batch: TrainBatch) -> torch.Tensor:
        return rows_with_gradient(batch, self.config.kl_coef)

    def proximal_logprobs_needed(self) -> bool:
        return self.config.off_policy_correction != "none"

    def loss_denominator(self, batch: TrainBatch) -> float:
        """token_mean: the response tokens; constant: B * max_tokens."""
        c = self.config
        return len(batch) * c.max_tokens if c.loss_normalizer == "constant" else float(batch.num_tokens())

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        c = self.config
        return clipped_policy_loss_with_kl(
            outputs.logprobs,
            batch,
            c.clip_eps,
            c.kl_coef,
            self._aggregate,
            correction=c.off_policy_correction,
            cap=c.is_cap,
        )


def loss_aggregate(config: GRPOConfig):
    """`aggregate(x, mask)` reducing per-token loss terms to a minibatch's loss: the masked token
    mean, or Dr.GRPO's sum_{i,t} x / (B * max_tokens)."""
    if config.loss_normalizer == "constant":
        return partial(masked_sum_over_constant, constant=config.max_tokens)
    return masked_mean


def sequence_advantage_batch(table: pa.Table, advantages: np.ndarray) -> TrainBatch:
    """The rows collated, each response's advantage on every one of its tokens."""
    batch = collate(table)
    batch.advantages = broadcast_to_tokens(torch.tensor(advantages, dtype=torch.float32), batch.response_mask)
    return batch
