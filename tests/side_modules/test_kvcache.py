"""SpeCache (rlsys/kvcache): quantiser, top-k, two-tier cache and generation."""

import pytest
import torch

from rlsys.kvcache import SpeCacheConfig, dequantize, full_cache_generate, quantize, specache_generate
from rlsys.kvcache.attention import causal_padding_mask, select_topk, topk_recall
from rlsys.kvcache.cache import SpeCache
from rlsys.kvcache.quant import pack_codes, unpack_codes
from rlsys.models import TinyModelSpec, build_tiny_model

SPEC = TinyModelSpec(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(SPEC, None, seed=0).eval()


@pytest.fixture(scope="module")
def prompts():
    """Three left-padded prompts of 120, 97 and 64 tokens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, SPEC.vocab_size, (3, 120), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    mask[2, :56] = 0
    return ids.masked_fill(mask == 0, 0), mask


# ---------------------------------------------------------------- quantiser


@pytest.mark.parametrize("bits,bound", [(1, 1 / 4), (2, 1 / 6), (4, 1 / 30)])
def test_quantiser_error_bound(bits, bound):
    x = torch.randn(4, 8, 16, 32) * torch.rand(1, 1, 1, 32) * 10  # channels of different ranges
    q = quantize(x, bits, dim=-2)  # one group per channel over 16 tokens (keys, per channel)
    err = (dequantize(q, x.dtype) - x).abs()
    span = x.amax(-2, keepdim=True) - x.amin(-2, keepdim=True)
    assert (err <= bound * span + 1e-5).all()
    assert err.amax().item() > 0.9 * bound * span.amin().item()  # the bound is attained, not loose


def test_one_bit_levels_are_the_half_midpoints():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 8.0]])
    out = dequantize(quantize(x, 1, dim=-1), x.dtype)
    lo, hi = 0.0, 8.0
    assert set(out.flatten().tolist()) == {(3 * lo + hi) / 4, (lo + 3 * hi) / 4}
    assert out.tolist() == [[2.0, 2.0, 2.0, 2.0, 2.0, 6.0, 6.0, 6.0]]  # 4.0 rounds half to even


def test_pack_roundtrip_and_size():
    for bits in (1, 2, 4):
        codes = torch.randint(0, 1 << bits, (3, 5, 32), dtype=torch.uint8)
        packed = pack_codes(codes, bits)
        assert packed.shape[-1] == 32 * bits // 8
        assert torch.equal(unpack_codes(packed, bits), codes)


def test_padding_is_kept_out_of_the_group_range():
    x = torch.tensor([[100.0, 1.0, 2.0, 3.0]])
    valid = torch.tensor([[False, True, True, True]])
    out = dequantize(quantize(x, 2, dim=-1, valid=valid), x.dtype)
    assert ((out[0, 1:] - x[0, 1:]).abs() <= (3.0 - 1.0) / 6 + 1e-6).all()  # range of the valid entries only


def test_float16_metadata_stays_within_bound_up_to_rounding():
    x = torch.randn(6, 64, 32)
    q = quantize(x, 1, dim=-2, meta_dtype=torch.float16)
    assert q.zero.dtype == torch.float16
    span = x.amax(-2, keepdim=True) - x.amin(-2, keepdim=True)
    slack = 2e-3 * x.abs().amax(-2, keepdim=True)
    assert ((dequantize(q, x.dtype) - x).abs() <= span / 4 + slack).all()


# ---------------------------------------------------------------- top-k


def test_topk_recall_rises_with_bit_width():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(8, 2, 256, 32, generator=g) * (1 + 4 * torch.rand(1, 2, 1, 32, generator=g))
    queries = torch.randn(8, 4, 32, generator=g)

    def topk(k_used):
        scores = torch.einsum("bhd,bgsd->bhs", queries, k_used.repeat_interleave(2, 1))
        return select_topk(torch.softmax(scores, -1), kv_heads=2, k=16, candidates=256)

    true = topk(keys)
    recall = []
    for bits in (1, 2, 4):
        grouped = keys.reshape(8, 2, 8, 32, 32)  # per-channel groups of 32 tokens
        approx = dequantize(quantize(grouped, bits, dim=-2), keys.dtype).reshape(keys.shape)
        recall.append(topk_recall(topk(approx), true))
    assert recall[0] < recall[1] < recall[2] <= 1.0
    assert recall[0] > 16 / 256 * 2  # far better than chance even at 1 bit


def test_select_topk_averages_query_heads_of_a_kv_head():
    probs = torch.zeros(1, 4, 10)
    probs[0, 0, 3] = probs[0, 1, 3] = 0.5  # kv head 0: slot 3 by both its query heads
    probs[0, 0, 5] = 0.9  # slot 5 by one only -> averaged 0.45 < 0.5
    probs[0, 2, 7] = probs[0, 3, 7] = 0.6
    probs[0, 3, 8] = 1.0
    probs[0, :, 9] = 5.0  # slot 9 is outside the candidates
    index = select_topk(probs, kv_heads=2, k=1, candidates=9)
    assert index.tolist() == [[[3], [7]]]


def test_mask_is_causal_padded_and_self_visible():
    mask = causal_padding_mask(torch.tensor([[False, True, True]]), torch.ones(1, 2, dtype=torch.bool))
    assert mask[0, 0].tolist() == [[False, True, True, True, False], [False, True, True, True, True]]
    prefill = causal_padding_mask(torch.zeros(1, 0, dtype=torch.bool), torch.tensor([[False, True]]))
    assert prefill[0, 0].tolist() == [[True, False], [False, True]]


# ---------------------------------------------------------------- generation


def test_full_cache_loop_matches_transformers_generate(model, prompts):
    ids, _ = prompts
    ours, _, _ = full_cache_generate(model, ids[:1], None, max_new_tokens=12, eos_token_id=[])
    ref = model.generate(ids[:1], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours, ref)


def test_exact_when_k_covers_the_sequence(model, prompts):
    ids, mask = prompts
    full_seq, full_lp, _ = full_cache_generate(model, ids, mask, max_new_tokens=16, eos_token_id=[])
    seq, lp, stats = specache_generate(
        model, ids, mask, max_new_tokens=16, k=200, bits=1, window=8, group_size=16, eos_token_id=[]
    )
    assert torch.equal(seq, full_seq)
    assert torch.allclose(lp, full_lp, atol=1e-5)
    assert stats.fetches == SPEC.num_hidden_layers * 15 and stats.spec_tokens == 3 * 15


def test_exact_when_k_covers_the_sequence_sampling(model, prompts):
    ids, mask = prompts
    kw = dict(max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=50, eos_token_id=[])
    full_seq, full_lp, _ = full_cache_generate(model, ids, mask, generator=torch.Generator().manual_seed(3), **kw)
    seq, lp, _ = specache_generate(model, ids, mask, k=200, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(seq, full_seq)
    assert torch.allclose(lp, full_lp, atol=1e-5)


@pytest.mark.parametrize("bits, logprob_gap", [(1, 0.05), (2, 0.02)])
def test_small_k_compresses_and_stays_close(model, prompts, bits, logprob_gap):
    """k = 8 of 120-128 positions, an 8-token window, at about 3.4x (2-bit) and 3.7x (1-bit) less
    fast-tier memory: the greedy tokens are the full cache's, and each token's logprob within
    `logprob_gap` nats of the full cache's (measured: 0.007 and 0.024)."""
    ids, mask = prompts
    full_seq, full_lp, full_stats = full_cache_generate(model, ids, mask, max_new_tokens=8, eos_token_id=[])
    seq, lp, stats = specache_generate(
        model, ids, mask, max_new_tokens=8, k=8, bits=bits, window=8, group_size=16, eos_token_id=[]
    )
    assert stats.full_cache_bytes == full_stats.fast_tier_bytes and stats.compression > 3.0
    assert torch.equal(seq, full_seq)
    assert float((lp - full_lp).abs().max()) < logprob_gap


def test_fewer_bits_give_a_smaller_fast_tier(model, prompts):
    ids, mask = prompts
    _, _, full_stats = full_cache_generate(model, ids, mask, max_new_tokens=8, eos_token_id=[])
    by_bits = {}
    for bits in (1, 2):
        _, lp, stats = specache_generate(
            model, ids, mask, max_new_tokens=8, k=8, bits=bits, window=8, group_size=16, eos_token_id=[]
        )
        by_bits[bits] = stats
        assert torch.isfinite(lp).all()
    assert by_bits[1].fast_tier_bytes < by_bits[2].fast_tier_bytes < full_stats.fast_tier_bytes
    assert by_bits[1].compression > 3.0


def test_window_and_groups_invariants(model, prompts):
    ids, mask = prompts
    cfg = SpeCacheConfig(k=4, bits=2, window=8, group_size=16)
    valid = torch.cat([mask.bool(), torch.ones(3, 4, dtype=torch.bool)], 1)
    with SpeCache(SPEC.num_hidden_layers, cfg, capacity=valid.shape[1], valid=valid) as cache:
        model(
            ids,
            attention_mask={"full_attention": causal_padding_mask(valid[:, :0], mask.bool())},
            position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
            cache=cache,
            use_cache=True,
        )
    for layer in cache.layers:
        window = layer.window_keys.shape[2]
        assert layer.length == 120 and layer.n_quant % 16 == 0
        assert cfg.window <= window < cfg.window + cfg.group_size and layer.n_quant + window == 120


def test_eos_rows_are_padded_and_attention_restored(model, prompts):
    ids, mask = prompts
    seq, lp, _ = full_cache_generate(model, ids, mask, max_new_tokens=6, eos_token_id=[])
    eos = int(seq[0, 120])  # row 0's first generated token becomes the stop id
    out, out_lp, _ = specache_generate(model, ids, mask, max_new_tokens=6, k=200, eos_token_id=eos, pad_token_id=1)
    assert out[0, 120] == eos and (out[0, 121:] == 1).all() and (out_lp[0, 1:] == 0).all()
    assert out_lp[0, 0] < 0
    assert model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------- rollout backend wiring


def test_rollout_backend_serves_specache_and_matches_the_full_cache_when_k_covers(prompts):
    """`rollout.kv_cache=specache`: the HF rollout backend decodes through SpeCache; with k
    covering the whole sequence it is exact, with a small k it still returns well-formed rows."""
    from actors.rollout import HFBackend
    from rlsys.config import load_config
    from rlsys.generation import GenerationRequest, SamplingParams

    m = build_tiny_model(SPEC, None, seed=3).eval()
    m.config.eos_token_id, m.config.pad_token_id = 1, 0
    ids, mask = prompts
    reqs = [
        GenerationRequest(row[msk.bool()].tolist(), SamplingParams(max_new_tokens=12, temperature=0.0))
        for row, msk in zip(ids, mask)
    ]
    full = HFBackend("unused", model=m).generate(reqs)
    exact = HFBackend("unused", model=m, specache={"k": 400, "bits": 1, "window": 8}).generate(reqs)
    assert [g.response_ids for g in exact] == [g.response_ids for g in full]
    for a, b in zip(exact, full):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    small = HFBackend("unused", model=m, specache={"k": 8, "bits": 1, "window": 8}).generate(reqs)
    assert all(len(g.response_ids) == len(g.logprobs) <= 12 for g in small)
    assert load_config("configs/quickstart.yaml", ["rollout.kv_cache=specache"]).rollout.specache_settings() == {
        "k": 64,
        "bits": 2,
        "window": 32,
    }
    assert load_config("configs/quickstart.yaml", []).rollout.specache_settings() is None
