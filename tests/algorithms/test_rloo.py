"""The paper's RLOO (Ahmadian et al. 2024; ../shared/papers/ppo-grpo.md) against hand-computed values:
the KL in the sequence reward, the leave-one-out advantage, the REINFORCE loss and its gradient."""

import pytest
import torch

from algorithms.base import get_algorithm
from algorithms.rloo import RLOO, RLOOConfig, kl_penalised_sequence_rewards, reinforce_loss, sequence_kl
from rlsys.batch import TrainBatch
from rlsys.contract import ModelOutputs, SkipsRowsWithoutGradient, TrainsOnStaleRows
from rlsys.experience import make_experience

BETA = 0.5
# (group, prompt, response, rollout logprobs, reference logprobs, loss_mask, task reward), 2 prompts x 3 samples;
# a3's middle token is an environment token (loss_mask 0): it is in neither the KL nor the loss
ROWS = [
    ("a", [5, 6], [10, 11], [-0.5, -1.0], [-0.25, -1.5], [1, 1], 1.0),
    ("a", [5, 6], [12], [-2.0], [-1.5], [1], 0.0),
    ("a", [5, 6], [13, 14, 15], [-0.5, -4.0, -1.0], [-0.5, 0.0, -0.5], [1, 0, 1], 1.0),
    ("b", [7], [20, 21], [-1.0, -1.0], [-1.0, -0.5], [1, 1], 0.5),
    ("b", [7], [22, 23], [-0.25, -0.25], [-0.5, -0.5], [1, 1], 0.0),
    ("b", [7], [24], [-3.0], [-1.0], [1], 2.0),
]
# by hand: KL_i = sum over loss-mask tokens of (rollout - reference)
KL = [0.25, -0.5, -0.5, -0.5, 0.5, -2.0]
# R_i = r_i - BETA * KL_i
R = [0.875, 0.25, 1.25, 0.75, -0.25, 3.0]
# A_i = R_i - (sum of the other two R in the group) / 2
A = [0.875 - 0.75, 0.25 - 1.0625, 1.25 - 0.5625, 0.75 - 1.375, -0.25 - 1.875, 3.0 - 0.25]
# sum_t log pi over loss-mask tokens, the policy still the rollout's (first step)
SUM_LOGP = [-1.5, -2.0, -1.5, -2.0, -0.5, -3.0]
# loss = -1/6 * sum_i A_i * SUM_LOGP_i
LOSS = 0.921875


def table():
    return make_experience(
        [
            dict(
                uid=f"{g}{i}",
                group=g,
                prompt_ids=p,
                response_ids=r,
                logprobs=lp,
                ref_logprobs=ref,
                loss_mask=m,
                reward=reward,
                policy_version=0,
            )
            for i, (g, p, r, lp, ref, m, reward) in enumerate(ROWS)
        ]
    )


def test_hand_computed_values_are_consistent():
    assert A == pytest.approx([0.125, -0.8125, 0.6875, -0.625, -2.125, 2.75])
    assert sum(A[:3]) == pytest.approx(0.0) and sum(A[3:]) == pytest.approx(0.0)
    assert -sum(a * s for a, s in zip(A, SUM_LOGP)) / 6 == pytest.approx(LOSS)


def test_sequence_rewards_carry_the_kl_over_trainable_tokens():
    batch = RLOO(RLOOConfig(kl_coef=BETA)).prepare(table())
    mask = batch.response_mask
    assert sequence_kl(batch.old_logprobs, batch.ref_logprobs, mask).tolist() == KL
    rewards = kl_penalised_sequence_rewards(batch.rewards, batch.old_logprobs, batch.ref_logprobs, mask, BETA)
    assert rewards.tolist() == R
    # beta 0: the task rewards alone, and no reference logprobs are needed
    assert kl_penalised_sequence_rewards(batch.rewards, batch.old_logprobs, None, mask, 0.0) is batch.rewards
    with pytest.raises(ValueError, match="no reference logprobs"):
        kl_penalised_sequence_rewards(batch.rewards, batch.old_logprobs, None, mask, BETA)


def test_prepare_puts_the_leave_one_out_advantage_of_the_kl_penalised_reward_on_each_token():
    batch = RLOO(RLOOConfig(kl_coef=BETA)).prepare(table())
    mask = batch.response_mask
    assert mask.sum(1).tolist() == [2, 1, 2, 2, 2, 1]
    for i, a in enumerate(A):
        assert batch.advantages[i][mask[i] > 0].tolist() == [a] * int(mask[i].sum())
    assert bool((batch.advantages[mask == 0] == 0).all())


def test_reinforce_loss_equals_the_hand_computed_value():
    algo = RLOO(RLOOConfig(kl_coef=BETA))
    batch = algo.prepare(table())
    logprobs = batch.old_logprobs.clone()  # the first step: the policy is the one that sampled
    loss, metrics = algo.loss(ModelOutputs(logits=None, logprobs=logprobs), batch)
    assert loss.item() == pytest.approx(LOSS, abs=1e-6)
    assert metrics["loss/policy"] == pytest.approx(LOSS, abs=1e-6)
    assert metrics["kl_ref_sequence"] == pytest.approx(sum(KL) / 6)
    # the masked environment token's logprob (-4.0) changes nothing
    logprobs[2, batch.response_mask[2].nonzero()[0, 0] + 1] = -40.0
    assert algo.loss(ModelOutputs(None, logprobs), batch)[0].item() == pytest.approx(LOSS, abs=1e-6)


def test_gradient_is_minus_advantage_times_grad_of_the_sequence_logprob_over_b():
    batch = RLOO(RLOOConfig(kl_coef=BETA)).prepare(table())
    mask, B = batch.response_mask, len(batch)
    # with respect to the logprobs: -A_i / B on row i's trainable tokens, whatever the logprobs (no ratio)
    for shift in (0.0, 0.7):
        logprobs = (batch.old_logprobs + shift).requires_grad_()
        reinforce_loss(logprobs, batch.advantages, mask).backward()
        expected = -torch.tensor(A)[:, None] * mask / B
        assert torch.allclose(logprobs.grad, expected)
    # with respect to a policy's parameters: sum_i -A_i / B * grad sum_t log pi(y_i,t)
    torch.manual_seed(0)
    weights = torch.randn(*mask.shape, 30, requires_grad=True)  # a free logit per position: a tiny "policy"
    targets = batch.input_ids[:, 1:]

    def logprobs_of():
        return torch.log_softmax(weights, -1).gather(-1, targets[..., None]).squeeze(-1)

    (grad,) = torch.autograd.grad(reinforce_loss(logprobs_of(), batch.advantages, mask), weights)
    expected = torch.zeros_like(weights)
    for i, a in enumerate(A):
        (row_grad,) = torch.autograd.grad((logprobs_of()[i] * mask[i]).sum(), weights)
        expected += -a / B * row_grad
    assert torch.allclose(grad, expected, atol=1e-6)


def test_rloo_is_the_papers_and_the_clipped_variant_keeps_its_own_name():
    rloo, clipped = get_algorithm("rloo"), get_algorithm("rloo_clipped")
    assert rloo is RLOO and set(RLOOConfig.model_fields) == {"group_size", "kl_coef"}  # no clip_eps: no ratio
    # on-policy REINFORCE: no stale rows; rows whose A_i is 0 left out (the KL is in the reward, not a loss term)
    assert not issubclass(rloo, TrainsOnStaleRows) and issubclass(rloo, SkipsRowsWithoutGradient)
    rows = TrainBatch(torch.ones(3, 3, dtype=torch.long), torch.ones(3, 3), torch.ones(3, 2))
    rows.advantages = torch.tensor([[0.5, 0.5], [0.0, 0.0], [-0.5, -0.5]])
    assert rloo(RLOOConfig(kl_coef=0.1)).gradient_rows(rows).tolist() == [True, False, True]
    assert issubclass(clipped, TrainsOnStaleRows) and issubclass(clipped, SkipsRowsWithoutGradient)
    # the clipped variant: leave-one-out on the task reward alone, in GRPO's clipped surrogate and k3 loss
    from algorithms.common import clipped_policy_loss_with_kl, rloo_advantages
    from algorithms.grpo import sequence_advantage_batch

    algo = clipped(clipped.Config(kl_coef=0.1))
    rows = table()
    batch = algo.prepare(rows)
    expected_batch = sequence_advantage_batch(rows, rloo_advantages([r[-1] for r in ROWS], [r[0] for r in ROWS]))
    assert torch.equal(batch.advantages, expected_batch.advantages)
    logprobs = batch.old_logprobs + 0.1
    loss, _ = algo.loss(ModelOutputs(None, logprobs), batch)
    assert loss.item() == pytest.approx(clipped_policy_loss_with_kl(logprobs, batch, 0.2, 0.1)[0].item())
