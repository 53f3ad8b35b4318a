import torch

from rlsys.models import TinyModelSpec, build_tiny_model, load_model, load_tokenizer, num_parameters, save_model_dir, train_tokenizer

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


def test_same_seed_same_weights():
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    a, b = build_tiny_model(spec, seed=3), build_tiny_model(spec, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
