"""The off-policy corrections (decoupled PPO, TIS, MIS) and the mismatch and staleness metrics
against hand-computed values."""

import math

import numpy as np
import pytest
import torch

from algorithms.common import behaviour_weights, corrected_ratio_inputs
from algorithms.grpo import GRPO, GRPOConfig
from algorithms.ppo import PPO, PPOConfig
from rlsys.batch import TrainBatch
from rlsys.config import ConfigError, validate_section
from rlsys.contract import ModelOutputs, UsesProximalLogprobs
from rlsys.logprobs import mismatch_metrics
from rlsys.run.loop import staleness_metrics

# 2 rows of 3 and 2 tokens (T = 3); the sampler's logprobs are -1 everywhere; the learner's
# before the update (proximal) are -1 + log rho with rho 0.5, 1, 3 / 4, 1; the current policy is
# r = 1.5, 1, 1 / 1, 0.5 times the proximal one. A = +1 on row 0, -1 on row 1.
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
RHO = torch.tensor([[0.5, 1.0, 3.0], [4.0, 1.0, 1.0]], dtype=torch.float64)
R = torch.tensor([[1.5, 1.0, 1.0], [1.0, 0.5, 1.0]], dtype=torch.float64)
A = torch.tensor([1.0, -1.0], dtype=torch.float64)


def batch() -> TrainBatch:
    return TrainBatch(
        input_ids=torch.zeros(2, 4, dtype=torch.long),
        attention_mask=torch.ones(2, 4),
        response_mask=MASK,
        old_logprobs=-MASK,
        proximal_logprobs=(-1.0 + torch.log(RHO)) * MASK,
        advantages=A[:, None] * MASK,
    )


def logprobs_of(b: TrainBatch) -> torch.Tensor:
    return (b.proximal_logprobs + torch.log(R) * MASK).clone().requires_grad_()


def test_weights_of_each_correction():
    b = batch()
    w = {c: behaviour_weights(b.proximal_logprobs, b.old_logprobs, c, cap=2.0) for c in ("decoupled", "tis", "mis")}
    assert torch.allclose(w["decoupled"] * MASK, RHO * MASK)
    assert torch.allclose(w["tis"] * MASK, torch.tensor([[0.5, 1.0, 2.0], [2.0, 1.0, 0.0]], dtype=torch.float64))
    assert torch.allclose(w["mis"] * MASK, torch.tensor([[0.5, 1.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown off-policy correction 'xyz'"):
        behaviour_weights(b.proximal_logprobs, b.old_logprobs, "xyz", cap=2.0)


def test_grpo_tis_loss_is_the_weighted_surrogate_of_the_ratio_to_the_proximal_policy():
    """Per token -w min(r A, clip(r, 0.8, 1.2) A), token mean over 5 tokens:
    row 0 (A = 1): w 0.5, 1, 2 and r 1.5 (clipped to 1.2), 1, 1 -> -(0.6 + 1 + 2) = -3.6
    row 1 (A = -1): w 2, 1 and r 1, 0.5 (min(-0.5, -0.8) = -0.8) -> -(-2 - 0.8) = 2.8."""
    b = batch()
    algo = GRPO(GRPOConfig(kl_coef=0.0, off_policy_correction="tis", is_cap=2.0))
    loss, metrics = algo.loss(ModelOutputs(None, logprobs_of(b)), b)
    assert loss.item() == pytest.approx((-3.6 + 2.8) / 5, rel=1e-12)
    assert metrics["is/weight_mean"] == pytest.approx((0.5 + 1 + 2 + 2 + 1) / 5)
    assert metrics["is/capped_frac"] == pytest.approx(2 / 5)  # the 3 and the 4


def test_without_a_correction_the_ratio_is_to_the_sampler_and_proximal_logprobs_are_unused():
    b = batch()
    logprobs = logprobs_of(b)
    plain = GRPO(GRPOConfig(kl_coef=0.0)).loss(ModelOutputs(None, logprobs), b)[0]
    # r to the sampler = rho * R: 0.75, 1, 3 / 4, 0.5 -> row 0 -(0.75 + 1 + 1.2), row 1 -(-4 - 0.8)
    assert plain.item() == pytest.approx((-2.95 + 4.8) / 5, rel=1e-12)
    assert not GRPO(GRPOConfig()).proximal_logprobs_needed()


def test_mis_masked_tokens_have_no_gradient_and_the_others_are_weighted():
    b = batch()
    logprobs = logprobs_of(b)
    GRPO(GRPOConfig(kl_coef=0.0, off_policy_correction="mis")).loss(ModelOutputs(None, logprobs), b)[0].backward()
    g = logprobs.grad
    assert g[0, 2].item() == 0.0 and g[1, 0].item() == 0.0  # rho 3 and 4 > C = 2: masked
    assert g[0, 0].item() == 0.0  # r 1.5 past the clip with A > 0: PPO's clip, as before
    assert g[0, 1].item() == pytest.approx(-1.0 / 5)  # w 1, r 1, A 1
    assert g[1, 1].item() == 0.0  # r 0.5 past the clip with A < 0


def test_decoupled_ppo_weights_the_surrogate_by_rho():
    b = batch()
    b.old_values = torch.zeros_like(MASK)
    b.returns = torch.zeros_like(MASK)
    b.ref_logprobs = b.old_logprobs.clone()
    outputs = ModelOutputs(None, logprobs_of(b), torch.zeros_like(MASK))
    loss, metrics = PPO(PPOConfig(off_policy_correction="decoupled")).loss(outputs, b)
    # row 0: -(0.5 * 1.2 + 1 + 3), row 1: -(4 * -1 + 1 * -0.8); value loss 0
    assert loss.item() == pytest.approx((-4.6 + 4.8) / 5, rel=1e-12)
    assert metrics["is/weight_mean"] == pytest.approx((0.5 + 1 + 3 + 4 + 1) / 5)


def test_a_correction_without_proximal_logprobs_is_named():
    b = batch()
    b.proximal_logprobs = None
    with pytest.raises(ValueError, match="needs the learner's proximal logprobs"):
        corrected_ratio_inputs(b, "tis", 2.0)


def test_capability_and_config():
    for algo in (GRPO(GRPOConfig(off_policy_correction="tis")), PPO(PPOConfig(off_policy_correction="mis"))):
        assert isinstance(algo, UsesProximalLogprobs) and algo.proximal_logprobs_needed()
    with pytest.raises(ConfigError, match="off_policy_correction"):
        validate_section(GRPOConfig, {"off_policy_correction": "is"}, prefix="algorithm")
    with pytest.raises(ConfigError, match="is_cap"):
        validate_section(GRPOConfig, {"is_cap": 0}, prefix="algorithm")


def test_mismatch_metrics():
    """|log pi_learner - log pi_sampler| = |log rho|: log 2, 0, log 3 / log 4, 0; KL(sampler ||
    learner) by k3 = rho - 1 - log rho per token."""
    b = batch()
    m = mismatch_metrics(b.proximal_logprobs, b.old_logprobs, MASK)
    assert m["mismatch/logprob_abs"] == pytest.approx((math.log(2) + math.log(3) + math.log(4)) / 5)
    k3 = sum(r - 1 - math.log(r) for r in (0.5, 1.0, 3.0, 4.0, 1.0))
    assert m["mismatch/kl"] == pytest.approx(k3 / 5)
    same = mismatch_metrics(b.old_logprobs, b.old_logprobs, MASK)
    assert same == {"mismatch/logprob_abs": 0.0, "mismatch/kl": 0.0}


def test_staleness_metrics_are_per_token():
    staleness = np.repeat(np.array([0, 2, 1]), [3, 1, 4])  # three rows' tokens
    assert staleness_metrics(staleness) == {"staleness/mean": pytest.approx(6 / 8), "staleness/max": 2.0}
    assert staleness_metrics(np.array([], dtype=int)) == {"staleness/mean": 0.0, "staleness/max": 0.0}
