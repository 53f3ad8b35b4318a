"""Bradley-Terry reward model (rlsys/reward_model.py): the loss and its gradient, pairs from
the task, a tiny RM trained by the real `rlsys rm train` CLI ranking held-out pairs, the
reward worker and evaluator metrics on it, the `reward` config section, and a 2-step run on
a real local Ray cluster whose rewards come from the reward model."""

import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from rlsys.config import ConfigError, load_config
from rlsys.reward_model import bradley_terry_loss, preference_pairs, wrong_answer

TINY_TASK = ["task.num_train=200", "task.num_eval=16", "task.max_value=9"]
TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    *TINY_TASK,
    "sft.steps=5",
    "trainer.prompts_per_step=4",
    "trainer.eval_every=2",
    "rollout.max_new_tokens=4",
    "rollout.num_workers=1",
    "trainer.steps=2",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bradley_terry_loss_value_and_gradient():
    chosen = torch.tensor([2.0, 0.0, -1.0], requires_grad=True)
    rejected = torch.tensor([0.0, 0.0, 1.0], requires_grad=True)
    loss = bradley_terry_loss(chosen, rejected)
    expected = np.mean([math.log1p(math.exp(-d)) for d in (2.0, 0.0, -2.0)])
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # d/dr_w = -sigmoid(r_l - r_w) / N, d/dr_l = +sigmoid(r_l - r_w) / N
    s = torch.sigmoid(rejected.detach() - chosen.detach()) / 3
    assert torch.allclose(chosen.grad, -s) and torch.allclose(rejected.grad, s)
    assert bradley_terry_loss(torch.tensor([5.0]), torch.tensor([0.0])) < bradley_terry_loss(
        torch.tensor([1.0]), torch.tensor([0.0])
    )


def test_bradley_terry_fit_recovers_a_linear_reward():
    """Preferences drawn from P(a > b) = sigmoid(w*.(x_a - x_b)): gradient descent on the BT loss
    with r = w.x points w along w*."""
    gen = torch.Generator().manual_seed(0)
    w_true = torch.tensor([2.0, -1.0, 0.5])
    xa, xb = torch.randn(2000, 3, generator=gen), torch.randn(2000, 3, generator=gen)
    a_wins = torch.rand(2000, generator=gen) < torch.sigmoid((xa - xb) @ w_true)
    chosen, rejected = torch.where(a_wins[:, None], xa, xb), torch.where(a_wins[:, None], xb, xa)
    w = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([w], lr=1.0)
    for _ in range(100):
        loss = bradley_terry_loss(chosen @ w, rejected @ w)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.nn.functional.cosine_similarity(w.detach(), w_true, dim=0) > 0.99
    assert w.detach().norm().item() == pytest.approx(w_true.norm().item(), rel=0.15)  # the scale is identified too


def test_preference_pairs_prefer_the_correct_answer(tmp_path):
    from envs.arithmetic import ArithmeticTask

    task = ArithmeticTask.create(tmp_path, 60, 10, 0, 9, ["+"], seed=0)
    rows = task.rows("train")
    pairs = preference_pairs(rows, task.prompt_text, per_row=3, seed=0)
    by_prompt = {r["prompt"]: r for r in rows}
    assert len(rows) < len(pairs) <= 3 * len(rows)
    for p in pairs:
        row = by_prompt[p["prompt"]]
        assert task.is_correct(row, p["chosen"]) and not task.is_correct(row, p["rejected"])
    rng = random.Random(0)
    assert wrong_answer("x", rng, ["x", "y"]) == "y"
    with pytest.raises(ValueError, match="cannot make a wrong answer"):
        wrong_answer("x", rng, ["x"])


@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory):
    """A tiny reward model trained by the real CLI (`rlsys rm train`), saved with save_pretrained."""
    out = tmp_path_factory.mktemp("rm") / "rm"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlsys.run.cli",
            "rm",
            "train",
            "configs/quickstart.yaml",
            *TINY[:3],
            *TINY_TASK,
            "--out",
            str(out),
            "--steps",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "held-out pairwise accuracy" in p.stdout
    return out


def test_trained_reward_model_loads_with_the_standard_pair_in_a_fresh_process(trained_rm):
    """`AutoModelForSequenceClassification` / `AutoTokenizer.from_pretrained(dir)`, with nothing of
    rlsys imported, score `prompt + response` as rlsys's RewardModel does."""
    from actors.reward import RewardModel

    texts = [("12+34=", "46"), ("12+34=", "47"), ("7+8=", "15")]
    fresh = r"""
import json, sys
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForSequenceClassification.from_pretrained(sys.argv[1]).eval()
scores = []
for prompt, response in json.loads(sys.argv[2]):
    ids = torch.tensor([tok(prompt + response, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        scores.append(model(ids).logits[0, 0].item())
print(json.dumps([scores, any(m == "rlsys" or m.startswith("rlsys.") for m in sys.modules)]))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", fresh, str(trained_rm), json.dumps(texts)],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(trained_rm.parent),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    theirs, rlsys_imported = json.loads(done.stdout.strip().splitlines()[-1])
    ours = RewardModel(str(trained_rm)).score_texts([p for p, _ in texts], [r for _, r in texts])
    assert not rlsys_imported and theirs == pytest.approx(ours, abs=1e-5)


def test_trained_reward_model_ranks_held_out_pairs(trained_rm):
    from actors.reward import RewardModel
    from envs.arithmetic import ArithmeticTask

    report = json.loads((trained_rm / "rm_train.json").read_text())
    assert report["last_loss"] < report["first_loss"]
    task = ArithmeticTask(trained_rm / "data" / "train.parquet", trained_rm / "data" / "eval.parquet")
    assert not {r["prompt"] for r in task.rows("eval")} & {r["prompt"] for r in task.rows("train")}
    held_out = preference_pairs(task.rows("eval"), task.prompt_text, per_row=4, seed=123)
    rm = RewardModel(str(trained_rm))  # from_pretrained of the saved dir, its own tokenizer
    prompts = [p["prompt"] for p in held_out]
    chosen = rm.score_texts(prompts, [p["chosen"] for p in held_out])
    rejected = rm.score_texts(prompts, [p["rejected"] for p in held_out])
    accuracy = float(np.mean(np.array(chosen) > np.array(rejected)))
    # chance is 0.5; with ~50 pairs, 0.75 is more than 3.5 standard deviations above it
    assert len(held_out) >= 40 and accuracy >= 0.75, (accuracy, report)
    assert report["held_out_accuracy"] >= 0.75


def test_reward_worker_and_evaluator_metric_on_the_trained_model(trained_rm):
    from actors.reward import RewardModel, RewardWorker
    from envs.arithmetic import ArithmeticTask
    from rlsys.evaluators import EvaluatorWorker, parse_spec
    from rlsys.experience import make_experience
    from rlsys.models import TinyModelSpec, build_tiny_model, load_tokenizer, save_model_dir, train_tokenizer

    task = ArithmeticTask(trained_rm / "data" / "train.parquet", trained_rm / "data" / "eval.parquet")
    rows = task.rows("eval")
    # a policy with another tokenizer: the worker decodes with it and re-encodes with the RM's
    policy_tok = train_tokenizer(task.corpus(), 300, split_digits=False)
    assert policy_tok("12+34=")["input_ids"] != load_tokenizer(trained_rm)("12+34=")["input_ids"]
    policy_dir = save_model_dir(
        build_tiny_model(TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2), policy_tok),
        policy_tok,
        trained_rm.parent / "policy",
    )
    worker = RewardWorker(str(policy_dir), reward_model_dir=str(trained_rm))
    enc = lambda t: policy_tok(t, add_special_tokens=False)["input_ids"]
    answers = [r["answer"] for r in rows] + [str(int(r["answer"]) + 3) for r in rows]
    table = make_experience(
        [
            dict(
                uid=str(k),
                group="g",
                prompt_ids=enc(rows[k % len(rows)]["prompt"]),
                response_ids=enc(a) + [policy_tok.eos_token_id],
                logprobs=[0.0],
                reward=0.0,
                policy_version=0,
            )
            for k, a in enumerate(answers)
        ]
    )
    scores = worker.score(table)
    direct = RewardModel(str(trained_rm)).score_texts([r["prompt"] for r in rows] * 2, answers)
    assert np.allclose(scores, direct, atol=1e-5)
    assert np.mean(scores[: len(rows)]) > np.mean(scores[len(rows) :])

    spec = parse_spec({"name": "rm", "metric": "reward_model", "reward_model": str(trained_rm), "limit": 8})
    evaluator = EvaluatorWorker(str(policy_dir), spec.model_dump(), task, max_new_tokens=3)
    result = evaluator.evaluate(0, None)
    assert set(result["metrics"]) == {"reward_model", "n"} and math.isfinite(result["metrics"]["reward_model"])
    right = evaluator.model_metric(list(range(8)), [r["answer"] for r in rows[:8]])["reward_model"]
    wrong = evaluator.model_metric(list(range(8)), [str(int(r["answer"]) + 3) for r in rows[:8]])["reward_model"]
    assert right > wrong


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["reward.source=model"],
            "config error: reward.model_dir = None: Value error, is required when reward.source is 'model'",
        ),
        (
            ["reward.source=model", "reward.model_dir=/no/such"],
            "reward.model_dir = '/no/such': Value error, is not a model directory",
        ),
        (["reward.model_dir=configs"], "is used by reward.source 'model' only (reward.source is 'rule')"),
        (
            ["reward.source=judge", "reward.judge_dir=configs"],
            "reward.judge_dir = 'configs': Value error, is not a model directory",
        ),
        (
            ["reward.source=critic"],
            "config error: reward.source = 'critic': Input should be 'rule', 'model', 'judge' or 'http'",
        ),
        (["reward.judge.mode=listwise"], "reward.judge.mode = 'listwise': Input should be 'pointwise' or 'pairwise'"),
        (
            ["reward.judge.min_score=5", "reward.judge.max_score=5"],
            "reward.judge.max_score = 5: Value error, must be above",
        ),
        (
            ["reward.judge.max_plan_tokens=0"],
            "reward.judge.max_plan_tokens = 0: Input should be greater than or equal to 1",
        ),
        (["reward.jduge.mode=pairwise"], "config error: unknown key 'reward.jduge'"),
    ],
)
def test_reward_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("configs/quickstart.yaml", overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"name": "x", "metric": "reward_model"},
            "evaluator error: reward_model = None: is required by metric 'reward_model'",
        ),
        ({"name": "x", "metric": "judge", "judge": "/no/such"}, "judge = '/no/such': is not a model directory"),
        ({"name": "x", "reward_model": "configs"}, "reward_model = 'configs': is used by metric 'reward_model' only"),
    ],
)
def test_model_metric_specs_fail_in_one_line(data, message):
    from rlsys.evaluators import parse_spec

    with pytest.raises(ConfigError) as e:
        parse_spec(data)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.integration
def test_two_grpo_steps_with_rewards_from_the_reward_model(ray_cluster, tmp_path, trained_rm):
    from actors.reward import RewardModel
    from rlsys.experience import make_experience
    from rlsys.run.controller import Controller

    cfg = load_config(
        "configs/quickstart.yaml",
        [
            *TINY,
            "algorithm.group_size=4",
            "reward.source=model",
            f"reward.model_dir={trained_rm}",
            f"run.output_dir={tmp_path}",
            "run.name=rm",
        ],
    )
    controller = Controller(cfg, tmp_path / "rm", progress=False)
    summary = controller.run()
    rows = [json.loads(l) for l in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and summary["steps"] == 2
    for row in rows:
        assert row["samples"] == 4 * 4 and math.isfinite(row["loss/policy"]) and math.isfinite(row["reward/mean"])
        assert "accuracy/train" not in row  # reward-model scores say nothing of correctness
    # the run's reward actor is the reward model: its scores on a table match the model's own
    tok = controller.tokenizer
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]
    pairs = [("3+4=", "7"), ("3+4=", "9"), ("5+1=", "6")]
    table = make_experience(
        [
            dict(
                uid=str(k),
                group="g",
                prompt_ids=enc(p),
                response_ids=enc(r),
                logprobs=[0.0],
                reward=0.0,
                policy_version=0,
            )
            for k, (p, r) in enumerate(pairs)
        ]
    )
    from_run = ray_cluster.get(controller.reward.score.remote(table))
    direct = RewardModel(str(trained_rm)).score_texts([p for p, _ in pairs], [r for _, r in pairs])
    assert np.allclose(from_run, direct, atol=1e-5)
    assert any(abs(x - round(x)) > 1e-3 for x in from_run)  # real-valued scores, not the 0/1 rule reward
    # a GRPO step asks the reward model and the reference together: the same answers as one at a time
    together = controller.ctx.score_and_ref_logprobs(table)
    assert np.allclose(together[0], from_run, atol=1e-6)
    assert np.allclose(np.concatenate(together[1]), np.concatenate(controller.ctx.ref_logprobs(table)), atol=1e-6)
    assert all(row["time/reward"] > 0 and row["time/reference"] > 0 for row in rows)


def test_reward_scores_of_sequences_sharing_a_prompt_match_the_plain_forward():
    """A group's responses (and a preference pair's two) are scored with their prompt run once:
    every score, and its gradient, is the plain forward's, the pooled token found by
    transformers' rule (the rightmost non-pad token: inside the prompt when the response is all
    pad ids, as with eos = pad)."""
    from actors.reward import pooled_positions, prompt_lengths, sequence_scores
    from rlsys.models import TinyModelSpec, train_tokenizer
    from rlsys.reward_model import build_reward_model

    tok = train_tokenizer([f"{a}+{b}={a + b}" for a in range(30) for b in range(30)], vocab_size=200)
    model = build_reward_model(tok, TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2), seed=2)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    pad = model.config.pad_token_id
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (6, 3, 5)]
    responses = [torch.randint(5, 200, (1 + k,), generator=g).tolist() for k in range(7)]
    seqs = [prompts[i % 3] + r for i, r in enumerate(responses)] + [prompts[1] + [pad, pad], prompts[2]]
    lens = [len(prompts[i % 3]) for i in range(7)] + [len(prompts[1]), len(prompts[2])]
    ids = torch.tensor([seqs[-2] + [pad]])
    assert pooled_positions(ids, torch.ones_like(ids), pad).item() == len(prompts[1]) - 1

    plain = sequence_scores(model, seqs)
    calls = []
    hook = model.model.register_forward_pre_hook(
        lambda m, a, kw: calls.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    shared = sequence_scores(model, seqs, lens)
    hook.remove()
    assert calls[0] < len(seqs)  # the distinct prompts ran once, not once per sequence
    assert torch.allclose(shared, plain, atol=1e-5)
    grads = [
        torch.autograd.grad(s.pow(2).sum(), list(model.parameters()))
        for s in (sequence_scores(model, seqs), sequence_scores(model, seqs, lens))
    ]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-4)
    # text: the prompt's own tokens are shared up to where a token merges across the boundary
    words = train_tokenizer(["say hello world", "say help me"] * 50, vocab_size=300)
    text = ["say hel"] * 3
    pair_seqs = [words(p + r, add_special_tokens=False)["input_ids"] for p, r in zip(text, ["!", "lo", "p"])]
    assert words.convert_ids_to_tokens(pair_seqs[1]) == ["say", "Ġhello"]  # "hel" + "lo" merged
    assert prompt_lengths(words, text, pair_seqs) == [2, 1, 1]
