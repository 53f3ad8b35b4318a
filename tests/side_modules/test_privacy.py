"""Privacy module: the attention merge, Cascade's sharded forward, and the vocab-matching
attack on plain, permuted and Cascade-party views (compute parties' hidden states, attention
parties' keys/values and queries). Tiny random-init Qwen2 (the attack needs open weights, not a
trained model); everything in-process (Ray parties: test_privacy_ray.py)."""

from __future__ import annotations

import pytest
import torch

from rlsys.models import TinyModelSpec, build_tiny_model
from rlsys.privacy import cli
from rlsys.privacy.attack import AttackConfig, View, blind_view, permuted_view, plain_view, vocab_matching_attack
from rlsys.privacy.cascade import (
    attention_pairs,
    attention_party_views,
    c_delta_shards,
    cascade_forward,
    check_shards,
    party_view,
)
from rlsys.privacy.decoder import DecoderWeights, hidden_states, merge_partials, partial_attention, plain_logits
from rlsys.privacy.evaluate import (
    COMPUTE_PARTY,
    DIAGONAL_ATTENTION_PARTY,
    OFF_DIAGONAL_ATTENTION_PARTY,
    evaluate,
    random_prompts,
    sample_parties,
)

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


def _transformers_qkv(model, ids):
    """Per layer, the queries, keys and values [1, heads, n, hd] transformers' own forward
    computes: keys/values from its cache, queries from q_proj's output rotated by its RoPE."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    projected = []
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(lambda module, args, out: projected.append(out))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            cache = model(ids[None], use_cache=True).cache
    finally:
        for hook in hooks:
            hook.remove()
    n, head_dim = ids.shape[0], model.config.hidden_size // model.config.num_attention_heads
    cos, sin = model.model.rotary_emb(projected[0], torch.arange(n)[None])
    out = []
    for layer, q in enumerate(projected):
        q = q.view(1, n, -1, head_dim).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        out.append((q, cache.layers[layer].keys, cache.layers[layer].values))
    return out


def test_attention_party_views_are_what_the_forward_hands_each_party(model, weights, prompt):
    """Every attention party (i, j) recorded, at every layer, the queries of S_i and the
    keys/values of S_j that transformers computes; its views hold them as rows at those positions."""
    out = cascade_forward(weights, prompt, c_delta_shards(N, 2, 3))
    reference = _transformers_qkv(model, prompt)
    assert sorted(out.attention_views) == sorted(attention_pairs(out.shards))
    for (i, j), seen in out.attention_views.items():
        assert len(seen) == weights.n_layers
        qs, ks = torch.tensor(out.shards[i]), torch.tensor(out.shards[j])
        for layer, (q, k, v) in enumerate(seen):
            ref_q, ref_k, ref_v = reference[layer]
            torch.testing.assert_close(q, ref_q[:, :, qs], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(k, ref_k[:, :, ks], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, ref_v[:, :, ks], atol=1e-5, rtol=1e-5)
            kv_view, q_view = attention_party_views(out, (i, j), layer)
            assert (kv_view.observable, q_view.observable) == ("keys_values", "queries")
            assert kv_view.positions.tolist() == out.shards[j] and q_view.positions.tolist() == out.shards[i]
            for row, p in enumerate(out.shards[j]):
                expected = torch.cat([ref_k[0, :, p].reshape(-1), ref_v[0, :, p].reshape(-1)])
                torch.testing.assert_close(kv_view.states[row], expected, atol=1e-5, rtol=1e-5)
            for row, p in enumerate(out.shards[i]):
                torch.testing.assert_close(q_view.states[row], ref_q[0, :, p].reshape(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer", [0, 2, 3])
@pytest.mark.parametrize("which, observable", [(0, "keys_values"), (1, "queries")])
def test_attack_recovers_every_token_from_unsharded_keys_values_or_queries(weights, prompt, layer, which, observable):
    """One party holding every row (a single shard): matching candidates' K/V (or Q) projections
    rebuilds the whole prompt, every token under epsilon."""
    view = attention_party_views(cascade_forward(weights, prompt, [list(range(N))]), (0, 0), layer)[which]
    assert view.observable == observable
    result = vocab_matching_attack(weights, view, AttackConfig())
    assert result.tokens == prompt.tolist()
    assert all(result.matched)


@pytest.mark.parametrize("layer", [0, 2])
def test_attack_on_one_attention_party_recovers_only_what_its_shards_allow(weights, prompt, layer):
    """Attention party (i, j) holds the rows of S_i and S_j. At layer 0 a row depends on its token
    and position alone, so every held token is matched exactly; deeper, a held token is matched
    exactly iff every token before it was recovered (the sharding leaves gaps, so mostly only
    where the positions before it are held too). Tokens of positions it holds no row of: chance."""
    out = cascade_forward(weights, prompt, c_delta_shards(N, 2, 3))
    truth = prompt.tolist()
    config = AttackConfig(budget=weights.vocab_size)
    unheld_hits = unheld = exact_with_gap = 0
    for i, j in attention_pairs(out.shards):
        held = set(out.shards[i]) | set(out.shards[j])
        result = vocab_matching_attack(weights, attention_party_views(out, (i, j), layer), config)
        assert result.candidates <= config.budget * len(held)  # the same per-position budget
        for p in range(N):
            if p not in held:
                unheld_hits += result.tokens[p] == truth[p]
                unheld += 1
                assert not result.matched[p]
            elif layer == 0:
                assert result.matched[p] and result.tokens[p] == truth[p]
            else:
                assert result.matched[p] == (result.tokens[:p] == truth[:p])
                assert result.tokens[p] == truth[p] or not result.matched[p]
                exact_with_gap += result.matched[p] and not set(range(p)) <= held
    assert unheld_hits / unheld <= 0.02  # chance is 1/V; allow a couple of flukes
    assert exact_with_gap <= 1  # past a gap, an exact match needs a lucky guess of the gap


def test_attention_view_layers_and_kinds_are_checked(weights, prompt):
    rows = torch.zeros(1, 2 * weights.n_kv_heads * weights.head_dim)
    with pytest.raises(ValueError, match="keys_values exist for 0..3"):
        vocab_matching_attack(
            weights, View(rows, N, weights.n_layers, torch.tensor([0]), observable="keys_values"), AttackConfig()
        )
    with pytest.raises(ValueError, match="observable"):
        View(rows, N, 0, torch.tensor([0]), observable="logits")


def test_sample_parties_draws_distinct_parties_in_order():
    parties = list(range(20))
    picked = sample_parties(parties, 5, torch.Generator().manual_seed(0))
    assert len(set(picked)) == 5 and picked == sorted(picked) and set(picked) <= set(parties)
    assert sample_parties(parties, None, torch.Generator()) == parties


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
        assert scores[name].recovery == 1.0 and scores[name].matched == 1.0 and scores[name].held_recovery == 1.0
    shards = c_delta_shards(12, 2, 3)
    pairs = attention_pairs(shards)
    # a party learns about its own positions: c of them, or 2c for attention parties (i, j), i != j
    for name, held, attacks in [
        (COMPUTE_PARTY, 2, len(shards)),
        (DIAGONAL_ATTENTION_PARTY, 2, len(shards)),
        (OFF_DIAGONAL_ATTENTION_PARTY, 4, len(pairs) - len(shards)),
    ]:
        assert scores[name].recovery <= held / 12 + 0.05
        assert scores[name].attacks == attacks
    assert ev.n_parties == len(shards)
    assert ev.cascade_max_logit_diff < 1e-4


def test_cli_attack_prints_recovery_table(capsys):
    assert cli.main(["attack", "--backend", "local", "--prompts", "1", "--length", "8", "--layer", "1"]) == 0
    out = capsys.readouterr().out
    assert "| plain | 100.0% |" in out and "cascade: one compute party" in out
    assert "cascade: one attention party (i = j)" in out and "cascade: one attention party (i != j)" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["attack", "--backend", "local", "--layer", "9"],
        ["attack", "--backend", "local", "--budget", "0"],
        ["attack", "--backend", "local", "--c", "0"],
        ["attack", "--backend", "local", "--parties", "0"],
        ["attack", "--backend", "local", "--text", "hi"],
        ["attack", "--backend", "local", "--model", "/nonexistent"],
        ["nope"],
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlsys privacy: error:") and "\n" not in err
