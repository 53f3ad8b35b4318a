"""RLEF (../shared/papers/rlef.md): the code env's state machine and reward table, the
HumanEval public/private split, feedback, per-turn advantages and masks, the loss."""

import json
import re

import numpy as np
import pyarrow as pa
import pytest
import torch

from algorithms.rlef import RLEF, capped_importance_weight, spread_over_turns, turn_advantages, turn_kl, turn_spans
from envs.code import (
    FEEDBACK_HEAD,
    CodeEnv,
    CodeEpisode,
    extract_code,
    format_feedback,
    humaneval_rows,
    read_code_rows,
    split_tests,
)
from envs.datasets import DatasetError
from rlsys.experience import make_experience
from sandbox.types import ExecResult, TestResult

ROW = {  # public: f(1) == 2; private: two more cases
    "prompt": 'def f(x):\n    """x plus one"""\n',
    "code_prefix": 'def f(x):\n    """x plus one"""\n',
    "public_tests": ["assert f(1) == 2\n"],
    "private_tests": ["assert f(5) == 6\n", "assert f(-1) == 0\n"],
}
RIGHT, WRONG, NO_CODE = "    return x + 1\n", "    return x\n", "    return (\n"
PUBLIC_ONLY = "    return 2 if x == 1 else 0\n"  # passes the public test, fails the private ones


class Recorder:
    """Runs requests on a backend and records the test names of each call."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def __call__(self, requests):
        self.calls.append([t.name for r in requests for t in r.tests])
        return [self.backend.run(r) for r in requests]


@pytest.fixture(scope="module")
def unsafe():
    # The state-machine tests are about the episode's logic, not isolation: the plain
    # subprocess backend (NOT a sandbox) runs our own fixed snippets here. The tests on
    # HumanEval canonical and broken solutions below run in the real sandboxes (bwrap and docker).
    from sandbox import make_backend

    return make_backend("subprocess-unsafe")


def played(episode: CodeEpisode, answer, run) -> CodeEpisode:
    """`episode` played to the end through CodeEnv, as the multi-turn rollout steps it:
    `answer(episode)` is the next answer."""
    env = CodeEnv(run, lambda row: episode)
    env.reset(episode.row)
    while not env.step(answer(episode))[2]:
        pass
    return episode


def play(answers, backend, max_turns=3, row=ROW):
    run = Recorder(backend)
    episode = played(CodeEpisode(row, max_turns=max_turns, uid="e"), lambda e: answers[len(e.answers)], run)
    return episode, run


# ---- the state machine and the reward table ------------------------------------------


def test_stops_on_public_pass_and_pays_plus_one(unsafe):
    e, run = play([WRONG, RIGHT, WRONG], unsafe)
    assert e.answers == [WRONG, RIGHT] and e.public_passed and e.private_passed
    assert e.turn_rewards == [0.0, 1.0] and e.reward == 1.0
    assert len(e.feedbacks) == 1 and "expected 2, got 1" in e.feedbacks[0]


def test_at_most_max_turns_answers_then_minus_one(unsafe):
    e, _ = play([WRONG] * 5, unsafe)
    assert len(e.answers) == 3 and e.done and not e.public_passed and e.private_passed is False
    assert e.turn_rewards == [0.0, 0.0, -1.0]
    assert len(e.feedbacks) == 2  # no feedback after the last answer
    with pytest.raises(RuntimeError):
        e.submit(RIGHT)
    e1, _ = play([WRONG] * 5, unsafe, max_turns=1)
    assert len(e1.answers) == 1 and e1.reward == -1.0


def test_private_tests_only_at_the_end(unsafe):
    e, run = play([WRONG, WRONG, WRONG], unsafe)
    *turns, final = run.calls
    assert turns == [["public_0"]] * 3 and final == ["private_0", "private_1"]
    fresh = CodeEpisode(ROW)
    with pytest.raises(RuntimeError):
        fresh.final_request()  # not before the episode is over
    # a public pass ends the episode, but the private tests still decide the reward
    e2, run2 = play([PUBLIC_ONLY], unsafe)
    assert e2.public_passed and not e2.private_passed and e2.reward == -1.0
    assert run2.calls == [["public_0"], ["private_0", "private_1"]]
    assert all("f(5)" not in d and "f(-1)" not in d for d in [ROW["prompt"], *e.feedbacks])


def test_reward_table_with_unparsable_answers(unsafe):
    e, run = play([NO_CODE, "", RIGHT], unsafe)
    assert e.turn_rewards == pytest.approx([-0.2, -0.2, 1.0]) and e.reward == pytest.approx(0.6)
    assert run.calls[0] == ["public_0"]  # unparsable answers never reach the sandbox
    e2, run2 = play([NO_CODE] * 3, unsafe)
    assert e2.turn_rewards == pytest.approx([-0.2, -0.2, -1.2]) and e2.reward == pytest.approx(-1.6)
    assert run2.calls == []
    assert "no parsable code" in e2.feedbacks[0] and "SyntaxError" in e2.feedbacks[0]


def test_env_protocol_step(unsafe):
    env = CodeEnv(run=lambda reqs: [unsafe.run(r) for r in reqs])
    assert env.reset(ROW) == ROW["prompt"]
    obs, r, done, info = env.step(f"Here:\n```python\n{WRONG}```\n")
    assert obs.startswith("\n" + FEEDBACK_HEAD) and r == 0.0 and not done
    obs, r, done, info = env.step(f"```python\n{RIGHT}```")
    assert obs is None and r == 1.0 and done
    assert info == {"public_passed": True, "private_passed": True, "turn": 2, "correct": True}


# ---- pure pieces -----------------------------------------------------------------------


def test_extract_code():
    assert extract_code("text\n```python\nx = 1\n```\nmore ```py\ny\n```") == "x = 1\n"
    assert extract_code("```\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```python\ndef g():\n    return 1") == "def g():\n    return 1\n"  # cut off
    assert extract_code("    return x\n\n\n") == "    return x\n"  # whole answer, indentation kept
    assert extract_code("  \n ") == "" and extract_code("```python\n```") == ""


def test_feedback_is_formatted_and_truncated():
    res = ExecResult(
        "failed",
        exit_code=0,
        stderr="warn\n" * 200,
        tests=[
            TestResult("public_0", True),
            TestResult("public_1", False, "line 3: assert f(2) == 3\nexpected 3, got 4"),
        ],
    )
    text = format_feedback(res, max_chars=500)
    assert "public_1: line 3: assert f(2) == 3" in text and "expected 3, got 4" in text and "public_0" not in text
    assert "stderr: " in text and len(text) <= 500
    assert all(line.startswith("#") for line in text.strip().splitlines())
    long = ExecResult(
        "timeout", error="wall time limit exceeded (10 s)", tests=[TestResult("public_0", False, "x" * 5000)]
    )
    text = format_feedback(long, max_chars=200)
    assert len(text) <= 200 and text.endswith("# Fix the code.\n")


def test_split_rule_on_loops_setup_and_trivial_asserts():
    src = (
        "M = 1\n\ndef check(candidate):\n    import math\n    assert candidate(1) == 1\n    assert True\n"
        "    k = 3\n    for i in range(k):\n        assert candidate(i) == i\n    assert candidate(2) == 2, 'msg'\n"
    )
    public, private = split_tests(src, "ident")
    assert len(public) == 1 and len(private) == 2
    assert public[0] == "M = 1\ncandidate = ident\nimport math\nassert candidate(1) == 1\n"
    assert "k = 3\nfor i in range(k):" in private[0] and "assert True" not in "".join(private)
    ns = {"ident": lambda v: v}
    for code in public + private:
        exec(code, dict(ns))  # each case runs on its own
    one = "def check(candidate):\n    for i in range(3):\n        assert candidate(i) == i\n"
    assert split_tests(one, "g")[0] == split_tests(one, "g")[1]  # a single case is both
    with pytest.raises(ValueError):
        split_tests("def check(candidate):\n    pass\n", "g")


def test_humaneval_split_covers_all_164_problems_deterministically():
    rows, again = humaneval_rows(), humaneval_rows()
    assert len(rows) == 164 and rows == again
    for r in rows:
        assert r["public_tests"] and r["private_tests"] and r["answer"]
        if len(r["private_tests"]) > 1 or r["private_tests"] != r["public_tests"]:
            assert not set(r["public_tests"]) & set(r["private_tests"])
    assert sum(len(r["public_tests"]) for r in rows) == 164
    assert sum(r["private_tests"] == r["public_tests"] for r in rows) <= 6  # loop-only tests: both


def test_user_rows_and_one_line_errors(tmp_path):
    good = tmp_path / "ok.jsonl"
    good.write_text(
        json.dumps(ROW)
        + "\n"
        + json.dumps(
            {
                "prompt": "read n, print n+1",
                "public_tests": [{"stdin": "1\n", "expected_stdout": "2\n"}],
                "private_tests": [{"stdin": "5\n", "expected_stdout": "6\n"}],
            }
        )
        + "\n"
    )
    assert len(read_code_rows(good)) == 2
    for row, needle in [
        ({**ROW, "public_tests": []}, "row 1: 'public_tests' must be a non-empty list"),
        ({**ROW, "private_tests": [3]}, "row 1: private_tests[0] must be assert code"),
        ({k: v for k, v in ROW.items() if k != "private_tests"}, "row 1: missing field 'private_tests'"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(row) + "\n")
        with pytest.raises(DatasetError, match=re.escape(needle)) as e:
            read_code_rows(bad)
        assert "\n" not in str(e.value)


# ---- real sandbox: HumanEval canonical and broken solutions -----------------------------

SAMPLE = [0, 2, 10, 32, 38, 50, 53, 100, 163]  # 32, 38, 50, 53: loop-shaped tests


def test_canonical_solutions_pass_in_one_turn_in_the_sandbox(sandbox_backend):
    rows = humaneval_rows()
    run = lambda rs: [sandbox_backend.run(r) for r in rs]  # noqa: E731
    episodes = [
        played(
            CodeEpisode(rows[i], uid=rows[i]["id"]),
            lambda e: f"```python\n{e.row['answer']}```" if k % 2 else e.row["answer"],
            run,
        )
        for k, i in enumerate(SAMPLE)
    ]
    assert [(len(e.answers), e.reward) for e in episodes] == [(1, 1.0)] * len(SAMPLE)


def test_broken_solution_gets_feedback_and_minus_one_in_the_sandbox(sandbox_backend):
    rows = humaneval_rows()
    run = lambda rs: [sandbox_backend.run(r) for r in rs]  # noqa: E731
    episodes = [played(CodeEpisode(rows[i], uid=rows[i]["id"]), lambda e: "    return None\n", run) for i in (0, 53)]
    for e in episodes:
        assert len(e.answers) == 3 and e.reward == -1.0 and not e.private_passed and len(e.feedbacks) == 2
        assert e.feedbacks[0].startswith("\n" + FEEDBACK_HEAD) and "got None" in e.feedbacks[0]


# ---- held-out evaluation ----------------------------------------------------------------


class ScriptedWorkers:
    """Stands in for the rollout workers (the test is about how RLEF plays and counts held-out
    episodes, not about generation): answer k to a problem is its script's k-th answer. The
    sandbox runs are real (the `unsafe` backend, as the state-machine tests above)."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]], backend):
        self.tokenizer, self.scripts, self.backend, self.sandbox = tokenizer, scripts, backend, backend
        self.task = self  # ctx.task.episode: the code task's
        self.episode_tokens = 4096  # the run's episode budget (env.max_tokens or the context)
        self.asked: dict[str, int] = {}
        self.script_ids = {p: tokenizer(p)["input_ids"] for p in scripts}

    def generate(self, requests):
        from rlsys.generation import Generation

        out = []
        for i, r in enumerate(requests):
            prompt = next(p for p, ids in self.script_ids.items() if r.prompt_ids[: len(ids)] == ids)
            k = self.asked[prompt] = self.asked.get(prompt, -1) + 1
            ids = self.tokenizer(self.scripts[prompt][k], add_special_tokens=False)["input_ids"]
            cut = ids[: r.params.max_new_tokens]  # a turn gets at most what the episode's budget has left
            out.append(Generation(i, list(r.prompt_ids), cut, [0.0] * len(cut), "stop" if cut == ids else "length"))
        return out

    def episode(self, row, max_turns, uid="", feedback_chars=500):
        return CodeEpisode(row, max_turns, uid=uid, feedback_chars=feedback_chars)

    def execute(self, requests):
        return [self.backend.run(r) for r in requests]


def test_held_out_evaluation_is_the_papers_1_at_3(unsafe):
    """One episode per problem; a problem counts when its final code passes the private tests
    (here: right at once, right after one feedback turn), not when its first answer does."""
    from rlsys.contract import Prompt
    from rlsys.generation import SamplingParams
    from rlsys.models import train_tokenizer

    scripts = {
        'def f(x):\n    """x plus one"""\n': [RIGHT],
        'def f(x):\n    """one more than x"""\n': [WRONG, RIGHT],
        'def f(x):\n    """add one to x"""\n': [WRONG, WRONG, WRONG],
        'def f(x):\n    """the successor of x"""\n': [PUBLIC_ONLY],
    }
    tok = train_tokenizer([*scripts, RIGHT, WRONG, PUBLIC_ONLY, FEEDBACK_HEAD], vocab_size=200)
    ctx = ScriptedWorkers(tok, scripts, unsafe)
    prompts = [
        Prompt(f"eval-{i}", tok(p)["input_ids"], p, {**ROW, "prompt": p, "code_prefix": p})
        for i, p in enumerate(scripts)
    ]
    got = RLEF().evaluate(ctx, prompts, SamplingParams(temperature=0.0, max_new_tokens=64))
    assert ctx.asked == {p: len(s) - 1 for p, s in scripts.items()}  # each script played to its end, no further
    assert got == {"accuracy": 0.5, "public_pass": 0.75, "turns_mean": 1.75, "first_answer_public_pass": 0.5}


def test_a_dialog_past_the_token_budget_ends_at_its_last_answer(unsafe):
    """RLEF's episodes keep within the run's token budget: a dialog whose feedback would pass it
    stops there (`max_tokens`) and its last answer is the final one, run on the private tests
    (-1 for a wrong one, where the dialog with room went on to +1); a dialog done within the
    budget is as before."""
    from algorithms.episodes import play_episodes
    from rlsys.contract import Prompt
    from rlsys.generation import SamplingParams
    from rlsys.models import train_tokenizer

    scripts = {'def f(x):\n    """one more than x"""\n': [WRONG, RIGHT], 'def f(x):\n    """x plus one"""\n': [RIGHT]}
    tok = train_tokenizer([*scripts, RIGHT, WRONG, FEEDBACK_HEAD], vocab_size=200)
    prompts = [
        Prompt(f"p{i}", tok(p)["input_ids"], p, {**ROW, "prompt": p, "code_prefix": p}) for i, p in enumerate(scripts)
    ]
    played = {}
    for budget in ("roomy", "tight"):
        ctx = ScriptedWorkers(tok, scripts, unsafe)
        if budget == "tight":  # the first answer fits, its feedback does not
            ctx.episode_tokens = played["roomy"][0].conversation.policy_turns[0][1] + 2
        settings = RLEF()._settings(ctx)
        played[budget] = play_episodes(ctx, prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=64), settings)
    (went_on, right), (cut, right_again) = played["roomy"], played["tight"]
    assert (went_on.stop, went_on.turns, went_on.rewards, went_on.correct) == ("done", 2, [0.0, 1.0], True)
    assert (cut.stop, cut.turns, cut.rewards, cut.correct) == ("max_tokens", 1, [-1.0], False)
    assert cut.conversation.num_tokens <= ctx.episode_tokens
    assert cut.env.episode.feedbacks == [] and cut.env.episode.private_passed is False
    for done in (right, right_again):
        assert (done.stop, done.turns, done.rewards, done.correct) == ("done", 1, [1.0], True)
    assert right_again.conversation.num_tokens <= ctx.episode_tokens and right_again.finish_reasons == ["stop"]


# ---- advantages, masks and the loss ------------------------------------------------------


def test_turn_advantages_are_returns_to_go_minus_the_turn_value():
    returns, adv = turn_advantages([-0.2, 0.0, 1.0], [0.5, 0.0, -1.0], [0.1, 0.2, 0.3], kl_coef=0.1)
    r = np.array([-0.2 - 0.05, 0.0, 1.0 + 0.1])
    assert returns == pytest.approx([r.sum(), r[1:].sum(), r[2]])
    assert adv == pytest.approx(returns - [0.1, 0.2, 0.3])
    assert turn_spans([3, 2, 4], [5, 1]) == [(0, 3), (8, 10), (11, 15)]
    assert turn_kl([1, 2, 0, 0, 4], [0, 0, 0, 0, 1], [(0, 2), (4, 5), (5, 5)]) == pytest.approx([1.5, 3.0, 0.0])
    assert spread_over_turns([1.0, 2.0], [(0, 2), (4, 5)], 6) == [1.0, 1.0, 0.0, 0.0, 2.0, 0.0]


def episode_table():
    """Two episodes as RLEF.rollout lays them out: a 3-turn one (feedback of 2 and 3 tokens)
    and a 1-turn one."""
    rng = np.random.default_rng(0)
    rows = []
    for prompt_len, answers, feedbacks, turn_rewards in [
        (4, [3, 2, 2], [2, 3], [0.0, -0.2, 1.0]),
        (2, [5], [], [-1.0]),
    ]:
        n = sum(answers) + sum(feedbacks)
        mask = []
        for t, a in enumerate(answers):
            mask += [1] * a + ([0] * feedbacks[t] if t < len(feedbacks) else [])
        rows.append(
            dict(
                uid=str(len(rows)),
                group="g",
                prompt_ids=list(range(1, prompt_len + 1)),
                response_ids=list(range(10, 10 + n)),
                logprobs=(-rng.random(n)).tolist(),
                ref_logprobs=(-rng.random(n)).tolist(),
                values=rng.normal(size=n).tolist(),
                learner_logprobs=(-rng.random(n)).tolist(),
                loss_mask=mask,
                reward=sum(turn_rewards),
                policy_version=0,
                meta={
                    "answer_lengths": answers,
                    "feedback_lengths": feedbacks,
                    "turn_rewards": turn_rewards,
                    "public_passed": True,
                    "private_passed": turn_rewards[-1] > 0,
                    "no_code_turns": 0,
                },
            )
        )
    learner = pa.schema([("learner_logprobs", pa.list_(pa.float32()))])
    return make_experience(rows, learner), rows


def test_prepare_shares_the_advantage_per_turn_and_masks_feedback():
    table, rows = episode_table()
    algo = RLEF(RLEF.Config(kl_coef=0.05, whiten_advantages=False))
    batch = algo.prepare(table)
    whitened = RLEF(RLEF.Config(kl_coef=0.05)).prepare(table).advantages
    mask = batch.response_mask
    assert float((whitened * mask).sum()) == pytest.approx(0.0, abs=1e-4)
    assert torch.allclose(
        whitened,
        (batch.advantages - float(batch.advantages[mask > 0].mean()))
        * mask
        / float(batch.advantages[mask > 0].std(unbiased=False)),
        atol=1e-4,
    )
    for i, row in enumerate(rows):
        o = len(row["prompt_ids"]) - 1
        m = row["meta"]
        spans = turn_spans(m["answer_lengths"], m["feedback_lengths"])
        kls = turn_kl(row["logprobs"], row["ref_logprobs"], spans)
        returns, adv = turn_advantages(m["turn_rewards"], kls, [row["values"][a] for a, _ in spans], 0.05)
        n = len(row["response_ids"])
        assert batch.response_mask[i, o : o + n].tolist() == row["loss_mask"]  # feedback tokens: 0
        got = batch.advantages[i, o : o + n]
        for t, (a, b) in enumerate(spans):
            assert torch.allclose(got[a:b], torch.full((b - a,), float(adv[t])))  # one value per turn
            assert batch.extras["value_mask"][i, o + a] == 1 and batch.returns[i, o + a] == pytest.approx(returns[t])
        assert float(batch.extras["value_mask"][i].sum()) == len(spans)
        env = torch.tensor(row["loss_mask"]) == 0
        assert (got[env] == 0).all()
        assert torch.allclose(batch.old_logprobs[i, o : o + n], torch.tensor(row["learner_logprobs"]))
        assert torch.allclose(batch.extras["behaviour_logprobs"][i, o : o + n], torch.tensor(row["logprobs"]))
    metrics = algo.prepare_metrics(table)
    assert metrics["rlef/turns_3"] == 0.5 and metrics["rlef/turns_1"] == 0.5 and metrics["rlef/private_pass"] == 0.5


def test_loss_masks_feedback_and_caps_the_importance_weight():
    from algorithms.common import clipped_policy_loss
    from rlsys.contract import ModelOutputs

    table, _ = episode_table()
    algo = RLEF()
    batch = algo.prepare(table)
    w = capped_importance_weight(batch.old_logprobs, batch.extras["behaviour_logprobs"])
    assert (w <= 1).all() and (w > 0).all()
    assert capped_importance_weight(torch.tensor([0.0, -1.0]), torch.tensor([-1.0, 0.0])).tolist() == pytest.approx(
        [1.0, np.exp(-1.0)]
    )
    logprobs = (batch.old_logprobs + 0.1).clone().requires_grad_(True)
    values = torch.zeros_like(batch.old_logprobs, requires_grad=True)
    loss, metrics = algo.loss(ModelOutputs(None, logprobs, values), batch)
    loss.backward()
    env = batch.response_mask == 0
    assert (logprobs.grad[env] == 0).all() and (logprobs.grad[~env] != 0).any()
    assert (values.grad[batch.extras["value_mask"] == 0] == 0).all()  # the value is trained at V(c_t) only
    # with behaviour == old the weight is 1: the plain clipped surrogate
    batch.extras["behaviour_logprobs"] = batch.old_logprobs
    plain, _, _ = clipped_policy_loss(logprobs.detach(), batch.old_logprobs, batch.advantages, batch.response_mask)
    _, m = algo.loss(ModelOutputs(None, logprobs.detach(), values.detach()), batch)
    assert m["loss/policy"] == pytest.approx(plain.item()) and m["is_weight_mean"] == pytest.approx(1.0)


def test_config_errors_are_one_line():
    from algorithms.base import build_algorithm
    from rlsys.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="algorithm.max_turns = 0"):
        build_algorithm(load_config("configs/rlef.yaml", ["algorithm.max_turns=0"]))
    with pytest.raises(ConfigError, match="sandbox.backend = 'nsjail'"):
        load_config("configs/rlef.yaml", ["sandbox.backend=nsjail"])


@pytest.mark.sandbox  # needs bubblewrap installed: the missing piece is the root filesystem
def test_run_fails_early_when_the_sandbox_engine_is_missing(tmp_path):
    # In a process of its own: importing the controller imports ray, and the test session's
    # ray must first be imported by the ray_cluster fixture (rlsys.cluster.init_ray).
    import os
    import subprocess
    import sys

    script = (
        "import sys; from rlsys.config import load_config; from rlsys.run.controller import Controller\n"
        "from rlsys.errors import RunFailed\n"
        f"cfg = load_config('configs/rlef.yaml', ['run.output_dir={tmp_path}'])\n"
        "try:\n    Controller(cfg, cfg.run.output_dir + '/rlef', progress=False).prepare_policy()\n"
        "except RunFailed as e:\n    print(e); sys.exit(3)\n"
    )
    env = {**os.environ, "RLSYS_SANDBOX_ROOTFS": str(tmp_path / "no-rootfs")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout.count("\n") == 1
    assert proc.stdout.startswith("task 'code' runs code in the bwrap sandbox, which is unavailable here: ")
    assert "no sandbox root filesystem" in proc.stdout
    assert not (tmp_path / "rlef" / "policy_init").exists()  # before the tokenizer and the warm-up
