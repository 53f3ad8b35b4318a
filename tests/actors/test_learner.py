"""The learner's lr schedule (a pure function of the optimizer step)."""

import math

import pytest

from actors.learner import lr_multiplier


def test_warmup_rises_linearly_to_one():
    assert [lr_multiplier(s, 100, warmup_steps=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decay_ends_at_min_ratio_and_never_rises(schedule):
    factors = [lr_multiplier(s, 50, warmup_steps=5, schedule=schedule, min_ratio=0.1) for s in range(60)]
    after_warmup = factors[4:]
    assert after_warmup[0] == 1.0 and factors[50] == pytest.approx(0.1) and factors[59] == pytest.approx(0.1)
    assert all(b <= a + 1e-12 for a, b in zip(after_warmup, after_warmup[1:]))


def test_cosine_midpoint_and_constant():
    assert lr_multiplier(10, 20, schedule="cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_multiplier(10, 20, schedule="linear") == pytest.approx(0.5)
    assert lr_multiplier(10**6, 20) == 1.0


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="unknown lr schedule 'step'"):
        lr_multiplier(3, 10, schedule="step")
