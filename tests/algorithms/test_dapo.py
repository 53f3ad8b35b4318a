"""DAPO (Yu et al. 2025) against hand-computed values: clip-higher, dynamic sampling's refill,
the token-level loss, the overlong penalty."""

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from algorithms.base import get_algorithm
from algorithms.dapo import DAPO, DAPOConfig, groups_with_signal, overlong_penalty, policy_turn_lengths
from rlsys.batch import TrainBatch
from rlsys.contract import (
    ModelOutputs,
    Prompt,
    SkipsRowsWithoutGradient,
    TrainsOnStaleRows,
    UsesProximalLogprobs,
)
from rlsys.experience import make_experience
from tests.fakes import TwoTokenContext


def test_overlong_penalty_is_the_papers_piecewise_linear_length_reward():
    """L_max 10, L_cache 4: 0 up to 6 tokens, (6 - |y|) / 4 up to 10, -1 beyond."""
    got = overlong_penalty([3, 6, 7, 9, 10, 12], max_tokens=10, buffer_tokens=4)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.75, -1.0, -1.0])
    assert overlong_penalty([9, 10], 10, 4, penalty=0.5).tolist() == pytest.approx([-0.375, -0.5])
    assert overlong_penalty([10], 10, 0).tolist() == [0.0]  # no buffer: no penalty


def test_policy_turn_lengths_are_the_runs_of_the_loss_mask():
    assert policy_turn_lengths([1, 1, 1]) == [3]  # a single-turn response
    assert policy_turn_lengths([1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 1]) == [2, 4, 1]  # turns around observations
    assert policy_turn_lengths([0, 0]) == [] and policy_turn_lengths([]) == []


def test_groups_with_signal_are_those_with_unequal_rewards():
    keep = groups_with_signal([1, 1, 0, 1, 0, 0, 1, 0], ["a", "a", "b", "b", "c", "c", "d", "d"])
    assert keep.tolist() == [False, False, True, True, False, False, True, True]


# 2 rows of 2 and 3 tokens, A = +1 and -1, ratios to the rollout policy as below
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
RATIO = torch.tensor([[1.25, 1.3, 1.0], [0.7, 1.0, 1.1]], dtype=torch.float64)


def test_clip_higher_and_the_token_mean():
    """Per token -min(r A, clip(r, 0.8, 1.28) A): row 0 (A 1): 1.25 (inside the higher clip,
    past GRPO's 1.2), 1.28 (1.3 clipped); row 1 (A -1): min(-0.7, -0.8) = -0.8, -1, -1.1.
    The mean over the 5 tokens, whatever row they are in."""
    b = TrainBatch(
        input_ids=torch.zeros(2, 4, dtype=torch.long),
        attention_mask=torch.ones(2, 4),
        response_mask=MASK,
        old_logprobs=-MASK,
        advantages=torch.tensor([1.0, -1.0], dtype=torch.float64)[:, None] * MASK,
    )
    logprobs = (b.old_logprobs + torch.log(RATIO) * MASK).requires_grad_()
    loss, metrics = DAPO().loss(ModelOutputs(None, logprobs), b)
    assert loss.item() == pytest.approx((-(1.25 + 1.28) + (0.8 + 1.0 + 1.1)) / 5, rel=1e-12)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)  # the 1.3 and the 0.7
    loss.backward()
    assert logprobs.grad[0, 0].item() == pytest.approx(-1.25 / 5)  # still trained at 1.25
    assert logprobs.grad[0, 1].item() == 0.0 and logprobs.grad[1, 0].item() == 0.0


class GroupContext(TwoTokenContext):
    """Prompts whose meta says `flat` get equal rewards in every group; the others 0, 1, 0, 1, ...
    `more_prompts` hands out the next prompts of a fixed list."""

    def __init__(self, spare: list[Prompt]):
        super().__init__()
        self.spare, self.asked = list(spare), []

    def more_prompts(self, n):
        self.asked.append(n)
        out, self.spare = self.spare[:n], self.spare[n:]
        return out

    def score(self, table):
        metas = [json.loads(m) for m in table.column("meta").to_pylist()]
        return [0.0 if m["flat"] else float(i % 2) for i, m in enumerate(metas)]


def prompt(uid: str, flat: bool) -> Prompt:
    return Prompt(uid, [5, 6], uid, {"flat": flat})


def test_dynamic_sampling_refills_flat_groups_with_new_prompts():
    ctx = GroupContext([prompt("c", True), prompt("d", False), prompt("e", False), prompt("f", False)])
    table = DAPO(DAPOConfig(group_size=2)).rollout(ctx, [prompt("a", False), prompt("b", True), prompt("x", True)])
    # round 1 keeps a; round 2 asks 2 more (c flat, d kept); round 3 asks 1 (e kept)
    assert ctx.asked == [2, 1]
    assert table.column("group").to_pylist() == ["a", "a", "d", "d", "e", "e"]
    assert set(table.column("sampling_rounds").to_pylist()) == {3}
    assert groups_with_signal(table.column("reward").to_pylist(), table.column("group").to_pylist()).all()


def test_dynamic_sampling_stops_after_its_rounds_and_keeps_the_groups_it_has():
    ctx = GroupContext([prompt("c", True), prompt("d", True)])
    table = DAPO(DAPOConfig(group_size=2, max_sampling_rounds=2)).rollout(ctx, [prompt("a", False), prompt("b", True)])
    assert ctx.asked == [1] and table.column("group").to_pylist() == ["a", "a"]
    nothing = GroupContext([prompt("c", True)])
    table = DAPO(DAPOConfig(group_size=2, max_sampling_rounds=2)).rollout(nothing, [prompt("a", True)])
    assert table.column("group").to_pylist() == ["a", "a"]  # no group with signal at all: the first round's rows


def test_without_dynamic_sampling_flat_groups_stay():
    ctx = GroupContext([])
    table = DAPO(DAPOConfig(group_size=2, dynamic_sampling=False)).rollout(ctx, [prompt("a", False), prompt("b", True)])
    assert ctx.asked == [] and table.column("group").to_pylist() == ["a", "a", "b", "b"]


def test_prepare_adds_the_overlong_penalty_to_the_reward_before_the_group_advantages():
    rows = [
        dict(
            uid=f"u{i}",
            group="g",
            prompt_ids=[5],
            response_ids=[7] * n,
            logprobs=[-1.0] * n,
            reward=r,
            policy_version=0,
        )
        for i, (r, n) in enumerate([(1.0, 2), (1.0, 9), (0.0, 2), (0.0, 2)])
    ]
    table = make_experience(rows)
    penalty = overlong_penalty([2, 9, 2, 2], max_tokens=10, buffer_tokens=2)  # -0.5 on the 9-token response
    table = table.append_column("overlong_penalty", pa.array(penalty, type=pa.float32()))
    table = table.append_column("sampling_rounds", pa.array([1] * 4, type=pa.int32()))
    b = DAPO().prepare(table)
    shaped = np.array([1.0, 0.5, 0.0, 0.0])
    expected = (shaped - shaped.mean()) / (shaped.std() + 1e-6)
    per_row = (b.advantages * b.response_mask).sum(1) / b.response_mask.sum(1)
    assert per_row.tolist() == pytest.approx(expected.tolist(), rel=1e-5)
    metrics = DAPO().prepare_metrics(table)
    assert metrics["dapo/overlong_frac"] == 0.25 and metrics["dapo/overlong_penalty"] == pytest.approx(-0.125)


def test_registered_with_the_papers_defaults_and_capabilities():
    assert get_algorithm("dapo") is DAPO
    algo = DAPO()
    for capability in (SkipsRowsWithoutGradient, TrainsOnStaleRows, UsesProximalLogprobs):
        assert isinstance(algo, capability)
    c = algo.config
    assert (c.clip_eps_low, c.clip_eps_high, c.kl_coef, c.overlong_buffer_frac) == (0.2, 0.28, 0.0, 0.2)
