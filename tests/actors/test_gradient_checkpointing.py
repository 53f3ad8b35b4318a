"""learner.gradient_checkpointing (actors/modeling.py `enable_activation_checkpointing`): each
decoder layer is recomputed in the backward, and the learner's forwards (the plain one, the
shared-prompt one whose prompt pass hands its KV cache to the responses, the value head's) give
the same logprobs, values and gradients as without it; a learner step gives the same weights."""

import numpy as np
import pytest
import torch

from actors.modeling import PolicyOnly, PolicyWithValueHead, enable_activation_checkpointing
from rlsys.logprobs import response_logprobs, shared_prompt_passes
from rlsys.models import TinyModelSpec, build_tiny_model, load_model, save_model_dir
from tests.fakes import rows_sharing_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
TIGHT = dict(rtol=1e-5, atol=1e-6)  # float32, the same ops: the recompute is the forward again


def twin_models(architecture: str):
    """The same tiny model twice, in training mode; the second with its layers checkpointed."""
    spec = TinyModelSpec(**SPEC, architecture=architecture)
    plain, checkpointed = (build_tiny_model(spec, seed=3).train() for _ in range(2))
    assert enable_activation_checkpointing(checkpointed) == spec.num_hidden_layers
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), checkpointed.parameters()))
    return plain, checkpointed


def layer_runs(model) -> list:
    """A list that gets one entry each time a decoder layer's attention runs (its forward, and
    its recompute in the backward under checkpointing)."""
    runs = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda *_: runs.append(1))
    return runs


def outputs_and_grads(module, batch, response_mask, output: int):
    """(output [B, L-1] at the trainable positions, gradients of their sum w.r.t. every parameter)."""
    trainable = batch.response_mask > 0
    out = module(batch.input_ids, batch.attention_mask, 0.7, response_mask)[output][:, : trainable.shape[1]]
    grads = torch.autograd.grad((out * trainable).sum(), list(module.parameters()))
    return out[trainable], grads


def assert_same(a, b, **tol):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.allclose(out_a, out_b, **tol)
    assert len(grads_a) == len(grads_b)
    for ga, gb in zip(grads_a, grads_b):
        assert torch.allclose(ga, gb, **tol)


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_checkpointed_forwards_give_the_same_logprobs_and_gradients(architecture):
    """Plain and shared-prompt forwards of PolicyOnly: with checkpointing, the logprobs and every
    parameter's gradient are those without; each layer ran again in the backward; the shared
    prompt still ran once; and the shared-prompt forward under checkpointing is the plain one's."""
    prompts, batch = rows_sharing_prompts()
    plain_model, checkpointed_model = twin_models(architecture)
    plain, checkpointed = PolicyOnly(plain_model), PolicyOnly(checkpointed_model)
    plain_runs, checkpointed_runs = layer_runs(plain_model), layer_runs(checkpointed_model)
    batch_sizes = []
    checkpointed_model.register_forward_pre_hook(
        lambda m, a, kw: batch_sizes.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    layers = len(plain_model.model.layers)
    for response_mask, passes in ((None, 1), (batch.response_mask, 2)):
        plain_runs.clear(), checkpointed_runs.clear(), batch_sizes.clear()
        want = outputs_and_grads(plain, batch, response_mask, output=1)
        got = outputs_and_grads(checkpointed, batch, response_mask, output=1)
        assert_same(want, got, **TIGHT)
        assert len(plain_runs) == passes * layers  # each pass's layers once
        assert len(checkpointed_runs) == 2 * passes * layers  # and once more in the backward
        assert batch_sizes == ([len(batch)] if passes == 1 else [len(prompts), len(batch)])  # the prompts ran once
        if response_mask is None:
            plain_forward = got
    # the shared-prompt forward under checkpointing is the plain forward (test_models.py's tolerance)
    assert_same(plain_forward, got, atol=1e-4)


def test_the_value_head_under_checkpointing_gives_the_same_values_and_gradients():
    """PolicyWithValueHead (PPO): values from the last hidden state of the prompt pass and of the
    responses' pass, and all gradients (value head and policy), are those without checkpointing."""
    _, batch = rows_sharing_prompts(seed=1)
    plain_model, checkpointed_model = twin_models("qwen2")
    critics = PolicyWithValueHead(plain_model), PolicyWithValueHead(checkpointed_model)
    for critic in critics:
        torch.manual_seed(7)
        torch.nn.init.normal_(critic.value_head.weight, std=0.5)
    runs = layer_runs(checkpointed_model)
    for response_mask in (None, batch.response_mask):
        want, got = (outputs_and_grads(c, batch, response_mask, output=2) for c in critics)
        assert_same(want, got, **TIGHT)
    assert len(runs) == 2 * (1 + 2) * len(checkpointed_model.model.layers)


def test_the_recompute_reads_and_leaves_the_cache_as_the_forward_did():
    """The hazard: a checkpointed layer that writes the KV cache is run again in the backward,
    after the responses' pass has appended to the prompt's cache. Replayed on the cache as it was
    before the layer (`_replaying`), the backward leaves each layer's cache at prompt + response
    length and the gradients right; run on the live cache (no replay), the backward breaks."""
    import actors.modeling

    _, batch = rows_sharing_prompts()
    plen = batch.response_mask.gt(0).float().argmax(1) + 1
    plain_model, checkpointed_model = twin_models("qwen2")
    sums = []
    for model in (plain_model, checkpointed_model):
        passes = shared_prompt_passes(model, batch.input_ids, batch.attention_mask, plen)
        cache = passes.rest.cache
        width = int(plen.max() + passes.positions.shape[1])
        lengths = [layer.keys.shape[-2] for layer in cache.layers]
        assert lengths == [width] * len(cache.layers)
        loss = passes.rest.logits.square().mean() + passes.prefix.logits.square().mean()
        sums.append(torch.autograd.grad(loss, list(model.parameters())))
        assert [layer.keys.shape[-2] for layer in cache.layers] == lengths  # nothing appended in the backward
    for a, b in zip(*sums):
        assert torch.allclose(a, b, **TIGHT)

    original = actors.modeling._replaying
    actors.modeling._replaying = lambda forward, cache: forward
    try:
        logprobs = response_logprobs(checkpointed_model, batch.input_ids, batch.attention_mask, batch.response_mask)[1]
        with pytest.raises(RuntimeError):
            torch.autograd.grad((logprobs * batch.response_mask).sum(), list(checkpointed_model.parameters()))
    finally:
        actors.modeling._replaying = original


def test_without_gradients_or_in_eval_mode_nothing_is_checkpointed():
    """The reference-style scoring (no_grad) and an eval-mode forward run the layers once, the
    shared-prompt cache included, with the same logprobs."""
    _, batch = rows_sharing_prompts()
    plain_model, checkpointed_model = twin_models("qwen2")
    runs = layer_runs(checkpointed_model)
    with torch.no_grad():
        want, got = (
            response_logprobs(m, batch.input_ids, batch.attention_mask, batch.response_mask)[1]
            for m in (plain_model, checkpointed_model)
        )
    assert torch.equal(want, got) and len(runs) == 2 * len(checkpointed_model.model.layers)
    runs.clear()
    checkpointed_model.eval()
    logprobs = response_logprobs(checkpointed_model, batch.input_ids, batch.attention_mask, batch.response_mask)[1]
    logprobs.sum().backward()
    assert torch.allclose(logprobs, want, **TIGHT) and len(runs) == 2 * len(checkpointed_model.model.layers)


def test_transformers_own_checkpointing_falls_back_to_the_plain_forward():
    """transformers' `activation_checkpointing_enable` turns the cache off in training: the
    shared-prompt forward then steps aside (no prompt pass) and the plain forward serves, with
    the same gradients."""
    _, batch = rows_sharing_prompts()
    plain_model, hf_model = (build_tiny_model(TinyModelSpec(**SPEC), seed=3).train() for _ in range(2))
    hf_model.activation_checkpointing_enable()
    plen = batch.response_mask.gt(0).float().argmax(1) + 1
    assert shared_prompt_passes(hf_model, batch.input_ids, batch.attention_mask, plen) is None
    want, got = (outputs_and_grads(PolicyOnly(m), batch, batch.response_mask, 1) for m in (plain_model, hf_model))
    assert_same(want, got, atol=1e-4)


@pytest.mark.parametrize("algorithm, zero_stage", [("grpo", 0), ("ppo", 3)])
def test_a_learner_step_with_checkpointing_gives_the_same_weights(tmp_path, algorithm, zero_stage):
    """The learner (in process, one rank) with learner.gradient_checkpointing: two optimizer
    steps on a batch whose rows share prompts give the policy weights (and the loss) the learner
    without it gives, GRPO under ZeRO-0 and PPO (the value head) under ZeRO-3 (the recompute
    gathers the sharded parameters again); its layers ran again in the backward; `restart`
    checkpoints the rebuilt policy too."""
    from actors.learner import Learner
    from algorithms.grpo import GRPO
    from algorithms.ppo import PPO
    from rlsys.cluster import free_port

    model_dir = save_model_dir(build_tiny_model(TinyModelSpec(**SPEC), seed=3), None, tmp_path / "policy")
    _, batch = rows_sharing_prompts(seed=2)
    g = torch.Generator().manual_seed(3)
    shape, mask = batch.response_mask.shape, batch.response_mask
    batch.old_logprobs = (-torch.rand(shape, generator=g) * 3) * mask
    batch.ref_logprobs = (-torch.rand(shape, generator=g) * 3) * mask
    batch.advantages = torch.randn(shape, generator=g) * mask
    batch.old_values = torch.randn(shape, generator=g) * mask
    batch.returns = torch.randn(shape, generator=g) * mask
    make = lambda: GRPO(GRPO.Config(group_size=3, kl_coef=0.0)) if algorithm == "grpo" else PPO()
    weights, losses = [], []
    try:  # both learners in one process group
        for checkpointing in (False, True):
            learner = Learner(
                str(model_dir),
                make(),
                minibatches=2,
                zero_stage=zero_stage,
                master_port=free_port(),
                gradient_checkpointing=checkpointing,
            )
            runs = layer_runs(learner.module.policy)
            metrics = learner.train_step(batch.select(slice(None)))
            layers = len(learner.module.policy.model.layers)
            assert len(runs) == (2 if checkpointing else 1) * 2 * 2 * layers  # x (prompt + responses) x minibatches
            weights.append(learner.weights())  # gathered under ZeRO-3
            losses.append(metrics["loss"])
            learner.restart(str(model_dir))
            checkpointed = ["forward" in vars(layer) for layer in learner.module.policy.model.layers]
            assert checkpointed == [checkpointing] * layers
    finally:  # DeepSpeed's: it also drops the groups it cached, so a later learner in this process starts clean
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert weights[0].keys() == weights[1].keys()
    for name, w in weights[0].items():
        assert np.allclose(w, weights[1][name], **TIGHT), name
    initial = load_model(model_dir).state_dict()["model.layers.0.mlp.up_proj.weight"].numpy()
    assert not np.array_equal(weights[0]["model.layers.0.mlp.up_proj.weight"], initial)  # the steps moved it


def test_the_config_key_defaults_off_and_reaches_the_learner():
    import inspect

    from actors.learner import Learner
    from rlsys.config import load_config
    from rlsys.run import actors

    assert load_config().learner.gradient_checkpointing is False
    assert load_config(overrides=["learner.gradient_checkpointing=true"]).learner.gradient_checkpointing is True
    assert inspect.signature(Learner).parameters["gradient_checkpointing"].default is False
    assert "gradient_checkpointing=l.gradient_checkpointing" in inspect.getsource(actors.start_actors)
