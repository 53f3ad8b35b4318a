"""Long-CoT reward shaping (../shared/papers/long-cot-rewards.md): the page's properties on
the pure functions, config errors, the reward actor applying it in-process, and two GRPO
steps with shaping on a real local Ray cluster."""

import json
import math

import pytest

from envs.rewards import (
    RewardShaping,
    ShapedTask,
    build_shaping,
    cosine_length_reward,
    repetition_token_penalties,
    sparse_repetition_penalty,
)
from rlsys.config import ConfigError, load_config

L_MAX = 100


def test_cosine_boundary_values():
    # correct: 2 at L=0 falling to 1 at L_max; wrong: -10 at L=0 rising to 0 at L_max
    assert cosine_length_reward(0, True, L_MAX) == pytest.approx(2.0)
    assert cosine_length_reward(0, False, L_MAX) == pytest.approx(-10.0)
    # the formula's value at L_max itself (margin 0 so that L_max is not "truncated")
    assert cosine_length_reward(L_MAX, True, L_MAX, margin=0) == -10.0  # L + 0 >= L_max: truncated
    assert cosine_length_reward(L_MAX - 1e-9, True, L_MAX, margin=0) == pytest.approx(1.0)
    assert cosine_length_reward(L_MAX - 1e-9, False, L_MAX, margin=0) == pytest.approx(0.0)
    # halfway: the mean of a and b
    assert cosine_length_reward(L_MAX // 2, True, L_MAX) == pytest.approx(1.5)
    assert cosine_length_reward(L_MAX // 2, False, L_MAX) == pytest.approx(-5.0)
    # truncation: L + 16 >= L_max gives -10 whether right or wrong; one token shorter does not
    for correct in (True, False):
        assert cosine_length_reward(L_MAX - 16, correct, L_MAX) == -10.0
        assert cosine_length_reward(L_MAX - 17, correct, L_MAX) != -10.0
    a, b = 1.0, 2.0
    L = 37
    assert cosine_length_reward(L, True, L_MAX) == pytest.approx(
        a + 0.5 * (b - a) * (1 + math.cos(math.pi * L / L_MAX))
    )


def test_cosine_monotone_in_length():
    lengths = range(0, L_MAX - 16)
    correct = [cosine_length_reward(L, True, L_MAX) for L in lengths]
    wrong = [cosine_length_reward(L, False, L_MAX) for L in lengths]
    assert all(x > y for x, y in zip(correct, correct[1:]))  # shorter correct answers earn more
    assert all(x < y for x, y in zip(wrong, wrong[1:]))  # longer wrong answers are punished less
    assert min(correct) > max(wrong)  # any correct answer beats any wrong one


def test_repetition_penalty_zero_without_repeats():
    tokens = list(range(120))
    assert repetition_token_penalties(tokens, n=40) == [0.0] * 120
    assert repetition_token_penalties(tokens, n=1) == [0.0] * 120
    assert sparse_repetition_penalty(tokens, n=3) == 0.0
    assert sparse_repetition_penalty([1, 2], n=3) == 0.0  # no n-gram at all


def test_repetition_penalty_exact_count():
    # a 3-token phrase said three times: only the 2nd and 3rd occurrences are penalised
    tokens = [7, 8, 9, 7, 8, 9, 7, 8, 9]
    assert repetition_token_penalties(tokens, n=3, penalty=-0.05) == [0.0] * 3 + [-0.05] * 6
    # 40-gram default: a block of 50 distinct tokens, then its first 45 again -> the repeated
    # 40-grams start at 50..55 and cover tokens 50..94, 45 tokens penalised once each
    block = list(range(50))
    tokens = block + block[:45]
    pen = repetition_token_penalties(tokens)
    assert sum(p != 0 for p in pen) == 45 and pen[:50] == [0.0] * 50
    assert sum(pen) == pytest.approx(-0.05 * 45)
    # sparse: 9 tokens, 7 trigrams, 3 unique -> (1 - 3/7) * max_penalty
    assert sparse_repetition_penalty([7, 8, 9] * 3, n=3, max_penalty=-1.0) == pytest.approx(-(1 - 3 / 7))


def test_shaping_composes_and_token_rewards_sum_to_the_scalar():
    shaping = build_shaping(
        [
            {"cosine_length": {"max_length": 40}},
            {"repetition": {"ngram": 2}},
            {"repetition": {"mode": "sparse", "ngram": 2, "max_penalty": -0.5}},
        ]
    )
    tokens = [5, 6, 5, 6, 5]  # bigrams 56 65 56 65: repeats start at 2 and 3 -> tokens 2, 3, 4
    right = shaping.apply(1.0, True, tokens)
    assert right.sequence == pytest.approx(cosine_length_reward(5, True, 40))  # sparse only on wrong answers
    assert right.tokens == [0.0, 0.0, -0.05, -0.05, -0.05]
    assert right.reward == pytest.approx(right.sequence - 0.15)
    assert sum(right.token_rewards) == pytest.approx(right.reward) and right.token_rewards[:2] == [0.0, 0.0]
    wrong = shaping.apply(0.0, False, tokens)
    assert wrong.sequence == pytest.approx(cosine_length_reward(5, False, 40) + (1 - 2 / 4) * -0.5)
    assert RewardShaping().apply(0.7, True, tokens).reward == 0.7  # no shaping: the task's reward


@pytest.mark.parametrize(
    "entries, message",
    [
        (["cosine_length"], "config error: 'task.shaping[0].cosine_length.max_length' is required"),
        (
            ["length"],
            "config error: task.shaping[0] = 'length': unknown reward function (available: cosine_length, repetition)",
        ),
        (
            [{"repetition": {"ngram": 0}}],
            "config error: task.shaping[0].repetition.ngram = 0: Input should be greater than or equal to 1",
        ),
        (
            [{"repetition": {"penalty": 0.05}}],
            "config error: task.shaping[0].repetition.penalty = 0.05: Input should be less than or equal to 0",
        ),
        ([{"repetition": {"n": 3}}], "config error: unknown key 'task.shaping[0].repetition.n'"),
        ([{"cosine_length": {"max_length": 8}}], "config error: task.shaping[0].cosine_length = "),
        (
            [{"cosine_length": {"max_length": 32}, "repetition": {}}],
            "must be a reward function name or {name: {params}}",
        ),
        ([{"repetition": 3}], "config error: task.shaping[0].repetition = 3: parameters must be a mapping"),
    ],
)
def test_config_errors_are_one_line(entries, message):
    with pytest.raises(ConfigError) as e:
        build_shaping(entries)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_bad_shaping_entry_fails_when_the_controller_is_built(tmp_path):
    from rlsys.run.controller import Controller

    cfg = load_config("configs/quickstart.yaml", ["task.shaping=[{cosine_length: {max_length: 16, margin: 16}}]"])
    with pytest.raises(
        ConfigError, match=r"^config error: task.shaping\[0\].cosine_length = .*margin 16 must be below"
    ):
        Controller(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_shaping_a_judge_or_model_score_is_refused_not_ignored(tmp_path):
    from rlsys.run.controller import Controller

    cfg = load_config("configs/quickstart.yaml", ["task.shaping=[{repetition: {ngram: 2}}]", "reward.source=judge"])
    with pytest.raises(
        ConfigError,
        match=r"^config error: 'task.shaping' shapes the task's rule reward, but reward.source "
        r"is 'judge' \(its scores are not shaped\)",
    ):
        Controller(cfg, tmp_path / "run", progress=False)


def test_make_task_and_reward_worker_apply_the_configured_shaping(tmp_path):
    """The reward actor class in-process (its Ray form is used by the integration test below)."""
    import pyarrow as pa

    from actors.reward import RewardWorker
    from envs.registry import make_task
    from rlsys.experience import make_experience
    from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer

    cfg = load_config(
        None,
        [
            "task.num_train=50",
            "task.num_eval=5",
            "task.max_value=9",
            "task.shaping=[{cosine_length: {max_length: 20}}, {repetition: {ngram: 1}}]",
        ],
    )
    task = make_task(cfg.task, tmp_path / "data", 0)
    assert isinstance(task, ShapedTask) and task.rows("train") and task.corpus()  # the task's own methods pass through
    tokenizer = train_tokenizer(task.corpus(), 64)
    save_model_dir(
        build_tiny_model(
            TinyModelSpec(
                hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
            ),
            tokenizer,
        ),
        tokenizer,
        tmp_path / "policy",
    )
    row = task.rows("train")[0]
    right = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    wrong = tokenizer("1 1 1", add_special_tokens=False)["input_ids"]
    table = make_experience(
        [
            dict(
                uid=str(i),
                group="g",
                prompt_ids=[1],
                response_ids=ids,
                logprobs=[0.0] * len(ids),
                reward=0.0,
                policy_version=0,
                meta=row,
            )
            for i, ids in enumerate([right, wrong])
        ]
    )
    worker = RewardWorker(str(tmp_path / "policy"), task=task)
    scores = worker.score(table)
    repeats = len(wrong) - len(set(wrong))
    # the same rewards per token (what PPO's GAE takes): each repeat's penalty on its own token
    tokens = worker.take_token_rewards(["0", "1"])
    assert [sum(t) for t in tokens] == pytest.approx(scores) and [len(t) for t in tokens] == [len(right), len(wrong)]
    seen = set()
    for j, token in enumerate(wrong[:-1]):
        assert tokens[1][j] == pytest.approx(-0.05 if token in seen else 0.0)
        seen.add(token)
    assert worker.take_token_rewards(["0"]) is None  # taken once
    assert scores[0] == pytest.approx(
        cosine_length_reward(len(right), True, 20) - 0.05 * (len(right) - len(set(right)))
    )
    assert scores[1] == pytest.approx(cosine_length_reward(len(wrong), False, 20) - 0.05 * repeats) and repeats >= 2
    plain = make_task(
        load_config(None, ["task.num_train=50", "task.num_eval=5", "task.max_value=9"]).task, tmp_path / "d2", 0
    )
    assert RewardWorker(str(tmp_path / "policy"), task=plain).score(table) == [1.0, 0.0]
    assert isinstance(table, pa.Table)


@pytest.mark.integration
def test_grpo_with_shaping_on_a_local_cluster(ray_cluster, tmp_path):
    from fakes import TINY_ONE_WORKER as TINY

    from rlsys.run.controller import Controller

    shaping = "task.shaping=[{cosine_length: {max_length: 24}}, {repetition: {ngram: 2}}]"
    cfg = load_config(
        "configs/quickstart.yaml",
        [*TINY, shaping, "algorithm.group_size=4", f"run.output_dir={tmp_path}", "run.name=shaped"],
    )
    controller = Controller(cfg, tmp_path / "shaped", progress=False)
    summary = controller.run()
    rows = [json.loads(l) for l in (tmp_path / "shaped" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and summary["steps"] == 2
    # the metrics' rewards are the shaped ones. With 4 new tokens at most and L_max 24, a correct
    # answer earns r(L) in [1.93, 2] less at most 4 x 0.05 of repetition penalty, a wrong one
    # r(L) in [-10, -9.33] less the same: the mean lies between these bounds at the step's accuracy
    hi_wrong = 0.5 * -10 * (1 + math.cos(math.pi * 4 / 24))
    for r in rows:
        acc = r["accuracy/train"]
        assert acc * 1.73 + (1 - acc) * -10.2 - 1e-4 <= r["reward/mean"] <= acc * 2 + (1 - acc) * hi_wrong + 1e-4
    # the reward actor on the cluster scores a fresh rollout exactly as the pure functions do
    task, tokenizer = controller.task, controller.tokenizer
    table = controller.algorithm.rollout(controller.ctx, controller.stream.next(4))
    metas = [json.loads(m) for m in table.column("meta").to_pylist()]
    for ids, meta, reward in zip(table.column("response_ids").to_pylist(), metas, table.column("reward").to_pylist()):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        expected = cosine_length_reward(len(ids), task.is_correct(meta, text), 24) + sum(
            repetition_token_penalties(ids, 2)
        )
        assert reward == pytest.approx(expected, abs=1e-5)
    # and per token through the context (what PPO's rollout asks): each row's sums to its reward
    tokens = controller.ctx.token_rewards(table)
    assert [sum(t) for t in tokens] == pytest.approx(table.column("reward").to_pylist(), abs=1e-5)
