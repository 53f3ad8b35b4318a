import pytest
import torch

from rlsys.models import (
    TinyModelSpec,
    build_tiny_model,
    load_model,
    load_policy_tokenizer,
    load_tokenizer,
    num_parameters,
    save_model_dir,
    train_tokenizer,
)

TEXTS = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]


def test_tokenizer_and_model_round_trip(tmp_path):
    tok = train_tokenizer(TEXTS, vocab_size=300)
    ids = tok("12+34=46", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "12+34=46"
    assert len(tok("123", add_special_tokens=False)["input_ids"]) == 3  # digits stay single tokens
    model = build_tiny_model(TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2), tok, seed=1)
    assert 10_000 < num_parameters(model) < 2_000_000
    save_model_dir(model, tok, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").exists()
    tok2, model2 = load_tokenizer(tmp_path / "m"), load_model(tmp_path / "m")
    assert tok2("12+34=46", add_special_tokens=False)["input_ids"] == ids
    assert (tok2.eos_token_id, tok2.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(model(x).logits, model2(x).logits)


def test_a_policy_tokenizer_without_eos_is_refused_and_one_without_pad_pads_with_eos(tmp_path):
    """model.path's tokenizer: no eos token is a one-line config error naming the dir; no pad token
    (Llama's, Mistral's) pads with eos, so rows of different lengths collate (the warm-up's batches)."""
    from rlsys.batch import collate_ids
    from rlsys.config import ConfigError

    tok = train_tokenizer(TEXTS, vocab_size=300)
    tok.pad_token = None
    tok.save_pretrained(str(tmp_path / "no_pad"))
    loaded = load_policy_tokenizer(tmp_path / "no_pad")
    assert loaded.pad_token_id == loaded.eos_token_id == tok.eos_token_id
    batch = collate_ids([[5, 6, 7], [5]], [[8], [9]], pad_id=loaded.pad_token_id)
    assert batch.input_ids[1].tolist() == [5, 9, tok.eos_token_id, tok.eos_token_id]
    tok.eos_token = None
    tok.save_pretrained(str(tmp_path / "no_eos"))
    with pytest.raises(ConfigError, match=r"model.path .*no_eos: its tokenizer has no eos token"):
        load_policy_tokenizer(tmp_path / "no_eos")


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "llama", "mistral", "phi3", "gemma"])
def test_every_tiny_architecture_round_trips_and_runs_the_lean_decode_loop(tmp_path, architecture):
    """`model.architecture`: the tiny factory builds each Llama-family type with head_dim =
    hidden / heads, saves it, loads it back with from_pretrained to the same logits, and the
    rollout worker's lean decode loop serves it; a reward model of the same spec is a one-logit
    sequence classifier of that type."""
    from actors.lean_decode import supports_lean_decode
    from rlsys.reward_model import build_reward_model

    tok = train_tokenizer(TEXTS, vocab_size=300)
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, architecture=architecture)
    model = build_tiny_model(spec, tok, seed=1)
    assert model.config.model_type == architecture and model.config.head_dim == 8 and supports_lean_decode(model)
    loaded = load_model(save_model_dir(model, tok, tmp_path / "m"))
    x = torch.tensor([tok("12+34=46", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)
    rm = build_reward_model(tok, spec, seed=2)
    assert rm.config.model_type == architecture and rm(x).logits.shape == (1, 1)


def test_same_seed_same_weights():
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    a, b = build_tiny_model(spec, seed=3), build_tiny_model(spec, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_rows_sharing_a_prompt_run_it_once_with_the_same_logprobs_and_gradients():
    """The learner's forward (PolicyOnly / PolicyWithValueHead with a response mask): each distinct
    prompt runs once and its keys/values serve its group's rows; every trainable position's
    logprob and value, and their gradients, are the plain forward's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.modeling import PolicyOnly, PolicyWithValueHead
    from rlsys.batch import collate_ids
    from rlsys.logprobs import shared_prompt_logprobs
    from tests.fakes import rows_sharing_prompts

    spec = TinyModelSpec(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(4)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
        )
    )
    prompts, batch = rows_sharing_prompts()  # a multi-turn row too: its environment tokens still get their context
    trainable = batch.response_mask > 0
    for model in (build_tiny_model(spec, seed=3), llama):
        policy = PolicyOnly(model)
        _, plain, _ = policy(batch.input_ids, batch.attention_mask, 0.7)
        logits, shared, _ = policy(batch.input_ids, batch.attention_mask, 0.7, batch.response_mask)
        assert logits[0, 0].abs().sum() == 0  # the first prompt token was not recomputed per row
        assert torch.allclose(plain[trainable], shared[trainable], atol=1e-5)
        grads = [torch.autograd.grad((lp * trainable).sum(), list(model.parameters())) for lp in (plain, shared)]
        for a, b in zip(*grads):
            assert torch.allclose(a, b, atol=1e-4)
    distinct = collate_ids(prompts, [[5], [6], [7]])
    assert shared_prompt_logprobs(model, distinct.input_ids, distinct.attention_mask, distinct.response_mask) is None
    # PPO's value head: the values at every trainable position, and their gradients, too
    critic = PolicyWithValueHead(build_tiny_model(spec, seed=3))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)
    plain_v, shared_v = (critic(batch.input_ids, batch.attention_mask, 1.0, m)[2] for m in (None, batch.response_mask))
    assert torch.allclose(plain_v[trainable], shared_v[trainable], atol=1e-5)
    grads = [torch.autograd.grad((v * trainable).sum(), list(critic.parameters())) for v in (plain_v, shared_v)]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-4)


def test_reference_scores_of_rows_sharing_a_prompt_match_the_plain_forward(tmp_path):
    """The reference worker (and the learner's `logprobs`, same path) scores a group's rows with
    its prompt run once: each response token's logprob and top-k distribution are the plain
    forward's, a multi-turn row's environment tokens included."""
    from actors.reference import ReferenceWorker
    from rlsys.batch import collate, response_slices
    from rlsys.experience import make_experience
    from rlsys.logprobs import forward_logprobs

    spec = TinyModelSpec(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model_dir = save_model_dir(build_tiny_model(spec, seed=5), None, tmp_path / "ref")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (4, 6, 3)]
    rows = [
        dict(
            uid=f"{i}{k}",
            group=str(i),
            prompt_ids=p,
            response_ids=torch.randint(3, 64, (1 + (i + k) % 4,), generator=g).tolist(),
            logprobs=[],
            reward=0.0,
            policy_version=0,
        )
        for i, p in enumerate(prompts)
        for k in range(3)
    ]
    rows[-1]["loss_mask"] = [0] * len(rows[-1]["response_ids"])  # a row whose response is all environment tokens
    table = make_experience(rows)
    worker = ReferenceWorker(str(model_dir), temperature=0.8)
    batch = collate(table)
    logits, plain, _ = forward_logprobs(worker.model, batch.input_ids, batch.attention_mask, 0.8)
    expected = [plain[i, s].tolist() for i, s in enumerate(response_slices(table))]
    calls = []
    hook = worker.model.register_forward_pre_hook(
        lambda m, a, kw: calls.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    scored = worker.logprobs(table)
    hook.remove()
    assert calls[0] == len(prompts)  # the prompts ran once, not once per row
    # in chunks smaller than the table, a chunk ends where a group does: each prompt still runs once
    small = ReferenceWorker(str(model_dir), temperature=0.8, batch_size=4)
    calls.clear()
    hook = small.model.register_forward_pre_hook(
        lambda m, a, kw: calls.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    for got, want in zip(small.logprobs(table), scored):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)
    hook.remove()
    assert calls == [1, 3] * 3  # per chunk: its one prompt, then its 3 rows' responses
    assert [len(r) for r in scored] == [len(r["response_ids"]) for r in rows]
    for got, want in zip(scored, expected):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)
    top_ids, top_lp = zip(*worker.top_logprobs(table, k=3))
    want = torch.log_softmax(logits.float(), -1).topk(3, dim=-1)
    for i, s in enumerate(response_slices(table)):
        assert torch.equal(torch.tensor(top_ids[i]), want.indices[i, s])
        assert torch.allclose(torch.tensor(top_lp[i]), want.values[i, s], atol=1e-5)
