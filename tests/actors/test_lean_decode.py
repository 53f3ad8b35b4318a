"""The lean decode loop (actors/lean_decode.py) samples what transformers' generate would:
same greedy tokens and logprobs (Qwen2, Llama, Qwen3, Mistral; left padding, rows stopping at
different steps), the same truncated distribution, the weights most recently loaded, and a
fallback for other models (and for a Mistral whose sliding window is shorter than its context)."""

import numpy as np
import pytest
import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from actors.lean_decode import sample_next, supports_lean_decode
from actors.rollout import HFBackend
from rlsys.generation import GenerationRequest, SamplingParams
from rlsys.models import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = TinyModelSpec(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15]]


def qwen2():
    model = build_tiny_model(SPEC, seed=3).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)  # peaked next-token distributions: greedy ties are unlikely
    model.config.eos_token_id, model.config.pad_token_id = 1, 0
    return model


def tiny(config_cls, model_cls, seed: int, **config):
    """A random-init model of the tests' sizes (eos 1, pad 0) from one transformers family."""
    cfg = config_cls(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=1,
        pad_token_id=0,
        **config,
    )
    torch.manual_seed(seed)
    return model_cls(cfg).eval()


def llama():
    return tiny(LlamaConfig, LlamaForCausalLM, 4, attention_bias=True)


def qwen3():
    """Qwen3: an RMSNorm of every query and key head (weights away from 1, so they matter), a
    head_dim that is not hidden / heads, tied embeddings."""
    model = tiny(Qwen3Config, Qwen3ForCausalLM, 5, head_dim=16, tie_word_embeddings=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
            layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
        model.model.norm.weight.mul_(4.0)
    return model


def mistral(sliding_window=None):
    model = tiny(MistralConfig, MistralForCausalLM, 6, head_dim=8, sliding_window=sliding_window)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    return model


def phi3(**config):
    """Phi-3: q/k/v in one projection and gate/up in another (split by the loop's fusing)."""
    model = tiny(Phi3Config, Phi3ForCausalLM, 7, **config)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    return model


def gemma():
    """Gemma: norms that scale by 1 + weight (weights away from 0, so the offset matters),
    embeddings scaled by sqrt(hidden), a tanh-GELU-gated MLP, tied embeddings."""
    model = tiny(GemmaConfig, GemmaForCausalLM, 8, head_dim=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
        model.model.norm.weight.fill_(3.0)
    return model


def both(model, requests):
    lean = HFBackend("unused", model=model, decode="lean")
    plain = HFBackend("unused", model=model, decode="generate")
    assert lean.lean is not None and plain.lean is None
    return lean.generate(requests), plain.generate(requests)


@pytest.mark.parametrize("make", [qwen2, llama, qwen3, mistral, phi3, gemma])
def test_greedy_tokens_and_logprobs_match_generate(make):
    model = make()
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    _, free = both(model, [GenerationRequest(p, greedy) for p in PROMPTS])
    # stop tokens that end rows at different steps, so finished rows leave the batch mid-way
    stops = {free[0].response_ids[2], free[1].response_ids[6]}
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=tuple(sorted(stops)))
    lean, plain = both(model, [GenerationRequest(p, params) for p in PROMPTS])
    assert [g.response_ids for g in lean] == [g.response_ids for g in plain]
    assert [g.finish_reason for g in lean] == [g.finish_reason for g in plain]
    assert len({len(g.response_ids) for g in lean}) >= 2 and any(g.finish_reason == "stop" for g in lean)
    for a, b in zip(lean, plain):
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.parametrize("make", [qwen2, llama, qwen3, mistral, phi3, gemma])
def test_a_prompt_sampled_n_times_is_prefilled_once_and_decodes_as_generate(make, monkeypatch):
    from actors.lean_decode import LeanDecoder

    model = make()
    prefills = []
    forward = LeanDecoder.forward

    def recording_forward(self, ids, *args):  # calls through: records the prefill's batch rows
        if ids.shape[1] > 1:
            prefills.append(ids.shape[0])
        return forward(self, ids, *args)

    monkeypatch.setattr(LeanDecoder, "forward", recording_forward)
    params = SamplingParams(n=3, max_new_tokens=8, temperature=0.0)
    requests = [GenerationRequest(p, params) for p in [*PROMPTS, PROMPTS[1]]]  # a prompt in two requests too
    lean, plain = both(model, requests)
    assert prefills == [len(PROMPTS)]  # 15 rows, 4 distinct prompts
    key = lambda g: (g.request_index, g.response_ids)  # noqa: E731
    assert sorted(map(key, lean)) == sorted(map(key, plain)) and len(lean) == 3 * len(requests)
    for a, b in zip(sorted(lean, key=key), sorted(plain, key=key)):
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.9)])
def test_sampled_tokens_follow_the_warped_softmax(temperature, top_k, top_p):
    """Token frequencies match transformers' temperature -> top-k -> top-p distribution, and
    nothing outside its support is ever drawn."""
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.softmax(-1)[0]
    draws = sample_next(logits.expand(40000, -1), temperature, top_k, top_p, greedy=False)
    freq = torch.bincount(draws, minlength=12).float() / len(draws)
    assert set(draws.unique().tolist()) == set(expected.nonzero().squeeze(-1).tolist())
    assert torch.allclose(freq, expected, atol=0.01)


def test_sampled_logprobs_are_the_policy_softmax_of_the_drawn_tokens(one_torch_thread):
    model = qwen2()
    params = SamplingParams(n=8, max_new_tokens=6, temperature=0.8, seed=1)
    gens = HFBackend("unused", model=model).generate([GenerationRequest(p, params) for p in PROMPTS])
    g = gens[5]
    ids = torch.tensor([g.prompt_ids + g.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(g.prompt_ids) - 1 : -1] / 0.8
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.response_ids)[:, None]).squeeze(-1)
    assert np.allclose(g.logprobs, expected.tolist(), atol=1e-5)


def test_decoding_uses_the_weights_loaded_last(one_torch_thread):
    model, other = qwen2(), build_tiny_model(SPEC, seed=9).eval()
    other.config.eos_token_id, other.config.pad_token_id = 1, 0
    backend = HFBackend("unused", model=model)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    reqs = [GenerationRequest(p, params) for p in PROMPTS]
    before = backend.generate(reqs)
    backend.load_weights({k: v.numpy() for k, v in other.state_dict().items()})
    after = backend.generate(reqs)
    expected = HFBackend("unused", model=other, decode="generate").generate(reqs)
    assert [g.response_ids for g in after] == [g.response_ids for g in expected]
    lps = lambda gens: np.concatenate([g.logprobs for g in gens])
    assert np.allclose(lps(after), lps(expected), atol=1e-5)
    assert not np.allclose(lps(after), lps(before), atol=1e-2)


def test_fused_weights_follow_arrays_rewritten_in_place_and_in_place_edits(one_torch_thread):
    """The fused projections are kept between generate calls; they follow weights rewritten in
    the same arrays (a shared-memory slot the learner overwrote, loaded again: no new tensor, no
    torch op here) and in-place edits of a parameter."""
    model, other = qwen2(), build_tiny_model(SPEC, seed=9).eval()
    other.config.eos_token_id, other.config.pad_token_id = 1, 0
    backend = HFBackend("unused", model=model)
    reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=8, temperature=0.0)) for p in PROMPTS]
    slot = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    backend.load_weights(slot)
    lps = lambda gens: np.concatenate([g.logprobs for g in gens])  # noqa: E731
    before = lps(backend.generate(reqs))
    for k, v in other.state_dict().items():  # the learner rewrites the slot behind the model's back
        slot[k][...] = v.numpy()
    backend.load_weights(slot)
    expected = lps(HFBackend("unused", model=other, decode="generate").generate(reqs))
    assert np.allclose(lps(backend.generate(reqs)), expected, atol=1e-5)
    assert not np.allclose(before, expected, atol=1e-2)
    with torch.no_grad():  # an in-place edit, no load_weights
        for a, b in zip(model.parameters(), qwen2().parameters()):
            a.copy_(b)
    assert np.allclose(lps(backend.generate(reqs)), before, atol=1e-5)


def teacher_forced_logprobs(model, gens, bf16: bool) -> np.ndarray:
    """The model's own forward's logprobs of each generation's tokens, in fp32 or under bf16 autocast."""
    out = []
    for g in gens:
        ids = torch.tensor([g.prompt_ids + g.response_ids])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids).logits[0, len(g.prompt_ids) - 1 : -1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.response_ids)[:, None]).squeeze(-1))
    return torch.cat(out).numpy()


@pytest.mark.parametrize("make", [qwen2, llama, qwen3, mistral, phi3, gemma])
def test_bfloat16_decoding_computes_in_bfloat16_and_tracks_the_models_forward(make):
    """rollout.dtype bfloat16: the fused weights and the KV cache are bf16, the model's weights
    stay fp32, and the sampler's logprobs are the model's to bf16 rounding: as far from its fp32
    forward as its own forward under bf16 autocast is, and not equal to the fp32 ones."""
    model = make()
    backend = HFBackend("unused", model=model, dtype="bfloat16")
    params = SamplingParams(n=4, max_new_tokens=10, temperature=1.0, seed=2)
    gens = backend.generate([GenerationRequest(p, params) for p in PROMPTS])
    with torch.inference_mode():
        stream = backend.lean.start(torch.tensor([PROMPTS[0]]), torch.ones(1, len(PROMPTS[0]), dtype=torch.long), 8)
        logits = stream.logits()
    assert stream.cache[0][0].dtype == torch.bfloat16 and stream.fused[0]["qkv"][0].dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float32 and logits.dtype == torch.float32
    sampled = np.concatenate([g.logprobs for g in gens])
    fp32, autocast = teacher_forced_logprobs(model, gens, False), teacher_forced_logprobs(model, gens, True)
    off, autocast_off = np.abs(sampled - fp32), np.abs(autocast - fp32)
    assert off.mean() > 1e-4  # bf16 rounding, not an fp32 decode
    assert off.mean() < 3 * autocast_off.mean() + 1e-3 and off.max() < 0.25
    fp32_backend = HFBackend("unused", model=model)  # the default decodes in fp32, to float rounding
    assert fp32_backend.lean.dtype == torch.float32
    assert np.allclose(
        np.concatenate([g.logprobs for g in fp32_backend.generate([GenerationRequest(p, params) for p in PROMPTS])]),
        teacher_forced_logprobs(model, fp32_backend.generate([GenerationRequest(p, params) for p in PROMPTS]), False),
        atol=1e-5,
    )


def test_bfloat16_needs_the_lean_decoder(one_torch_thread):
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64, eos_token_id=1, pad_token_id=0)
    with pytest.raises(ValueError, match=r"rollout.dtype=bfloat16 is the lean decoder's, which does not run"):
        HFBackend("unused", model=GPT2LMHeadModel(cfg).eval(), dtype="bfloat16")
    with pytest.raises(ValueError, match=r"rollout.dtype=bfloat16 is the lean decoder's"):
        HFBackend("unused", model=qwen2(), decode="generate", dtype="bfloat16")


def test_other_architectures_fall_back_to_generate(one_torch_thread):
    assert not supports_lean_decode(mistral(sliding_window=16))  # a window shorter than the context: not ours
    assert not supports_lean_decode(phi3(partial_rotary_factor=0.5))  # rotary over half of each head
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    assert not supports_lean_decode(model)
    backend = HFBackend("unused", model=model)
    assert backend.lean is None
    gens = backend.generate([GenerationRequest(PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=0.0))])
    assert len(gens[0].response_ids) >= 1
    with pytest.raises(ValueError, match="rollout.decode"):
        HFBackend("unused", model=model, decode="fast")
