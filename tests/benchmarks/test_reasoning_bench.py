"""benchmarks/reasoning.py's table: equal samples are each run's last point, equal wall time is
the fastest method's training time, means over seeds with their range."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("reasoning_bench", ROOT / "benchmarks" / "reasoning.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def point(samples, wall, greedy, passk, train_reward=0.0, length=0.0):
    """An evaluation point; the training reward and response length are the mean since the one before."""
    return {
        "samples": samples,
        "wall_s": wall,
        "greedy": greedy,
        "pass@4": passk,
        "train_reward": train_reward,
        "response_length": length,
    }


CURVES = {
    ("grpo", 0): [point(0, 0, 0.1, 0.2), point(100, 50, 0.3, 0.5, 0.5, 70), point(200, 100, 0.5, 0.7, 0.6, 80)],
    ("grpo", 1): [point(0, 0, 0.1, 0.2), point(100, 50, 0.2, 0.4, 0.3, 90), point(200, 100, 0.4, 0.6, 0.4, 100)],
    ("vineppo", 0): [point(0, 0, 0.1, 0.2), point(100, 150, 0.6, 0.8, 0.7, 110), point(200, 300, 0.7, 0.9, 0.8, 120)],
}


def test_the_table_compares_at_equal_samples_and_at_the_fastest_methods_wall_time():
    rows = bench.table(CURVES, pass_k=4).splitlines()
    assert "greedy at 100 s" in rows[0]  # grpo's mean training time, the fastest
    grpo, vineppo = rows[2], rows[3]
    assert grpo.startswith("| grpo | 0.100 (0.100-0.100) | 0.450 (0.400-0.500) | 0.650 (0.600-0.700) | 0.450")
    assert grpo.endswith("| 0.500 | 90.0 | 100 | 2 |")  # the last points' training reward and length, then wall s
    # at 100 s VinePPO has only its start point: 0.1, though it ends higher at equal samples
    assert vineppo.startswith("| vineppo | 0.100 (0.100-0.100) | 0.700 (0.700-0.700) | 0.900 (0.900-0.900) | 0.100")
    assert bench.at_wall_time(CURVES[("vineppo", 0)], 160)["greedy"] == 0.6


def test_earlier_seeds_are_read_back_by_method_and_seed(tmp_path):
    path = tmp_path / "reasoning.jsonl"
    path.write_text(
        "".join(json.dumps({"method": m, "seed": s, **p}) + "\n" for (m, s), c in CURVES.items() for p in c)
    )
    curves = bench.read_curves([path])
    assert list(curves) == list(CURVES)
    assert all([p["greedy"] for p in curves[key]] == [p["greedy"] for p in CURVES[key]] for key in CURVES)
    with pytest.raises(ValueError, match="grpo seed 0 is in an earlier curves file too"):
        bench.read_curves([path, path])
