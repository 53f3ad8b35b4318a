"""VinePPO properties (../shared/papers/vineppo.md) on text and on a toy tree MDP with known values."""

import dataclasses

import numpy as np
import pytest

from algorithms.vineppo import (
    VinePPO,
    cap_steps,
    mc_value_estimates,
    split_steps,
    step_advantages,
    step_token_ends,
    value_state_prefixes,
)
from rlsys.contract import Prompt
from rlsys.experience import meta_of
from rlsys.generation import Generation, SamplingParams

# ---- step segmentation ----------------------------------------------------------------
TEXTS = [
    "First we add the two numbers.\nThen we carry the one. So the sum is 12.\n# Answer\n\n12",
    "We know $a. B$ holds and \\[x = 1.\nY = 2\\] gives it. Next step follows here.\nDone",
    "Let \\begin{align} a &= 1.\nB &= 2 \\end{align} be given. The rest is easy to see now.",
    "short\nalso short\nthis one is long enough to stand.\nend",
    "95",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_steps_rebuild_the_response_exactly(text):
    assert "".join(split_steps(text)) == text


def test_steps_never_split_a_math_span():
    text = TEXTS[1] + "\n" + TEXTS[2]
    steps = split_steps(text, min_chars=0)
    bounds = np.cumsum([len(s) for s in steps])[:-1]
    for span in ("$a. B$", "\\[x = 1.\nY = 2\\]", "\\begin{align} a &= 1.\nB &= 2 \\end{align}"):
        a = text.index(span)
        assert not any(a < c < a + len(span) for c in bounds), span


def test_cuts_at_newlines_and_sentences_merge_short_parts_and_the_answer():
    steps = split_steps(TEXTS[0])
    assert steps == ["First we add the two numbers.\n", "Then we carry the one. ", "So the sum is 12.\n# Answer\n\n12"]
    # "short\n" and "also short\n" are under 20 characters without a period: they merge forward
    assert split_steps(TEXTS[3]) == ["short\nalso short\nthis one is long enough to stand.\nend"]
    assert split_steps("95") == ["95"]


def test_step_token_ends_snap_to_token_boundaries_and_cap():
    # tokens of 3 characters each; steps end at characters 7 and 12 of 15
    prefix_chars = [0, 3, 6, 9, 12, 15]
    assert step_token_ends(["a" * 7, "b" * 5, "c" * 3], prefix_chars) == [3, 4, 5]
    # two steps inside one token merge
    assert step_token_ends(["a", "b", "c" * 13], prefix_chars) == [1, 5]
    assert cap_steps([1, 2, 3, 4, 5], 2) == [3, 5]
    assert value_state_prefixes([3, 4, 5]) == [0, 3, 4]


# ---- advantages ------------------------------------------------------------------------
def test_advantages_telescope_to_return_minus_first_value():
    rng = np.random.default_rng(0)
    for m in (1, 2, 5):
        values, reward = rng.random(m), float(rng.random())
        a = step_advantages(values, reward)
        assert a.sum() == pytest.approx(reward - values[0])
        assert a[-1] == pytest.approx(reward - values[-1])


def test_advantages_vanish_when_every_rollout_returns_the_trajectorys_reward():
    for reward in (0.0, 1.0):
        values = mc_value_estimates({s: [reward] * 9 for s in range(4)})
        assert np.allclose(step_advantages(list(values.values()), reward), 0.0)


# ---- a toy tree MDP: binary actions, depth 3, leaf rewards known --------------------------
LEFT, RIGHT, ANSWER, EOS, ROOT = 3, 4, 5, 2, 1
DEPTH = 3
TEXT = {LEFT: "Take the left branch.\n", RIGHT: "Take the right branch.\n", ANSWER: "Answer: done"}
GOOD_LEAVES = {(LEFT, LEFT, RIGHT), (LEFT, RIGHT, RIGHT), (RIGHT, RIGHT, LEFT), (RIGHT, LEFT, LEFT)}


def p_left(node):
    return 0.2 + 0.15 * ((3 * len(node) + sum(a == LEFT for a in node) * 2 + (node[:1] == (RIGHT,))) % 5)


def true_value(node):
    if len(node) == DEPTH:
        return float(node in GOOD_LEAVES)
    p = p_left(node)
    return p * true_value(node + (LEFT,)) + (1 - p) * true_value(node + (RIGHT,))


class Tokenizer:
    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return "".join(TEXT.get(t, "") for t in ids)


class TreeContext:
    """A RolloutContext whose 'model' walks the tree: the prompt is the root, each action a token."""

    policy_version = 0
    tokenizer = Tokenizer()
    task = None

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.generate_calls = []

    def sampling(self, **overrides):
        return dataclasses.replace(SamplingParams(max_new_tokens=DEPTH + 2), **overrides)

    def next_seed(self):
        return int(self.rng.integers(2**31 - 1))

    def generate(self, requests):
        self.generate_calls.append(requests)
        out = []
        for i, r in enumerate(requests):
            rng = np.random.default_rng([r.params.seed, *r.prompt_ids])
            for _ in range(r.params.n):
                node, tokens = tuple(r.prompt_ids[1:]), []
                while len(node) < DEPTH:
                    a = LEFT if rng.random() < p_left(node) else RIGHT
                    node, tokens = node + (a,), tokens + [a]
                tokens += [ANSWER, EOS]
                finish = "stop" if len(tokens) <= r.params.max_new_tokens else "length"
                tokens = tokens[: r.params.max_new_tokens]
                out.append(Generation(i, list(r.prompt_ids), tokens, [0.0] * len(tokens), finish))
        return out

    def score(self, table):
        return [float(tuple(r[:DEPTH]) in GOOD_LEAVES) for r in table.column("response_ids").to_pylist()]

    def ref_logprobs(self, table):
        return [[0.0] * len(r) for r in table.column("response_ids").to_pylist()]

    def score_and_ref_logprobs(self, table):
        return self.score(table), self.ref_logprobs(table)


def test_rollout_values_and_advantages_on_the_tree():
    ctx = TreeContext(seed=1)
    algo = VinePPO(VinePPO.Config(group_size=6, mc_rollouts=5))
    prompts = [Prompt("p0", [ROOT], "", {}), Prompt("p1", [ROOT], "", {})]
    table = algo.rollout(ctx, prompts)
    assert table.num_rows == 12
    # one trajectory call and one batched call for every value state, deduplicated
    assert len(ctx.generate_calls) == 2
    states = {tuple(r.prompt_ids) for r in ctx.generate_calls[1]}
    expected = {(ROOT, *resp[:j]) for resp in table.column("response_ids").to_pylist() for j in range(DEPTH)}
    assert states == expected and len(ctx.generate_calls[1]) == len(expected)
    assert all(
        r.params.n == 5 and r.params.max_new_tokens == DEPTH + 2 - (len(r.prompt_ids) - 1)
        for r in ctx.generate_calls[1]
    )
    for row, meta in zip(table.to_pylist(), meta_of(table)):
        assert meta["step_ends"] == [1, 2, DEPTH + 2]  # the answer merges into the last action's step
        v, adv = meta["step_values"], np.asarray(row["advantages"])
        assert len(adv) == len(row["response_ids"])
        # every token of a step shares its advantage, and they telescope
        steps = [adv[0:1], adv[1:2], adv[2:]]
        assert all(np.allclose(s, s[0]) for s in steps)
        assert sum(s[0] for s in steps) == pytest.approx(row["reward"] - v[0], abs=1e-6)
    batch = algo.prepare(table)
    assert batch.advantages.shape == batch.response_mask.shape
    assert batch.advantages[batch.response_mask > 0].mean().abs() < 1e-5  # whitened


def mc_errors(K, repeats, node_list):
    """V_hat(s) - V(s) over `repeats` independent estimates per state, through the algorithm's
    batched MC call (all states in one request batch)."""
    algo = VinePPO(VinePPO.Config(mc_rollouts=K))
    ctx = TreeContext(seed=K)
    errors = []
    for _ in range(repeats):
        keys = {((ROOT,), node): {} for node in node_list}
        values = mc_value_estimates(algo._mc_returns(ctx, keys))
        errors.append([values[((ROOT,), n)] - true_value(n) for n in node_list])
    return np.asarray(errors)


def test_mc_values_are_unbiased_and_their_error_shrinks_like_one_over_sqrt_k():
    nodes = [(), (LEFT,), (RIGHT,), (LEFT, RIGHT), (RIGHT, RIGHT)]
    var = np.array([true_value(n) * (1 - true_value(n)) for n in nodes])
    assert (var > 0.05).all()  # the states are genuinely uncertain
    repeats = 300
    rmse = {}
    for K in (1, 4, 16):
        err = mc_errors(K, repeats, nodes)
        # unbiased: the mean error is within 4 standard errors of 0
        assert np.all(np.abs(err.mean(0)) < 4 * np.sqrt(var / K / repeats)), (K, err.mean(0))
        rmse[K] = np.sqrt((err**2).mean())
        assert rmse[K] == pytest.approx(np.sqrt(var.mean() / K), rel=0.2)
    # error ~ 1/sqrt(K): 4x the rollouts halves it
    assert rmse[1] / rmse[4] == pytest.approx(2.0, rel=0.2)
    assert rmse[4] / rmse[16] == pytest.approx(2.0, rel=0.2)


def test_truncated_rollouts_score_zero():
    ctx = TreeContext()
    algo = VinePPO(VinePPO.Config(mc_rollouts=8))
    good = (RIGHT, RIGHT, LEFT)
    ctx.sampling = lambda **o: dataclasses.replace(SamplingParams(max_new_tokens=DEPTH), **o)  # no room for the answer
    returns = algo._mc_returns(ctx, {((ROOT,), good[:2]): {}})
    assert returns[((ROOT,), good[:2])] == [0.0] * 8
