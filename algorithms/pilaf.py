"""PILAF (Feng et al. 2025): policy-interpolated sampling of preference pairs for online DPO
(Rafailov et al. 2023); `sampler: vanilla` is plain online DPO, its baseline
(../shared/papers/pilaf.md).

Per prompt, one pair. With probability 1/2 (PILAF) the two responses come from the
optimistic and the pessimistic interpolation of the policy and the reference, applied token
by token on logits by the rollout backend (`rlsys.generation.Interpolation`):
    y_a ~ pi_plus  ∝ pi_theta^(1+beta) * pi_ref^(-beta)    h_plus  = (1+beta) h_theta - beta h_ref
    y_b ~ pi_minus ∝ pi_theta^(1-beta) * pi_ref^(beta)     h_minus = (1-beta) h_theta + beta h_ref
otherwise both from pi_theta. The reward source behind `ctx.score` (rule, reward model or
judge) labels the pair: the higher score wins (`labels: max`; a tie carries no preference),
or a Bradley-Terry draw P(a > b) = sigmoid(r_a - r_b). The learner minimises the DPO loss
    -log sigmoid(beta * ((log pi_theta(y_w) - log pi_ref(y_w)) - (log pi_theta(y_l) - log pi_ref(y_l))))
with beta = 0.1, the same beta as the interpolation (the implicit reward is beta*log(pi_theta/pi_ref)).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Literal

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from pydantic import Field

from algorithms.base import register, score_and_ref_logprobs, set_rewards, set_token_column
from algorithms.common import masked_sum
from rlsys.batch import TrainBatch, collate
from rlsys.contract import Algorithm, AlgorithmConfig, AveragesLossOver, ModelOutputs, ReportsPrepareMetrics
from rlsys.experience import make_experience, meta_of, new_uid
from rlsys.generation import GenerationRequest, Interpolation


class PILAFConfig(AlgorithmConfig):
    """PILAF (Feng et al. 2025): online DPO on pairs sampled from interpolations of the policy and the reference."""

    sampler: Literal["pilaf", "vanilla"] = Field(
        "pilaf",
        description="pilaf: a share of the pairs from the "
        "interpolated policies; vanilla: both responses from the policy "
        "(plain online DPO)",
    )
    beta: float = Field(0.1, gt=0, description="DPO beta, also the interpolation's beta")
    interpolated_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="sampler pilaf: probability that a prompt's "
        "pair is drawn from (pi_plus, pi_minus) instead of twice from the policy",
    )
    labels: Literal["max", "bradley_terry"] = Field(
        "max",
        description="how a pair's two scores become a preference: "
        "max: the higher wins (a tie: no preference); bradley_terry: a "
        "wins with probability sigmoid(r_a - r_b)",
    )


@dataclass
class GroupedBatch(TrainBatch):
    """A TrainBatch whose rows come in consecutive groups of `group_size` that one loss term
    needs together (a DPO pair, an AMPO subset): splits across ranks and minibatches cut only
    between groups."""

    group_size: int = 1

    @classmethod
    def of(cls, batch: TrainBatch, group_size: int) -> "GroupedBatch":
        return cls(**{f.name: getattr(batch, f.name) for f in fields(batch)}, group_size=group_size)

    def split(self, n: int) -> list["GroupedBatch"]:
        bounds = np.linspace(0, len(self) // self.group_size, n + 1).astype(int) * self.group_size
        return [self.select(slice(a, b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def interpolated_pairs(n: int, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Which of n pairs are drawn from (pi_plus, pi_minus): each independently with prob `fraction`."""
    return rng.random(n) < fraction


def label_pairs(reward_a, reward_b, mode: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(a_wins, decisive) per pair. `max`: the higher score wins, a tie is not decisive;
    `bradley_terry`: a wins with probability sigmoid(r_a - r_b), always decisive."""
    ra, rb = np.asarray(reward_a, dtype=np.float64), np.asarray(reward_b, dtype=np.float64)
    if mode == "max":
        return ra > rb, ra != rb
    return rng.random(len(ra)) < 1.0 / (1.0 + np.exp(rb - ra)), np.ones(len(ra), dtype=bool)


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi(y|x) = sum of the response tokens' logprobs, per row."""
    return (token_logprobs * mask).sum(dim=1)


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float, weights=None):
    """-log sigmoid(beta * ((lp_w - ref_w) - (lp_l - ref_l))), weighted mean over pairs.
    Returns (loss, margins) with margins = beta * (...), the implicit reward difference."""
    margins = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
    losses = -F.logsigmoid(margins)
    weights = torch.ones_like(losses) if weights is None else weights
    return masked_sum(losses, weights) / weights.sum().clamp(min=1.0), margins


def pair_weights(batch: TrainBatch) -> torch.Tensor:
    """Each [chosen, rejected] pair's weight (0: a tie), [B / 2]."""
    return batch.extras["pair_weight"][0::2]


@register("pilaf")
class PILAF(Algorithm, ReportsPrepareMetrics, AveragesLossOver):
    Config = PILAFConfig
    needs_value_head = False

    def __init__(self, config: PILAFConfig | None = None):
        self.config = config or self.Config()

    def rollout(self, ctx, prompts) -> pa.Table:
        c = self.config
        fraction = c.interpolated_fraction if c.sampler == "pilaf" else 0.0
        mixed = interpolated_pairs(len(prompts), fraction, np.random.default_rng(ctx.next_seed()))
        plus = ctx.sampling(n=1, seed=ctx.next_seed(), interpolation=Interpolation(c.beta, "plus"))
        minus = ctx.sampling(n=1, seed=ctx.next_seed(), interpolation=Interpolation(c.beta, "minus"))
        policy = ctx.sampling(n=2, seed=ctx.next_seed())
        requests, origin = [], []  # origin: (pair index, sampler) per request
        for i, (prompt, m) in enumerate(zip(prompts, mixed)):
            for params, sampler in [(plus, "plus"), (minus, "minus")] if m else [(policy, "policy")]:
                requests.append(GenerationRequest(list(prompt.prompt_ids), params))
                origin.append((i, sampler))
        generations = sorted(ctx.generate(requests), key=lambda g: g.request_index)  # a pair's two rows adjacent
        groups = [new_uid() for _ in prompts]
        rows = []
        for g in generations:
            i, sampler = origin[g.request_index]
            rows.append(
                dict(
                    uid=new_uid(),
                    group=groups[i],
                    prompt_ids=g.prompt_ids,
                    response_ids=g.response_ids,
                    logprobs=g.logprobs,
                    reward=0.0,
                    policy_version=g.policy_version,
                    meta={**prompts[i].meta, "finish_reason": g.finish_reason, "sampler": sampler},
                )
            )
        table = make_experience(rows)
        rewards, ref_logprobs = score_and_ref_logprobs(ctx, table)
        table = set_token_column(set_rewards(table, rewards), "ref_logprobs", ref_logprobs)
        rewards = np.asarray(rewards, dtype=np.float64)
        a_wins, decisive = label_pairs(rewards[0::2], rewards[1::2], c.labels, np.random.default_rng(ctx.next_seed()))
        metas = meta_of(table)
        for k, (win, dec) in enumerate(zip(a_wins, decisive)):
            metas[2 * k]["preference"] = "chosen" if win else "rejected"
            metas[2 * k + 1]["preference"] = "rejected" if win else "chosen"
            metas[2 * k]["decisive"] = metas[2 * k + 1]["decisive"] = bool(dec)
        return table.set_column(table.schema.get_field_index("meta"), "meta", pa.array([json.dumps(m) for m in metas]))

    def prepare(self, table: pa.Table) -> TrainBatch:
        """Rows as [chosen, rejected] per pair; ties weigh 0 (`extras['pair_weight']`)."""
        metas = meta_of(table)
        by_group: dict[str, dict[str, int]] = {}
        for k, (g, m) in enumerate(zip(table.column("group").to_pylist(), metas)):
            by_group.setdefault(g, {})[m["preference"]] = k
        order = [k for pair in by_group.values() for k in (pair["chosen"], pair["rejected"])]
        batch = collate(table.take(pa.array(order)))
        batch.extras["pair_weight"] = torch.tensor([float(metas[k]["decisive"]) for k in order])
        return GroupedBatch.of(batch, 2)

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        metas, rewards = meta_of(table), table.column("reward").to_pylist()
        out = {
            "pilaf/decisive_pairs": float(np.mean([m["decisive"] for m in metas])),
            "pilaf/interpolated_pairs": float(np.mean([m["sampler"] != "policy" for m in metas])),
        }
        for sampler in ("plus", "minus", "policy"):
            mine = [r for r, m in zip(rewards, metas) if m["sampler"] == sampler]
            if mine:
                out[f"pilaf/reward_{sampler}"] = float(np.mean(mine))
        return out

    def loss_denominator(self, batch: TrainBatch) -> float:
        return float(pair_weights(batch).sum().clamp(min=1.0))  # as dpo_loss divides

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        mask = batch.response_mask
        policy = sequence_logprobs(outputs.logprobs, mask)
        ref = sequence_logprobs(batch.ref_logprobs, mask)
        weights = pair_weights(batch)
        loss, margins = dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2], self.config.beta, weights)
        decisive = weights > 0
        margins = margins.detach()[decisive]
        return loss, {
            "loss/dpo": loss.item(),
            "dpo/margin": margins.mean().item() if decisive.any() else 0.0,
            "dpo/accuracy": (margins > 0).float().mean().item() if decisive.any() else 0.0,
            "dpo/decisive_pairs": decisive.float().mean().item(),
        }
