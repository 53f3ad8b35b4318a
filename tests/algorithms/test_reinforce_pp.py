"""REINFORCE++ (Hu et al. 2025, arXiv 2501.03262) against hand-computed values: the k1 KL in the per-token
reward, the discounted return, the normalisation over the whole batch's tokens, the baseline variant's
group-centred reward with the KL moved to the loss (k2), the clipped surrogate and its gradient."""

import math
from pathlib import Path

import pytest
import torch

import algorithms.reinforce_pp as reinforce_pp_module
from algorithms.base import BUILTIN_MODULES, build_algorithm, get_algorithm
from algorithms.common import gae
from algorithms.reinforce_pp import (
    ReinforcePP,
    ReinforcePPConfig,
    discounted_returns,
    k2_kl,
    kl_estimate,
    reinforce_pp_advantages,
    token_rewards,
)
from rlsys.batch import TrainBatch
from rlsys.config import ConfigError, load_config
from rlsys.contract import ModelOutputs, ReportsPrepareMetrics, SkipsRowsWithoutGradient, TrainsOnStaleRows
from rlsys.experience import make_experience

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
EPS = 1e-8  # masked_whiten's: std = sqrt(var + 1e-8)
BETA = 0.5

# ---- a step's rows: 2 prompts x 2 responses, 8 response tokens -------------------------------
# (group, response, rollout logprobs, reference logprobs, task reward)
ROWS = [
    ("a", [10, 11], [-1.0, -0.5], [-1.5, -0.5], 1.0),
    ("a", [12], [-2.0], [-1.0], 0.0),
    ("b", [13, 14, 15], [-0.5, -1.0, -1.0], [-0.5, -2.0, -0.5], 2.0),
    ("b", [16, 17], [-1.0, -1.0], [-1.0, -1.0], 0.0),
]
# k1 = rollout - reference per token: a0 [0.5, 0], a1 [-1], b0 [0, 1, -0.5], b1 [0, 0]
# r_t = -BETA * k1 + R on the last token
R_TOKENS = [[-0.25, 1.0], [0.5], [0.0, -0.5, 2.25], [0.0, 0.0]]
# gamma 1: G_t = sum of r over t and later
G1 = [[0.75, 1.0], [0.5], [1.75, 1.75, 2.25], [0.0, 0.0]]
# gamma 0.5: b0: 2.25; -0.5 + 0.5 * 2.25 = 0.625; 0 + 0.5 * 0.625 = 0.3125
G_HALF = [[-0.25 + 0.5 * 1.0, 1.0], [0.5], [0.3125, 0.625, 2.25], [0.0, 0.0]]
# the global normalisation of G1: mean over the 8 tokens 8 / 8 = 1, squared deviations sum to 5, var 0.625
A_PLAIN = [[(g - 1.0) / math.sqrt(0.625 + EPS) for g in row] for row in G1]

# baseline: R - group mean: a [1, 0] -> [0.5, -0.5], b [2, 0] -> [1, -1], the same on every token (KL in the loss)
G_BASE = [[0.5, 0.5], [-0.5], [1.0, 1.0, 1.0], [-1.0, -1.0]]
# token mean 1.5 / 8 = 0.1875 (not 0: the centred rewards weigh by length), squared deviations 5.46875
A_BASELINE = [[(g - 0.1875) / math.sqrt(5.46875 / 8 + EPS) for g in row] for row in G_BASE]
# baseline with kl_in reward: centred reward on the last token, -BETA * k1 on every token
G_BASE_KL_REWARD = [[0.25, 0.5], [0.0], [0.75, 0.75, 1.25], [-1.0, -1.0]]


def table(rows=ROWS):
    return make_experience(
        [
            dict(
                uid=f"{g}{i}",
                group=g,
                prompt_ids=[5, 6],
                response_ids=r,
                logprobs=lp,
                ref_logprobs=ref,
                reward=x,
                policy_version=0,
            )
            for i, (g, r, lp, ref, x) in enumerate(rows)
        ]
    )


def per_row(batch_tensor: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [batch_tensor[i][mask[i] > 0].tolist() for i in range(mask.shape[0])]


def padded(rows: list[list[float]], T: int = 3) -> torch.Tensor:
    return torch.tensor([r + [0.0] * (T - len(r)) for r in rows], dtype=torch.float64)


def test_hand_computed_values_are_consistent():
    flat = [g for row in G1 for g in row]
    assert sum(flat) / 8 == pytest.approx(1.0) and sum((g - 1) ** 2 for g in flat) == pytest.approx(5.0)
    flat = [g for row in G_BASE for g in row]
    assert sum(flat) / 8 == pytest.approx(0.1875)
    assert sum((g - 0.1875) ** 2 for g in flat) == pytest.approx(5.46875)


# ---- the per-token reward and its return ---------------------------------------------------------
def test_token_rewards_are_minus_beta_k1_plus_the_reward_on_the_last_token():
    lp, ref = padded([r[2] for r in ROWS]), padded([r[3] for r in ROWS])
    mask = padded([[1.0] * len(r[1]) for r in ROWS])
    rewards = torch.tensor([r[4] for r in ROWS], dtype=torch.float64)
    assert torch.allclose(token_rewards(rewards, lp, ref, mask, BETA), padded(R_TOKENS))
    # beta 0: the reward alone on the last token, and no reference logprobs are needed
    expected = padded([[0.0, 1.0], [0.0], [0.0, 0.0, 2.0], [0.0, 0.0]])
    assert torch.equal(token_rewards(rewards, lp, None, mask, 0.0), expected)
    with pytest.raises(ValueError, match="no reference logprobs"):
        token_rewards(rewards, lp, None, mask, BETA)


def test_discounted_returns_with_gamma_one_and_below_one():
    mask = padded([[1.0] * len(r[1]) for r in ROWS])
    r = padded(R_TOKENS)
    assert torch.allclose(discounted_returns(r, mask, 1.0), padded(G1))
    assert torch.allclose(discounted_returns(r, mask, 0.5), padded(G_HALF))


def test_discounted_returns_step_over_environment_tokens_and_ignore_masked_rewards():
    """Row 1's token 1 is an environment token (mask 0): its reward (100) is not counted, it is not
    discounted over, and its return is 0. The same as GAE with V = 0 and lambda = 1."""
    rewards = torch.tensor([[1.0, 2.0, 4.0, 7.0], [0.0, 100.0, 3.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.float64)
    # gamma 0.5: row 0: 4; 2 + 2 = 4; 1 + 2 = 3. row 1: 5; 3 + 2.5 = 5.5; (skip); 0 + 2.75
    expected = torch.tensor([[3.0, 4.0, 4.0, 0.0], [2.75, 0.0, 5.5, 5.0]], dtype=torch.float64)
    assert torch.allclose(discounted_returns(rewards, mask, 0.5), expected)
    assert torch.allclose(
        discounted_returns(rewards, mask, 1.0),
        torch.tensor([[7.0, 6.0, 4.0, 0.0], [8.0, 0.0, 8.0, 5.0]], dtype=torch.float64),
    )
    via_gae, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma=0.5, lam=1.0)
    assert torch.allclose(discounted_returns(rewards, mask, 0.5), via_gae)


# ---- prepare: the advantages, normalised over the whole batch -------------------------------------
def test_plain_advantages_are_the_return_normalised_over_every_token_of_the_batch():
    algo = ReinforcePP(ReinforcePPConfig(kl_coef=BETA))
    assert (algo.config.kl_in, algo.config.kl_estimator) == ("reward", "k1")  # the KL in the reward
    batch = algo.prepare(table())
    mask = batch.response_mask
    got = per_row(batch.advantages, mask)
    for row, expected in zip(got, A_PLAIN):
        assert row == pytest.approx(expected, rel=1e-6)
    assert bool((batch.advantages[mask == 0] == 0).all())
    # global, not per prompt: the token mean is 0 and the token variance 1 over the whole batch only
    flat = torch.tensor([a for row in got for a in row], dtype=torch.float64)
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert (flat**2).mean().item() == pytest.approx(1.0, rel=1e-6)
    group_a = torch.tensor(got[0] + got[1])
    # group a's tokens average (0.75 + 1 + 0.5) / 3 - 1 = -0.25 before the division: not centred per prompt
    assert group_a.mean().item() == pytest.approx(-0.25 / math.sqrt(0.625 + EPS), rel=1e-6)


def test_plain_advantages_with_gamma_below_one():
    b = ReinforcePP(ReinforcePPConfig(kl_coef=BETA, gamma=0.5)).prepare(table())
    flat = [g for row in G_HALF for g in row]
    mean = sum(flat) / 8
    std = math.sqrt(sum((g - mean) ** 2 for g in flat) / 8 + EPS)
    for row, expected in zip(per_row(b.advantages, b.response_mask), G_HALF):
        assert row == pytest.approx([(g - mean) / std for g in expected], rel=1e-6)


def test_baseline_advantages_centre_each_group_then_normalise_over_the_batch_with_no_kl_in_the_reward():
    algo = ReinforcePP(ReinforcePPConfig(baseline=True, group_size=2, kl_coef=BETA))
    assert (algo.config.kl_in, algo.config.kl_estimator) == ("loss", "k2")  # the paper's placement
    b = algo.prepare(table())
    for row, expected in zip(per_row(b.advantages, b.response_mask), A_BASELINE):
        assert row == pytest.approx(expected, rel=1e-6)
    # the KL put in the reward instead when asked
    algo = ReinforcePP(ReinforcePPConfig(baseline=True, group_size=2, kl_coef=BETA, kl_in="reward"))
    b = algo.prepare(table())
    flat = [g for row in G_BASE_KL_REWARD for g in row]
    mean = sum(flat) / 8
    std = math.sqrt(sum((g - mean) ** 2 for g in flat) / 8 + EPS)
    for row, expected in zip(per_row(b.advantages, b.response_mask), G_BASE_KL_REWARD):
        assert row == pytest.approx([(g - mean) / std for g in expected], rel=1e-6)


def test_a_flat_group_still_gets_a_non_zero_advantage_after_the_global_shift():
    """Group a: rewards 1 and 0, responses of 1 and 2 tokens (centred 0.5, -0.5, -0.5); group c: rewards
    1 and 1 (centred 0, 0). Token mean -0.1: group c's tokens get 0.1 / std, not 0; so no row can be
    left out of the forward as gradient-free (the algorithm does not declare SkipsRowsWithoutGradient)."""
    rows = [
        ("a", [10], [-1.0], [-1.0], 1.0),
        ("a", [11, 12], [-1.0, -1.0], [-1.0, -1.0], 0.0),
        ("c", [13], [-1.0], [-1.0], 1.0),
        ("c", [14], [-1.0], [-1.0], 1.0),
    ]
    b = ReinforcePP(ReinforcePPConfig(baseline=True, group_size=2, kl_coef=0.0)).prepare(table(rows))
    values = [0.5, -0.5, -0.5, 0.0, 0.0]
    std = math.sqrt(sum((v + 0.1) ** 2 for v in values) / 5 + EPS)
    got = per_row(b.advantages, b.response_mask)
    assert got[2] == pytest.approx([0.1 / std], rel=1e-6) and got[3] == pytest.approx([0.1 / std], rel=1e-6)
    assert got[0] == pytest.approx([0.6 / std], rel=1e-6)
    assert not isinstance(ReinforcePP(), SkipsRowsWithoutGradient)


def test_advantages_function_is_what_prepare_puts_on_the_tokens():
    rows = table()
    algo = ReinforcePP(ReinforcePPConfig(kl_coef=BETA))
    b = algo.prepare(rows)
    direct = reinforce_pp_advantages(
        [r[4] for r in ROWS], [r[0] for r in ROWS], b.old_logprobs, b.ref_logprobs, b.response_mask, algo.config
    )
    assert direct.dtype == torch.float64 and b.advantages.dtype == torch.float32
    assert torch.allclose(direct.float(), b.advantages)


# ---- the loss: PPO's clipped surrogate, a token mean, and the KL where the variant puts it ----------
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float64)
RATIO = torch.tensor([[1.5, 1.0, 1.0], [0.5, 1.1, 1.0], [1.0, 1.0, 1.0], [0.9, 1.25, 1.0]], dtype=torch.float64)
ADV = torch.tensor([[1.0, -2.0, 0.0], [-1.0, 0.5, 2.0], [3.0, 0.0, 0.0], [-0.5, 1.0, 0.0]], dtype=torch.float64)
# -min(r A, clip(r, 0.8, 1.2) A) per token:
#   (0,0) 1.5, A 1: clipped, -1.2   (0,1) 2            (1,0) 0.5, A -1: clipped, 0.8   (1,1) -0.55
#   (1,2) -2                        (2,0) -3           (3,0) 0.45                       (3,1) 1.25, A 1: clipped, -1.2
SURROGATE = -4.7 / 8
# d loss / d log pi = -r A / 8 where not clipped, 0 where clipped
GRAD = torch.tensor([[0.0, 2.0, 0.0], [0.0, -0.55, -2.0], [-3.0, 0.0, 0.0], [0.45, 0.0, 0.0]], dtype=torch.float64) / 8
# log pi - log pi_ref per token (the policy's, not the rollout's)
D = torch.tensor([[0.5, -1.0, 0.0], [1.0, 0.0, 0.2], [2.0, 0.0, 0.0], [-0.5, 0.5, 0.0]], dtype=torch.float64)
K2_MEAN = (0.125 + 0.5 + 0.5 + 0.0 + 0.02 + 2.0 + 0.125 + 0.125) / 8  # 0.5 D^2
K1_MEAN = (0.5 - 1.0 + 1.0 + 0.0 + 0.2 + 2.0 - 0.5 + 0.5) / 8


def loss_batch(with_ref: bool = True) -> TrainBatch:
    old = -MASK
    return TrainBatch(
        input_ids=torch.zeros(4, 4, dtype=torch.long),
        attention_mask=torch.ones(4, 4),
        response_mask=MASK,
        old_logprobs=old,
        ref_logprobs=(old + torch.log(RATIO) - D) * MASK if with_ref else None,
        advantages=ADV * MASK,
    )


def logprobs_of(b: TrainBatch) -> torch.Tensor:
    return (b.old_logprobs + torch.log(RATIO) * MASK).clone().requires_grad_()


def test_loss_is_the_clipped_surrogate_token_mean_and_its_gradient():
    assert SURROGATE == pytest.approx(-0.5875)
    b = loss_batch(with_ref=False)
    logprobs = logprobs_of(b)
    loss, metrics = ReinforcePP(ReinforcePPConfig(kl_coef=0.0)).loss(ModelOutputs(None, logprobs), b)
    assert loss.item() == pytest.approx(SURROGATE, rel=1e-12)
    assert metrics["loss/policy"] == pytest.approx(SURROGATE, rel=1e-12)
    assert metrics["clip_frac"] == pytest.approx(3 / 8)  # 1.5, 0.5 and 1.25
    assert "kl_ref" not in metrics
    loss.backward()
    assert torch.allclose(logprobs.grad, GRAD, atol=1e-12)


def test_kl_in_the_reward_adds_nothing_to_the_loss():
    """REINFORCE++'s default: the KL is in the advantages already; the loss is the surrogate alone
    and `kl_ref` reports the token mean of k1 for the current policy."""
    b = loss_batch()
    logprobs = logprobs_of(b)
    loss, metrics = ReinforcePP(ReinforcePPConfig(kl_coef=0.1)).loss(ModelOutputs(None, logprobs), b)
    assert loss.item() == pytest.approx(SURROGATE, rel=1e-12)
    assert metrics["kl_ref"] == pytest.approx(K1_MEAN, rel=1e-12)
    loss.backward()
    assert torch.allclose(logprobs.grad, GRAD, atol=1e-12)


def test_baseline_puts_beta_times_the_k2_token_mean_in_the_loss():
    """d/d log pi of 0.1 * mean(0.5 D^2) is 0.1 * D / 8 on each token, beside the surrogate's."""
    b = loss_batch()
    logprobs = logprobs_of(b)
    config = ReinforcePPConfig(baseline=True, group_size=2, kl_coef=0.1)
    loss, metrics = ReinforcePP(config).loss(ModelOutputs(None, logprobs), b)
    assert loss.item() == pytest.approx(SURROGATE + 0.1 * K2_MEAN, rel=1e-12)
    assert metrics["kl_ref"] == pytest.approx(K2_MEAN, rel=1e-12)
    assert metrics["loss/policy"] == pytest.approx(SURROGATE, rel=1e-12)
    loss.backward()
    assert torch.allclose(logprobs.grad, GRAD + 0.1 * D * MASK / 8, atol=1e-12)


def test_k3_in_the_loss_when_asked():
    b = loss_batch()
    logprobs = logprobs_of(b)
    config = ReinforcePPConfig(baseline=True, group_size=2, kl_coef=0.1, kl_estimator="k3")
    loss, metrics = ReinforcePP(config).loss(ModelOutputs(None, logprobs), b)
    k3 = [math.exp(-d) + d - 1 for d in D[MASK > 0].tolist()]  # exp(ref - logp) - (ref - logp) - 1
    assert metrics["kl_ref"] == pytest.approx(sum(k3) / 8, rel=1e-12)
    assert loss.item() == pytest.approx(SURROGATE + 0.1 * sum(k3) / 8, rel=1e-12)
    loss.backward()  # d k3 / d logp = 1 - exp(-D)
    assert torch.allclose(logprobs.grad, GRAD + 0.1 * (1 - torch.exp(-D)) * MASK / 8, atol=1e-12)


def test_kl_estimates():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    assert kl_estimate(logp, ref, "k1").tolist() == [0.5, -1.0]
    assert kl_estimate(logp, ref, "k2").tolist() == [0.125, 0.5] == k2_kl(logp, ref).tolist()
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0])
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, "k4")


# ---- the rollout, the metrics, the config ----------------------------------------------------------
def test_rollout_samples_groups_with_reference_logprobs_only_when_there_is_a_kl(monkeypatch):
    calls = []
    monkeypatch.setattr(
        reinforce_pp_module, "sample_groups", lambda ctx, prompts, n, with_ref: calls.append((n, with_ref))
    )
    ReinforcePP().rollout(None, [])
    ReinforcePP(ReinforcePPConfig(kl_coef=0.0, group_size=3)).rollout(None, [])
    ReinforcePP(ReinforcePPConfig(baseline=True, group_size=4, kl_coef=0.1)).rollout(None, [])
    assert calls == [(1, True), (3, False), (4, True)]


def test_prepare_metrics_report_flat_groups_only_where_there_are_groups():
    rows = table([ROWS[0], ROWS[1], ("b", [13], [-1.0], [-1.0], 1.0), ("b", [14], [-1.0], [-1.0], 1.0)])
    assert ReinforcePP(ReinforcePPConfig(group_size=2)).prepare_metrics(rows) == {"groups_without_signal": 0.5}
    assert ReinforcePP().prepare_metrics(rows) == {}  # one response per prompt: no groups


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["algorithm.baseline=true", "algorithm.group_size=1"], "needs group_size >= 2"),
        (["algorithm.baseline=true", "algorithm.gamma=0.9"], "discounting is plain REINFORCE++'s"),
        (["algorithm.kl_estimator=k2"], "kl_estimator 'k2' is for kl_in 'loss'"),
        (["algorithm.kl_in=loss", "algorithm.kl_estimator=k1"], "zero in expectation"),
        (["algorithm.kl_in=middle"], "algorithm.kl_in"),
        (["algorithm.group_size=0"], "algorithm.group_size"),
        (["algorithm.clip_eps=1.5"], "algorithm.clip_eps"),
        (["algorithm.gamma=1.5"], "algorithm.gamma"),
        (["algorithm.kl_coef=-0.1"], "algorithm.kl_coef"),
        (["algorithm.std_normalize=false"], "std_normalize"),  # GRPO's key: unknown here
    ],
)
def test_config_errors_name_the_problem(overrides, words):
    with pytest.raises(ConfigError, match="config error") as e:
        build_algorithm(load_config(QUICKSTART, ["algorithm.name=reinforce_pp", *overrides]))
    assert words in str(e.value)


def test_config_defaults_and_what_the_quickstart_builds():
    c = ReinforcePPConfig()
    assert (c.baseline, c.group_size, c.clip_eps, c.kl_coef, c.kl_in, c.kl_estimator, c.gamma) == (
        False, 1, 0.2, 0.01, "reward", "k1", 1.0,
    )  # fmt: skip
    algo = build_algorithm(load_config(QUICKSTART, ["algorithm.name=reinforce_pp"]))
    assert isinstance(algo, ReinforcePP) and (algo.config.group_size, algo.config.kl_coef) == (8, 0.01)
    algo = build_algorithm(load_config(QUICKSTART, ["algorithm.name=reinforce_pp", "algorithm.baseline=true"]))
    assert (algo.config.kl_in, algo.config.kl_estimator) == ("loss", "k2")
    # rows one version old are corrected by the clipped ratio: overlap is allowed
    overlap = ["algorithm.name=reinforce_pp", "trainer.mode=overlap", "buffer.max_staleness=1"]
    assert isinstance(build_algorithm(load_config(QUICKSTART, overlap)), ReinforcePP)


def test_registered_with_the_capabilities_it_has():
    assert "reinforce_pp" in BUILTIN_MODULES
    assert get_algorithm("reinforce_pp") is ReinforcePP
    algo = ReinforcePP()
    assert isinstance(algo, TrainsOnStaleRows) and isinstance(algo, ReportsPrepareMetrics)
    assert not isinstance(algo, SkipsRowsWithoutGradient) and not algo.needs_value_head
