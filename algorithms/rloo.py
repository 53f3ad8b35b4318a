"""RLOO (Ahmadian et al. 2024, "Back to Basics"): REINFORCE with a leave-one-out baseline.

The whole response is one action. For k responses y_1..y_k to one prompt, the reward carries the
KL penalty, estimated from the sampled tokens' rollout and reference logprobs (no gradient through it):
    R_i = r_i - kl_coef * sum_t (log pi_old(y_i,t) - log pi_ref(y_i,t))
    A_i = R_i - 1/(k-1) * sum_{j != i} R_j
and the loss over a minibatch of B responses is REINFORCE's, a mean over responses (not tokens):
    loss = -1/B * sum_i A_i * sum_t log pi_theta(y_i,t)
so its gradient is -1/B * sum_i A_i * grad sum_t log pi_theta(y_i,t), the paper's estimator
(1/k) sum_i A_i grad log pi(y_i | x) averaged over the prompts. No ratio, no clipping, no KL loss term.
The sums run over the response's trainable tokens (`loss_mask`); B counts every response.

REINFORCE is on-policy and has no importance weight. With learner.epochs 1 and learner.minibatches 1
(the defaults) the one gradient step is taken at the weights that sampled the rows and the estimator
is exact, on one rank or several (the learner weighs each rank's loss by its share of the responses
before DeepSpeed averages the ranks' gradients). More epochs or minibatches take the later steps at updated
weights with nothing correcting for it (a biased gradient): that regime, and trainer.mode=overlap
(refused here: not TrainsOnStaleRows), is `rloo_clipped`'s. A response whose A_i is 0 (a group whose
KL-penalised rewards are all equal: with kl_coef 0, equal task rewards) adds nothing to the gradient and
is left out of the forward (SkipsRowsWithoutGradient; the learner rescales the rest by their share of B).
"""

from __future__ import annotations

import pyarrow as pa
import torch
from pydantic import Field

from algorithms.base import register, rewards_of, sample_groups
from algorithms.common import broadcast_to_tokens, group_stats, rloo_advantages, rows_with_gradient
from rlsys.batch import TrainBatch, collate
from rlsys.contract import (
    Algorithm,
    AlgorithmConfig,
    AveragesLossOver,
    ModelOutputs,
    PlaysEpisodes,
    ReportsPrepareMetrics,
    SkipsRowsWithoutGradient,
)


class RLOOConfig(AlgorithmConfig):
    """RLOO (Ahmadian et al. 2024): REINFORCE on whole responses, a leave-one-out baseline, the KL penalty in the
    reward."""

    group_size: int = Field(
        4, ge=2, description="responses sampled per prompt (k); each one's baseline is the mean reward of the other k-1"
    )
    kl_coef: float = Field(
        0.05,
        ge=0,
        description="beta: the reward is r - beta * sum over the response of (rollout logprob - reference logprob) "
        "(0: no reference logprobs are computed)",
    )


def sequence_kl(old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each response's KL estimate sum_t (log pi_old - log pi_ref) over its masked tokens, [B]."""
    return ((old_logprobs - ref_logprobs) * mask).sum(dim=1)


def kl_penalised_sequence_rewards(rewards, old_logprobs, ref_logprobs, mask, kl_coef: float) -> torch.Tensor:
    """R_i = r_i - kl_coef * sequence_kl_i, [B]; the task rewards alone when kl_coef is 0."""
    if kl_coef == 0:
        return rewards
    if ref_logprobs is None:
        raise ValueError(f"kl_coef {kl_coef} puts the KL in the reward, but the rows have no reference logprobs")
    return rewards - kl_coef * sequence_kl(old_logprobs, ref_logprobs, mask)


def reinforce_loss(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-1/B * sum_i A_i * sum_t log pi(y_i,t) over the masked tokens; `advantages` [B, T] hold row i's
    A_i on its tokens (`broadcast_to_tokens`), B = logprobs.shape[0] counts every row."""
    return -(advantages * logprobs * mask).sum() / logprobs.shape[0]


@register("rloo")
class RLOO(Algorithm, ReportsPrepareMetrics, AveragesLossOver, SkipsRowsWithoutGradient, PlaysEpisodes):
    Config = RLOOConfig
    needs_value_head = False

    def __init__(self, config: RLOOConfig | None = None):
        self.config = config or self.Config()

    def rollout(self, ctx, prompts) -> pa.Table:
        return sample_groups(ctx, prompts, self.config.group_size, with_ref=self.config.kl_coef > 0)

    def prepare(self, table: pa.Table) -> TrainBatch:
        batch = collate(table)
        # in float64, as the task rewards' advantages are: a sum over a long response loses float32 digits
        ref = None if batch.ref_logprobs is None else batch.ref_logprobs.double()
        mask = batch.response_mask.double()
        rewards = kl_penalised_sequence_rewards(
            torch.as_tensor(rewards_of(table)), batch.old_logprobs.double(), ref, mask, self.config.kl_coef
        )
        advantages = rloo_advantages(rewards.numpy(), table.column("group").to_pylist())
        batch.advantages = broadcast_to_tokens(torch.tensor(advantages, dtype=torch.float32), batch.response_mask)
        return batch

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        return group_stats(rewards_of(table).tolist(), table.column("group").to_pylist())

    def gradient_rows(self, batch: TrainBatch) -> torch.Tensor:
        return rows_with_gradient(batch, kl_coef=0.0)  # the KL is in the reward, not a loss term

    def loss_denominator(self, batch: TrainBatch) -> float:
        return float(len(batch))  # B, every row

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        loss = reinforce_loss(outputs.logprobs, batch.advantages, batch.response_mask)
        metrics = {"loss/policy": loss.item()}
        if batch.ref_logprobs is not None:
            kl = sequence_kl(batch.old_logprobs, batch.ref_logprobs, batch.response_mask)
            metrics["kl_ref_sequence"] = kl.mean().item()
        return loss, metrics
