"""REINFORCE++ (Hu et al. 2025, arXiv 2501.03262, "REINFORCE++: An Efficient RLHF Algorithm with
Robustness to Both Prompt and Reward Models"; v9 "... Stabilizing Critic-Free Policy Optimization with
Global Normalization"): REINFORCE with PPO's per-token KL penalty and clipped ratio, no critic, and the
advantages normalised over the whole batch instead of per prompt. `baseline: true` is its
REINFORCE++-baseline variant (group sampling, the prompt's mean reward subtracted first).

REINFORCE++ (`baseline: false`, k >= 1 responses per prompt). For response y_i with task reward R_i,
per token (the paper's token-level KL penalty, pi_old the sampler, pi_ref the reference):
    KL_t = log pi_old(y_t) - log pi_ref(y_t)                                  (k1)
    r_t = -beta * KL_t + [t = last token] * R_i                               (`kl_penalised_rewards`)
    G_t = sum_{s >= t} gamma^(s - t) r_s                                      (gamma 1: R_i - beta * sum_{s>=t} KL_s)
    A_t = (G_t - mean(G)) / std(G)                                            (`masked_whiten`)
where mean and std run over every trainable token of the step's rows: global batch normalisation, on the
controller before the learner splits the rows into ranks and minibatches. The loss is PPO's clipped
surrogate on the ratio to the sampler, a token mean (`clipped_policy_loss`):
    loss = 1/sum_i |y_i| * sum_{i,t} -min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t),  rho_t = pi/pi_old.

REINFORCE++-baseline (`baseline: true`, k >= 2 responses per prompt):
    R'_i = R_i - mean_{j in group(i)} R_j                                     (no std division)
then the same return (gamma 1: G_t = R'_i on every token) and the same global normalisation, and the KL
leaves the reward for the loss: loss += beta * 1/sum_i |y_i| * sum_{i,t} k2_t, with
    k2_t = 0.5 * (log pi(y_t) - log pi_ref(y_t))^2
whose gradient, beta * (log pi - log pi_ref) * grad log pi per token, is in expectation at pi = pi_old the
per-token KL's, where k3's is not (GRPO's k3 = exp(ref - logp) - (ref - logp) - 1 is `kl_estimator: k3`).

Choices and sources. `kl_in` (reward | loss) and `kl_estimator` (k1 | k2 | k3) left unset take each
variant's placement: reward/k1 for REINFORCE++ (the paper's token-level KL penalty with
KL_t = log(pi_old / pi_SFT); OpenRLHF `--algo.advantage.estimator reinforce`, the KL in the reward with
its default `--algo.kl.estimator k1`), loss/k2 for the baseline variant (OpenRLHF's reinforce_baseline
recipe, examples/scripts/train_reinforce_baseline_hybrid_engine.sh: `--algo.kl.use_loss
--algo.kl.estimator k2`; the paper's v9 pairs the baseline variant with a k2 KL loss in place of GRPO's
k3, as secondary accounts of it read). The other placement is one key away. In the reward the estimator
must be k1 (its sum over the later tokens is the return's KL); in the loss k2 or k3 (k1 as a loss has
gradient grad log pi, zero in expectation: no regularisation). The baseline variant keeps gamma 1
(OpenRLHF forces it for reinforce_baseline: its advantage is a whole-response outcome).
Defaults: clip_eps 0.2 (PPO's, OpenRLHF's `--actor.eps_clip`), kl_coef 0.01 (OpenRLHF's
`--algo.kl.init_coef`; its baseline recipe uses 1e-5 with a 7B model), gamma 1 (OpenRLHF's default, and
the paper's A_t = R - beta * sum_{i>=t} KL_i), group_size 1 (REINFORCE++ needs no group). The std is
sqrt(var + 1e-8) (`masked_whiten`; OpenRLHF's clamp(var, 1e-8)): a batch of equal returns gets 0.

Capabilities. The clipped ratio to the rollout logprobs corrects rows one policy version old
(TrainsOnStaleRows). ReportsPrepareMetrics: the share of prompts whose responses' rewards are all
equal (`group_stats`), when there are groups (group_size > 1; nothing with one response per prompt).
Not SkipsRowsWithoutGradient: with the global shift a row whose group is flat still gets
A = (0 - mean) / std, non-zero in general (the token mean of the centred rewards weighs a response by
its length), so no row can be assumed to carry no gradient.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, model_validator

from algorithms.base import register, rewards_of, sample_groups
from algorithms.common import (
    OffPolicyCorrectionConfig,
    clipped_policy_loss,
    corrected_ratio_inputs,
    group_stats,
    grpo_advantages,
    k3_kl,
    kl_penalised_rewards,
    masked_mean,
    masked_whiten,
)
from rlsys.batch import TrainBatch, collate
from rlsys.contract import (
    Algorithm,
    ModelOutputs,
    PlaysEpisodes,
    ReportsPrepareMetrics,
    TrainsOnStaleRows,
    UsesProximalLogprobs,
)

KL_IN = {False: "reward", True: "loss"}  # baseline -> where the paper's variant puts the KL


class ReinforcePPConfig(OffPolicyCorrectionConfig):
    """REINFORCE++ (Hu et al. 2025): REINFORCE with a per-token KL penalty, PPO's clipped ratio, advantages
    normalised over the batch; `baseline: true` subtracts each prompt's mean reward first (REINFORCE++-baseline)."""

    baseline: bool = Field(
        False,
        description="REINFORCE++-baseline: subtract each prompt's mean reward before the global normalisation (needs "
        "group_size >= 2; the KL then goes in the loss as k2 unless kl_in says otherwise)",
    )
    group_size: int = Field(
        1, ge=1, description="responses sampled per prompt (k); 1 suffices for REINFORCE++, the baseline needs >= 2"
    )
    clip_eps: float = Field(
        0.2, gt=0, lt=1, description="PPO clip range of the ratio to the rollout policy: [1 - eps, 1 + eps]"
    )
    kl_coef: float = Field(
        0.01,
        ge=0,
        description="beta, the weight of the KL to the reference, wherever kl_in puts it (OpenRLHF's default 0.01; "
        "0: no reference logprobs are computed)",
    )
    kl_in: Literal["reward", "loss"] | None = Field(
        None,
        description="where the KL goes: reward: -beta * KL_t in each token's reward (k1); loss: beta * the token mean "
        "of kl_estimator added to the loss; unset: the paper's for the variant (reward for REINFORCE++, loss for the "
        "baseline)",
    )
    kl_estimator: Literal["k1", "k2", "k3"] | None = Field(
        None,
        description="the per-token KL estimate: k1 = logp - ref (the only one in the reward), k2 = (logp - ref)^2 / 2 "
        "or k3 = exp(ref - logp) - (ref - logp) - 1 (in the loss); unset: k1 in the reward, k2 in the loss",
    )
    gamma: float = Field(
        1.0,
        ge=0,
        le=1,
        description="discount of the per-token return G_t = sum_{s>=t} gamma^(s-t) r_s (1, the paper's; the baseline "
        "variant needs 1)",
    )

    @model_validator(mode="after")
    def _variant(self):
        if self.baseline and self.group_size < 2:
            raise ValueError(
                f"baseline: true subtracts each prompt's mean reward: it needs group_size >= 2 (got "
                f"{self.group_size}; a group of one has advantage 0)"
            )
        if self.baseline and self.gamma != 1.0:
            raise ValueError(
                f"gamma {self.gamma}: the baseline variant's advantage is the group-centred outcome on every token "
                "(gamma 1, as OpenRLHF's reinforce_baseline); discounting is plain REINFORCE++'s (baseline: false)"
            )
        if self.kl_in is None:
            self.kl_in = KL_IN[self.baseline]
        if self.kl_estimator is None:
            self.kl_estimator = "k1" if self.kl_in == "reward" else "k2"
        if self.kl_in == "reward" and self.kl_estimator != "k1":
            raise ValueError(
                f"kl_in 'reward' sums the k1 estimate (logp - ref) over the later tokens, the paper's penalty: "
                f"kl_estimator {self.kl_estimator!r} is for kl_in 'loss'"
            )
        if self.kl_in == "loss" and self.kl_estimator == "k1":
            raise ValueError(
                "kl_estimator 'k1' as a loss has gradient grad log pi, zero in expectation (no regularisation): use "
                "k2 (the paper's) or k3 with kl_in 'loss', or k1 with kl_in 'reward'"
            )
        return self


def k2_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k2 estimate of KL(pi || ref): 0.5 * (logp - ref)^2 >= 0; its gradient is
    (logp - ref) * grad logp, the k1 penalty's as a reward."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """The per-token k1, k2 or k3 estimate of KL(pi || ref)."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return k2_kl(logprobs, ref_logprobs)
    if estimator == "k3":
        return k3_kl(logprobs, ref_logprobs)
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2 or k3)")


def token_rewards(rewards: torch.Tensor, old_logprobs, ref_logprobs, mask, kl_coef: float) -> torch.Tensor:
    """r_t = -kl_coef * (log pi_old - log pi_ref) on every masked token, plus each row's reward on its
    last masked token, [B, T]; the reward alone when kl_coef is 0 (no reference logprobs needed)."""
    if kl_coef == 0:
        ref_logprobs = old_logprobs
    elif ref_logprobs is None:
        raise ValueError(f"kl_coef {kl_coef} puts the KL in the reward, but the rows have no reference logprobs")
    return kl_penalised_rewards(rewards, old_logprobs, ref_logprobs, mask, kl_coef)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum_{s >= t} gamma^(s - t) r_s over each row's masked tokens, [B, T] (0 where mask is 0).
    Positions with mask 0 are stepped over, not discounted (environment tokens between turns), as
    `algorithms.common.gae` does: this is its advantage with V = 0 and lambda = 1."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        on = mask[:, t] > 0
        running = torch.where(on, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(on, running, torch.zeros_like(running))
    return returns


def reinforce_pp_advantages(
    rewards: np.ndarray,
    groups: Sequence[str],
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    config: ReinforcePPConfig,
) -> torch.Tensor:
    """The step's advantages, [B, T] float64: rewards (group-centred under `baseline`), the KL in the
    per-token reward when `kl_in` is reward, the discounted return, normalised over every masked
    token of the batch."""
    c = config
    mask = mask.double()
    rewards = np.asarray(rewards, dtype=np.float64)
    if c.baseline:
        rewards = grpo_advantages(rewards, groups, std_normalize=False)  # R_i - mean of its group
    kl_coef = c.kl_coef if c.kl_in == "reward" else 0.0
    ref = None if ref_logprobs is None else ref_logprobs.double()
    r = token_rewards(torch.as_tensor(rewards), old_logprobs.double(), ref, mask, kl_coef)
    return masked_whiten(discounted_returns(r, mask, c.gamma), mask)


def reinforce_pp_loss(logprobs: torch.Tensor, batch: TrainBatch, config: ReinforcePPConfig):
    """The clipped surrogate on `batch.advantages`, a token mean, plus kl_coef * the token mean of the
    `kl_estimator` to the reference when `kl_in` is loss. Returns (loss, metrics); `kl_ref` is the
    token mean of that estimate (k1 of the current policy when the KL is in the reward)."""
    c, mask = config, batch.response_mask
    old, weights, metrics = corrected_ratio_inputs(batch, c.off_policy_correction, c.is_cap)
    loss, clip_frac, approx_kl = clipped_policy_loss(logprobs, old, batch.advantages, mask, c.clip_eps, weights=weights)
    metrics |= {"loss/policy": loss.item(), "clip_frac": clip_frac.item(), "approx_kl_old": approx_kl.item()}
    if c.kl_coef > 0 and c.kl_in == "loss":
        kl = kl_estimate(logprobs, batch.ref_logprobs, c.kl_estimator)
        loss = loss + c.kl_coef * masked_mean(kl, mask)
        metrics["kl_ref"] = masked_mean(kl.detach(), mask).item()
    elif batch.ref_logprobs is not None:
        metrics["kl_ref"] = masked_mean(logprobs.detach() - batch.ref_logprobs, mask).item()
    return loss, metrics


@register("reinforce_pp")
class ReinforcePP(Algorithm, ReportsPrepareMetrics, TrainsOnStaleRows, UsesProximalLogprobs, PlaysEpisodes):
    Config = ReinforcePPConfig
    needs_value_head = False

    def __init__(self, config: ReinforcePPConfig | None = None):
        self.config = config or self.Config()

    def rollout(self, ctx, prompts) -> pa.Table:
        return sample_groups(ctx, prompts, self.config.group_size, with_ref=self.config.kl_coef > 0)

    def prepare(self, table: pa.Table) -> TrainBatch:
        batch = collate(table)
        advantages = reinforce_pp_advantages(
            rewards_of(table),
            table.column("group").to_pylist(),
            batch.old_logprobs,
            batch.ref_logprobs,
            batch.response_mask,
            self.config,
        )
        batch.advantages = advantages.to(torch.float32)
        return batch

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        if self.config.group_size < 2:
            return {}
        return group_stats(rewards_of(table).tolist(), table.column("group").to_pylist())

    def proximal_logprobs_needed(self) -> bool:
        return self.config.off_policy_correction != "none"

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        return reinforce_pp_loss(outputs.logprobs, batch, self.config)
