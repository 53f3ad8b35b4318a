"""learner.lora (actors/lora.py): the learner trains peft adapters only; a sync sends them alone;
the rollout worker, the reference and a vLLM adapter directory serve W0 + alpha/r * B A, equal to
the learner's own forward; checkpoints hold the adapters and their optimizer state; the HF export
is the merged model or peft's adapter directory."""

import numpy as np
import pytest
import torch

from actors.lora import SCALING, MergedAdapters, adapter_pairs, merged_weight, write_peft_adapter
from rlsys.experience import make_experience
from rlsys.models import TinyModelSpec, build_tiny_model, load_model, save_model_dir
from tests.fakes import rows_sharing_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread", "in_process_learners")

SPEC = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
LORA = dict(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj"], export="merged")
CLOSE = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def model_dir(tmp_path):
    return save_model_dir(build_tiny_model(TinyModelSpec(**SPEC), seed=3), None, tmp_path / "policy")


def training_batch(seed: int = 2):
    _, batch = rows_sharing_prompts(seed=seed)
    g = torch.Generator().manual_seed(seed)
    shape, mask = batch.response_mask.shape, batch.response_mask
    batch.old_logprobs = (-torch.rand(shape, generator=g) * 3) * mask
    batch.ref_logprobs = (-torch.rand(shape, generator=g) * 3) * mask
    batch.advantages = torch.randn(shape, generator=g) * mask
    return batch


def make_learner(model_dir, lora=LORA, **kw):
    from actors.learner import Learner
    from algorithms.grpo import GRPO
    from rlsys.cluster import free_port

    return Learner(
        str(model_dir), GRPO(GRPO.Config(group_size=3, kl_coef=0.0)), lr=1e-2, master_port=free_port(), lora=lora, **kw
    )


@torch.no_grad()
def logits_of(model, batch):
    model.eval()
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def test_the_learner_trains_and_syncs_the_adapters_only(model_dir):
    """The optimizer holds the adapters' A and B only; a step moves them and leaves every base
    weight as it was; the sync's tensors are the adapters and their scaling (a fraction of the
    policy's bytes), with peft's names and shapes [r, in] and [out, r]."""
    learner = make_learner(model_dir)
    named = dict(learner.module.named_parameters())
    trained = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert {n for n, p in named.items() if id(p) in trained} == {n for n in named if ".lora_" in n}
    assert len(trained) == 2 * 3 * SPEC["num_hidden_layers"]  # A and B of 3 layers per decoder block
    before = {n: p.detach().clone() for n, p in named.items()}
    learner.train_step(training_batch())
    after = dict(learner.module.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in named if ".lora_" not in n)
    assert any(not torch.equal(before[n], after[n]) for n in named if ".lora_B" in n)

    weights = learner.weights()
    assert float(weights[SCALING][0]) == LORA["alpha"] / LORA["rank"]
    pairs = adapter_pairs(weights)
    assert len(pairs) == 3 * SPEC["num_hidden_layers"] and "model.layers.0.self_attn.q_proj" in pairs
    a, b = pairs["model.layers.1.mlp.gate_proj"]
    assert a.shape == (4, SPEC["hidden_size"]) and b.shape == (SPEC["intermediate_size"], 4)
    full = sum(t.numel() for t in load_model(model_dir).state_dict().values())
    assert sum(w.size for w in weights.values()) < full / 10
    assert learner.bucket_names(0.0001) == [list(weights)]  # one bucket: a receiver merges A with its B


def test_a_worker_and_the_reference_serve_what_the_learner_trains(model_dir):
    """A rollout backend and a reference worker over the initial policy, given the synced
    adapters, give the learner's logits; a second sync is merged onto the initial weights again,
    not onto the first merge."""
    from actors.reference import ReferenceWorker
    from actors.rollout import HFBackend

    learner, batch = make_learner(model_dir), training_batch()
    backend, reference = HFBackend(str(model_dir)), ReferenceWorker(str(model_dir))
    for _ in range(2):
        learner.train_step(batch)
        backend.load_weights(learner.weights())
        reference.load_weights(learner.weights())
        want = logits_of(learner.module.policy, batch)
        assert torch.allclose(logits_of(backend.model, batch), want, **CLOSE)
        assert torch.allclose(logits_of(reference.model, batch), want, **CLOSE)
        learner.engine.train()


def test_the_learner_with_its_adapters_off_is_the_reference(model_dir):
    """Under learner.lora the run's reference is the learner's base with the adapters off: after
    steps that moved the adapters its logprobs are a reference worker's over the initial policy,
    not the policy's own, and the adapters are on again afterwards."""
    from actors.reference import ReferenceWorker

    learner = make_learner(model_dir)
    for _ in range(3):
        learner.train_step(training_batch())
    g = torch.Generator().manual_seed(5)
    rows = [
        dict(
            uid=f"{i}-{k}",
            group=str(i),
            prompt_ids=torch.randint(3, 64, (2 + i,), generator=g).tolist(),
            response_ids=torch.randint(3, 64, (1 + k,), generator=g).tolist(),
            logprobs=[],
            reward=0.0,
            policy_version=0,
        )
        for i in range(3)
        for k in range(3)
    ]
    table = make_experience(rows)
    policy = learner.logprobs(table)
    got, want = learner.reference_logprobs(table), ReferenceWorker(str(model_dir)).logprobs(table)
    flat = lambda rows: np.concatenate([np.asarray(r) for r in rows])
    assert np.allclose(flat(got), flat(want), atol=1e-5)
    assert np.abs(flat(policy) - flat(want)).max() > 1e-3
    assert np.array_equal(flat(learner.logprobs(table)), flat(policy))


def test_a_generation_after_a_lora_sync_uses_the_merged_weights(model_dir):
    """The lean decoder re-reads the merged weights: greedy tokens and their logprobs after a
    sync are those of the merged model decoded with transformers' generate."""
    from actors.rollout import HFBackend
    from rlsys.generation import GenerationRequest, SamplingParams

    learner = make_learner(model_dir)
    for _ in range(3):
        learner.train_step(training_batch())
    lean, generate = HFBackend(str(model_dir)), HFBackend(str(model_dir), decode="generate")
    request = GenerationRequest(prompt_ids=[5, 9, 11], params=SamplingParams(max_new_tokens=6, temperature=0.0))
    before = lean.generate([request])[0]
    for backend in (lean, generate):
        backend.load_weights(learner.weights())
    got, want = lean.generate([request])[0], generate.generate([request])[0]
    assert got.response_ids == want.response_ids and np.allclose(got.logprobs, want.logprobs, atol=1e-5)
    assert before.logprobs != got.logprobs


def test_merging_follows_the_lora_formula_and_names_a_bad_sync():
    """W = W0 + s * B @ A (transposed for a [in, out] weight); an A without its B, a stray name
    or a layer the model lacks is a one-line KeyError."""
    g = torch.Generator().manual_seed(0)
    base, a, b = torch.randn(6, 5, generator=g), torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)
    assert torch.allclose(merged_weight(base, a, b, 0.5), base + 0.5 * b @ a)
    assert torch.allclose(merged_weight(base.T.contiguous(), a, b, 0.5), (base + 0.5 * b @ a).T)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6))
    good = {
        "base_model.model.0.lora_A.weight": a.numpy(),
        "base_model.model.0.lora_B.weight": b.numpy(),
        SCALING: np.array([0.5], dtype=np.float32),
    }
    with pytest.raises(KeyError, match="lacks lora_A or lora_B of 0"):
        adapter_pairs({k: v for k, v in good.items() if "lora_B" not in k})
    with pytest.raises(KeyError, match="is not a layer's lora_A or lora_B"):
        adapter_pairs({**good, "base_model.model.0.weight": a.numpy()})
    with pytest.raises(KeyError, match="has no parameter 1.weight"):
        MergedAdapters(model).load({k.replace(".0.", ".1."): v for k, v in good.items()})
    w0 = model[0].weight.detach().clone()
    merged = MergedAdapters(model)
    merged.load(good)
    merged.load(good)  # twice: from W0 each time
    assert torch.allclose(model[0].weight, w0 + 0.5 * b @ a, atol=1e-6)


def test_the_synced_adapters_as_a_peft_directory_load_in_peft(model_dir, tmp_path):
    """The vLLM backend's adapter directory (write_peft_adapter, from the synced tensors alone)
    is a peft adapter: PeftModel.from_pretrained over the initial policy gives the learner's logits."""
    from peft import PeftModel

    learner, batch = make_learner(model_dir), training_batch()
    learner.train_step(batch)
    path = write_peft_adapter(learner.weights(), tmp_path / "adapter", str(model_dir))
    peft_model = PeftModel.from_pretrained(load_model(model_dir), str(path))
    assert torch.allclose(logits_of(peft_model, batch), logits_of(learner.module.policy, batch), **CLOSE)


@pytest.mark.parametrize("export", ["merged", "adapter"])
def test_the_hf_export_is_the_merged_model_or_the_adapter_directory(model_dir, tmp_path, export):
    """export merged: a model dir AutoModelForCausalLM loads, with the learner's logits and no
    LoRA names; export adapter: peft's directory, which PeftModel.from_pretrained loads over the
    initial policy with the same logits. The tokenizer goes beside either."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    learner, batch = make_learner(model_dir, lora={**LORA, "export": export}), training_batch()
    learner.train_step(batch)
    learner.export_hf(str(tmp_path / "hf"))
    if export == "merged":
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        assert not any("lora" in k or "base_layer" in k for k in model.state_dict())
    else:
        assert (tmp_path / "hf" / "adapter_config.json").exists()
        model = PeftModel.from_pretrained(load_model(model_dir), str(tmp_path / "hf"))
    assert torch.allclose(logits_of(model, batch), logits_of(learner.module.policy, batch), **CLOSE)


def test_a_checkpoint_holds_the_adapters_and_resumes_them_exactly(model_dir, tmp_path):
    """The learner checkpoint has no frozen base weight in it (a fraction of a full one's size);
    loaded into a fresh learner over the initial policy, the next step gives bit-identical
    adapters to the uninterrupted learner's (the optimizer's moments came back too)."""
    learner, batch = make_learner(model_dir), training_batch()
    learner.train_step(batch)
    learner.save(str(tmp_path / "ckpt"))
    states = torch.load(tmp_path / "ckpt" / "learner" / "mp_rank_00_model_states.pt", weights_only=False)
    assert states["module"] and all(".lora_" in k for k in states["module"])
    full = make_learner(model_dir, lora=None)
    full.train_step(batch)  # its AdamW moments exist too
    full.save(str(tmp_path / "full"))
    size = lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    assert size(tmp_path / "ckpt") < size(tmp_path / "full") / 3

    resumed = make_learner(model_dir)
    resumed.load(str(tmp_path / "ckpt"))
    learner.train_step(batch)
    resumed.train_step(batch)
    a, b = learner.weights(), resumed.weights()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_checkpointing_with_lora_gives_the_same_step(model_dir):
    """learner.gradient_checkpointing with LoRA (frozen base, the adapters inside the recomputed
    layers) gives the same adapters after a step as without it."""
    plain, checkpointed = make_learner(model_dir), make_learner(model_dir, gradient_checkpointing=True)
    batch = training_batch()
    plain.train_step(batch)
    checkpointed.train_step(batch)
    a, b = plain.weights(), checkpointed.weights()
    assert all(np.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert any(not np.allclose(v, 0) for k, v in a.items() if "lora_B" in k)


def test_bad_lora_settings_fail_in_one_line(model_dir):
    from rlsys.config import ConfigError, load_config

    with pytest.raises(ValueError, match=r"learner.lora.target_modules \['attn_q'\]"):
        make_learner(model_dir, lora={**LORA, "target_modules": ["attn_q"]})
    with pytest.raises(ConfigError, match="learner.lora"):
        load_config("configs/quickstart.yaml", ["learner.lora.rank=-1"])
    from algorithms.base import build_algorithm

    cfg = load_config(
        "configs/quickstart.yaml", ["learner.lora.rank=8", "rollout.backend=vllm", "trainer.weight_sync=broadcast"]
    )
    with pytest.raises(ConfigError, match="not broadcast"):
        build_algorithm(cfg)


def test_lora_with_packed_microbatches_gives_the_same_step(model_dir):
    """learner.max_tokens_per_microbatch with LoRA: the packed micro-batches accumulate the
    adapters' gradients into the same step as the padded forward."""
    padded, packed = make_learner(model_dir), make_learner(model_dir, max_tokens_per_microbatch=16)
    batch = training_batch()
    padded.train_step(batch)
    packed.train_step(batch)
    a, b = padded.weights(), packed.weights()
    assert all(np.allclose(a[k], b[k], atol=2e-4) for k in a)
    assert any(not np.allclose(v, 0) for k, v in a.items() if "lora_B" in k)
