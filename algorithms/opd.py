"""On-policy distillation (OPD): the student samples, a fixed teacher scores every sampled token,
and the policy gradient minimises the per-token reverse KL(student || teacher).

Sources: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD, ICLR 2024: train on the student's own samples, with the reverse
KL among its divergences; GKD takes each token's divergence over the whole vocabulary, with no
gradient through the sampling); Lu et al. 2025, "On-Policy Distillation" (Thinking Machines
blog), whose form this is: the sampled token's log-ratio as a per-token reward in a policy
gradient, the recipe of Tinker cookbook's `distillation/train_on_policy.py`
(`incorporate_kl_penalty`). For each response y ~ pi_old (the sampler: the student's policy at
rollout, its logprobs the rollout's) to prompt x,
    r_t = log pi_teacher(y_t | x, y_<t) - log pi_old(y_t | x, y_<t)
        + reward_coef * R(x, y) on the last response token                 (reward_coef 0: none)
    A_t = sum_{l >= 0} discount^l r_{t+l} over the row's masked tokens     (discount 0: A_t = r_t)
    ratio_t = pi_theta(y_t) / pi_old(y_t)
    loss = -1/sum_i |y_i| * sum_{i,t} ratio_t * A_t                  (loss: importance_sampling)
    loss = -1/sum_i |y_i| * sum_{i,t} min(ratio_t A_t, clip(ratio_t, 1 +- clip_eps) A_t)   (ppo)
a token mean over the minibatch's response tokens (prompt, environment and padding tokens add
nothing). The advantage has no gradient: r_t is a reward computed once from the sampler.

Why it minimises the reverse KL: E_{y_t ~ pi}[log pi(y_t) - log pi_teacher(y_t)] is
KL(pi || pi_teacher) at that context, so -r_t is its one-sample (k1) estimate and at ratio 1 the
loss value is the batch's mean estimate. The surrogate's gradient at theta = old is
-E[A_t grad log pi(y_t)] = sum_y grad pi(y) (log pi(y) - log pi_teacher(y)) = grad KL(pi || pi_teacher)
(the term sum_y pi grad log pi = grad sum_y pi is 0): a token the teacher finds likelier than
the student gets A_t > 0 and its logprob is pushed up, an unlikelier one down. Discount 0 is the
Thinking Machines recipe (each token's own term: greedy in the per-token KL, low variance);
discount 1 gives each token the KL of the rest of the response, the unbiased gradient of the
sequence-level reverse KL. When the student equals the teacher every r_t is 0: no update.

Defaults, from the Tinker recipe (recipes/distillation/on_policy_distillation.py): `group_size` 4
(its rollouts per prompt), `discount` 0 (`kl_discount_factor` 0.0), the KL term at weight 1
(`kl_penalty_coef` 1.0: the advantage is -reverse KL itself) and no task reward (`reward_coef` 0:
"no correctness or format rewards are used"), `loss` importance_sampling (its `loss_fn` default:
Tinker's importance_sampling loss, -sum ratio * A, here a token mean). The unclipped ratio is
the default because with this system's default learner (one epoch, one minibatch: one optimizer
step per batch of fresh rows) pi_theta = pi_old at the update up to sampler/learner numerics, so a
clip would never bind; `loss: ppo` (clip_eps 0.2, PPO's) bounds the step for several epochs or
minibatches, or rows a version stale. The teacher scores at the rollout temperature (the
controller's ReferenceWorker), as the sampler's logprobs are; temperature 1 makes r_t exactly
the log-ratio of the two models' distributions.

Capabilities: `HasTeacher` (the teacher is DA-KD's: `algorithm.teacher`, a local model with the
student's tokenizer or a tiny one trained on the task before any actor starts,
algorithms/distill.py `prepare_teacher`; served as `ctx.teacher_logprobs`),
`ReportsPrepareMetrics` (`opd/reverse_kl`, the sampled reverse-KL estimate per token, the
quantity OPD drives down), `TrainsOnStaleRows` (the ratio to the rows' sampler logprobs corrects
rows a policy version old; their r_t is then the older sampler's KL). Not `Stateful` (nothing
kept between steps) and not `SkipsRowsWithoutGradient`: a row has advantage 0 only where teacher
and sampler agree exactly on every token, so the check would leave out nothing.
"""

from __future__ import annotations

from itertools import chain
from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field

from algorithms.base import register, sample_groups
from algorithms.common import clipped_policy_loss, gae, kl_penalised_rewards, masked_mean
from algorithms.distill import TeacherConfig, prepare_teacher
from rlsys.batch import TrainBatch, collate, rows_into
from rlsys.contract import (
    Algorithm,
    AlgorithmConfig,
    HasTeacher,
    ModelOutputs,
    ReportsPrepareMetrics,
    TrainsOnStaleRows,
)

TEACHER_COLUMN = "teacher_logprobs"  # log pi_teacher of each response token, aligned with response_ids


# ---- the method, as pure functions ---------------------------------------------------------
def opd_token_rewards(teacher_logprobs, sampler_logprobs, mask, rewards, reward_coef: float) -> torch.Tensor:
    """r_t = (log pi_teacher - log pi_old) on every masked token (the negative reverse-KL
    estimate), plus reward_coef * R_i on row i's last masked token; [B, T], 0 where mask is 0.
    PPO's KL-penalised reward with the teacher as the anchor at weight 1."""
    return kl_penalised_rewards(reward_coef * rewards, sampler_logprobs, teacher_logprobs, mask, 1.0)


def discounted_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """A_t = sum_{l >= 0} discount^l r_{t+l} over each row's masked tokens (masked-out ones
    stepped over): GAE with V = 0 and lambda 1. discount 0: A_t = r_t."""
    if discount == 0:
        return token_rewards * mask
    return gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma=discount, lam=1.0)[0]


def importance_sampling_loss(logprobs, old_logprobs, advantages, mask):
    """-1/sum|y_i| * sum_{i,t} (pi_theta / pi_old) * A_t over the masked tokens (Tinker's
    importance_sampling loss as a token mean); its gradient on log pi_theta(y_t) is
    -ratio_t * A_t / sum|y_i|. Returns (loss, approx_kl: the token mean of (log ratio)^2 / 2)."""
    log_ratio = logprobs - old_logprobs
    loss = masked_mean(-torch.exp(log_ratio) * advantages, mask)
    with torch.no_grad():
        approx_kl = masked_mean(0.5 * log_ratio**2, mask)
    return loss, approx_kl


def teacher_metrics(sampler_logprobs, teacher_logprobs, loss_masks) -> dict[str, float]:
    """Token means over the rows' masked response tokens (per-row lists): `opd/reverse_kl`, of
    log pi_old - log pi_teacher, the sampled (k1) estimate of KL(student || teacher) per token;
    `opd/teacher_logprob`, of log pi_teacher of the student's tokens."""
    s, t, m = (
        np.fromiter(chain.from_iterable(v), np.float64) for v in (sampler_logprobs, teacher_logprobs, loss_masks)
    )
    n = max(m.sum(), 1.0)
    return {"opd/reverse_kl": float(((s - t) * m).sum() / n), "opd/teacher_logprob": float((t * m).sum() / n)}


def token_column(table: pa.Table, name: str, shape: tuple[int, int]) -> torch.Tensor:
    """A per-token column of the rows as a [B, L-1] tensor in collate's layout (response token j
    of row i at prompt length - 1 + j), 0 elsewhere."""
    starts = np.fromiter((len(p) - 1 for p in table.column("prompt_ids").to_pylist()), np.int64)
    return torch.from_numpy(rows_into(shape, starts, table.column(name).to_pylist(), np.float32))


# ---- the plug-in -------------------------------------------------------------------------------
class OPDConfig(AlgorithmConfig):
    """On-policy distillation (GKD, Agarwal et al. 2024; Thinking Machines 2025): the student's samples,
    each token's advantage the teacher's minus the sampler's logprob (the negative reverse KL)."""

    group_size: int = Field(4, ge=1, description="responses sampled per prompt (the Tinker recipe's group_size 4)")
    loss: Literal["importance_sampling", "ppo"] = Field(
        "importance_sampling",
        description="importance_sampling: -ratio * A, a token mean (Tinker's loss, the recipe's default); ppo: "
        "PPO's clipped surrogate with clip_eps",
    )
    clip_eps: float = Field(
        0.2, gt=0, lt=1, description="loss: ppo only: clip range of the ratio to the sampler, [1 - eps, 1 + eps]"
    )
    discount: float = Field(
        0.0,
        ge=0,
        le=1,
        description="A_t = sum_l discount^l r_{t+l}: 0 (the recipe's kl_discount_factor): each token's own "
        "reverse-KL term; 1: the KL of the rest of the response",
    )
    reward_coef: float = Field(
        0.0,
        ge=0,
        description="weight of the task's reward, added to the last response token's r_t (0, the recipe's: the "
        "teacher alone supervises)",
    )
    teacher: TeacherConfig = Field(
        TeacherConfig(),
        description="the teacher (DA-KD's section): a trained local model, or a tiny one trained on the task "
        "before the run",
    )


@register("opd")
class OPD(Algorithm, HasTeacher, ReportsPrepareMetrics, TrainsOnStaleRows):
    Config = OPDConfig
    needs_value_head = False

    def __init__(self, config: OPDConfig | None = None):
        self.config = config or self.Config()

    def teacher_dir(self, run_dir, task, tokenizer, seed: int):
        """DA-KD's `prepare_teacher` of the `teacher` section."""
        return prepare_teacher(self.config.teacher, run_dir, task, tokenizer, seed)

    def rollout(self, ctx, prompts) -> pa.Table:
        """group_size samples per prompt from the student, the task's rewards, and the teacher's
        logprob of every sampled token (column `teacher_logprobs`)."""
        table = sample_groups(ctx, prompts, self.config.group_size, with_ref=False)
        teacher = pa.array([list(map(float, v)) for v in ctx.teacher_logprobs(table)], type=pa.list_(pa.float32()))
        return table.append_column(TEACHER_COLUMN, teacher)

    def prepare(self, table: pa.Table) -> TrainBatch:
        c = self.config
        batch = collate(table)
        mask = batch.response_mask
        teacher = token_column(table, TEACHER_COLUMN, tuple(mask.shape))
        batch.token_rewards = opd_token_rewards(teacher, batch.old_logprobs, mask, batch.rewards, c.reward_coef)
        batch.advantages = discounted_advantages(batch.token_rewards, mask, c.discount)
        return batch

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        return teacher_metrics(
            table.column("logprobs").to_pylist(),
            table.column(TEACHER_COLUMN).to_pylist(),
            table.column("loss_mask").to_pylist(),
        )

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        c, mask = self.config, batch.response_mask
        if c.loss == "ppo":
            loss, clip_frac, approx_kl = clipped_policy_loss(
                outputs.logprobs, batch.old_logprobs, batch.advantages, mask, c.clip_eps
            )
            return loss, {"loss/policy": loss.item(), "clip_frac": clip_frac.item(), "approx_kl_old": approx_kl.item()}
        loss, approx_kl = importance_sampling_loss(outputs.logprobs, batch.old_logprobs, batch.advantages, mask)
        return loss, {"loss/policy": loss.item(), "approx_kl_old": approx_kl.item()}
