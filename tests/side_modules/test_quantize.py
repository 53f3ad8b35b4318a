"""SliM-LLM quantisation: properties from the method page (average bits, SQC never worse
than p = 1, mixed precision beats uniform on outlier channels, GPTQ beats RTN on
correlated inputs), the packed format round trip, and the `rlsys quantize` CLI."""

from __future__ import annotations

import json

import pytest
import torch

from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer
from rlsys.quantize import QuantConfig, average_bits, load_quantized, quantize_model, save_quantized
from rlsys.quantize.cli import main
from rlsys.quantize.gptq import (
    allocate_bits,
    gptq_quantize,
    group_salience,
    hessian_from_activations,
    inverse_hessian_cholesky,
    output_kl,
    rtn_quantize,
    sba_candidates,
)
from rlsys.quantize.quantizer import (
    QuantizedWeight,
    calibrate_scale,
    clip_grid,
    minmax_params,
    pack_codes,
    sqc_error,
    unpack_codes,
)

SPEC = TinyModelSpec(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hinv(x: torch.Tensor) -> torch.Tensor:
    h, _ = hessian_from_activations(x.T.double() @ x.double(), x.shape[0])
    return inverse_hessian_cholesky(h)


def _outlier_inputs(n: int, cols: int, channels: list[int], gain: float, seed: int) -> torch.Tensor:
    x = torch.randn(n, cols, generator=_gen(seed))
    x[:, channels] *= gain
    return x


# --- formulas --------------------------------------------------------------------------


def test_hessian_is_damped_scaled_gram():
    x = torch.randn(50, 8, generator=_gen(0))
    x[:, 3] = 0.0  # a dead input channel
    h, dead = hessian_from_activations(x.T.double() @ x.double(), 50, percdamp=0.01)
    ref = 2.0 / 50 * x.T.double() @ x.double()
    ref[3, 3] = 1.0
    ref += 0.01 * torch.diag(ref).mean() * torch.eye(8, dtype=torch.float64)
    assert dead.tolist() == [False, False, False, True, False, False, False, False]
    assert torch.allclose(h, ref)
    u = inverse_hessian_cholesky(h).double()
    assert torch.allclose(u.T @ u, torch.linalg.inv(h), atol=1e-4)
    assert torch.equal(u, torch.triu(u))


def test_group_salience_formula():
    w = torch.randn(4, 8, generator=_gen(1))
    hinv = _hinv(torch.randn(40, 8, generator=_gen(2)))
    s = group_salience(w, hinv, 4)
    d = torch.diag(hinv)
    ref = [(w[:, g * 4 : (g + 1) * 4] ** 2 / d[g * 4 : (g + 1) * 4] ** 2).sum() for g in range(2)]
    assert torch.allclose(s, torch.stack(ref))


# --- properties -------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [4, 5, 8, 13, 24])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_sba_candidates_average_exactly_n_bits(groups, bits):
    salience = torch.rand(groups, generator=_gen(groups * 10 + bits))
    maps = sba_candidates(salience, bits)
    assert len(maps) == groups // 2 - 1
    for k, m in enumerate(maps, start=1):
        assert int(m.sum()) == bits * groups  # exact, integer arithmetic
        assert int((m == bits - 1).sum()) == k and int((m == bits + 1).sum()) == k
        low, high = salience[m == bits - 1].max(), salience[m == bits + 1].min()
        assert low <= salience[m == bits].min() and salience[m == bits].max() <= high


def test_sba_needs_four_groups_and_two_bits():
    assert sba_candidates(torch.rand(3), 2) == []
    assert sba_candidates(torch.rand(8), 1) == []


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("lam", [1.0, 4.0])
def test_scale_search_never_worse_than_p1(bits, lam):
    gen = _gen(bits)
    w = torch.distributions.StudentT(2.0).sample((32, 64)) * 0.05  # heavy tails: clipping pays
    salient = torch.rand(32, 64, generator=gen) > 0.9
    params, p = calibrate_scale(w, bits, salient, lam=lam)
    err = sqc_error(w, params, salient, lam)
    err_p1 = sqc_error(w, minmax_params(w, bits, 1.0), salient, lam)
    assert torch.all(err <= err_p1)
    assert torch.any(err < err_p1)
    assert torch.isin(p, clip_grid()).all()


def test_mixed_precision_beats_uniform_on_outlier_channels():
    rows, cols, gs, bits = 64, 128, 16, 2
    w = torch.randn(rows, cols, generator=_gen(3)) * 0.1
    x = _outlier_inputs(512, cols, channels=[5, 9, 70], gain=20.0, seed=4)
    hinv = _hinv(x)
    salience = group_salience(w, hinv, gs)
    mixed, kls = allocate_bits(w, x, salience, bits, gs)
    uniform = torch.full((cols // gs,), bits)
    assert kls and float(mixed.float().mean()) == bits
    assert mixed[0] == bits + 1 and mixed[4] == bits + 1  # the outlier groups get more bits
    y = x @ w.T
    for quant in (lambda m: rtn_quantize(w, m, gs), lambda m: gptq_quantize(w, hinv, m, gs)):
        kl_mixed = output_kl(x @ quant(mixed).dequantize().T, y)
        kl_uniform = output_kl(x @ quant(uniform).dequantize().T, y)
        assert kl_mixed < kl_uniform


def test_sba_with_the_uniform_candidate_never_scores_worse_than_uniform_bits():
    """`include_uniform`: the uniform map is scored first and wins where every mixed map's output KL
    is higher (a layer without outlier inputs); on outlier channels mixed precision still wins."""
    rows, cols, gs, bits = 32, 64, 16, 2
    w = torch.randn(rows, cols, generator=_gen(11)) * 0.1
    x = torch.randn(256, cols, generator=_gen(12))
    salience = group_salience(w, _hinv(x), gs)
    plain, plain_kls = allocate_bits(w, x, salience, bits, gs)
    chosen, kls = allocate_bits(w, x, salience, bits, gs, include_uniform=True)
    assert kls[1:] == pytest.approx(plain_kls) and len(kls) == len(plain_kls) + 1
    assert kls[0] < min(plain_kls) and torch.equal(chosen, torch.full((cols // gs,), bits))  # k = 1 binarises a group
    assert not torch.equal(plain, chosen)
    x = _outlier_inputs(512, cols, channels=[5, 40], gain=20.0, seed=4)
    salience = group_salience(w, _hinv(x), gs)
    chosen, kls = allocate_bits(w, x, salience, bits, gs, include_uniform=True)
    assert min(kls[1:]) < kls[0] and float(chosen.float().mean()) == bits and chosen.max() == bits + 1


def test_gptq_error_compensation_beats_rtn_on_correlated_inputs():
    rows, cols, gs = 48, 64, 16
    latent = torch.randn(1024, 6, generator=_gen(5))
    x = latent @ torch.randn(6, cols, generator=_gen(6)) + 0.05 * torch.randn(1024, cols, generator=_gen(7))
    w = torch.randn(rows, cols, generator=_gen(8)) * 0.1
    hinv = _hinv(x)
    for bits in (2, 3):
        m = torch.full((cols // gs,), bits)
        err_gptq = (x @ (w - gptq_quantize(w, hinv, m, gs).dequantize()).T).pow(2).sum()
        err_rtn = (x @ (w - rtn_quantize(w, m, gs).dequantize()).T).pow(2).sum()
        assert err_gptq < err_rtn


# --- storage ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(1, 10))
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (7, 13), generator=_gen(bits))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == (codes.numel() * bits + 7) // 8
    assert torch.equal(unpack_codes(packed, bits, codes.numel()).reshape(7, 13), codes)


def test_quantized_weight_tensors_round_trip():
    w = torch.randn(8, 32, generator=_gen(9))
    q = rtn_quantize(w, torch.tensor([1, 2, 3, 2]), 8)
    back = QuantizedWeight.from_tensors(q.to_tensors(), rows=8, group_size=8)
    assert torch.equal(back.dequantize(), q.dequantize())
    assert q.nbytes() == sum(t.numel() * t.element_size() for t in q.to_tensors().values())


@pytest.fixture(scope="module")
def calib():
    return torch.randint(4, SPEC.vocab_size, (8, 24), generator=_gen(10))


@pytest.mark.parametrize("method", ["slim", "gptq", "rtn"])
def test_model_average_bits_exact(method, calib):
    model = build_tiny_model(SPEC, seed=0)
    cfg = QuantConfig(bits=3, group_size=16, method=method)
    q = quantize_model(model, calib, cfg)
    assert len(q) == 2 * 7
    for name, qw in q.items():
        assert int(qw.bits.sum()) == 3 * qw.bits.numel(), name
        assert torch.equal(dict(model.named_modules())[name].weight, qw.dequantize())
    assert average_bits(q) == 3.0
    if method == "slim":
        assert any(len(set(qw.bits.tolist())) == 3 for qw in q.values())


def test_save_load_round_trip_identical_outputs(tmp_path, calib):
    model = build_tiny_model(SPEC, seed=1)
    cfg = QuantConfig(bits=2, group_size=16)
    q = quantize_model(model, calib, cfg)
    save_quantized(model, q, cfg, tmp_path / "q")
    loaded = load_quantized(tmp_path / "q")
    x = calib[:3]
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)
    prompt = calib[:2, :4]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kw), loaded.generate(prompt, **kw))
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


# --- CLI --------------------------------------------------------------------------------

TEXT = [f"{a} plus {b} is {a + b}." for a in range(12) for b in range(12)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = train_tokenizer(TEXT, vocab_size=SPEC.vocab_size + 32)
    path = tmp_path_factory.mktemp("fp") / "model"
    save_model_dir(build_tiny_model(SPEC, tok, seed=2), tok, path)
    (path.parent / "calib.txt").write_text("\n".join(TEXT))
    return path


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{missing}", "--out", "{out}"], "not a model directory"),
        (["{model}", "--bits", "0", "--out", "{out}"], "bits must be in 1..8"),
        (["{model}", "--bits", "9", "--out", "{out}"], "bits must be in 1..8"),
        (["{model}", "--group", "24", "--out", "{out}"], "does not divide the width 64"),
        (["{model}", "--bits", "two", "--out", "{out}"], "invalid int value"),
        (["{model}", "--calib-file", "{missing}", "--out", "{out}"], "not found"),
        (["{model}", "--calib-samples", "0", "--out", "{out}"], "--calib-samples"),
        (["{model}"], "required: --out"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, message, model_dir, tmp_path, capsys):
    subst = {"model": str(model_dir), "missing": str(tmp_path / "nope"), "out": str(tmp_path / "out")}
    assert main([a.format(**subst) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_cli_quantizes_with_calib_file(model_dir, tmp_path, capsys):
    out = tmp_path / "q"
    argv = [
        str(model_dir),
        "--bits",
        "2",
        "--group",
        "16",
        "--out",
        str(out),
        "--calib-file",
        str(model_dir.parent / "calib.txt"),
        "--calib-samples",
        "4",
        "--seqlen",
        "16",
    ]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and "avg 2.000 bits" in line and "bytes" in line
    assert (out / "tokenizer.json").exists() and (out / "chat_template.jinja").exists()  # beside the weights
    model = load_quantized(out)
    assert model.generate(torch.tensor([[1, 5, 6]]), max_new_tokens=3, do_sample=False).shape == (1, 6)


def test_cli_self_generated_calibration(model_dir, tmp_path, capsys):
    out = tmp_path / "q"
    assert (
        main(
            [
                str(model_dir),
                "--bits",
                "3",
                "--group",
                "32",
                "--out",
                str(out),
                "--calib-samples",
                "2",
                "--seqlen",
                "8",
                "--sba-uniform",
            ]
        )
        == 0
    )
    assert "avg 3.000 bits" in capsys.readouterr().out
    assert load_quantized(out) is not None
    assert json.loads((out / "quantize_config.json").read_text())["settings"]["sba_uniform"] is True
