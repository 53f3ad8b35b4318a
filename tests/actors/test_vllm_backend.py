"""The vLLM rollout backend's pure parts (no vllm needed), the learner's DeepSpeed config
builder, and the vLLM engine itself where vllm is installed (skipped otherwise)."""

import numpy as np
import pytest
import torch

from actors.vllm_backend import (
    engine_kwargs,
    eos_token_ids,
    generations_from_outputs,
    plain_output,
    plan_requests,
    rollout_placement,
    tied_embeddings,
    unsupported_reason,
    vllm_sampling_kwargs,
    vllm_weight_items,
    weight_buckets,
)
from actors.vllm_worker import engine_tensor
from rlsys.generation import GenerationRequest, Interpolation, SamplingParams


def test_sampling_params_map_one_to_one():
    p = SamplingParams(n=4, max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=20, seed=3, stop_token_ids=(5, 2))
    kw = vllm_sampling_kwargs(p, eos_ids=(1,))
    assert kw == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "max_tokens": 12,
        "stop_token_ids": [1, 2, 5],
        "seed": 3,
        "logprobs": 0,
        "detokenize": False,
    }
    # top_k 0 (off here) is -1 (off in vLLM); no seed stays None; eos ids are not duplicated
    kw = vllm_sampling_kwargs(SamplingParams(top_k=0, stop_token_ids=(1,)), eos_ids=(1,))
    assert kw["top_k"] == -1 and kw["seed"] is None and kw["stop_token_ids"] == [1]
    # greedy: temperature 0 in both; vLLM refuses greedy n > 1, so one sequence is asked for
    kw = vllm_sampling_kwargs(SamplingParams(n=3, temperature=0.0))
    assert kw["temperature"] == 0.0 and kw["n"] == 1


def test_plan_requests_keeps_order_and_shares_identical_params():
    a, b = SamplingParams(n=2, seed=1), SamplingParams(n=1, temperature=0.0)
    reqs = [GenerationRequest([3, 4], a), GenerationRequest([5], b), GenerationRequest([6, 7, 8], a)]
    prompts, kwargs = plan_requests(reqs, eos_ids=(1,))
    assert prompts == [{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": [5]}, {"prompt_token_ids": [6, 7, 8]}]
    assert kwargs[0] is kwargs[2] and kwargs[0] is not kwargs[1]
    assert kwargs[1]["temperature"] == 0.0 and kwargs[0]["n"] == 2


@pytest.mark.parametrize(
    "request_, words",
    [
        (
            GenerationRequest([1], SamplingParams(interpolation=Interpolation(0.5, "plus"))),
            "interpolated sampling (PILAF)",
        ),
        (GenerationRequest([1], embedding="policy"), "embeddings"),
        (GenerationRequest([1], SamplingParams(temperature=2.5)), "temperature 2.5"),
    ],
)
def test_unsupported_requests_fail_in_one_line(request_, words):
    assert words in unsupported_reason(request_)
    with pytest.raises(ValueError) as e:
        plan_requests([GenerationRequest([2]), request_])
    assert str(e.value).startswith("request 1: ") and "\n" not in str(e.value) and words in str(e.value)
    assert unsupported_reason(GenerationRequest([1])) is None


class _Logprob:  # the shape of vllm.logprobs.Logprob / CompletionOutput / RequestOutput (test data only)
    def __init__(self, logprob):
        self.logprob = logprob


class _Completion:
    def __init__(self, index, token_ids, logprobs, finish_reason):
        self.index, self.token_ids, self.finish_reason = index, token_ids, finish_reason
        self.logprobs = [{t: _Logprob(lp), 999: _Logprob(-0.01)} for t, lp in zip(token_ids, logprobs)]


class _RequestOutput:
    def __init__(self, outputs):
        self.outputs = outputs


def test_outputs_become_generations_in_request_order_n_per_request():
    reqs = [
        GenerationRequest([3, 4], SamplingParams(n=2)),
        GenerationRequest([5], SamplingParams(n=3, temperature=0.0)),
    ]
    outs = [
        # completions may come back out of index order; the sampled token's logprob is picked
        # out of each step's {token: Logprob} (which also holds top-k alternatives)
        _RequestOutput(
            [_Completion(1, [9, 2], [-0.5, -0.25], "stop"), _Completion(0, [7, 8, 6], [-1.0, -2.0, -3.0], "length")]
        ),
        _RequestOutput([_Completion(0, [4, 2], [-0.1, -0.2], "stop")]),
    ]
    plain = [plain_output(o) for o in outs]
    assert plain[0][0] == {"token_ids": [7, 8, 6], "logprobs": [-1.0, -2.0, -3.0], "finish_reason": "length"}
    gens = generations_from_outputs(reqs, plain)
    assert [g.request_index for g in gens] == [0, 0, 1, 1, 1]
    assert [g.response_ids for g in gens[:2]] == [[7, 8, 6], [9, 2]]
    assert [g.finish_reason for g in gens[:2]] == ["length", "stop"]
    assert gens[1].logprobs == [-0.5, -0.25] and gens[0].prompt_ids == [3, 4]
    # greedy n=3: the one greedy sequence, three times
    assert all(g.response_ids == [4, 2] and g.logprobs == [-0.1, -0.2] for g in gens[2:])
    with pytest.raises(RuntimeError, match="expected n=2"):
        generations_from_outputs(reqs[:1], [plain[0][:1]])
    with pytest.raises(RuntimeError, match="'abort'"):
        generations_from_outputs(reqs[1:], [[{"token_ids": [1], "logprobs": [-1.0], "finish_reason": "abort"}]])


def test_weight_names_from_a_real_hf_state_dict(tmp_path):
    from actors.modeling import state_dict_numpy
    from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer

    tok = train_tokenizer([f"{a}+{b}={a + b}" for a in range(30) for b in range(30)], 64)
    model = build_tiny_model(
        TinyModelSpec(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        tok,
    )
    save_model_dir(model, tok, tmp_path)
    weights = state_dict_numpy(model)
    tied = tied_embeddings(tmp_path)
    assert tied == bool(model.config.tie_word_embeddings)
    assert eos_token_ids(tmp_path) == (model.config.eos_token_id,)
    items = dict(vllm_weight_items(weights, tied))
    # HF checkpoint names as they are (vLLM's loader stacks q/k/v and gate/up itself)
    assert "model.layers.0.self_attn.q_proj.weight" in items and "model.layers.0.mlp.gate_proj.weight" in items
    assert ("lm_head.weight" in items) == (not tied) and "model.embed_tokens.weight" in items
    assert set(items) == set(weights) - ({"lm_head.weight"} if tied else set())
    assert all(items[k] is weights[k] for k in items)  # no copies: numpy has no bf16, the worker converts
    # tied: the untied-name variant keeps lm_head; a rotary buffer or a value-head weight is refused/dropped
    assert "lm_head.weight" in dict(vllm_weight_items({"lm_head.weight": weights["model.embed_tokens.weight"]}, False))
    assert [
        n for n, _ in vllm_weight_items({"a.weight": np.ones(2), "model.rotary_emb.inv_freq": np.ones(2)}, True)
    ] == ["a.weight"]
    with pytest.raises(ValueError, match="value head"):
        vllm_weight_items({"value_head.weight": np.ones(2)}, False)


def test_weight_buckets_bound_bytes_and_keep_order():
    items = [(f"w{i}", np.zeros(n, dtype=np.float32)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    names = lambda buckets: [[n for n, _ in b] for b in buckets]
    # bytes 40, 40, 120, 20, 400, 4: consecutive, <= the cap unless one tensor alone exceeds it
    assert names(weight_buckets(items, max_bytes=100)) == [["w0", "w1"], ["w2"], ["w3"], ["w4"], ["w5"]]
    assert names(weight_buckets(items, max_bytes=200)) == [["w0", "w1", "w2"], ["w3"], ["w4"], ["w5"]]
    assert names(weight_buckets(items, max_bytes=10**6)) == [[n for n, _ in items]]


def test_weight_payload_round_trips_through_msgpack_plain_data():
    import msgpack

    from actors.vllm_backend import weight_payload
    from actors.vllm_worker import arrays_from_payload

    items = [
        ("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4) / 7),
        ("b.bias", np.array([1.5], dtype=np.float16)),
        ("c.ids", np.arange(5, dtype=np.int64)),
    ]
    items[0][1].setflags(write=False)
    wire = msgpack.unpackb(msgpack.packb(weight_payload(items)))  # what reaches the engine process
    back = arrays_from_payload(wire)
    assert [n for n, _ in back] == [n for n, _ in items]
    for (_, a), (_, b) in zip(items, back):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    bf16 = torch.randn(3, 5).to(torch.bfloat16)  # a bf16 learner's shared-memory slot entry
    ((name, back),) = arrays_from_payload(msgpack.unpackb(msgpack.packb(weight_payload([("d.weight", bf16.t())]))))
    assert name == "d.weight" and back.dtype == torch.bfloat16 and torch.equal(back, bf16.t())


def test_engine_tensor_converts_readonly_fp32_numpy_to_bf16():
    a = np.arange(6, dtype=np.float32).reshape(2, 3) / 3
    a.setflags(write=False)  # as an object-store view arrives
    t = engine_tensor(a, torch.bfloat16, "cpu")
    assert t.dtype == torch.bfloat16 and t.shape == (2, 3)
    assert torch.equal(t, torch.from_numpy(a.copy()).to(torch.bfloat16))
    assert engine_tensor(np.arange(3), torch.bfloat16, "cpu").dtype == torch.int64  # integer buffers keep their dtype


def test_rollout_placement_bundles():
    bundles, strategy = rollout_placement(3, 2, cpus_per_worker=1)
    assert bundles == [{"GPU": 2.0, "CPU": 1.0}] * 3 and strategy == "PACK"
    with pytest.raises(ValueError):
        rollout_placement(0, 1)


def test_engine_kwargs():
    kw = engine_kwargs("/m", tensor_parallel_size=2, gpu_memory_utilization=0.5, seed=7, dtype="bfloat16")
    assert kw["tensor_parallel_size"] == 2 and kw["gpu_memory_utilization"] == 0.5 and kw["seed"] == 7
    assert kw["worker_extension_cls"] == "actors.vllm_worker.RlsysWorkerExtension"
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["skip_tokenizer_init"] is True
    assert kw["distributed_executor_backend"] == "mp" and "distributed_executor_backend" not in engine_kwargs("/m")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine_kwargs("/m", gpu_memory_utilization=1.5)
    # learner.lora: the engine serves one adapter of at most the run's rank; no LoRA, no LoRA support
    assert {k: engine_kwargs("/m", max_lora_rank=8)[k] for k in ("enable_lora", "max_lora_rank", "max_loras")} == {
        "enable_lora": True,
        "max_lora_rank": 8,
        "max_loras": 1,
    }
    assert "enable_lora" not in kw


def test_deepspeed_config_builder():
    from actors.learner import deepspeed_config, learner_device

    cpu = deepspeed_config(2, 1.0)
    assert "bf16" not in cpu and cpu["zero_optimization"] == {"stage": 2} and cpu["gradient_clipping"] == 1.0
    for stage in (2, 3):
        cfg = deepspeed_config(stage, 0.5, bf16=True)
        assert cfg["bf16"] == {"enabled": True} and cfg["zero_optimization"]["stage"] == stage
        assert {k: v for k, v in cfg.items() if k != "bf16"} == deepspeed_config(stage, 0.5)
        # a CPU learner: torch autocast in the engine's forward, fp32 weights and gradient reduces
        autocast = deepspeed_config(stage, 0.5, bf16=True, device="cpu")
        assert "bf16" not in autocast and autocast["torch_autocast"]["dtype"] == "bfloat16"
        assert autocast["torch_autocast"]["lower_precision_safe_modules"] == []
    # learner.offload: the optimizer state (and under ZeRO-3 the parameters) to host memory
    offloaded = deepspeed_config(3, 1.0, offload="params")
    assert offloaded["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert offloaded["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert offloaded["zero_force_ds_cpu_optimizer"] is False
    assert "offload_param" not in deepspeed_config(2, 1.0, offload="optimizer")["zero_optimization"]
    assert deepspeed_config(2, 1.0, offload="none") == cpu
    device, backend = learner_device()
    assert (device, backend) == (("cuda", "nccl") if torch.cuda.is_available() else ("cpu", "gloo"))
    assert learner_device(prefer_cuda=False) == ("cpu", "gloo")


def test_config_keys_for_vllm_and_weight_sync():
    from rlsys.config import ConfigError, load_config

    cfg = load_config(
        "configs/quickstart.yaml",
        [
            "rollout.backend=vllm",
            "rollout.tensor_parallel_size=2",
            "rollout.gpu_memory_utilization=0.6",
            "trainer.weight_sync=broadcast",
            "learner.bf16=true",
        ],
    )
    assert (cfg.rollout.tensor_parallel_size, cfg.rollout.gpu_memory_utilization) == (2, 0.6)
    assert cfg.trainer.weight_sync == "broadcast" and cfg.learner.bf16
    assert load_config("configs/quickstart.yaml").trainer.weight_sync == "auto"
    for override, words in [
        ("rollout.tensor_parallel_size=2", "rollout.backend 'vllm' only"),
        ("rollout.gpu_memory_utilization=0.5", "rollout.backend 'vllm' only"),
        ("trainer.weight_sync=nccl", "'object_store' or 'broadcast'"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config("configs/quickstart.yaml", [override])
        assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="less than or equal to 1"):
        load_config("configs/quickstart.yaml", ["rollout.backend=vllm", "rollout.gpu_memory_utilization=1.5"])
    gpu = load_config("configs/gpu.yaml")  # the GPU job config validates (it runs only where vllm and GPUs are)
    assert (gpu.rollout.backend, gpu.trainer.weight_sync, gpu.learner.bf16, gpu.learner.zero_stage) == (
        "vllm",
        "broadcast",
        True,
        2,
    )


def test_vllm_engine_generates_and_loads_weights_in_place(tmp_path):
    """Needs vllm and a GPU: skipped where either is absent (vllm is not installable on CPU machines)."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vllm is installed but no GPU is visible")
    from actors.modeling import state_dict_numpy
    from actors.vllm_backend import VLLMBackend
    from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer

    tok = train_tokenizer([f"{a}+{b}={a + b}" for a in range(30) for b in range(30)], 128)
    spec = TinyModelSpec(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = build_tiny_model(spec, tok, seed=0)
    save_model_dir(model, tok, tmp_path / "m")
    backend = VLLMBackend(str(tmp_path / "m"), gpu_memory_utilization=0.3, enforce_eager=True)
    reqs = [
        GenerationRequest([5, 6, 7], SamplingParams(n=2, max_new_tokens=6, seed=1)),
        GenerationRequest([8], SamplingParams(max_new_tokens=6, temperature=0.0)),
    ]
    gens = backend.generate(reqs)
    assert [g.request_index for g in gens] == [0, 0, 1]
    assert all(len(g.logprobs) == len(g.response_ids) and all(lp <= 0 for lp in g.logprobs) for g in gens)
    greedy_before = gens[2].response_ids
    other = build_tiny_model(spec, tok, seed=1)
    backend.load_weights(state_dict_numpy(other))
    after = backend.generate(reqs[1:])[0]
    backend.load_weights(state_dict_numpy(model))
    assert backend.generate(reqs[1:])[0].response_ids == greedy_before  # the same weights, the same greedy text
    assert after.logprobs != gens[2].logprobs
