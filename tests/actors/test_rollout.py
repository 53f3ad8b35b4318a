"""The transformers rollout backend samples from the distribution its logprobs describe."""

import torch

from actors.rollout import HFBackend
from rlsys.generation import GenerationRequest, SamplingParams
from rlsys.models import TinyModelSpec, build_tiny_model


def tiny_spec(vocab: int = 64, layers: int = 1) -> TinyModelSpec:
    return TinyModelSpec(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def test_sampling_draws_from_the_full_softmax(one_torch_thread):
    """top_k=0 / top_p=1.0 sample the full softmax the learner differentiates: no default
    truncation (transformers' global default is top_k=50) hides most of a near-uniform
    256-token distribution, and the logprobs are that distribution's."""
    spec = tiny_spec(vocab=256)
    model = build_tiny_model(spec, None, seed=0).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(0.01)  # near-uniform next-token distribution
    model.config.eos_token_id, model.config.pad_token_id = 1, 0
    params = SamplingParams(n=2000, max_new_tokens=1, temperature=1.0, seed=0)
    gens = HFBackend("unused", model=model, batch_size=500).generate([GenerationRequest([5, 6, 7], params)])
    first_tokens = {g.response_ids[0] for g in gens}
    assert len(first_tokens) > 150
    logprobs = torch.tensor([g.logprobs[0] for g in gens])
    assert torch.allclose(logprobs, torch.full_like(logprobs, -torch.log(torch.tensor(256.0))), atol=0.05)


def test_loaded_weights_are_read_in_place_not_copied():
    """A weight sync points the rollout model at the received arrays (no copy into the model):
    tied embeddings stay one tensor, the outputs are the new weights', and a missing or
    misshapen tensor is named."""
    import numpy as np
    import pytest

    spec = tiny_spec()
    model, other = build_tiny_model(spec, None, seed=0).eval(), build_tiny_model(spec, None, seed=1).eval()
    backend = HFBackend("unused", model=model)
    weights = {k: v.numpy().copy() for k, v in other.state_dict().items()}
    backend.load_weights(weights)
    emb = model.model.embed_tokens.weight
    assert emb.data_ptr() == weights["model.embed_tokens.weight"].__array_interface__["data"][0]
    assert model.lm_head.weight is emb  # still tied
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, other(input_ids=ids).logits)
    with pytest.raises(KeyError, match="lack"):
        backend.load_weights({k: v for k, v in weights.items() if "mlp" not in k})
    bad = dict(weights, **{"model.norm.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        backend.load_weights(bad)


def test_an_empty_prompt_is_named_before_any_generation():
    import pytest

    spec = tiny_spec()
    backend = HFBackend("unused", model=build_tiny_model(spec, None, seed=0).eval())
    reqs = [
        GenerationRequest([5, 6], SamplingParams(max_new_tokens=2)),
        GenerationRequest([], SamplingParams(max_new_tokens=2)),
    ]
    with pytest.raises(ValueError, match="generation request 1 has an empty prompt"):
        backend.generate(reqs)


def chunk_models():
    spec = tiny_spec(layers=2)
    models = [build_tiny_model(spec, None, seed=s).eval() for s in (0, 1)]
    for m in models:
        m.config.eos_token_id, m.config.pad_token_id = 1, 0
    return models


def test_partial_rollouts_resume_from_the_prefix_and_record_each_tokens_version(one_torch_thread):
    """rollout.inflight_update resume: under unchanged weights, greedy decoding in chunks gives the
    unchunked tokens (and their logprobs); when new weights load between two chunks, the tokens
    after are the new policy's continuation of the same prefix, each marked with its version."""
    from rlsys.generation import generate_in_chunks

    policy, newer = chunk_models()
    backend = HFBackend("unused", model=policy)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    requests = [GenerationRequest([5, 6, 7], greedy), GenerationRequest([9, 3, 4, 8, 2], greedy)]
    whole = backend.generate(requests)
    chunked = generate_in_chunks(lambda asked: {"p": backend.generate(asked["p"])}, {"p": requests}, 5)["p"]
    for a, b in zip(whole, chunked):
        assert a.response_ids == b.response_ids and len(b.response_ids) == 12
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
        assert b.token_versions == [0] * 12 and b.policy_version == 0

    version = {"now": 0}

    def generate_each(asked):  # the worker receives new weights after the first chunk
        gens = backend.generate(asked["p"])
        for g in gens:
            g.policy_version = version["now"]
        if version["now"] == 0:
            backend.load_weights({k: v.numpy().copy() for k, v in newer.state_dict().items()})
            version["now"] = 1
        return {"p": gens}

    backend.load_weights({k: v.numpy().copy() for k, v in policy.state_dict().items()})
    resumed = generate_in_chunks(generate_each, {"p": requests}, 5)["p"]
    for request, first, g in zip(requests, whole, resumed):
        assert g.response_ids[:5] == first.response_ids[:5]  # the first chunk: the old policy's
        assert g.token_versions == [0] * 5 + [1] * 7 and g.policy_version == 0
        prefix = GenerationRequest(
            request.prompt_ids + g.response_ids[:5], SamplingParams(max_new_tokens=7, temperature=0.0)
        )
        assert g.response_ids[5:] == backend.generate([prefix])[0].response_ids  # the newer policy's continuation


def test_partial_rollouts_keep_n_samples_per_request_in_order(one_torch_thread):
    from rlsys.generation import generate_in_chunks

    backend = HFBackend("unused", model=chunk_models()[0])
    params = SamplingParams(n=3, max_new_tokens=9, temperature=1.0, seed=4)
    requests = [GenerationRequest([5, 6, 7], params), GenerationRequest([9, 3], params)]
    gens = generate_in_chunks(lambda asked: {"p": backend.generate(asked["p"])}, {"p": requests}, 4)["p"]
    assert [g.request_index for g in gens] == [0, 0, 0, 1, 1, 1]
    assert [g.prompt_ids for g in gens] == [[5, 6, 7]] * 3 + [[9, 3]] * 3
    assert any(len(g.response_ids) > 4 for g in gens)  # some were resumed past the first chunk
    for g in gens:
        assert 1 <= len(g.response_ids) <= 9 and len(g.logprobs) == len(g.token_versions) == len(g.response_ids)
        assert g.finish_reason == ("stop" if g.response_ids[-1] == 1 else "length")


def test_continue_loads_new_weights_between_decode_steps_over_the_old_cache(one_torch_thread):
    """rollout.inflight_update continue: new weights loaded after the 4th token are used from
    the forward of that token on, attending to the keys and values the old weights wrote (kept,
    not prefilled again): every later logprob is the newer model's over the old model's cache,
    and each token records the version that sampled it."""
    policy, newer = chunk_models()
    reference = chunk_models()[0]  # the old weights, kept for the check (the backend's model changes)
    backend = HFBackend("unused", model=policy)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    requests = [GenerationRequest([5, 6, 7], greedy), GenerationRequest([9, 3, 4, 8, 2], greedy)]
    whole = backend.generate(requests)
    calls = []

    def weights_between_steps():  # called before the prefill and after each step's draw
        calls.append(len(calls))
        if len(calls) == 5:  # after the 4th token was drawn
            backend.load_weights({k: v.numpy().copy() for k, v in newer.state_dict().items()})
        return 0 if len(calls) < 5 else 1

    continued = backend.generate(requests, weights_between_steps=weights_between_steps)
    for request, first, g in zip(requests, whole, continued):
        n = len(g.response_ids)
        assert g.response_ids[:4] == first.response_ids[:4] and n > 5
        assert g.token_versions == [0] * 4 + [1] * (n - 4)
        tokens = torch.tensor([request.prompt_ids + g.response_ids])
        p = len(request.prompt_ids)
        with torch.no_grad():  # the old model over the prompt and 3 tokens, then the newer one over its cache
            cache = reference(input_ids=tokens[:, : p + 3], use_cache=True).past_key_values
            later = newer(input_ids=tokens[:, p + 3 : p + n - 1], cache=cache).logits[0].float()
            fresh = newer(input_ids=tokens[:, : p + 4]).logits[0, -1].float()  # the prefix prefilled again
        want = torch.log_softmax(later, -1).gather(-1, tokens[0, p + 4 : p + n, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(g.logprobs[4:]), want, atol=1e-4)
        assert g.response_ids[4:] == later.argmax(-1).tolist()  # greedy under the newer model
        assert abs(torch.log_softmax(fresh, -1)[g.response_ids[4]] - g.logprobs[4]) > 1e-3  # the old cache counts
    assert len(calls) == 12  # one batch: once before the prefill, then after every step but the last


def test_a_worker_takes_an_offer_during_its_generation_and_only_the_newest(one_torch_thread, tmp_path):
    """The worker's side of continue: an offer while it is idle loads at once; one that arrives
    during a generation (from another thread, as the actor's "weights" group calls it) loads at a
    decode step boundary, the tokens before and after it marked with their versions; an offer
    older than the weights held is dropped, and corrupt weights are refused before they load."""
    import threading

    import pytest

    from actors.rollout import RolloutWorker
    from rlsys.errors import WeightsCorrupt
    from rlsys.models import save_model_dir
    from rlsys.weight_digest import digest

    policy, newer = chunk_models()
    save_model_dir(policy, None, tmp_path / "policy")
    worker = RolloutWorker(str(tmp_path / "policy"), inflight_update="continue")
    weights = [{k: v.numpy().copy() for k, v in m.state_dict().items()} for m in (policy, newer)]
    assert worker.offer_weights(1, weights[0], digest(weights[0])) == 1 and worker.version == 1  # idle: now
    request = GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=400, temperature=0.0))
    at_tenth_step, offered = threading.Event(), threading.Event()
    between_steps = worker._take_offered

    def held_at_the_tenth_step():  # the generation waits there until the offer is made
        calls.append(None)
        if len(calls) == 10:
            at_tenth_step.set()
            offered.wait(timeout=60)
        return between_steps()

    calls, out = [], []
    worker._take_offered = held_at_the_tenth_step
    generating = threading.Thread(target=lambda: out.extend(worker.generate([request])))
    generating.start()
    assert at_tenth_step.wait(timeout=60)
    worker.offer_weights(2, weights[1], digest(weights[1]))  # the generation holds the model: it waits
    assert worker.version == 1 and worker.offers.pending()
    offered.set()
    generating.join()
    assert out[0].token_versions == [1] * 9 + [2] * 391  # loaded after the 9th token's draw
    assert out[0].policy_version == 1 and worker.version == 2
    versions = out[0].token_versions
    worker.offer_weights(1, weights[0])  # older than held: not loaded
    assert worker.version == 2 and worker.generate([request])[0].token_versions == [2] * len(versions)
    with pytest.raises(WeightsCorrupt, match="version 3 arrived corrupt"):
        worker.offer_weights(3, weights[0], digest(weights[1]))
    assert worker.version == 2 and not worker.offers.pending()


def test_a_one_token_prompt_decodes_as_transformers_does(one_torch_thread):
    """A prompt of a single token is a prefill of one position (its own mask), not a decode step."""
    policy, _ = chunk_models()
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    lean = HFBackend("unused", model=policy).generate([GenerationRequest([5], params)])[0]
    plain = HFBackend("unused", model=policy, decode="generate").generate([GenerationRequest([5], params)])[0]
    assert lean.response_ids == plain.response_ids
    assert torch.allclose(torch.tensor(lean.logprobs), torch.tensor(plain.logprobs), atol=1e-4)
