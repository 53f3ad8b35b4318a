"""`rollout.quantized: DIR`: a rollout worker serves the SliM-LLM quantised policy written by
`rlsys quantize`, and keeps it on the saved bit maps when new weights are synced."""

from __future__ import annotations

import pytest
import torch

from actors.modeling import state_dict_numpy
from actors.rollout import HFBackend, RolloutWorker
from rlsys.config import ConfigError, load_config
from rlsys.generation import GenerationRequest, SamplingParams
from rlsys.models import TinyModelSpec, build_tiny_model, load_model, save_model_dir, train_tokenizer
from rlsys.quantize import QuantConfig, load_quantized, quantize_model, save_quantized
from rlsys.quantize.calib import calibration_from_text
from rlsys.quantize.gptq import rtn_quantize
from rlsys.quantize.model import quantized_bit_maps

TEXT = " ".join(f"{a}+{b}={a + b}" for a in range(30) for b in range(0, 30, 3))
SPEC = TinyModelSpec(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("qserve")
    tok = train_tokenizer([TEXT], 64)
    fp = save_model_dir(build_tiny_model(SPEC, tok, seed=0), tok, root / "fp")
    model = load_model(fp)
    cfg = QuantConfig(bits=3, group_size=16, method="slim")
    q = quantize_model(model, calibration_from_text(tok, TEXT, 8, 32), cfg)
    qdir = save_quantized(model, q, cfg, root / "q")
    other = save_model_dir(build_tiny_model(SPEC, tok, seed=1), tok, root / "other")
    return tok, fp, qdir, other


def greedy(backend, tok):
    prompts = [tok("1+2=", add_special_tokens=False)["input_ids"], tok("12+7=", add_special_tokens=False)["input_ids"]]
    return [
        g.response_ids
        for g in backend.generate(
            [GenerationRequest(p, SamplingParams(max_new_tokens=6, temperature=0.0)) for p in prompts]
        )
    ]


def test_worker_serves_the_quantised_policy(dirs):
    tok, fp, qdir, _ = dirs
    worker = RolloutWorker(str(fp), quantized=str(qdir))
    served, reference = worker.backend.model.state_dict(), load_quantized(qdir).state_dict()
    assert all(torch.equal(served[k], reference[k]) for k in reference)
    fp_state = load_model(fp).state_dict()
    assert not torch.equal(served["model.layers.0.mlp.up_proj.weight"], fp_state["model.layers.0.mlp.up_proj.weight"])
    assert greedy(worker.backend, tok) == greedy(HFBackend(str(fp), model=load_quantized(qdir)), tok)


def test_synced_weights_are_requantised_on_the_saved_bit_maps(dirs):
    tok, fp, qdir, other = dirs
    worker = RolloutWorker(str(fp), quantized=str(qdir))
    new = state_dict_numpy(load_model(other))
    worker.load_weights(3, new)
    group_size, bit_maps = quantized_bit_maps(qdir)
    assert len(bit_maps) == 2 * 7 and len({int(b) for m in bit_maps.values() for b in m}) > 1  # mixed precision
    served = worker.backend.model.state_dict()
    for name, bits in bit_maps.items():
        w_new = torch.from_numpy(new[f"{name}.weight"])
        expected = rtn_quantize(w_new, bits, group_size).dequantize()
        assert torch.equal(served[f"{name}.weight"], expected) and not torch.equal(served[f"{name}.weight"], w_new)
        for g, b in enumerate(bits.tolist()):  # each row of each group holds at most 2**bits levels
            block = served[f"{name}.weight"][:, g * group_size : (g + 1) * group_size]
            assert max(len(torch.unique(row)) for row in block) <= 2**b
    assert torch.equal(served["model.embed_tokens.weight"], torch.from_numpy(new["model.embed_tokens.weight"]))
    assert worker.policy_version() == 3


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["rollout.quantized=/no/such/dir"], ["rollout.quantized", "/no/such/dir", "rlsys quantize"]),
        (["rollout.backend=vllm", "rollout.quantized=QDIR"], ["rollout.quantized", "'hf' only"]),
    ],
)
def test_bad_quantized_config_fails_in_one_line(dirs, overrides, words):
    overrides = [o.replace("QDIR", str(dirs[2])) for o in overrides]
    with pytest.raises(ConfigError) as e:
        load_config("configs/quickstart.yaml", overrides)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    assert load_config("configs/quickstart.yaml", [f"rollout.quantized={dirs[2]}"]).rollout.quantized == str(dirs[2])
