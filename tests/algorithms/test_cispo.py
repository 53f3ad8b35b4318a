"""CISPO (MiniMax-M1, 2025) against hand-computed values: the clipped importance weight carries no
gradient, and a token whose ratio is past the clip keeps its gradient (PPO's surrogate drops it)."""

import math

import pytest
import torch

from algorithms.base import get_algorithm
from algorithms.cispo import CISPO, CISPOConfig, cispo_policy_loss, clipped_weight
from algorithms.common import clipped_policy_loss
from rlsys.batch import TrainBatch
from rlsys.contract import ModelOutputs, SkipsRowsWithoutGradient, TrainsOnStaleRows
from rlsys.experience import make_experience

# 2 groups x 2 responses of 2, 3, 1 and 2 tokens (T = 3), pi_old = e^-1 on every response token
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float64)
RATIO = torch.tensor([[8.0, 1.0, 1.0], [0.1, 1.0, 2.0], [1.0, 1.0, 1.0], [0.5, 1.0, 1.0]], dtype=torch.float64)
A = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
# the defaults (eps_low 1, eps_high 3): weights clip(r, 0, 4); only the 8 is clipped, the 0.1 is not
WEIGHT = torch.tensor([[4.0, 1.0, 0.0], [0.1, 1.0, 2.0], [1.0, 0.0, 0.0], [0.5, 1.0, 0.0]], dtype=torch.float64)
# sum_{i,t} w A log pi with log pi = -1 + log r:
#   row 0: 4 (-1 + log 8) - 1 = -5 + 12 log 2
#   row 1: -(0.1 (-1 - log 10) - 1 + 2 (-1 + log 2)) = 3.1 + 0.1 log 10 - 2 log 2
#   row 2: 1
#   row 3: 0.5 (-1 - log 2) - 1 = -1.5 - 0.5 log 2
# total -2.4 + 9.5 log 2 + 0.1 log 10, over the 8 tokens, negated:
LOSS = (2.4 - 9.5 * math.log(2.0) - 0.1 * math.log(10.0)) / 8  # -0.5518946


def batch(advantages=A, ref_logprobs=None) -> TrainBatch:
    return TrainBatch(
        input_ids=torch.zeros(4, 4, dtype=torch.long),
        attention_mask=torch.ones(4, 4),
        response_mask=MASK,
        old_logprobs=-MASK,
        ref_logprobs=ref_logprobs,
        advantages=advantages[:, None] * MASK,
    )


def logprobs_of(b: TrainBatch) -> torch.Tensor:
    return (b.old_logprobs + torch.log(RATIO) * MASK).clone().requires_grad_()


def test_weight_is_the_ratio_clipped_above_only_by_default_with_no_gradient():
    b = batch()
    logprobs = logprobs_of(b)
    w = clipped_weight(logprobs, b.old_logprobs, 1.0, 3.0)
    assert torch.allclose(w * MASK, WEIGHT)
    assert not w.requires_grad
    # a lower clip when asked: 1 - 0.2
    assert clipped_weight(logprobs, b.old_logprobs, 0.2, 3.0)[1, 0].item() == pytest.approx(0.8)


def test_loss_is_the_weighted_token_mean_of_minus_a_log_pi():
    assert LOSS == pytest.approx(-0.5518945905773606, rel=1e-12)
    b = batch()
    loss, clip_frac = cispo_policy_loss(logprobs_of(b), b.old_logprobs, b.advantages, MASK, 1.0, 3.0)
    assert loss.item() == pytest.approx(LOSS, rel=1e-12)
    assert clip_frac.item() == pytest.approx(1 / 8)  # the ratio 8
    loss, metrics = CISPO().loss(ModelOutputs(None, logprobs_of(b)), b)
    assert loss.item() == pytest.approx(LOSS, rel=1e-12)
    assert metrics == {"loss/policy": pytest.approx(LOSS, rel=1e-12), "clip_frac": pytest.approx(1 / 8)}


def test_every_token_keeps_a_gradient_even_past_the_clip_unlike_ppo():
    """d loss / d log pi_theta(o_i,t) = -w_i,t * A_i / 8 on every token. The ratio-8 token (A = 1)
    has -4/8; in PPO's clipped surrogate (the same clip range) it has none: min(r A, clip(r) A)
    takes the constant clip(r) A there."""
    b = batch()
    logprobs = logprobs_of(b)
    CISPO().loss(ModelOutputs(None, logprobs), b)[0].backward()
    expected = -WEIGHT * A[:, None] / 8
    assert torch.allclose(logprobs.grad, expected, atol=1e-12)
    assert logprobs.grad[0, 0].item() == pytest.approx(-0.5)

    ppo_logprobs = logprobs_of(b)
    ppo_loss, _, _ = clipped_policy_loss(ppo_logprobs, b.old_logprobs, b.advantages, MASK, clip_eps=3.0)
    ppo_loss.backward()
    assert ppo_logprobs.grad[0, 0].item() == 0.0


def test_k3_kl_is_a_token_mean():
    """The reference log 2 above the policy on every token: k3 = 1 - log 2 per token."""
    ref = logprobs_of(batch()).detach() + math.log(2.0)
    b = batch(ref_logprobs=ref)
    loss, metrics = CISPO(CISPOConfig(kl_coef=0.5)).loss(ModelOutputs(None, logprobs_of(b)), b)
    assert metrics["kl_ref"] == pytest.approx(1 - math.log(2.0), rel=1e-12)
    assert loss.item() == pytest.approx(LOSS + 0.5 * (1 - math.log(2.0)), rel=1e-12)


def test_rows_with_zero_advantage_are_left_out_without_the_kl():
    b = batch(advantages=torch.tensor([1.0, 0.0, 0.0, -1.0], dtype=torch.float64))
    assert CISPO().gradient_rows(b).tolist() == [True, False, False, True]
    assert CISPO(CISPOConfig(kl_coef=0.1)).gradient_rows(b).tolist() == [True, True, True, True]


def test_prepare_gives_grpo_advantages_on_every_token():
    rewards = [("a", 1.0), ("a", 0.0), ("b", 0.0), ("b", 1.0)]
    table = make_experience(
        [
            dict(
                uid=f"u{i}",
                group=g,
                prompt_ids=[5],
                response_ids=[10, 11],
                logprobs=[-1.0, -1.0],
                reward=r,
                policy_version=0,
            )
            for i, (g, r) in enumerate(rewards)
        ]
    )
    b = CISPO().prepare(table)
    a = 0.5 / (0.5 + 1e-6)
    assert (b.advantages * b.response_mask).sum(1).tolist() == pytest.approx([2 * a, -2 * a, -2 * a, 2 * a], rel=1e-6)


def test_registered_with_the_capabilities_it_has():
    assert get_algorithm("cispo") is CISPO
    algo = CISPO()
    assert isinstance(algo, TrainsOnStaleRows) and isinstance(algo, SkipsRowsWithoutGradient)
    assert (algo.config.clip_eps_low, algo.config.clip_eps_high, algo.config.kl_coef) == (1.0, 3.0, 0.0)
