"""GRPO's loss normalisers (../shared/papers/ppo-grpo.md): the token mean, and Dr.GRPO's (Liu et al.
2025) token sum over a constant, on responses of different lengths, against hand-computed values."""

import math

import pydantic
import pytest
import torch

from algorithms.common import masked_sum_over_constant
from algorithms.grpo import GRPO, GRPOConfig
from rlsys.batch import TrainBatch
from rlsys.contract import ModelOutputs

# three responses of 1, 3 and 4 tokens (T = 4), advantages A_i on their tokens
MASK = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
A = torch.tensor([1.0, -0.5, 0.25])
MAX_TOKENS = 8
KL_COEF = 0.1


def batch() -> TrainBatch:
    """On-policy rows (ratio 1: the surrogate's per-token term is -A_i) whose reference is log 2 above
    the policy on every token: k3 = exp(log 2) - log 2 - 1 = 1 - log 2 per token."""
    old = torch.full((3, 4), -1.0)
    return TrainBatch(
        input_ids=torch.zeros(3, 5, dtype=torch.long),
        attention_mask=torch.ones(3, 5),
        response_mask=MASK,
        old_logprobs=old,
        ref_logprobs=old + math.log(2.0),
        advantages=A[:, None] * MASK,
    )


def dr_grpo(**overrides) -> GRPO:
    keys = dict(std_normalize=False, loss_normalizer="constant", max_tokens=MAX_TOKENS, kl_coef=KL_COEF)
    return GRPO(GRPOConfig(**{**keys, **overrides}))


def test_dr_grpo_loss_is_the_token_sum_over_responses_times_the_constant():
    surrogate_sum = -(1.0 * 1 + -0.5 * 3 + 0.25 * 4)  # sum_{i,t} -A_i = -(1 - 1.5 + 1) = -0.5
    k3_sum = 8 * (1 - math.log(2.0))  # 8 response tokens
    b = batch()
    loss, metrics = dr_grpo().loss(ModelOutputs(None, b.old_logprobs.clone()), b)
    expected = (surrogate_sum + KL_COEF * k3_sum) / (3 * MAX_TOKENS)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["loss/policy"] == pytest.approx(surrogate_sum / (3 * MAX_TOKENS), rel=1e-6)
    assert metrics["kl_ref"] == pytest.approx(1 - math.log(2.0), rel=1e-6)  # reported as a token mean either way
    # the token mean divides by the 8 tokens instead: a different loss, so this test can fail
    token_mean, _ = GRPO(GRPOConfig(kl_coef=KL_COEF)).loss(ModelOutputs(None, b.old_logprobs.clone()), b)
    assert token_mean.item() == pytest.approx((surrogate_sum + KL_COEF * k3_sum) / 8, rel=1e-6)
    assert abs(token_mean.item() - loss.item()) > 1e-3


def test_dr_grpo_gradient_has_no_length_normaliser():
    """d loss / d logp_{i,t} = -A_i / (B * max_tokens) on every token, whatever the response's length
    (the token mean gives -A_i / total tokens; GRPO's paper, -A_i / (B * |o_i|))."""
    b = batch()
    logprobs = b.old_logprobs.clone().requires_grad_()
    dr_grpo(kl_coef=0.0).loss(ModelOutputs(None, logprobs), b)[0].backward()
    assert torch.allclose(logprobs.grad, -A[:, None] * MASK / (3 * MAX_TOKENS))


def test_masked_sum_over_constant_counts_every_row():
    x = torch.tensor([[2.0, 9.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # an empty row still counts in B
    assert masked_sum_over_constant(x, mask, 4).item() == pytest.approx(2.0 / (2 * 4))


def test_both_normalisers_leave_zero_advantage_rows_out_unless_kl_counts():
    b = batch()
    b.advantages[1] = 0.0
    assert dr_grpo(kl_coef=0.0).gradient_rows(b).tolist() == [True, False, True]
    assert dr_grpo(kl_coef=0.1).gradient_rows(b).tolist() == [True, True, True]
    assert GRPO(GRPOConfig(kl_coef=0.0)).gradient_rows(b).tolist() == [True, False, True]


def test_constant_normaliser_needs_max_tokens_and_only_it_uses_them():
    with pytest.raises(pydantic.ValidationError, match="needs max_tokens"):
        GRPOConfig(loss_normalizer="constant")
    with pytest.raises(pydantic.ValidationError, match="used only by loss_normalizer 'constant'"):
        GRPOConfig(max_tokens=8)
    assert GRPOConfig().loss_normalizer == "token_mean"
