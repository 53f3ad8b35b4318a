"""AMPO properties (../shared/papers/ampo.md): selection and the group-contrastive loss."""

import math

import numpy as np
import pytest
import torch
from fakes import TwoTokenContext

from actors.rollout import HFBackend
from algorithms.ampo import (
    AMPO,
    group_contrastive_loss,
    kmeans,
    optselect_cost,
    select_bottomk,
    select_coreset,
    select_optselect,
)
from algorithms.pilaf import GroupedBatch
from rlsys.config import ConfigError, validate_section
from rlsys.contract import ModelOutputs, Prompt
from rlsys.generation import GenerationRequest, SamplingParams
from rlsys.models import TinyModelSpec, build_tiny_model


def test_one_positive_one_negative_is_the_pairwise_loss():
    torch.manual_seed(0)
    s = torch.randn(5, 2)
    positive = torch.tensor([[True, False]] * 5)
    per_pair = -torch.nn.functional.logsigmoid(s[:, 0] - s[:, 1])
    assert group_contrastive_loss(s, positive).item() == pytest.approx(per_pair.mean().item(), rel=1e-6)
    w = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])
    assert group_contrastive_loss(s, positive, w).item() == pytest.approx(per_pair[[0, 2]].mean().item(), rel=1e-6)


def test_group_loss_by_hand():
    s = torch.tensor([[1.0, 0.5, -1.0, 2.0]])
    positive = torch.tensor([[True, True, False, False]])
    e = [math.exp(x) for x in s[0].tolist()]
    assert group_contrastive_loss(s, positive).item() == pytest.approx(-math.log((e[0] + e[1]) / sum(e)), rel=1e-6)


def islands(rng, per_island=6):
    """Three far-apart 2-D islands; the lowest rewards all sit on the first."""
    centres = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = np.concatenate([c + 0.3 * rng.standard_normal((per_island, 2)) for c in centres])
    island = np.repeat(np.arange(3), per_island)
    rewards = np.where(island == 0, 0.0, 0.5) + 0.1 * rng.random(len(x))
    return x, rewards, island


def test_coreset_and_optselect_cover_every_island_and_bottomk_does_not():
    for seed in range(5):
        rng = np.random.default_rng(seed)
        x, r, island = islands(rng)
        assert set(island[select_bottomk(r, 3)]) == {0}
        assert set(island[select_coreset(x, r, 3, np.random.default_rng(seed))]) == {0, 1, 2}
        chosen, _ = select_optselect(x, r, 3)
        assert set(island[chosen]) == {0, 1, 2}


def test_coreset_takes_each_clusters_reward_minimum():
    rng = np.random.default_rng(3)
    x, r = rng.standard_normal((20, 4)), rng.random(20)
    picked = select_coreset(x, r, 5, np.random.default_rng(7))
    labels = kmeans(x, 5, np.random.default_rng(7))
    assert len(picked) == 5 and sorted(labels[picked]) == list(range(5))
    for i in picked:
        members = np.flatnonzero(labels == labels[i])
        assert r[i] == r[members].min()
    # identical embeddings (identical responses) still give k distinct indices
    assert len(set(select_coreset(np.zeros((6, 3)), r[:6], 3, rng))) == 3


def test_optselect_cost_never_rises_and_ends_at_a_local_minimum():
    rng = np.random.default_rng(4)
    x, r = rng.standard_normal((15, 3)), rng.random(15)
    chosen, costs = select_optselect(x, r, 4)
    assert all(b <= a for a, b in zip(costs, costs[1:])) and len(costs) >= 2
    w = np.exp(r.mean() - r)
    d = np.linalg.norm(x[:, None] - x[None], axis=-1)
    assert costs[0] == pytest.approx(optselect_cost(d, w, select_bottomk(r, 4)))
    assert costs[-1] == pytest.approx(optselect_cost(d, w, chosen))
    for p in range(4):
        for c in set(range(15)) - set(chosen):
            assert optselect_cost(d, w, chosen[:p] + [c] + chosen[p + 1 :]) >= costs[-1] - 1e-9


class SampleContext(TwoTokenContext):
    """Random two-token samples with 4-dim embeddings; a response's reward is its first token."""

    embedding_dim = 4

    def score(self, table):
        return [float(r[0]) for r in table.column("response_ids").to_pylist()]


@pytest.mark.parametrize("selection", ["bottomk", "coreset", "optselect"])
def test_prepare_selects_k_per_prompt_positive_first(selection):
    ctx = SampleContext()
    algo = AMPO(AMPO.Config(num_samples=8, subset_size=4, selection=selection))
    table = algo.rollout(ctx, [Prompt(f"p{i}", [1, 2], "", {}) for i in range(5)])
    assert table.num_rows == 40 and all(r.embedding == "policy" for r in ctx.requests)
    batch = algo.prepare(table)
    assert isinstance(batch, GroupedBatch) and len(batch) == 20
    rewards = table.column("reward").to_numpy().reshape(5, 8)
    picked = batch.rewards.numpy().reshape(5, 4)
    assert np.all(picked[:, 0] == rewards.max(1))
    if selection == "bottomk":
        assert np.allclose(np.sort(picked[:, 1:], 1), np.sort(rewards, 1)[:, :3])
    offsets = batch.extras["reward_offset"].numpy().reshape(5, 4)
    assert np.allclose(offsets, algo.config.alpha * (picked - rewards.mean(1, keepdims=True)), atol=1e-5)
    assert all(len(s) % 4 == 0 for n in (2, 3) for s in batch.split(n))
    logprobs = torch.randn(batch.response_mask.shape) * batch.response_mask
    loss, _ = algo.loss(ModelOutputs(None, logprobs), batch)
    mean_lp = (logprobs * batch.response_mask).sum(1) / batch.response_mask.sum(1)
    s = (algo.config.beta * mean_lp + batch.extras["reward_offset"]).view(5, 4)
    w = batch.extras["group_weight"].view(5, 4)[:, 0]
    expected = ((torch.logsumexp(s, 1) - s[:, 0]) * w).sum() / w.sum().clamp(min=1)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_groups_with_equal_rewards_weigh_nothing_and_config_checks_k():
    ctx = SampleContext()
    ctx.score = lambda table: [1.0] * table.num_rows
    algo = AMPO(AMPO.Config(num_samples=4, subset_size=2))
    batch = algo.prepare(algo.rollout(ctx, [Prompt("p", [1], "", {})]))
    assert batch.extras["group_weight"].sum() == 0
    with pytest.raises(ConfigError, match="subset_size"):
        validate_section(AMPO.Config, {"num_samples": 4, "subset_size": 4}, prefix="algorithm")


def test_backend_returns_mean_pooled_response_embeddings():
    spec = TinyModelSpec(
        vocab_size=24,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    policy, reference = build_tiny_model(spec, seed=1).eval(), build_tiny_model(spec, seed=0).eval()
    backend = HFBackend(None, model=policy, reference=reference)
    for which, model in (("policy", policy), ("reference", reference)):
        gens = backend.generate(
            [
                GenerationRequest([5, 6, 7], SamplingParams(n=2, max_new_tokens=4, seed=1), embedding=which),
                GenerationRequest([8, 9], SamplingParams(n=1, max_new_tokens=4, seed=1)),
            ]
        )
        assert gens[2].embedding is None
        for g in gens[:2]:
            with torch.no_grad():
                hidden = model(
                    input_ids=torch.tensor([g.prompt_ids + g.response_ids]), output_hidden_states=True
                ).hidden_states[-1]
            expected = hidden[0, len(g.prompt_ids) :].mean(0)
            assert torch.allclose(torch.tensor(g.embedding), expected, atol=1e-5), which
