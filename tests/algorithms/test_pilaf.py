"""PILAF + online DPO properties (../shared/papers/pilaf.md): the interpolating sampler of the
rollout backend and the DPO loss."""

import math

import numpy as np
import pytest
import torch
from fakes import TwoTokenContext

from actors.modeling import pad_sequences
from actors.rollout import HFBackend, ReferenceMixing
from algorithms.pilaf import PILAF, GroupedBatch, dpo_loss, label_pairs
from rlsys.contract import ModelOutputs, Prompt
from rlsys.experience import meta_of
from rlsys.generation import GenerationRequest, Interpolation, SamplingParams, interpolated_logits
from rlsys.models import TinyModelSpec, build_tiny_model

SPEC = TinyModelSpec(
    vocab_size=24,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)


@pytest.fixture(scope="module")
def models():
    """A policy and a reference that differ clearly (logits scaled up from a random init)."""
    out = []
    for seed in (1, 0):
        m = build_tiny_model(SPEC, seed=seed).eval()
        with torch.no_grad():
            m.model.norm.weight.mul_(8.0)
        out.append(m)
    return out


def test_interpolated_logits_equal_the_formulas():
    torch.manual_seed(0)
    h, h_ref = torch.randn(3, 7), torch.randn(3, 7)
    beta = 0.3
    assert torch.allclose(interpolated_logits(h, h_ref, beta, "plus"), 1.3 * h - 0.3 * h_ref)
    assert torch.allclose(interpolated_logits(h, h_ref, beta, "minus"), 0.7 * h + 0.3 * h_ref)
    # in probability space: pi_plus ∝ pi^(1+beta) pi_ref^(-beta), pi_minus ∝ pi^(1-beta) pi_ref^beta
    lp, lr = torch.log_softmax(h, -1), torch.log_softmax(h_ref, -1)
    assert torch.allclose(
        torch.log_softmax(interpolated_logits(h, h_ref, beta, "plus"), -1),
        torch.log_softmax((1 + beta) * lp - beta * lr, -1),
        atol=1e-6,
    )
    for mode in ("plus", "minus"):
        assert torch.equal(interpolated_logits(h, h_ref, 0.0, mode), h)
    with pytest.raises(ValueError):
        Interpolation(0.1, "sideways")


def test_backend_mixes_the_reference_logits_token_by_token(models):
    """The scores generate samples from equal the formula on full forward passes of both models,
    at every generated position, for left-padded prompts of different lengths."""
    policy, reference = models
    prompts = [[5, 6, 7, 8], [9, 10]]
    ids, mask = pad_sequences(prompts, 0, left=True)
    for mode, beta in (("plus", 0.5), ("minus", 0.25)):
        mixing = ReferenceMixing(reference, Interpolation(beta, mode), mask)
        out = policy.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=5,
            do_sample=False,
            logits_processor=[mixing],
            return_dict_in_generate=True,
            output_scores=True,
            pad_token_id=0,
            eos_token_id=[23],
        )
        seq = out.sequences
        full_mask = torch.cat([mask, torch.ones(2, seq.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            h = policy(input_ids=seq, attention_mask=full_mask, position_ids=positions).logits
            h_ref = reference(input_ids=seq, attention_mask=full_mask, position_ids=positions).logits
        P = ids.shape[1]
        for t, scores in enumerate(out.scores):
            expected = interpolated_logits(h[:, P - 1 + t], h_ref[:, P - 1 + t], beta, mode)
            assert torch.allclose(scores, expected, atol=1e-4), (mode, t)
            assert torch.equal(seq[:, P + t], scores.argmax(-1))


def test_beta_zero_samples_exactly_what_vanilla_samples(models):
    policy, reference = models
    backend = HFBackend(None, model=policy, reference=reference)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    vanilla = backend.generate([GenerationRequest(p, SamplingParams(n=4, max_new_tokens=6, seed=11)) for p in prompts])
    for mode in ("plus", "minus"):
        params = SamplingParams(n=4, max_new_tokens=6, seed=11, interpolation=Interpolation(0.0, mode))
        mixed = backend.generate([GenerationRequest(p, params) for p in prompts])
        assert [g.response_ids for g in mixed] == [g.response_ids for g in vanilla]
        assert np.allclose([x for g in mixed for x in g.logprobs], [x for g in vanilla for x in g.logprobs], atol=1e-5)


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit (bins with expected < 5 pooled); p from the gamma tail."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0), torch.tensor(stat / 2.0)))


def test_one_token_responses_follow_the_sequence_level_tilt(models):
    """For one-token responses pi_plus(y) ∝ pi(y)^(1+beta) pi_ref(y)^(-beta) exactly (chi-square)."""
    policy, reference = models
    backend = HFBackend(None, batch_size=1000, model=policy, reference=reference)
    prompt, n, beta = [5, 6, 7], 3000, 1.0
    with torch.no_grad():
        lp = torch.log_softmax(policy(input_ids=torch.tensor([prompt])).logits[0, -1], -1).double()
        lr = torch.log_softmax(reference(input_ids=torch.tensor([prompt])).logits[0, -1], -1).double()
    for mode, sign in (("plus", 1.0), ("minus", -1.0)):
        tilt = torch.softmax((1 + sign * beta) * lp - sign * beta * lr, -1).numpy()
        params = SamplingParams(n=n, max_new_tokens=1, seed=5, interpolation=Interpolation(beta, mode))
        tokens = [g.response_ids[0] for g in backend.generate([GenerationRequest(prompt, params)])]
        counts = np.bincount(tokens, minlength=SPEC.vocab_size)
        assert chi_square_p(counts, tilt) > 1e-3, mode
        # the test has power: the same samples are not from the policy itself
        assert chi_square_p(counts, torch.softmax(lp, -1).numpy()) < 1e-3, mode


def test_dpo_loss_matches_hand_computation():
    lp_w, lp_l, ref_w, ref_l = (
        torch.tensor([-3.0, -1.0]),
        torch.tensor([-4.0, -0.5]),
        torch.tensor([-3.5, -1.2]),
        torch.tensor([-3.0, -0.9]),
    )
    beta = 0.1
    loss, margins = dpo_loss(lp_w, lp_l, ref_w, ref_l, beta)
    hand = [
        -math.log(1 / (1 + math.exp(-beta * ((a - c) - (b - d)))))
        for a, b, c, d in zip(lp_w.tolist(), lp_l.tolist(), ref_w.tolist(), ref_l.tolist())
    ]
    assert loss.item() == pytest.approx(np.mean(hand), rel=1e-6)
    assert margins.tolist() == pytest.approx([0.1 * ((-3 + 3.5) - (-4 + 3)), 0.1 * ((-1 + 1.2) - (-0.5 + 0.9))])
    weighted, _ = dpo_loss(lp_w, lp_l, ref_w, ref_l, beta, torch.tensor([1.0, 0.0]))
    assert weighted.item() == pytest.approx(hand[0], rel=1e-6)


def test_labels():
    rng = np.random.default_rng(0)
    a_wins, decisive = label_pairs([1.0, 0.0, 1.0], [0.0, 1.0, 1.0], "max", rng)
    assert a_wins.tolist() == [True, False, False] and decisive.tolist() == [True, True, False]
    a_wins, decisive = label_pairs(np.full(20000, 1.0), np.zeros(20000), "bradley_terry", rng)
    assert decisive.all() and a_wins.mean() == pytest.approx(1 / (1 + math.exp(-1)), abs=0.015)


class PairContext(TwoTokenContext):
    """Random two-token samples; a response's reward is its first token's parity."""

    def score(self, table):
        return [float(r[0] % 2) for r in table.column("response_ids").to_pylist()]

    def ref_logprobs(self, table):
        return [[-1.2, -0.4] for _ in range(table.num_rows)]


def test_rollout_mixes_interpolated_and_policy_pairs_half_and_half():
    ctx, algo = PairContext(), PILAF()
    prompts = [Prompt(f"p{i}", [1, 2], "", {}) for i in range(2000)]
    table = algo.rollout(ctx, prompts)
    assert table.num_rows == 4000
    metas = meta_of(table)
    mixed = np.array([m["sampler"] != "policy" for m in metas[0::2]])
    assert abs(mixed.mean() - 0.5) < 4 * math.sqrt(0.25 / 2000)
    for m0, m1, g0, g1 in zip(
        metas[0::2], metas[1::2], table.column("group").to_pylist()[0::2], table.column("group").to_pylist()[1::2]
    ):
        assert g0 == g1 and {m0["sampler"], m1["sampler"]} in ({"plus", "minus"}, {"policy"})
        assert {m0["preference"], m1["preference"]} == {"chosen", "rejected"}
    interp = [r.params.interpolation for r in ctx.requests]
    assert {i for i in interp} == {None, Interpolation(0.1, "plus"), Interpolation(0.1, "minus")}
    assert all(r.params.n == (1 if r.params.interpolation else 2) for r in ctx.requests)
    vanilla = PILAF(PILAF.Config(sampler="vanilla")).rollout(PairContext(), prompts[:50])
    assert all(m["sampler"] == "policy" for m in meta_of(vanilla))


def test_prepare_orders_pairs_keeps_them_whole_and_loss_is_dpo():
    ctx, algo = PairContext(), PILAF()
    table = algo.rollout(ctx, [Prompt(f"p{i}", [1, 2], "", {}) for i in range(7)])
    batch = algo.prepare(table.take(np.random.default_rng(1).permutation(table.num_rows)))
    assert isinstance(batch, GroupedBatch) and len(batch) == 14
    rewards, weights = batch.rewards.numpy(), batch.extras["pair_weight"].numpy()
    assert np.all(weights[0::2] == weights[1::2])
    assert np.all((rewards[0::2] > rewards[1::2]) == (weights[0::2] > 0))
    assert all(len(s) % 2 == 0 for n in (2, 3, 4) for s in batch.split(n))
    logprobs = torch.randn(batch.response_mask.shape) * batch.response_mask
    loss, metrics = algo.loss(ModelOutputs(None, logprobs), batch)
    seq = (logprobs * batch.response_mask).sum(1)
    ref = (batch.ref_logprobs * batch.response_mask).sum(1)
    margins = 0.1 * ((seq[0::2] - ref[0::2]) - (seq[1::2] - ref[1::2]))
    w = batch.extras["pair_weight"][0::2]
    expected = (-torch.nn.functional.logsigmoid(margins) * w).sum() / w.sum().clamp(min=1)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert 0 <= metrics["dpo/decisive_pairs"] <= 1
