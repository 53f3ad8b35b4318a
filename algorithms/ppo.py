"""PPO for language models (Ouyang et al. 2022; ../shared/papers/ppo-grpo.md).

Per-token reward: the task reward on the last response token minus
kl_coef * (logp - ref_logp) on every token. A value head on the policy estimates V;
GAE (gamma=1, lambda=0.95) gives advantages, whitened over the batch, and returns = A + V.
Loss: clipped surrogate (eps 0.2) + vf_coef * clipped value loss (value_clip 0.2).
"""

from __future__ import annotations

import pyarrow as pa
from pydantic import Field

from algorithms.base import register, sample_groups, set_token_column
from algorithms.common import (
    OffPolicyCorrectionConfig,
    clipped_policy_loss,
    clipped_value_loss,
    corrected_ratio_inputs,
    gae,
    kl_penalised_rewards,
    masked_mean,
    masked_whiten,
)
from rlsys.batch import TrainBatch, collate
from rlsys.contract import Algorithm, ModelOutputs, PlaysEpisodes, UsesProximalLogprobs


class PPOConfig(OffPolicyCorrectionConfig):
    """PPO (Ouyang et al. 2022): a value head on the policy, GAE, the KL penalty in the per-token reward."""

    group_size: int = Field(1, ge=1, description="responses sampled per prompt")
    clip_eps: float = Field(
        0.2, gt=0, lt=1, description="PPO clip range of the ratio to the rollout policy: [1 - eps, 1 + eps]"
    )
    value_clip: float = Field(
        0.2, gt=0, description="clip range of the new value around the rollout's value in the value loss"
    )
    vf_coef: float = Field(0.5, ge=0, description="weight of the clipped value loss")
    kl_coef: float = Field(0.05, ge=0, description="KL penalty folded into the per-token reward")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount per token")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    whiten_advantages: bool = Field(True, description="whiten the advantages over the batch's response tokens")


@register("ppo")
class PPO(Algorithm, UsesProximalLogprobs, PlaysEpisodes):
    Config = PPOConfig
    needs_value_head = True

    def __init__(self, config: PPOConfig | None = None):
        self.config = config or self.Config()

    def rollout(self, ctx, prompts) -> pa.Table:
        table = sample_groups(ctx, prompts, self.config.group_size, with_ref=True)
        shaped = ctx.token_rewards(table)  # task.shaping's penalties stay on their tokens for GAE
        if shaped is not None:
            table = set_token_column(table, "token_rewards", shaped)
        return set_token_column(table, "values", ctx.values(table))

    def prepare(self, table: pa.Table) -> TrainBatch:
        return ppo_prepare(collate(table), self.config)

    def proximal_logprobs_needed(self) -> bool:
        return self.config.off_policy_correction != "none"

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        c = self.config
        return ppo_loss(outputs, batch, c, c.off_policy_correction, c.is_cap)


def ppo_prepare(batch: TrainBatch, c) -> TrainBatch:
    """Per-token rewards (the task reward on each row's last masked token, or the rows' own
    per-token rewards where the rollout gave them (task.shaping); -kl_coef * (logp - ref_logp)
    on every masked token), GAE over the masked tokens (environment tokens between turns stepped
    over), advantages whitened over the batch when `c.whiten_advantages`. `c`: any config with
    PPOConfig's fields (CDG's online mode with `advantage: gae` too)."""
    mask = batch.response_mask
    batch.token_rewards = kl_penalised_rewards(
        batch.rewards, batch.old_logprobs, batch.ref_logprobs, mask, c.kl_coef, batch.token_rewards
    )
    advantages, batch.returns = gae(batch.token_rewards, batch.old_values, mask, c.gamma, c.lam)
    batch.advantages = masked_whiten(advantages, mask) if c.whiten_advantages else advantages
    return batch


def ppo_loss(outputs: ModelOutputs, batch: TrainBatch, c, correction: str = "none", cap: float = 2.0):
    """Clipped surrogate (under the off-policy `correction`, `corrected_ratio_inputs`) + vf_coef *
    clipped value loss, with the KL to the reference reported."""
    mask = batch.response_mask
    old, weights, corrected = corrected_ratio_inputs(batch, correction, cap)
    policy_loss, clip_frac, approx_kl = clipped_policy_loss(
        outputs.logprobs, old, batch.advantages, mask, c.clip_eps, weights=weights
    )
    value_loss = clipped_value_loss(outputs.values, batch.old_values, batch.returns, mask, c.value_clip)
    loss = policy_loss + c.vf_coef * value_loss
    kl = masked_mean(outputs.logprobs.detach() - batch.ref_logprobs, mask)
    return loss, {
        "loss/policy": policy_loss.item(),
        "loss/value": value_loss.item(),
        "clip_frac": clip_frac.item(),
        "approx_kl_old": approx_kl.item(),
        "kl_ref": kl.item(),
        **corrected,
    }
