"""benchmarks/credit_reasoning.py's pure pieces: value states by step position, the errors of each
estimator against the truth per position, the table, and the diagnostic's own seed stream."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("credit_reasoning_bench", ROOT / "benchmarks" / "credit_reasoning.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def rec(position, truth, critic, mc, se=0.0):
    return {"position": position, "truth": truth, "critic": critic, "mc": mc, "truth_se": se}


RECORDS = [
    rec(1, 0.5, 0.0, 0.4, 0.04),
    rec(1, 0.7, 0.0, 0.9, 0.02),
    rec(2, 1.0, 0.5, 1.0),
    rec(2, 0.0, 0.5, 0.2),
    rec(3, 0.25, 0.75, 0.25),
]


def test_errors_are_per_step_position_and_over_all_states():
    errors = bench.position_errors(RECORDS)
    assert list(errors["critic"]) == [1, 2, 3, "all"]
    assert errors["critic"][1] == {"n": 2, "mae": pytest.approx(0.6), "mse": pytest.approx(0.37), "mean": 0.0}
    assert errors["mc"][1]["mae"] == pytest.approx(0.15)
    assert errors["mc"][2] == {"n": 2, "mae": pytest.approx(0.1), "mse": pytest.approx(0.02), "mean": 0.6}
    assert errors["critic"][3]["mae"] == pytest.approx(0.5) and errors["mc"][3]["mae"] == 0.0
    assert errors["critic"]["all"]["n"] == 5
    assert errors["critic"]["all"]["mae"] == pytest.approx((0.5 + 0.7 + 0.5 + 0.5 + 0.5) / 5)
    assert errors["truth"][1] == {"n": 2, "mean": pytest.approx(0.6), "se": pytest.approx(0.03)}
    assert errors["critic"][2]["mean"] == 0.5 and errors["mc"][1]["mean"] == pytest.approx(0.65)


def test_the_constant_reference_is_each_positions_mean_truth():
    errors = bench.position_errors(RECORDS)
    assert errors["constant"][1]["mae"] == pytest.approx(0.1)  # truths 0.5, 0.7 around 0.6
    assert errors["constant"][2]["mae"] == pytest.approx(0.5) and errors["constant"][3]["mae"] == 0.0
    assert errors["constant"]["all"]["mae"] == pytest.approx((0.1 + 0.1 + 0.5 + 0.5 + 0.0) / 5)


def test_positions_sort_as_numbers():
    errors = bench.position_errors([rec(p, 0.0, 0.0, 0.0) for p in (10, 2, 1)])
    assert list(errors["mc"]) == [1, 2, 10, "all"]


def test_the_table_has_a_row_per_estimator_and_a_column_per_position():
    text = bench.table(bench.position_errors(RECORDS), {"critic": "PPO critic", "mc": "MC K=9"})
    lines = text.splitlines()
    assert lines[0] == "| estimator: MAE (MSE) vs truth | step 1 | step 2 | step 3 | all states |"
    assert lines[2].startswith("| PPO critic | 0.600 (0.370) | 0.500 (0.250) | 0.500 (0.250) |")
    assert lines[3].startswith("| MC K=9 | 0.150 (0.025) | 0.100 (0.020) | 0.000 (0.000) |")
    assert lines[4].startswith("| (reference: the truth's mean at the position) | 0.100 (0.010) |")
    assert lines[5] == "| states | 2 | 2 | 1 | 5 |"
    assert lines[6] == "| mean V: truth | 0.600 | 0.500 | 0.250 | 0.490 |"
    assert lines[7] == "| mean V: PPO critic | 0.000 | 0.500 | 0.750 | 0.350 |"


def test_records_are_grouped_by_evaluation_point_in_order():
    records = [{"samples": s, "ppo_steps": s // 128, **r} for s in (0, 256) for r in RECORDS]
    points = bench.by_point(records)
    assert [title for title, _ in points] == [
        "after 0 samples (0 PPO steps): critic untrained",
        "after 256 samples (2 PPO steps)",
    ]
    assert all(len(got) == len(RECORDS) for _, got in points)


def test_value_states_are_numbered_from_the_prompt():
    assert bench.state_positions([0, 12, 40]) == [(1, 0), (2, 12), (3, 40)]


def test_standard_error_of_the_returns():
    assert bench.binomial_se([1.0]) == 0.0
    r = [1.0, 0.0, 1.0, 1.0]
    assert bench.binomial_se(r) == pytest.approx(np.std(r, ddof=1) / 2)


def test_fixed_seeds_leave_the_runs_seed_stream_alone():
    class Ctx:
        tokenizer = "tok"

        def __init__(self):
            self.rng = np.random.default_rng(0)

        def next_seed(self):
            return int(self.rng.integers(0, 2**31 - 1))

    ctx = Ctx()
    a, b = bench.FixedSeeds(ctx, 7), bench.FixedSeeds(ctx, 7)
    assert [a.next_seed() for _ in range(3)] == [b.next_seed() for _ in range(3)]
    assert a.tokenizer == "tok"
    assert ctx.next_seed() == Ctx().next_seed()  # the run's own stream did not move
