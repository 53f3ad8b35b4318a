"""Pure functions shared by the policy-gradient algorithms (../shared/papers/ppo-grpo.md).

Every tensor argument named `mask` is 1 on trainable response tokens and 0 elsewhere
(prompt, environment and padding tokens): masked positions contribute nothing to any
loss, statistic or gradient.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal, Sequence

import numpy as np
import torch
from pydantic import Field

from rlsys.contract import AlgorithmConfig


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over positions where mask is 1 (0 when the mask is empty)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def masked_sum_over_constant(x: torch.Tensor, mask: torch.Tensor, constant: float) -> torch.Tensor:
    """Each row's masked sum of x divided by `constant`, averaged over the rows:
    sum_i sum_t mask * x / (rows * constant). Dr.GRPO's aggregate (Liu et al. 2025, constant =
    the generation budget), in place of a mean over tokens that weighs a token by 1 / its count."""
    return (x * mask).sum() / (mask.shape[0] * constant)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over masked positions; masked-out entries come back as 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) / torch.sqrt(var + eps) if shift_mean else x / torch.sqrt(var + eps)
    return out * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95):
    """Generalised advantage estimation over each row's masked tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = sum_l (gamma*lam)^l delta_{t+l};  R_t = A_t + V_t.
    Positions with mask 0 are skipped: the next value of the last response token is 0
    (terminal), and environment tokens in the middle of an episode are stepped over.
    Shapes [B, T]; returns (advantages, returns), zero where mask is 0.
    """
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    for b in range(B):
        next_value, running = 0.0, 0.0
        for t in range(T - 1, -1, -1):
            if mask[b, t] == 0:
                continue
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            running = delta + gamma * lam * running
            adv[b, t] = running
            next_value = values[b, t]
    returns = (adv + values) * mask
    return adv * mask, returns


def group_ids(groups: Sequence[str]) -> np.ndarray:
    """Map group labels to dense integer ids in first-seen order."""
    index: dict[str, int] = {}
    return np.array([index.setdefault(g, len(index)) for g in groups])


def grpo_advantages(
    rewards: np.ndarray, groups: Sequence[str], std_normalize: bool = True, eps: float = 1e-6
) -> np.ndarray:
    """GRPO: A_i = (r_i - mean(r_group)) / (std(r_group) + eps); Dr.GRPO drops the std."""
    rewards = np.asarray(rewards, dtype=np.float64)
    ids = group_ids(groups)
    adv = np.zeros_like(rewards)
    for g in np.unique(ids):
        sel = ids == g
        r = rewards[sel]
        a = r - r.mean()
        adv[sel] = a / (r.std() + eps) if std_normalize else a
    return adv


def rloo_advantages(rewards: np.ndarray, groups: Sequence[str]) -> np.ndarray:
    """RLOO: A_i = r_i - mean_{j != i} r_j within the group (0 for a group of one)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    ids = group_ids(groups)
    adv = np.zeros_like(rewards)
    for g in np.unique(ids):
        sel = ids == g
        r, k = rewards[sel], int(sel.sum())
        adv[sel] = 0.0 if k == 1 else r - (r.sum() - r) / (k - 1)
    return adv


def broadcast_to_tokens(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every masked token of row i the value per_sequence[i]."""
    return per_sequence[:, None].to(mask.dtype) * mask


def clipped_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_eps: float = 0.2,
    aggregate=masked_mean,
    clip_eps_high: float | None = None,
    weights=None,
):
    """PPO surrogate: -min(ratio*A, clip(ratio, 1-eps, 1+eps_high)*A) (eps_high = eps unless
    given: DAPO's clip-higher), each token's term times `weights` where given (the off-policy
    correction's, `behaviour_weights`), reduced by `aggregate(x, mask)` (the masked token mean
    unless given). Returns (loss, clip_fraction, approx_kl)."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * advantages
    surrogate = -torch.min(unclipped, clipped)
    loss = aggregate(surrogate if weights is None else surrogate * weights, mask)
    with torch.no_grad():
        clip_frac = masked_mean(((ratio < 1.0 - clip_eps) | (ratio > 1.0 + high)).float(), mask)
        approx_kl = masked_mean(0.5 * log_ratio**2, mask)
    return loss, clip_frac, approx_kl


# ---- off-policy corrections: the sampler's policy is not the learner's ------------------------
# pi_behav: the sampler's logprobs (`batch.old_logprobs`: the rollout engine's, possibly a policy
# version or more behind, and never bit-equal to the learner's forward); pi_prox: the learner's
# logprobs of the same tokens before this step's update (`batch.proximal_logprobs`, set by the
# learner when the algorithm's `proximal_logprobs_needed()` says so). With a correction the PPO
# ratio is pi_theta / pi_prox and each token's term is weighted by rho = pi_prox / pi_behav:
#   decoupled  w = rho                          (Hilton et al. 2021; AReaL, Fu et al. 2025, eq. 5)
#   tis        w = min(rho, C)                  (truncated IS, Yao et al. 2025)
#   mis        w = rho if rho <= C else 0       (masked IS, Liu et al. 2025; AReaL's weight cap)
OFF_POLICY_CORRECTIONS = ("none", "decoupled", "tis", "mis")


class OffPolicyCorrectionConfig(AlgorithmConfig):
    """The off-policy correction keys of an algorithm whose loss is the PPO clipped surrogate."""

    off_policy_correction: Literal["none", "decoupled", "tis", "mis"] = Field(
        "none",
        description="how the loss corrects for the sampler's policy not being the learner's: none: the ratio to "
        "the sampler's logprobs; decoupled: the ratio to the learner's logprobs before the update, each token "
        "weighted by rho = pi_learner / pi_sampler; tis: that weight truncated at is_cap; mis: tokens whose rho "
        "exceeds is_cap masked out (the last three cost a forward without gradient when a step is several "
        "optimizer steps)",
    )
    is_cap: float = Field(
        2.0, gt=0, description="C, the cap of rho in tis (min(rho, C)) and mis (rho > C masked); 2.0, Yao et al.'s"
    )


def behaviour_weights(proximal_logprobs, behaviour_logprobs, correction: str, cap: float) -> torch.Tensor:
    """Each token's weight w (no gradient) for `correction` (one of OFF_POLICY_CORRECTIONS but
    "none"), from rho = exp(proximal - behaviour) and the cap C."""
    with torch.no_grad():
        rho = torch.exp(proximal_logprobs - behaviour_logprobs)
        if correction == "decoupled":
            return rho
        if correction == "tis":
            return torch.clamp(rho, max=cap)
        if correction == "mis":
            return torch.where(rho <= cap, rho, torch.zeros_like(rho))
    raise ValueError(f"unknown off-policy correction {correction!r} (known: {', '.join(OFF_POLICY_CORRECTIONS)})")


def corrected_ratio_inputs(batch, correction: str, cap: float):
    """(the logprobs the PPO ratio divides by, the per-token weights or None, metrics): the
    sampler's logprobs and no weights for "none"; the learner's proximal logprobs and
    `behaviour_weights` otherwise."""
    if correction == "none":
        return batch.old_logprobs, None, {}
    if batch.proximal_logprobs is None:
        raise ValueError(f"off-policy correction {correction!r} needs the learner's proximal logprobs in the batch")
    weights = behaviour_weights(batch.proximal_logprobs, batch.old_logprobs, correction, cap)
    mask = batch.response_mask
    rho = torch.exp(batch.proximal_logprobs - batch.old_logprobs)
    metrics = {
        "is/weight_mean": masked_mean(weights, mask).item(),
        "is/capped_frac": masked_mean((rho > cap).float(), mask).item(),  # truncated (tis) or masked (mis)
    }
    return batch.proximal_logprobs, weights, metrics


def rows_with_gradient(batch, kl_coef: float) -> torch.Tensor:
    """Rows whose term in `clipped_policy_loss_with_kl` can have a non-zero gradient: a row
    whose advantage is 0 at every token adds 0 * ratio to the surrogate (clipped or not), so
    without the KL term it adds nothing but tokens to the mean's denominator (a GRPO/RLOO group
    whose rewards are all equal). With kl_coef > 0 every row counts."""
    if kl_coef > 0:
        return torch.ones(len(batch), dtype=torch.bool)
    return ((batch.advantages != 0) & (batch.response_mask > 0)).any(dim=1)


def clipped_policy_loss_with_kl(
    logprobs,
    batch,
    clip_eps: float,
    kl_coef: float,
    aggregate=masked_mean,
    clip_eps_high: float | None = None,
    correction: str = "none",
    cap: float = 2.0,
):
    """The PPO clipped surrogate on `batch.advantages` plus `kl_coef * k3(pi, ref)` as a loss
    (GRPO's objective, shared by the algorithms built on it), both per-token terms reduced by
    `aggregate(x, mask)` (the masked token mean unless given); the surrogate under the
    off-policy `correction` (`corrected_ratio_inputs`). Returns (loss, metrics); the `kl_ref`
    metric is the token mean of k3 whatever the aggregate."""
    mask = batch.response_mask
    old, weights, metrics = corrected_ratio_inputs(batch, correction, cap)
    loss, clip_frac, approx_kl = clipped_policy_loss(
        logprobs, old, batch.advantages, mask, clip_eps, aggregate, clip_eps_high, weights
    )
    metrics |= {"loss/policy": loss.item(), "clip_frac": clip_frac.item(), "approx_kl_old": approx_kl.item()}
    if kl_coef > 0:
        kl = k3_kl(logprobs, batch.ref_logprobs)
        loss = loss + kl_coef * aggregate(kl, mask)
        metrics["kl_ref"] = masked_mean(kl.detach(), mask).item()
    return loss, metrics


def clipped_value_loss(values, old_values, returns, mask, value_clip: float = 0.2):
    """0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2), masked token mean."""
    clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    loss = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * masked_mean(loss, mask)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def kl_penalised_rewards(
    reward: torch.Tensor, logprobs, ref_logprobs, mask, kl_coef: float, task_token_rewards=None
) -> torch.Tensor:
    """Per-token PPO rewards: -kl_coef * (logp - ref_logp) everywhere, plus the task reward on
    each row's last masked token, or plus `task_token_rewards` ([B, T], the reward spread over
    the tokens it is about: task.shaping's penalties) where given."""
    token_rewards = -kl_coef * (logprobs - ref_logprobs) * mask
    if task_token_rewards is not None:
        return token_rewards + task_token_rewards * mask
    last = last_token_index(mask)
    rows = torch.arange(mask.shape[0])
    token_rewards[rows, last] += reward * (mask.sum(1) > 0).to(reward.dtype)
    return token_rewards


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last position with mask 1 (0 for an empty row)."""
    T = mask.shape[1]
    positions = torch.arange(T, device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.zeros_like(positions)).max(dim=1).values


def group_stats(rewards: Sequence[float], groups: Sequence[str]) -> dict[str, float]:
    """Fraction of groups whose rewards are all equal (no learning signal for GRPO/RLOO)."""
    by_group: dict[str, list[float]] = defaultdict(list)
    for r, g in zip(rewards, groups):
        by_group[g].append(r)
    flat = sum(1 for v in by_group.values() if max(v) == min(v))
    return {"groups_without_signal": flat / max(1, len(by_group))}
