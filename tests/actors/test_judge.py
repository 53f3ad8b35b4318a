"""The generative judge (actors/judge.py, ../shared/papers/judge.md): prompt sections in
order, the plan written from the instruction alone, verdict parsing, order-swap handling,
unparsable verdicts reported as such, rewards from judgements; then real tiny models through
the real HF rollout backend."""

import numpy as np
import pytest

from actors.judge import (
    UNPARSABLE,
    JudgeWorker,
    combine_orders,
    fit_to_context,
    judgement_metrics,
    pairwise_prompt,
    parse_score,
    parse_verdict,
    plan_prompt,
    pointwise_prompt,
    round_robin,
    score_reward,
    swap_verdict,
    win_rates,
)


def section_positions(prompt: str, names) -> list[int]:
    return [prompt.index(f"{name} (") for name in names]


def test_prompt_sections_are_plan_execution_verdict_in_that_order():
    plan = "1. check the sum"
    for prompt in (pairwise_prompt("2+3=", plan, "5", "6"), pointwise_prompt("2+3=", plan, "5", 1, 10)):
        pos = section_positions(prompt, ("Plan", "Execution", "Verdict"))
        assert pos == sorted(pos)
        # the filled-in plan comes before the execution the model is asked to write, which ends the prompt
        assert prompt.index("Plan:\n1. check the sum") < prompt.rindex("Execution:\n")
        assert prompt.endswith("Execution:\n")
    pair = pairwise_prompt("2+3=", plan, "five", "six")
    assert pair.index("Response A:\nfive") < pair.index("Response B:\nsix") < pair.index("Plan:\n")
    assert "Verdict: A" in pair and "Verdict: tie" in pair
    assert "Score: N" in pointwise_prompt("q", plan, "r", 1, 10)


def test_plan_prompt_sees_the_instruction_only():
    prompt = plan_prompt("What is 2+3?")
    assert "What is 2+3?" in prompt and prompt.endswith("Plan:\n")
    assert "Response" not in prompt and "Verdict" not in prompt


@pytest.mark.parametrize(
    "text, verdict",
    [
        ("step 1: ok\nVerdict: A", "A"),
        ("Verdict: B\n\n", "B"),
        ("blah\n  verdict:   tie.  ", "tie"),
        ("VERDICT: b", "B"),
        ("Verdict: A\nmore text after the verdict", UNPARSABLE),  # not the final line
        ("Verdict: C", UNPARSABLE),
        ("Verdict: A or B", UNPARSABLE),
        ("I prefer A", UNPARSABLE),
        ("", UNPARSABLE),
        ("Verdict:", UNPARSABLE),
    ],
)
def test_parse_verdict_reads_the_final_line_only(text, verdict):
    assert parse_verdict(text) == verdict


@pytest.mark.parametrize(
    "text, score",
    [
        ("Score: 7", 7),
        ("x\nscore: 10.", 10),
        ("Score: 1", 1),
        ("Score: 11", None),
        ("Score: 0", None),
        ("Score: 7.5", None),
        ("Score: seven", None),
        ("7", None),
        ("", None),
    ],
)
def test_parse_score_in_range_or_unparsable(text, score):
    assert parse_score(text, 1, 10) == score


def test_order_swap_combination():
    assert [swap_verdict(v) for v in ("A", "B", "tie", UNPARSABLE)] == ["B", "A", "tie", UNPARSABLE]
    # (A,B) says A and (B,A) says B (= A in the original frame): a preference for A
    assert combine_orders("A", "B") == ("A", False)
    assert combine_orders("B", "A") == ("B", False)
    assert combine_orders("tie", "tie") == ("tie", False)
    # a position-biased judge (always the first slot) disagrees with itself: a tie, counted
    assert combine_orders("A", "A") == ("tie", True)
    assert combine_orders("B", "B") == ("tie", True)
    assert combine_orders("A", "tie") == ("tie", True)
    # one unparsable pass makes the pair unparsable, never a preference
    for other in ("A", "B", "tie", UNPARSABLE):
        assert combine_orders(other, UNPARSABLE) == (UNPARSABLE, False)
        assert combine_orders(UNPARSABLE, other) == (UNPARSABLE, False)


def test_order_swap_makes_the_verdict_symmetric():
    """Judging (a, b) and judging (b, a) give mirrored combined verdicts, for every pair of pass outcomes."""
    outcomes = ("A", "B", "tie", UNPARSABLE)
    for first in outcomes:
        for second in outcomes:
            verdict, _ = combine_orders(first, second)
            mirrored, _ = combine_orders(second, first)  # the same two passes, the pair given the other way round
            assert mirrored == swap_verdict(verdict)


def test_win_rates_and_score_rewards():
    assert round_robin(3) == [(0, 1), (0, 2), (1, 2)]
    assert win_rates(2, {(0, 1): "A"}) == [1.0, 0.0]
    assert win_rates(2, {(0, 1): "B"}) == [0.0, 1.0]
    for no_preference in ("tie", UNPARSABLE):
        assert win_rates(2, {(0, 1): no_preference}) == [0.5, 0.5]
    rates = win_rates(3, {(0, 1): "A", (0, 2): "A", (1, 2): "tie"})
    assert rates == [1.0, 0.25, 0.25] and sum(rates) == pytest.approx(3 / 2)  # one point per pair in all
    assert win_rates(1, {}) == [0.5]
    assert score_reward(1, 1, 10, -1.0) == 0.0 and score_reward(10, 1, 10, -1.0) == 1.0
    assert score_reward(None, 1, 10, -1.0) == -1.0


def test_metrics_count_disagreements_and_unparsable():
    from actors.judge import PairJudgement, PointJudgement

    pairs = [
        PairJudgement(*combine_orders(a, b)[:1], (a, b), combine_orders(a, b)[1])
        for a, b in (("A", "B"), ("A", "A"), ("B", UNPARSABLE), ("tie", "tie"))
    ]
    m = judgement_metrics(pairs, [PointJudgement(7), PointJudgement(None)])
    assert m["judge/pairs"] == 4 and m["judge/a"] == 0.25 and m["judge/tie"] == 0.5
    assert m["judge/order_disagreements"] == 0.25 and m["judge/unparsable"] == 0.25 and m["judge/b"] == 0.0
    assert m["judge/unparsable_scores"] == 0.5 and m["judge/score_mean"] == 7


# ---- real tiny models through the real HF backend ---------------------------------------------
INSTRUCTIONS = [f"{a}+{b}=" for a in range(4) for b in range(4)]


def scripted_rows():
    """Training rows for a tiny judge that always writes the same thing for each pass: a plan,
    `Verdict: A` (it always picks the first slot: position bias) and `Score: 7`."""
    rows = []
    for k, inst in enumerate(INSTRUCTIONS):
        a, b = str(k % 7), str((k + 3) % 7)
        rows += [
            {"prompt": plan_prompt(inst), "answer": "compare the sums"},
            {"prompt": pairwise_prompt(inst, "compare the sums", a, b), "answer": "A is first.\nVerdict: A"},
            {"prompt": pointwise_prompt(inst, "compare the sums", a, 1, 10), "answer": "fine.\nScore: 7"},
        ]
    return rows


class PromptTask:
    """Rows whose prompt is already the text (for algorithms.sft.warmup)."""

    def prompt_text(self, row):
        return row["prompt"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def judge_dirs(tmp_path_factory):
    """A random-init tiny judge and one trained to the scripted behaviour, both saved with save_pretrained."""
    from algorithms.sft import warmup
    from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer

    rows = scripted_rows()
    tokenizer = train_tokenizer([r["prompt"] + r["answer"] for r in rows], 512)
    spec = TinyModelSpec(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    root = tmp_path_factory.mktemp("judges")
    random_dir = save_model_dir(build_tiny_model(spec, tokenizer, seed=1), tokenizer, root / "random")
    model = build_tiny_model(spec, tokenizer, seed=2)
    warmup(model, tokenizer, PromptTask(), rows, steps=100, batch_size=12, lr=1e-2, seed=0)
    scripted_dir = save_model_dir(model, tokenizer, root / "scripted")
    return random_dir, scripted_dir


def experience(prompts, responses, groups, tokenizer):
    from rlsys.experience import make_experience

    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]
    return make_experience(
        [
            dict(
                uid=str(k),
                group=g,
                prompt_ids=enc(p),
                response_ids=enc(r),
                logprobs=[0.0] * len(enc(r)),
                reward=0.0,
                policy_version=0,
            )
            for k, (p, r, g) in enumerate(zip(prompts, responses, groups))
        ]
    )


def test_random_tiny_judge_verdicts_are_reported_unparsable(judge_dirs):
    random_dir, _ = judge_dirs
    judge = JudgeWorker(str(random_dir), options={"max_plan_tokens": 8, "max_execution_tokens": 12})
    pairs = judge.pairwise([("2+3=", "5", "6"), ("1+1=", "2", "3")])
    for j in pairs:
        assert j.orders == (UNPARSABLE, UNPARSABLE) and j.verdict == UNPARSABLE and not j.disagreement
        assert j.plan and all(isinstance(e, str) for e in j.executions)
    assert judge.judge("2+3=", ["5"]).score is None
    m = judge.take_metrics()
    assert m["judge/unparsable"] == 1.0 and m["judge/a"] == m["judge/b"] == 0.0 and m["judge/unparsable_scores"] == 1.0
    assert judge.take_metrics() == {}  # counted once
    # as a reward source: no preference from an unparsable pair, the configured value for an unparsable score
    table = experience(["2+3=", "2+3="], ["5", "6"], ["g", "g"], judge.tokenizer)
    judge.options.mode = "pairwise"
    assert judge.score(table) == [0.5, 0.5]
    judge.options.mode, judge.options.unparsable_reward = "pointwise", -1.0
    assert judge.score(table) == [-1.0, -1.0]
    with pytest.raises(ValueError, match="one response .* or two"):
        judge.judge("q", ["a", "b", "c"])


def test_a_sampling_judge_restored_from_its_state_draws_what_the_uninterrupted_one_would(judge_dirs):
    random_dir, _ = judge_dirs
    options = {"temperature": 1.0, "seed": 3}
    judge = JudgeWorker(str(random_dir), options=options)
    texts = ["2+3=", "1+1=", "4+4="]
    first = judge.complete(texts, 12)
    state = judge.state()  # what a checkpoint after this step keeps
    second = judge.complete(texts, 12)
    assert second != first  # each call draws with its own seed
    resumed = JudgeWorker(str(random_dir), options=options)
    resumed.load_state(state)
    assert resumed.complete(texts, 12) == second


def test_fit_to_context_drops_the_middle():
    ids = list(range(10))
    assert fit_to_context(ids, 10) == ids and fit_to_context(ids, 4) == [0, 1, 8, 9]
    assert fit_to_context(ids, 5) == [0, 1, 7, 8, 9]
    with pytest.raises(ValueError, match="no room"):
        fit_to_context(ids, 1)


def test_a_prompt_longer_than_the_judges_context_is_cut_and_counted(judge_dirs):
    random_dir, _ = judge_dirs
    judge = JudgeWorker(str(random_dir), options={"max_plan_tokens": 8, "max_execution_tokens": 12})
    assert judge.context_length == 512
    long_response = "12+30=42 " * 200  # well over 512 tokens
    verdict = judge.judge("12+30=", [long_response, "42"])
    assert verdict.verdict in ("A", "B", "tie", UNPARSABLE)
    m = judge.take_metrics()
    assert m["judge/truncated_prompts"] == 2  # both orders of the pair; the plan prompt fit


def test_scripted_tiny_judge_parsable_verdicts_are_combined_right(judge_dirs):
    _, scripted_dir = judge_dirs
    judge = JudgeWorker(str(scripted_dir), options={"max_plan_tokens": 8, "max_execution_tokens": 16})
    j = judge.judge("2+3=", ["5", "6"])
    assert j.executions[0].strip().endswith("Verdict: A") and j.executions[1].strip().endswith("Verdict: A")
    # "A" in both orders means the first slot both times: position bias, combined into a counted tie
    assert j.orders == ("A", "A") and j.verdict == "tie" and j.disagreement
    assert judge.judge("2+3=", ["5"]).score == 7
    m = judge.take_metrics()
    assert m["judge/order_disagreements"] == 1.0 and m["judge/tie"] == 1.0 and m["judge/score_mean"] == 7
    # rewards: pointwise 7 on 1..10 -> 2/3; pairwise win rates in groups of 3 and 2 -> all ties
    table = experience(["1+2="] * 3 + ["3+3="] * 2, ["3", "4", "5", "6", "7"], ["x"] * 3 + ["y"] * 2, judge.tokenizer)
    assert np.allclose(judge.score(table), 6 / 9)
    judge.options.mode = "pairwise"
    assert judge.score(table) == [0.5] * 5
    m = judge.take_metrics()
    assert m["judge/pairs"] == 3 + 1 and m["judge/order_disagreements"] == 1.0


def test_pairwise_judge_rewards_label_pilaf_pairs():
    """A pair's both-order verdict, as rewards (win rates), gives PILAF's labels: an agreed
    preference is decisive for the right side; a tie, a disagreement or an unparsable pair is not."""
    from algorithms.pilaf import label_pairs

    rng = np.random.default_rng(0)
    verdicts = [combine_orders(*o)[0] for o in (("A", "B"), ("B", "A"), ("A", "A"), ("tie", "tie"), ("A", UNPARSABLE))]
    rewards = np.array([win_rates(2, {(0, 1): v}) for v in verdicts])
    a_wins, decisive = label_pairs(rewards[:, 0], rewards[:, 1], "max", rng)
    assert decisive.tolist() == [True, True, False, False, False]
    assert a_wins[:2].tolist() == [True, False]


def test_judge_metric_of_an_attached_evaluator(judge_dirs, tmp_path):
    from envs.arithmetic import ArithmeticTask
    from rlsys.evaluators import EvaluatorWorker, parse_spec

    random_dir, scripted_dir = judge_dirs
    task = ArithmeticTask.create(tmp_path, 20, 6, 0, 3, ["+"], seed=0)
    for judge_dir, expected in (
        (scripted_dir, {"judge": 6 / 9, "judge_unparsable": 0.0, "n": 4.0}),
        (random_dir, {"judge_unparsable": 1.0, "n": 4.0}),
    ):
        spec = parse_spec(
            {"name": "judged", "metric": "judge", "judge": str(judge_dir), "limit": 4, "max_new_tokens": 3}
        )
        assert spec.metric_key == "judge"
        # the policy under evaluation is the random tiny model; the judge scores its answers
        evaluator = EvaluatorWorker(str(random_dir), spec.model_dump(), task, max_new_tokens=3)
        evaluator.judge.options.max_plan_tokens, evaluator.judge.options.max_execution_tokens = 8, 16
        metrics = evaluator.evaluate(0, None)["metrics"]
        assert metrics.keys() == expected.keys() and metrics == pytest.approx(expected)


@pytest.mark.integration
def test_judge_reward_actor_on_a_local_cluster(ray_cluster, judge_dirs):
    """`reward.source: judge` starts a JudgeWorker actor (the controller's path) that scores an
    experience table and hands its judge/* metrics over once."""
    from rlsys.config import load_config
    from rlsys.models import load_tokenizer
    from rlsys.reward_source import start_reward_actor

    random_dir, scripted_dir = judge_dirs
    cfg = load_config(
        "configs/pilaf.yaml",
        [
            "reward.source=judge",
            f"reward.judge_dir={scripted_dir}",
            "reward.judge.mode=pairwise",
            "reward.judge.max_execution_tokens=16",
            "reward.judge.max_plan_tokens=8",
        ],
    )
    actor = start_reward_actor(cfg.reward, random_dir, task=None)  # the policy's tokenizer: random_dir's
    table = experience(["2+2=", "2+2="], ["4", "5"], ["g", "g"], load_tokenizer(random_dir))
    assert ray_cluster.get(actor.score.remote(table)) == [0.5, 0.5]
    metrics = ray_cluster.get(actor.take_metrics.remote())
    assert metrics["judge/pairs"] == 1 and metrics["judge/order_disagreements"] == 1.0
    assert ray_cluster.get(actor.take_metrics.remote()) == {}
    ray_cluster.kill(actor)
