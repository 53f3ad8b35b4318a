"""Privacy module: the attention merge, Cascade's sharded forward, and the vocab-matching
attack on plain, permuted and Cascade-party views. Tiny random-init Qwen2 (the attack needs
open weights, not a trained model); everything in-process (Ray parties: test_privacy_ray.py)."""

from __future__ import annotations

import pytest
import torch

from rlsys.models import TinyModelSpec, build_tiny_model
from rlsys.privacy import cli
from rlsys.privacy.attack import AttackConfig, blind_view, permuted_view, plain_view, vocab_matching_attack
from rlsys.privacy.cascade import attention_pairs, c_delta_shards, cascade_forward, check_shards, party_view
from rlsys.privacy.decoder import DecoderWeights, hidden_states, merge_partials, partial_attention, plain_logits
from rlsys.privacy.evaluate import evaluate, random_prompts

N = 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(TinyModelSpec(), seed=0).eval()


@pytest.fixture(scope="module")
def weights(model):
    return DecoderWeights.from_hf(model)


@pytest.fixture(scope="module")
def prompt(model):
    return random_prompts(1, N, model.config.vocab_size, seed=1)[0]


@pytest.fixture(scope="module")
def hf(model, prompt):
    with torch.no_grad():
        return model(prompt[None], output_hidden_states=True)


def test_decoder_functions_match_transformers(weights, prompt, hf):
    ours = hidden_states(weights, prompt)
    assert len(ours) == len(hf.hidden_states)
    for a, b in zip(ours, hf.hidden_states):
        torch.testing.assert_close(a, b[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain_logits(weights, prompt), hf.logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("architecture", ["qwen3", "llama", "mistral", "phi3"])
def test_decoder_functions_match_every_tiny_architecture(architecture):
    """Qwen3's per-head query/key norms (weights away from 1), Phi-3's fused projections, and the
    others: every hidden state, and the Cascade logits, equal transformers'."""
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, architecture=architecture)
    model = build_tiny_model(spec, seed=2).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in ("q_norm", "k_norm"):
                if hasattr(layer.self_attn, norm):
                    getattr(layer.self_attn, norm).weight.uniform_(0.5, 2.0)
    w = DecoderWeights.from_hf(model)
    ids = random_prompts(1, 12, model.config.vocab_size, seed=3)[0]
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    for a, b in zip(hidden_states(w, ids), out.hidden_states):
        torch.testing.assert_close(a, b[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        cascade_forward(w, ids, c_delta_shards(12, 2, 2)).logits, out.logits[0], atol=1e-5, rtol=1e-5
    )


def test_decoders_it_does_not_implement_are_refused():
    import dataclasses

    from transformers import AutoModelForCausalLM

    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    for architecture, extra, why in [
        ("mistral", {"sliding_window": 16}, "sliding-window"),
        ("phi3", {"partial_rotary_factor": 0.5}, "partial RoPE"),
    ]:
        cfg = dataclasses.replace(spec, architecture=architecture).config(64, **extra)
        with pytest.raises(ValueError, match=why):
            DecoderWeights.from_hf(AutoModelForCausalLM.from_config(cfg))


def _full_causal(q, k, v):
    groups = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
    )


def test_merged_partial_blocks_equal_full_causal_attention():
    g = torch.Generator().manual_seed(0)
    n, heads, kv_heads, hd = 13, 4, 2, 8
    q = torch.randn(1, heads, n, hd, generator=g)
    k = torch.randn(1, kv_heads, n, hd, generator=g)
    v = torch.randn(1, kv_heads, n, hd, generator=g)
    full = _full_causal(q, k, v)
    # Shards of a random partition; every (query shard, key shard) block, including fully
    # masked ones (lse = -inf), merged per Eq. (A4).
    perm = torch.randperm(n, generator=g)
    shards = [sorted(perm[i::3].tolist()) for i in range(3)]
    for qs in shards:
        qi = torch.tensor(qs)
        parts = [
            partial_attention(q[:, :, qi], k[:, :, torch.tensor(ks)], v[:, :, torch.tensor(ks)], qi, torch.tensor(ks))
            for ks in shards
        ]
        torch.testing.assert_close(merge_partials(parts), full[:, :, qi], atol=1e-5, rtol=1e-5)


def test_fully_masked_block_has_zero_weight():
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    o, lse = partial_attention(q, k, v, torch.tensor([0]), torch.tensor([3, 5]))
    assert torch.isneginf(lse).all() and (o == 0).all()


@pytest.mark.parametrize("c, delta", [(1, 1), (2, 3), (4, 2), (N, 1)])
def test_c_delta_shards_are_spaced_partitions(c, delta):
    shards = c_delta_shards(N, c, delta)
    check_shards(shards, N)
    for s in shards:
        assert len(s) <= c
        assert all(b - a == delta for a, b in zip(s, s[1:]))


def test_attention_pairs_skip_only_fully_masked_blocks():
    shards = c_delta_shards(12, 2, 3)  # blocks of 6 positions: later blocks never feed earlier ones
    pairs = set(attention_pairs(shards))
    for i, qs in enumerate(shards):
        for j, ks in enumerate(shards):
            assert ((i, j) in pairs) == (min(ks) <= max(qs))


def test_check_shards_rejects_overlap_and_gaps():
    with pytest.raises(ValueError):
        check_shards([[0, 1], [1, 2]], 3)
    with pytest.raises(ValueError):
        check_shards([[0], [2]], 3)


@pytest.mark.parametrize(
    "shards",
    [
        c_delta_shards(N, 2, 3),
        c_delta_shards(N, 1, 1),
        [list(range(N))],
        [[0, 5, 6, 15], [1, 2, 3, 4], [7, 8, 9, 10, 11, 12, 13, 14]],
    ],
    ids=["c2-delta3", "one-per-party", "one-party", "irregular"],
)
def test_cascade_logits_and_views_equal_plain_model(weights, prompt, hf, shards):
    out = cascade_forward(weights, prompt, shards)
    torch.testing.assert_close(out.logits, hf.logits[0], atol=1e-5, rtol=1e-5)
    for s, seen in zip(out.shards, out.views):
        assert len(seen) == weights.n_layers + 1
        for layer, rows in enumerate(seen):
            torch.testing.assert_close(rows, hf.hidden_states[layer][0][torch.tensor(s)], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer", [1, 2, 4])
def test_attack_recovers_every_token_from_unsharded_states(weights, prompt, hf, layer):
    result = vocab_matching_attack(weights, plain_view(hf.hidden_states[layer][0], layer), AttackConfig())
    assert result.tokens == prompt.tolist()
    assert all(result.matched)


@pytest.mark.parametrize("rows, dims", [(True, False), (False, True), (True, True)], ids=["rows", "entries", "both"])
def test_attack_recovers_permuted_states(weights, prompt, hf, rows, dims):
    view = permuted_view(plain_view(hf.hidden_states[2][0], 2), rows, dims, torch.Generator().manual_seed(3))
    result = vocab_matching_attack(weights, view, AttackConfig())
    assert result.recovery(prompt) == 1.0 and all(result.matched)


def test_attack_on_one_cascade_party_falls_to_chance_under_the_same_budget(weights, prompt, hf):
    config = AttackConfig(budget=weights.vocab_size)
    plain = vocab_matching_attack(weights, plain_view(hf.hidden_states[2][0], 2), config)
    assert plain.recovery(prompt) == 1.0
    out = cascade_forward(weights, prompt, c_delta_shards(N, 2, 3))
    truth = prompt.tolist()
    held_hits = unheld_hits = unheld = 0
    for party, s in enumerate(out.shards):
        result = vocab_matching_attack(weights, party_view(out, party, 2), config)
        assert result.candidates <= config.budget * len(s)  # the same per-position budget
        # exact matches need the true prefix: only a party holding position 0 gets one
        assert sum(result.matched) <= (1 if 0 in s else 0)
        for p, (a, b) in enumerate(zip(result.tokens, truth)):
            if p in s:
                held_hits += a == b
            else:
                unheld_hits += a == b
                unheld += 1
    # the positions a party does not hold: at chance (1/V expected; allow a couple of flukes)
    assert unheld_hits / unheld <= 0.02
    # pooled over parties, what a party learns is at most (about) its own c tokens
    assert (held_hits + unheld_hits) / (N * len(out.shards)) <= 2 / N + 0.02


def test_proposal_ordering_finds_the_models_own_text_first(weights):
    """Greedy text of the model is its own top proposal at every step: one candidate per
    position after the first, against about V/2 for vocabulary order."""
    n, ids = 6, [7]
    with torch.no_grad():
        for _ in range(n - 1):
            ids.append(int(plain_logits(weights, torch.tensor(ids))[-1].argmax()))
    prompt = torch.tensor(ids)
    view = plain_view(hidden_states(weights, prompt)[2], 2)
    by_model = vocab_matching_attack(weights, view, AttackConfig(batch_size=1, proposal="model"))
    by_vocab = vocab_matching_attack(weights, view, AttackConfig(batch_size=1, proposal="vocab"))
    assert by_model.tokens == by_vocab.tokens == ids
    assert by_model.candidates == 8 + (n - 1)  # token 7 is the 8th id, then one each
    assert by_vocab.candidates == sum(t + 1 for t in ids)


def test_budget_caps_the_search(weights, prompt, hf):
    result = vocab_matching_attack(
        weights, plain_view(hf.hidden_states[2][0], 2), AttackConfig(budget=8, batch_size=4, proposal="vocab")
    )
    assert result.candidates == 8 * N
    assert result.matched == [t < 8 for t in prompt.tolist()]


def test_threshold_rejects_noisy_rows_but_nearest_candidate_survives(weights, prompt, hf):
    states = hf.hidden_states[2][0]
    noisy = states + 1e-3 * torch.randn(states.shape, generator=torch.Generator().manual_seed(0))
    result = vocab_matching_attack(weights, plain_view(noisy, 2), AttackConfig())
    assert not any(result.matched)  # L1 of the noise (~0.1) exceeds epsilon (~5e-3)
    assert result.recovery(prompt) == 1.0  # the nearest candidate is still the true token


def test_blind_view_is_the_proposal_alone(weights, prompt):
    result = vocab_matching_attack(weights, blind_view(N, 2, weights.embed.shape[1]), AttackConfig())
    assert result.candidates == 0 and not any(result.matched)


def test_view_must_fit_config():
    with pytest.raises(ValueError):
        AttackConfig(proposal="oracle")
    with pytest.raises(ValueError):
        AttackConfig(budget=0)


def test_evaluate_scores_every_view(model):
    ev = evaluate(model, random_prompts(1, 12, model.config.vocab_size, seed=2), 2, AttackConfig(), c=2, delta=3)
    scores = {s.view: s for s in ev.scores}
    for name in ("plain", "rows permuted", "entries permuted", "rows + entries permuted"):
        assert scores[name].recovery == 1.0 and scores[name].matched == 1.0
    assert scores["cascade: one compute party"].recovery <= 2 / 12 + 0.05
    assert scores["cascade: one compute party"].attacks == ev.n_parties == len(c_delta_shards(12, 2, 3))
    assert ev.cascade_max_logit_diff < 1e-4


def test_cli_attack_prints_recovery_table(capsys):
    assert cli.main(["attack", "--backend", "local", "--prompts", "1", "--length", "8", "--layer", "1"]) == 0
    out = capsys.readouterr().out
    assert "| plain | 100.0% |" in out and "cascade: one compute party" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["attack", "--backend", "local", "--layer", "9"],
        ["attack", "--backend", "local", "--budget", "0"],
        ["attack", "--backend", "local", "--c", "0"],
        ["attack", "--backend", "local", "--text", "hi"],
        ["attack", "--backend", "local", "--model", "/nonexistent"],
        ["nope"],
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlsys privacy: error:") and "\n" not in err
