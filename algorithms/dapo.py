"""DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"):
GRPO with a wider upper clip, groups without signal replaced by new ones, a token-level loss and
a length penalty near the generation budget; no KL term.

For G responses o_1..o_G to a prompt q with answer a and rewards R_1..R_G (the paper's eq. 8),
    A_i,t = (R_i - mean(R)) / (std(R) + 1e-6)                                 (GRPO's)
    r_i,t = pi_theta(o_i,t) / pi_old(o_i,t)
    loss = -1/sum_i |o_i| * sum_{i,t} min(r_i,t A_i,t, clip(r_i,t, 1 - eps_low, 1 + eps_high) A_i,t)
    subject to 0 < |{o_i : o_i is right}| < G
- Clip-higher (section 3.1): eps_low 0.2, eps_high 0.28, the paper's: a low-probability token
  may grow further before the clip stops it (entropy does not collapse).
- Dynamic sampling (section 3.2): a group whose rewards are all equal (every response right or
  every one wrong) has A = 0 and no gradient; such groups are dropped and the batch is refilled
  with groups of new prompts (`ctx.more_prompts`), "until the batch is fully filled with samples
  whose accuracy is neither 0 nor 1", here for at most `max_sampling_rounds` rounds of sampling,
  each over as many new prompts as groups are missing (the surplus past `trainer.prompts_per_step`
  groups is not kept). The filter is on the task reward, before the length penalty.
- Token-level loss (section 3.3): the masked token mean over the minibatch's responses, so that a
  long response's tokens count as much as a short one's (`masked_mean`).
- Overlong reward shaping (section 3.4, eq. 13), with L_max the generation budget
  (rollout.max_new_tokens) and L_cache = round(overlong_buffer_frac * L_max):
      R_length(y) = 0                                   |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                  = -1                                   L_max < |y|
  times `overlong_penalty`, added to the task reward before the advantages. The paper's budget is
  16384 + 4096 tokens of cache: L_cache is a fifth of L_max, the default 0.2 here.
- Multi-turn episodes (env.name; PlaysEpisodes): the groups are a prompt's episodes, filtered on
  their returns; L_max is the budget of one policy turn, so an episode's length penalty is that
  of its longest policy turn (|y| read off the loss mask's runs), the environment's tokens aside.
- No KL penalty (section 2.3: "the model distribution can diverge significantly from the initial
  model, thus this restriction is not necessary"); kl_coef > 0 adds GRPO's k3 term.

The clipped ratio corrects rows a policy version old (TrainsOnStaleRows); the off-policy correction
keys (TIS/MIS, decoupled) are GRPO's (UsesProximalLogprobs). A row whose advantage is 0 adds nothing
without the KL term and is left out of the forward (SkipsRowsWithoutGradient; the loss is a token mean).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field

from algorithms.base import register, rewards_of, sample_groups
from algorithms.common import (
    OffPolicyCorrectionConfig,
    clipped_policy_loss_with_kl,
    group_ids,
    group_stats,
    grpo_advantages,
    rows_with_gradient,
)
from algorithms.grpo import sequence_advantage_batch
from rlsys.batch import TrainBatch
from rlsys.contract import (
    Algorithm,
    ModelOutputs,
    PlaysEpisodes,
    ReportsPrepareMetrics,
    SkipsRowsWithoutGradient,
    TrainsOnStaleRows,
    UsesProximalLogprobs,
)
from rlsys.experience import concat_experience


class DAPOConfig(OffPolicyCorrectionConfig):
    """DAPO (Yu et al. 2025): clip-higher, dynamic sampling, token-level loss, overlong reward shaping."""

    group_size: int = Field(4, ge=2, description="responses sampled per prompt (G; the paper's 16)")
    clip_eps_low: float = Field(
        0.2, gt=0, lt=1, description="lower clip of the ratio: 1 - clip_eps_low (the paper's 0.2)"
    )
    clip_eps_high: float = Field(
        0.28, gt=0, description="upper clip of the ratio: 1 + clip_eps_high (clip-higher, the paper's 0.28)"
    )
    kl_coef: float = Field(
        0.0, ge=0, description="weight of GRPO's k3 KL to the reference (0, the paper's: no reference logprobs)"
    )
    dynamic_sampling: bool = Field(
        True,
        description="drop groups whose task rewards are all equal and refill the batch with groups of new prompts",
    )
    max_sampling_rounds: int = Field(
        4,
        ge=1,
        description="rounds of sampling a step may take to fill its batch with groups that have signal (the first "
        "included); after the last the step trains on the groups it has",
    )
    overlong_buffer_frac: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="L_cache as a fraction of the generation budget L_max: responses longer than L_max - L_cache "
        "are penalised linearly, down to -overlong_penalty at L_max (0: no length penalty; 0.2, the paper's 4096 "
        "of 20480)",
    )
    overlong_penalty: float = Field(1.0, ge=0, description="the length penalty at L_max (the paper's 1)")


def overlong_penalty(lengths, max_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> np.ndarray:
    """R_length(y) * penalty per response (the paper's eq. 13): 0 up to L_max - L_cache, then
    linear down to -penalty at L_max, -penalty beyond."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if buffer_tokens <= 0:
        return np.zeros_like(lengths)
    expected = max_tokens - buffer_tokens
    r = np.where(lengths <= expected, 0.0, (expected - lengths) / buffer_tokens)
    return penalty * np.maximum(r, -1.0)


def policy_turn_lengths(loss_mask) -> list[int]:
    """The lengths of the runs of 1 in a response's loss mask: its policy turns (one for a
    single-turn response, whose mask is all 1)."""
    lengths, run = [], 0
    for m in loss_mask:
        if m:
            run += 1
        elif run:
            lengths.append(run)
            run = 0
    return lengths + [run] if run else lengths


def groups_with_signal(rewards, groups) -> np.ndarray:
    """bool per row: its group's rewards are not all equal (0 < right answers < G)."""
    rewards, ids = np.asarray(rewards, dtype=np.float64), group_ids(groups)
    flat = {g for g in np.unique(ids) if np.ptp(rewards[ids == g]) == 0}
    return np.array([i not in flat for i in ids], dtype=bool)


def first_groups(table: pa.Table, keep: np.ndarray, n_groups: int) -> pa.Table:
    """The rows `keep` marks, of the first `n_groups` groups among them, in order."""
    groups = table.column("group").to_pylist()
    chosen = list(dict.fromkeys(g for g, k in zip(groups, keep) if k))[:n_groups]
    chosen = set(chosen)
    return table.filter(pa.array([bool(k) and g in chosen for g, k in zip(groups, keep)]))


def groups_with_signal_first(table: pa.Table, n_groups: int) -> pa.Table:
    """The rows of the table's first `n_groups` groups whose rewards are not all equal."""
    return first_groups(table, groups_with_signal(rewards_of(table), table.column("group").to_pylist()), n_groups)


def count_groups(table: pa.Table) -> int:
    return len(set(table.column("group").to_pylist()))


@register("dapo")
class DAPO(
    Algorithm, ReportsPrepareMetrics, SkipsRowsWithoutGradient, TrainsOnStaleRows, UsesProximalLogprobs, PlaysEpisodes
):
    Config = DAPOConfig
    needs_value_head = False

    def __init__(self, config: DAPOConfig | None = None):
        self.config = config or self.Config()

    def rollout(self, ctx, prompts) -> pa.Table:
        c = self.config
        sample = lambda batch: sample_groups(ctx, batch, c.group_size, with_ref=c.kl_coef > 0)
        table, rounds = sample(prompts), 1
        if c.dynamic_sampling:
            kept = groups_with_signal_first(table, len(prompts))
            missing = len(prompts) - count_groups(kept)
            while missing and rounds < c.max_sampling_rounds:
                kept = concat_experience([kept, groups_with_signal_first(sample(ctx.more_prompts(missing)), missing)])
                missing, rounds = len(prompts) - count_groups(kept), rounds + 1
            table = kept if kept.num_rows else table  # no group with signal at all: the step's rows (A = 0)
        max_tokens = ctx.sampling().max_new_tokens
        lengths = [max(policy_turn_lengths(m), default=0) for m in table.column("loss_mask").to_pylist()]
        penalty = overlong_penalty(lengths, max_tokens, round(c.overlong_buffer_frac * max_tokens), c.overlong_penalty)
        table = table.append_column("overlong_penalty", pa.array(penalty, type=pa.float32()))
        return table.append_column("sampling_rounds", pa.array([rounds] * table.num_rows, type=pa.int32()))

    def prepare(self, table: pa.Table) -> TrainBatch:
        shaped = rewards_of(table) + np.asarray(table.column("overlong_penalty").to_pylist(), dtype=np.float64)
        return sequence_advantage_batch(table, grpo_advantages(shaped, table.column("group").to_pylist()))

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        penalty = np.asarray(table.column("overlong_penalty").to_pylist())
        return group_stats(rewards_of(table).tolist(), table.column("group").to_pylist()) | {
            "dapo/sampling_rounds": float(np.mean(table.column("sampling_rounds").to_pylist())),
            "dapo/groups": float(count_groups(table)),
            "dapo/overlong_frac": float((penalty < 0).mean()),
            "dapo/overlong_penalty": float(penalty.mean()),
        }

    def gradient_rows(self, batch: TrainBatch) -> torch.Tensor:
        return rows_with_gradient(batch, self.config.kl_coef)

    def proximal_logprobs_needed(self) -> bool:
        return self.config.off_policy_correction != "none"

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        c = self.config
        return clipped_policy_loss_with_kl(
            outputs.logprobs,
            batch,
            c.clip_eps_low,
            c.kl_coef,
            clip_eps_high=c.clip_eps_high,
            correction=c.off_policy_correction,
            cap=c.is_cap,
        )
