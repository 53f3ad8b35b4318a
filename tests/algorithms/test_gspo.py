"""GSPO (Zheng et al. 2025) against hand-computed values: the sequence ratio is the geometric mean of
the token ratios, the clip applies per response, the loss is a mean over responses."""

import math

import pytest
import torch

from algorithms.base import get_algorithm
from algorithms.gspo import GSPO, GSPOConfig, gspo_policy_loss, sequence_ratio
from rlsys.batch import TrainBatch
from rlsys.contract import ModelOutputs, SkipsRowsWithoutGradient, TrainsOnStaleRows
from rlsys.experience import make_experience

# 2 groups x 2 responses of 2, 3, 1 and 2 tokens (T = 3); float64 so that ratios 1e-4 from 1 stay exact
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float64)
# log pi_theta - log pi_old per token (0 on padding)
LOG_RATIO = torch.tensor(
    [
        [math.log(2.0), math.log(0.5), 0.0],  # token ratios 2 and 0.5: s = sqrt(2 * 0.5) = 1, inside the range
        [3e-3, 0.0, 0.0],  # s = exp(1e-3) = 1.0010005 > 1 + 4e-4: clipped
        [math.log(0.9999), 0.0, 0.0],  # s = 0.9999, inside [0.9997, 1.0004]
        [-2e-3, 0.0, 0.0],  # s = exp(-1e-3) = 0.9990005 < 1 - 3e-4: clipped
    ],
    dtype=torch.float64,
)
A = torch.tensor([-1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
S = [1.0, math.exp(1e-3), 0.9999, math.exp(-1e-3)]
# -min(s A, clip(s) A) per response:
#   0: s = 1, A = -1: 1;  1: A = 1, min(1.0010005, 1.0004) = 1.0004 (clipped): -1.0004
#   2: A = 1: -0.9999;     3: A = -1, min(-0.9990005, -0.9997) = -0.9997 (clipped): 0.9997
TERMS = [1.0, -1.0004, -0.9999, 0.9997]
LOSS = sum(TERMS) / 4  # -0.00015


def batch(ref_logprobs=None) -> TrainBatch:
    old = torch.full((4, 3), -1.0, dtype=torch.float64) * MASK
    return TrainBatch(
        input_ids=torch.zeros(4, 4, dtype=torch.long),
        attention_mask=torch.ones(4, 4),
        response_mask=MASK,
        old_logprobs=old,
        ref_logprobs=ref_logprobs,
        advantages=A[:, None] * MASK,
    )


def logprobs_of(b: TrainBatch) -> torch.Tensor:
    return (b.old_logprobs + LOG_RATIO * MASK).clone().requires_grad_()


def test_the_sequence_ratio_is_the_geometric_mean_of_the_token_ratios():
    b = batch()
    s = sequence_ratio(logprobs_of(b), b.old_logprobs, MASK)
    assert s.tolist() == pytest.approx(S, abs=1e-12)
    assert s[0].item() == pytest.approx(1.0, abs=1e-12)  # token ratios 2 and 0.5


def test_loss_is_the_mean_over_responses_of_the_per_response_clipped_term():
    assert LOSS == pytest.approx(-0.00015, abs=1e-12)
    b = batch()
    loss, clip_frac = gspo_policy_loss(logprobs_of(b), b.old_logprobs, A, MASK, 3e-4, 4e-4)
    assert loss.item() == pytest.approx(LOSS, abs=1e-12)
    assert clip_frac.item() == pytest.approx(0.5)  # responses 1 and 3
    # through the plug-in, the advantages read back from the tokens, the defaults the paper's
    loss, metrics = GSPO().loss(ModelOutputs(None, logprobs_of(b)), b)
    assert loss.item() == pytest.approx(LOSS, abs=1e-12)
    assert metrics == {"loss/policy": pytest.approx(LOSS, abs=1e-12), "clip_frac": pytest.approx(0.5)}


def test_gradient_flows_through_the_sequence_ratio_and_the_clip_is_per_response():
    """d loss / d log pi_theta(y_i,t) = -A_i * s_i / (|y_i| * B) where response i is not clipped, 0
    where it is. Response 0's token ratios (2 and 0.5) are far outside the range, yet its tokens keep
    a gradient: the clip looks at the sequence, not the token."""
    b = batch()
    logprobs = logprobs_of(b)
    GSPO().loss(ModelOutputs(None, logprobs), b)[0].backward()
    expected = torch.zeros(4, 3, dtype=torch.float64)
    expected[0, :2] = 1.0 * 1.0 / (2 * 4)  # -A_0 = 1, s_0 = 1, |y_0| = 2
    expected[2, 0] = -1.0 * 0.9999 / (1 * 4)  # -A_2 = -1, s_2 = 0.9999, |y_2| = 1
    assert torch.allclose(logprobs.grad, expected, atol=1e-12)


def test_k3_kl_is_each_responses_token_mean_averaged_over_responses():
    """The reference log 2 above the policy on response 2's one token (k3 = 1 - log 2), equal
    elsewhere (k3 = 0): 1/B * sum_i mean_t k3 = (1 - log 2) / 4 (a token mean would give / 8)."""
    ref = batch().old_logprobs + LOG_RATIO * MASK
    ref[2, 0] += math.log(2.0)
    b = batch(ref_logprobs=ref)
    loss, metrics = GSPO(GSPOConfig(kl_coef=0.5)).loss(ModelOutputs(None, logprobs_of(b)), b)
    kl = (1 - math.log(2.0)) / 4
    assert metrics["kl_ref"] == pytest.approx(kl, abs=1e-12)
    assert loss.item() == pytest.approx(LOSS + 0.5 * kl, abs=1e-12)


def test_prepare_gives_grpo_advantages_on_every_token():
    rows = [
        ("a", [10, 11], 1.0),
        ("a", [12, 13, 14], 0.0),
        ("b", [15], 0.0),
        ("b", [16, 17], 1.0),
    ]
    table = make_experience(
        [
            dict(
                uid=f"u{i}",
                group=g,
                prompt_ids=[5],
                response_ids=r,
                logprobs=[-1.0] * len(r),
                reward=x,
                policy_version=0,
            )
            for i, (g, r, x) in enumerate(rows)
        ]
    )
    b = GSPO().prepare(table)
    a = 0.5 / (0.5 + 1e-6)  # (r - mean) / (std + 1e-6) in a group of two with rewards 0 and 1
    per_row = (b.advantages * b.response_mask).sum(1) / b.response_mask.sum(1)
    assert per_row.tolist() == pytest.approx([a, -a, -a, a], rel=1e-6)
    assert b.response_mask.sum(1).tolist() == [2, 3, 1, 2]


def test_registered_with_the_capabilities_it_has():
    assert get_algorithm("gspo") is GSPO
    algo = GSPO()
    assert isinstance(algo, TrainsOnStaleRows)
    assert isinstance(algo, SkipsRowsWithoutGradient)  # rescaled by its share of the responses
    assert (algo.config.clip_eps_low, algo.config.clip_eps_high, algo.config.kl_coef) == (3e-4, 4e-4, 0.0)
