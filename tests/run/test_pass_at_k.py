"""Held-out pass@k (`Controller.evaluate(samples=n)`): the unbiased estimator of Chen et al. 2021."""

import pytest

from rlsys.run.controller import pass_at_k


def test_pass_at_k_is_the_unbiased_estimator():
    # 4 samples: a prompt with 1 right has pass@2 = 1 - C(3,2)/C(4,2) = 1/2; with 2 right 5/6; none 0; all 1
    assert pass_at_k([1, 2, 0, 4], n=4, k=2) == pytest.approx((0.5 + 5 / 6 + 0 + 1) / 4)
    assert pass_at_k([1, 2, 0, 4], n=4, k=1) == pytest.approx((0.25 + 0.5 + 0 + 1) / 4)  # the mean accuracy
    assert pass_at_k([1, 3], n=4, k=4) == 1.0
