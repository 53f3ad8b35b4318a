"""benchmarks/gpu_check.py, the prepared GPU check, kept runnable where there is no GPU:
its --cpu run goes through the same code paths (hf backend, DeepSpeed ZeRO-2/3 learners, the
handoff, the gloo broadcast to a receiver process) on CPU, without Ray (the GPU image has none)."""

import re
import subprocess
import sys

import pytest
import torch


def test_gpu_check_runs_its_paths_on_cpu_without_ray():
    code = (
        "import runpy, sys; sys.modules['ray'] = None; sys.argv = ['gpu_check', '--cpu', '--reps', '1']; "
        "runpy.run_path('benchmarks/gpu_check.py', run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    cosines = [float(c) for c in re.findall(r"update cosine vs fp32 ([0-9.]+)", out.stdout)]
    assert len(cosines) == 3 and min(cosines) > 0.999  # fp32 ZeRO-2, ZeRO-3 and packed ZeRO-2 take ZeRO-0's step
    assert any("bit-identical" in r for r in rows) and any(r.startswith("| handoff ms") for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: the check would run")
def test_gpu_check_without_cuda_says_nothing_was_measured():
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "gpu_check: no CUDA device visible; nothing was measured"
