"""Properties from ../shared/papers/ppo-grpo.md, against hand-computed values."""

import numpy as np
import pytest
import torch

from algorithms.common import (
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    grpo_advantages,
    k3_kl,
    kl_penalised_rewards,
    masked_mean,
    masked_whiten,
    rloo_advantages,
    rows_with_gradient,
)


def test_gae_hand_computed_three_steps():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3)
    gamma, lam = 0.9, 0.8
    d2 = 1.0 - 0.7
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2, a1 = d2, d1 + 0.72 * d2
    a0 = d0 + 0.72 * a1
    adv, ret = gae(r, v, m, gamma, lam)
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2]]), atol=1e-6)
    assert torch.allclose(ret, adv + v, atol=1e-6)


def test_gae_lambda_one_gamma_one_gives_return_to_go():
    torch.manual_seed(0)
    r, v = torch.randn(4, 6), torch.randn(4, 6)
    m = torch.ones(4, 6)
    adv, ret = gae(r, v, m, 1.0, 1.0)
    return_to_go = torch.flip(torch.cumsum(torch.flip(r, [1]), 1), [1])
    assert torch.allclose(adv + v, return_to_go, atol=1e-5)
    assert torch.allclose(ret, return_to_go, atol=1e-5)


def test_gae_skips_masked_environment_tokens():
    """An env token in the middle is stepped over: the result equals GAE on the policy tokens alone."""
    r = torch.tensor([[0.1, 9.0, 0.2, 1.0]])
    v = torch.tensor([[0.3, 9.0, 0.4, 0.5]])
    m = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    adv, _ = gae(r, v, m, 1.0, 0.95)
    ref, _ = gae(r[:, [0, 2, 3]], v[:, [0, 2, 3]], torch.ones(1, 3), 1.0, 0.95)
    assert adv[0, 1] == 0
    assert torch.allclose(adv[:, [0, 2, 3]], ref)


def test_grpo_advantages_sum_to_zero_per_group_and_match_formula():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.2, 0.9])
    groups = ["a"] * 4 + ["b"] * 4
    adv = grpo_advantages(rewards, groups)
    for g in ("a", "b"):
        sel = np.array(groups) == g
        assert abs(adv[sel].sum()) < 1e-9
    a = rewards[:4]
    assert np.allclose(adv[:4], (a - a.mean()) / (a.std() + 1e-6))
    assert np.allclose(grpo_advantages(rewards, groups, std_normalize=False)[:4], a - a.mean())


def test_grpo_constant_group_has_zero_advantage():
    assert np.allclose(grpo_advantages(np.ones(4), ["g"] * 4), 0.0)


def test_rows_with_gradient_are_those_with_a_non_zero_advantage_unless_kl_counts():
    from rlsys.batch import TrainBatch

    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 1, 1]], dtype=torch.float32)
    adv = torch.tensor([[0.0, 0.5, 0.5], [3.0, 0.0, 3.0], [0.0, 0.0, 0.0]])  # row 1: non-zero only off the mask
    batch = TrainBatch(torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 4), mask, advantages=adv)
    assert rows_with_gradient(batch, kl_coef=0.0).tolist() == [True, False, False]
    assert rows_with_gradient(batch, kl_coef=0.01).tolist() == [True, True, True]
    # the algorithms whose loss is this surrogate leave such rows out; CDG's supervised rounds never do
    from algorithms.base import get_algorithm

    def built(name, kl):
        cls = get_algorithm(name)
        return cls(cls.Config(kl_coef=kl))

    for name in ("grpo", "rloo_clipped", "vineppo", "cdg", "gspo"):
        assert built(name, 0.0).gradient_rows(batch).tolist() == [True, False, False], name
        assert built(name, 0.01).gradient_rows(batch).all(), name
    batch.extras["sft"] = torch.ones(3)
    assert built("cdg", 0.0).gradient_rows(batch).all()
    # a zero-advantage row's surrogate has no gradient, clipped or not
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    clipped_policy_loss(logp, torch.tensor([[0.0, -3.0, -0.1]]), torch.zeros(1, 3), torch.ones(1, 3))[0].backward()
    assert torch.equal(logp.grad, torch.zeros(1, 3))


def test_rloo_leave_one_out():
    rewards = np.array([1.0, 0.0, 0.5, 3.0, 4.0])
    adv = rloo_advantages(rewards, ["a", "a", "a", "b", "b"])
    assert np.allclose(adv, [1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5, -1.0, 1.0])
    assert rloo_advantages(np.array([2.0]), ["x"])[0] == 0.0


def test_clipped_loss_zero_gradient_outside_trust_region():
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    # ratio 1.5 with A>0, ratio 0.5 with A<0: both clipped, no gradient pushes further
    logp = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_()
    loss, clip_frac, _ = clipped_policy_loss(logp, old, adv, torch.ones(1, 2), 0.2)
    loss.backward()
    assert torch.all(logp.grad == 0)
    assert clip_frac.item() == 1.0
    # inside the region the gradient is -A * ratio / n
    logp2 = torch.zeros(1, 2, requires_grad=True)
    loss2, _, _ = clipped_policy_loss(logp2, old, adv, torch.ones(1, 2), 0.2)
    loss2.backward()
    assert torch.allclose(logp2.grad, torch.tensor([[-0.5, 0.5]]))


def test_clipped_loss_matches_plain_reference():
    torch.manual_seed(1)
    logp, old, adv = torch.randn(3, 5) * 0.3, torch.randn(3, 5) * 0.3, torch.randn(3, 5)
    mask = (torch.rand(3, 5) > 0.3).float()
    loss, _, _ = clipped_policy_loss(logp, old, adv, mask, 0.2)
    expected, n = 0.0, 0
    for i in range(3):
        for j in range(5):
            if mask[i, j]:
                ratio = float(np.exp(float(logp[i, j] - old[i, j])))
                a = float(adv[i, j])
                expected += -min(ratio * a, min(max(ratio, 0.8), 1.2) * a)
                n += 1
    assert loss.item() == pytest.approx(expected / n, rel=1e-5)


def test_masked_tokens_contribute_nothing():
    torch.manual_seed(2)
    logp = torch.randn(2, 4, requires_grad=True)
    old, adv = torch.zeros(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    loss, _, _ = clipped_policy_loss(logp, old, adv, mask, 0.2)
    loss.backward()
    assert torch.all(logp.grad[mask == 0] == 0)
    # changing masked values changes nothing
    adv2 = adv.clone()
    adv2[mask == 0] = 1e6
    loss2, _, _ = clipped_policy_loss(logp.detach(), old, adv2, mask, 0.2)
    assert loss2.item() == pytest.approx(loss.item())
    assert masked_whiten(adv, mask)[mask == 0].abs().sum() == 0


def test_value_loss_clipped_and_k3_nonnegative():
    v, old, ret = torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]])
    # unclipped error 0, clipped prediction 0.2 has error 0.8 -> max picks the clipped one
    assert clipped_value_loss(v, old, ret, torch.ones(1, 1), 0.2).item() == pytest.approx(0.5 * 0.64)
    x, y = torch.randn(100), torch.randn(100)
    assert torch.all(k3_kl(x, y) >= 0) and torch.allclose(k3_kl(x, x), torch.zeros(100))


def test_kl_penalised_rewards_put_task_reward_on_last_token():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    lp, ref = torch.zeros(2, 3), torch.zeros(2, 3)
    tr = kl_penalised_rewards(torch.tensor([2.0, 3.0]), lp, ref, mask, 0.1)
    assert torch.equal(tr, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 3.0]]))
    tr2 = kl_penalised_rewards(torch.zeros(2), lp + 1.0, ref, mask, 0.1)
    assert torch.allclose(tr2, -0.1 * mask)
    assert masked_mean(torch.ones(2, 3), mask).item() == 1.0


def test_shaping_rewards_per_token_land_on_their_tokens_in_ppos_returns():
    """task.shaping's per-token rewards (a repetition penalty on the repeated tokens) reach GAE
    where they are, not folded into the last token: with gamma = lambda = 1 and zero values a
    token's return is the sum of the rewards from it on, so a penalty on token 1 lowers the
    returns of tokens 0-1 only; folded, every token's return is the whole sum."""
    from algorithms.ppo import PPOConfig, ppo_prepare
    from rlsys.batch import collate
    from rlsys.experience import make_experience

    row = dict(uid="a", group="g", prompt_ids=[1, 2], response_ids=[5, 6, 7, 8], logprobs=[-1.0] * 4, reward=0.5)
    row |= dict(policy_version=0, meta={}, ref_logprobs=[-1.0] * 4, values=[0.0] * 4)
    per_token = [0.0, -0.25, 0.0, 0.75]  # sums to the reward: the penalty on token 1, the rest on the last
    c = PPOConfig(kl_coef=0.0, gamma=1.0, lam=1.0, whiten_advantages=False)
    spread = ppo_prepare(collate(make_experience([row | {"token_rewards": per_token}])), c)
    folded = ppo_prepare(collate(make_experience([row])), c)
    mask = spread.response_mask[0].bool()
    assert spread.returns[0][mask].tolist() == pytest.approx([0.5, 0.5, 0.75, 0.75])
    assert folded.returns[0][mask].tolist() == pytest.approx([0.5, 0.5, 0.5, 0.5])
    assert spread.token_rewards[0][mask].tolist() == pytest.approx(per_token)
