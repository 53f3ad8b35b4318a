"""AMPO (Gupta et al. 2025): active multi-preference optimisation (../shared/papers/ampo.md).

1. N on-policy responses per prompt, reward scores r_i, embeddings e_i: the mean over the
   response tokens of the last hidden states of the policy or the reference (served by the
   rollout backend with the generations, `GenerationRequest.embedding`).
2. Select K < N: the top-reward response is the positive; the K-1 negatives by
   - BottomK (`select_bottomk`): the K-1 lowest rewards;
   - Coreset (`select_coreset`): k-means of the embeddings into K-1 clusters, the
     lowest-reward response of each cluster;
   - OptSelect (`select_optselect`): weights w_i = exp(mean(r) - r_i), distances
     A_ij = ||e_i - e_j||, S minimising sum_i w_i * min_{j in S} A_ij (weighted k-medoids)
     by local search: swap a medoid for a non-medoid while the cost falls.
3. Group-contrastive loss over positives S+ and negatives S-:
       L = -log( sum_{S+} exp(s_i) / sum_{S+ ∪ S-} exp(s_i) ),
       s_i = beta * mean_token_logprob(y_i|x) + alpha * (r_i - mean(r))
   (reference-free and length-normalised; r's mean is over the prompt's N responses). With one
   positive and one negative it is -log sigmoid(s+ - s-). A prompt whose N rewards are all
   equal has no preference and weighs 0.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, model_validator

from algorithms.base import register, set_rewards
from algorithms.pilaf import GroupedBatch
from rlsys.batch import TrainBatch, collate
from rlsys.contract import (
    Algorithm,
    AlgorithmConfig,
    AveragesLossOver,
    ModelOutputs,
    ReportsPrepareMetrics,
    Stateful,
)
from rlsys.experience import make_experience, new_uid
from rlsys.generation import GenerationRequest

EMBEDDING = pa.schema([("embedding", pa.list_(pa.float32()))])


class AMPOConfig(AlgorithmConfig):
    """AMPO (Gupta et al. 2025): active multi-preference optimisation, K of N responses per prompt in a
    group-contrastive loss."""

    num_samples: int = Field(8, ge=2, description="N responses sampled per prompt")
    subset_size: int = Field(
        4, ge=2, description="K responses trained on per prompt: 1 positive, K-1 negatives (below num_samples)"
    )
    selection: Literal["bottomk", "coreset", "optselect"] = Field(
        "coreset",
        description="how the K-1 negatives are chosen: bottomk: the lowest rewards; coreset: the lowest "
        "reward of each k-means cluster of the embeddings; optselect: weighted k-medoids by local search",
    )
    embedding_model: Literal["policy", "reference"] = Field(
        "policy", description="whose last hidden states, averaged over the response, embed a response"
    )
    beta: float = Field(2.0, gt=0, description="scale of the mean token logprob in s_i")
    alpha: float = Field(1.0, ge=0, description="scale of the centred reward in s_i")
    seed: int = Field(0, description="seed of the k-means initialisation")

    @model_validator(mode="after")
    def _subset_smaller(self):
        if self.subset_size >= self.num_samples:
            raise ValueError(f"subset_size ({self.subset_size}) must be below num_samples ({self.num_samples})")
        return self


def select_bottomk(rewards: np.ndarray, k: int) -> list[int]:
    """The k lowest rewards (ties by index)."""
    return [int(i) for i in np.argsort(rewards, kind="stable")[:k]]


def kmeans(x: np.ndarray, k: int, rng: np.random.Generator, iters: int = 50) -> np.ndarray:
    """Lloyd's k-means with k-means++ seeding; returns a cluster label per row (k clusters,
    none empty when there are at least k distinct rows)."""
    centres = [x[rng.integers(len(x))]]
    for _ in range(1, k):
        d2 = np.min([((x - c) ** 2).sum(1) for c in centres], axis=0)
        centres.append(x[rng.choice(len(x), p=d2 / d2.sum())] if d2.sum() > 0 else x[rng.integers(len(x))])
    centres = np.array(centres)
    labels = np.full(len(x), -1)
    for _ in range(iters):
        new = ((x[:, None] - centres[None]) ** 2).sum(-1).argmin(1)
        for c in range(k):  # an emptied cluster takes the farthest point of a cluster that can spare one
            if not (new == c).any():
                spare = np.bincount(new, minlength=k)[new] > 1
                far = np.where(spare, ((x - centres[new]) ** 2).sum(1), -1.0).argmax()
                new[far], centres[c] = c, x[far]
        if (new == labels).all():
            break
        labels = new
        centres = np.array([x[labels == c].mean(0) for c in range(k)])
    return labels


def select_coreset(embeddings: np.ndarray, rewards: np.ndarray, k: int, rng: np.random.Generator) -> list[int]:
    """k-means into k clusters; from each, its lowest-reward member."""
    labels = kmeans(embeddings, k, rng)
    return [int(np.flatnonzero(labels == c)[np.argmin(rewards[labels == c])]) for c in range(k)]


def optselect_cost(distances: np.ndarray, weights: np.ndarray, chosen) -> float:
    """sum_i w_i * min_{j in S} A_ij."""
    return float((weights * distances[:, list(chosen)].min(1)).sum())


def select_optselect(embeddings: np.ndarray, rewards: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    """Weighted k-medoids by local search from BottomK: w_i = exp(mean(r) - r_i), A_ij = ||e_i - e_j||;
    take the best single swap while it lowers the cost. Returns (S, the cost after each swap)."""
    weights = np.exp(rewards.mean() - rewards)
    distances = np.linalg.norm(embeddings[:, None] - embeddings[None], axis=-1)
    chosen = select_bottomk(rewards, k)
    costs = [optselect_cost(distances, weights, chosen)]
    while True:
        swaps = [
            (optselect_cost(distances, weights, chosen[:p] + [c] + chosen[p + 1 :]), p, c)
            for p in range(k)
            for c in range(len(rewards))
            if c not in chosen
        ]
        best = min(swaps, default=None)
        if best is None or best[0] >= costs[-1] - 1e-12:
            return chosen, costs
        chosen[best[1]] = best[2]
        costs.append(best[0])


def group_contrastive_loss(scores: torch.Tensor, positive: torch.Tensor, weights: torch.Tensor | None = None):
    """-log(sum_{S+} exp(s) / sum_{S+ ∪ S-} exp(s)) per group (rows of `scores` [G, K], `positive`
    a bool mask), weighted mean over groups."""
    per_group = torch.logsumexp(scores, 1) - torch.logsumexp(scores.masked_fill(~positive, float("-inf")), 1)
    weights = torch.ones_like(per_group) if weights is None else weights
    return (per_group * weights).sum() / weights.sum().clamp(min=1.0)


def subset_weights(batch: TrainBatch, subset_size: int) -> torch.Tensor:
    """Each subset's weight in the loss (its rows' `group_weight`), [B / subset_size]."""
    return batch.extras["group_weight"].view(-1, subset_size)[:, 0]


@register("ampo")
class AMPO(Algorithm, Stateful, ReportsPrepareMetrics, AveragesLossOver):
    Config = AMPOConfig
    needs_value_head = False

    def __init__(self, config: AMPOConfig | None = None):
        self.config = config or self.Config()
        self.rng = np.random.default_rng(self.config.seed)

    def state(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]

    def rollout(self, ctx, prompts) -> pa.Table:
        params = ctx.sampling(n=self.config.num_samples, seed=ctx.next_seed())
        requests = [
            GenerationRequest(list(p.prompt_ids), params, embedding=self.config.embedding_model) for p in prompts
        ]
        rows = [
            dict(
                uid=new_uid(),
                group=prompts[g.request_index].uid,
                prompt_ids=g.prompt_ids,
                response_ids=g.response_ids,
                logprobs=g.logprobs,
                reward=0.0,
                policy_version=g.policy_version,
                embedding=g.embedding,
                meta={**prompts[g.request_index].meta, "finish_reason": g.finish_reason},
            )
            for g in ctx.generate(requests)
        ]
        table = make_experience(rows, extra_schema=EMBEDDING)
        return set_rewards(table, ctx.score(table))

    def _select(self, embeddings: np.ndarray, rewards: np.ndarray) -> list[int]:
        """[positive, K-1 negatives] of one prompt's N responses (negatives from the other N-1)."""
        positive = int(np.argmax(rewards))
        rest = np.array([i for i in range(len(rewards)) if i != positive])
        k, c = self.config.subset_size - 1, self.config.selection
        if c == "bottomk":
            picked = select_bottomk(rewards[rest], k)
        elif c == "coreset":
            picked = select_coreset(embeddings[rest], rewards[rest], k, self.rng)
        else:
            picked = select_optselect(embeddings[rest], rewards[rest], k)[0]
        return [positive, *(int(rest[i]) for i in picked)]

    def prepare(self, table: pa.Table) -> TrainBatch:
        """K rows per prompt, [positive, negatives...]; extras: the centred reward term and the group weight."""
        rewards = table.column("reward").to_numpy().astype(np.float64)
        embeddings = table.column("embedding").to_pylist()
        groups: dict[str, list[int]] = {}
        for k, g in enumerate(table.column("group").to_pylist()):
            groups.setdefault(g, []).append(k)
        order, offsets, weights = [], [], []
        for members in groups.values():
            r = rewards[members]
            chosen = self._select(np.asarray([embeddings[m] for m in members], dtype=np.float64), r)
            order += [members[i] for i in chosen]
            offsets += [self.config.alpha * (r[i] - r.mean()) for i in chosen]
            weights += [float(r.max() > r.min())] * len(chosen)
        batch = collate(table.take(pa.array(order)))
        batch.extras["reward_offset"] = torch.tensor(offsets, dtype=torch.float32)
        batch.extras["group_weight"] = torch.tensor(weights, dtype=torch.float32)
        return GroupedBatch.of(batch, self.config.subset_size)

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        rewards = table.column("reward").to_numpy()
        groups = np.array(table.column("group").to_pylist())
        spread = [rewards[groups == g].max() > rewards[groups == g].min() for g in np.unique(groups)]
        return {"ampo/groups_with_signal": float(np.mean(spread))}

    def loss_denominator(self, batch: TrainBatch) -> float:
        weights = subset_weights(batch, self.config.subset_size)
        return float(weights.sum().clamp(min=1.0))  # as group_contrastive_loss divides

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        K, mask = self.config.subset_size, batch.response_mask
        mean_logprob = (outputs.logprobs * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        scores = (self.config.beta * mean_logprob + batch.extras["reward_offset"]).view(-1, K)
        positive = torch.zeros_like(scores, dtype=torch.bool)
        positive[:, 0] = True
        loss = group_contrastive_loss(scores, positive, subset_weights(batch, K))
        with torch.no_grad():
            margin = scores[:, 0] - scores[:, 1:].max(1).values
        return loss, {
            "loss/ampo": loss.item(),
            "ampo/positive_margin": margin.mean().item(),
            "ampo/positive_top": (margin > 0).float().mean().item(),
        }
