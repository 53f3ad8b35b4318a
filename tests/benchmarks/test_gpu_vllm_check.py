"""benchmarks/gpu_vllm_check.py's parts that need no GPU: the tiny models it builds, the new
weights it loads and the agreement it measures, run here with the transformers backend on both
sides; and its one line where there is no CUDA device."""

import math
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu_vllm_check import Agreement, agreement, build_policy, changed_row, perturbed_weights, requests
from rlsys.generation import Generation

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def gen(ids, logprobs):
    return Generation(0, [1], list(ids), list(logprobs), "length")


def test_agreement_counts_identical_rows_and_their_largest_logprob_gap():
    a = [gen([5, 6], [-0.1, -0.2]), gen([7, 8], [-0.3, -0.4]), gen([9], [-1.0])]
    b = [gen([5, 6], [-0.1, -0.25]), gen([7, 9], [-0.3, -0.4]), gen([9], [-1.02])]
    found = agreement(a, b)
    assert (found.rows, found.identical) == (3, 2) and found.max_logprob_gap == pytest.approx(0.05)
    assert found.ok(min_agree=0.6, max_gap=0.1) and not found.ok(min_agree=0.9, max_gap=0.1)
    assert not found.ok(min_agree=0.6, max_gap=0.01)
    assert str(found) == "greedy rows identical 2/3, max logprob gap 5.0e-02"
    none = agreement([gen([1], [0.0])], [gen([2], [0.0])])
    assert none.identical == 0 and math.isnan(none.max_logprob_gap) and not none.ok(0.0, 1.0)
    with pytest.raises(ValueError, match="1 generations against 2"):
        agreement(a[:1], b[:2])
    assert Agreement(2, 2, 0.0).ok(1.0, 0.0)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_the_models_and_the_new_weights_it_checks_vllm_with(tmp_path, architecture):
    from actors.rollout import HFBackend
    from rlsys.models import load_model

    policy = build_policy(tmp_path, architecture, hidden=128, layers=2)
    model = load_model(policy)
    assert type(model).__name__.lower().startswith(architecture) and model.config.head_dim == 64
    assert model.config.tie_word_embeddings == (architecture == "qwen2")
    greedy = requests(policy, 16, 8)
    assert len(greedy) == 16 and all(r.params.greedy and r.params.max_new_tokens == 8 for r in greedy)
    backend = HFBackend(policy)
    before = backend.generate(greedy)
    same = agreement(before, HFBackend(policy).generate(greedy))  # a backend agrees with itself
    assert same.identical == 16 and same.max_logprob_gap < 1e-5
    new = perturbed_weights(policy)
    backend.load_weights(new)
    after = backend.generate(greedy)
    assert all(changed_row(x, y) for x, y in zip(before, after))  # the new weights change every row
    assert not any(changed_row(x, x) for x in after)
    if architecture == "llama":  # untied: the greedy tokens themselves move
        assert agreement(before, after).identical < 16
    model.load_state_dict({k: torch.from_numpy(v) for k, v in new.items()})
    reloaded = HFBackend(policy, model=model)  # the same new weights, loaded another way
    assert agreement(after, reloaded.generate(greedy)).identical == 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: the check would run")
def test_without_cuda_it_says_nothing_was_run():
    out = subprocess.run([sys.executable, "benchmarks/gpu_vllm_check.py"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "gpu_vllm_check: no CUDA device visible; nothing was run"
