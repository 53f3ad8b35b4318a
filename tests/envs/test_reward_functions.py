"""Reward functions by name (envs/reward_functions.py), run so that no fault stops the loop
(envs/reward_runner.py), the reward server source, their config keys and `rlsys reward check`.

Worker processes are real (a function that sleeps past its timeout is killed); the HTTP server
is a real http.server on 127.0.0.1. No Ray, no model."""

from __future__ import annotations

import json
import socket
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from envs.reward_functions import (
    BUILTINS,
    FunctionLoadError,
    FunctionSpec,
    answer_letter,
    as_reward,
    choice_letter,
    choice_reward,
    exact_reward,
    final_answer,
    load_function,
    math_reward,
    normalize_text,
    reference_response,
    regex_reward,
)
from envs.reward_runner import FunctionRunner, HttpRunner, RewardScorer, build_scorer
from rlsys.config import BUILTIN_REWARD_FUNCTIONS, ConfigError, load_config
from rlsys.errors import RunFailed

# ---- math ---------------------------------------------------------------------------------------
MATH_EQUAL = [  # (the row's answer, a response): full marks
    ("1/2", "\\boxed{0.5}"),
    ("0.5", "\\boxed{\\frac{1}{2}}"),
    ("\\frac{1}{2}", "so it is 1/2"),
    ("1/2", "\\boxed{\\dfrac{1}{2}}"),
    ("-3", "the result is -3."),
    ("-0.5", "\\boxed{-\\frac{1}{2}}"),
    ("-7", "\u22127"),  # a unicode minus sign
    ("1234", "She has 1,234 apples."),
    ("1,234", "\\boxed{1234}"),
    ("1000000", "\\boxed{1,000,000}"),
    ("50", "50%"),
    ("0.25", "\\boxed{25\\%}"),
    ("10%", "\\boxed{0.1}"),
    ("72", "First 48/2 = 24, then 48 + 24 = 72"),
    ("72", "#### 72"),
    ("3", "\\boxed{3} is my answer, not 4"),
    ("2", "\\boxed{2.0}"),
    ("1.5", "\\boxed{3/2}"),
    ("5", "x = 5"),
    ("\\sqrt{2}", "\\boxed{\\sqrt{2}}"),
    ("12.50", "It costs $12.5"),
    (7, "\\boxed{7}"),  # a numeric answer column
]
MATH_NOT_EQUAL = [  # no marks
    ("6", "\\boxed{5}"),  # a wrong answer in a box
    ("6", "I get 6, so \\boxed{5}"),  # the box wins over a number before it
    ("3", "\\boxed{-3}"),
    ("-3", "3"),
    ("10", "0.1"),
    ("1234", "1,235"),
    ("1/3", "0.333"),
    ("3.14", "3.14159"),
    ("12", "1,2"),
    ("72", "no number here"),
    ("72", ""),
    ("0.5", "\\boxed{}"),
]


@pytest.mark.parametrize("answer,response", MATH_EQUAL)
def test_math_equivalences(answer, response):
    assert math_reward("", response, {"answer": answer}) == 1.0


@pytest.mark.parametrize("answer,response", MATH_NOT_EQUAL)
def test_math_non_equivalences(answer, response):
    assert math_reward("", response, {"answer": answer}) == 0.0


@pytest.mark.parametrize(
    "gold,predicted",
    [
        ("123456789", "123456788"),
        ("1000000000001", "1000000000000"),
        ("12", "012"),
        ("-0", "0"),
        ("-7", "7"),
        ("42", "42"),
        ("99999999999999999999", "99999999999999999998"),
    ],
)
def test_math_integers_take_a_fast_path_with_math_verifys_verdict(gold, predicted):
    from envs.reward_functions import math_equal, math_verify_equal

    assert math_equal(gold, predicted) == math_verify_equal(gold, predicted)


def test_math_final_answer_extraction():
    assert final_answer("a \\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"  # the last box, braces balanced
    assert final_answer("\\boxed{\\text{a {b} c}} tail 9") == "\\text{a {b} c}"
    assert final_answer("unclosed \\boxed{3 and 17") == "17"  # no complete box: the last number
    assert final_answer("it was -1,234.5 in 2024") == "2024"
    assert final_answer("it was -1,234.5.") == "-1,234.5"
    assert final_answer("3/4 of them") == "3/4"
    assert final_answer("x-3") == "3"  # a minus after a word is not a sign
    assert final_answer("none") is None
    assert math_reward("", "\\boxed{12}", {"solution": "12"}, answer_key="solution") == 1.0


# ---- exact, choice, regex -----------------------------------------------------------------------
def test_exact_normalises_case_spaces_and_a_trailing_period():
    assert normalize_text("  Paris \n is   nice. ") == "paris is nice"
    row = {"answer": "Paris"}
    assert [exact_reward("", r, row) for r in ("paris", " PARIS. ", "Paris!", "Paris is", "")] == [1, 1, 0, 0, 0]


@pytest.mark.parametrize(
    "response,letter",
    [
        ("B", "B"),
        ("(c)", None),  # lower case is not a choice
        ("(C)", "C"),
        ("D.", "D"),
        ("\\boxed{E}", "E"),
        ("\\boxed{\\text{(J)}}", "J"),
        ("The answer is (A).", "A"),
        ("I think the answer is B", "B"),
        ("the answer is a good one", None),  # upper-case letters only
        ("Answer: C", "C"),
        ("A. because it is", "A"),
        ("first (A) looks right, then (D) does", "D"),
        ("I am not sure", None),
        ("K", None),
    ],
)
def test_choice_letter(response, letter):
    assert choice_letter(response) == letter


def test_choice_reward_against_letters_and_indices():
    assert answer_letter("(b)") == "B" and answer_letter(2) == "C" and answer_letter(" D. ") == "D"
    assert choice_reward("", "The answer is (B)", {"answer": "B"}) == 1.0
    assert choice_reward("", "The answer is (B)", {"answer": 1}) == 1.0  # an index: 1 -> B
    assert choice_reward("", "The answer is (B)", {"answer": "C"}) == 0.0
    assert choice_reward("", "no idea", {"answer": "C"}) == 0.0


def test_regex_is_a_search():
    assert regex_reward("", "thinking... Answer: 42", {}, pattern=r"Answer: \d+") == 1.0
    assert regex_reward("", "Answer: 42 and more", {}, pattern=r"^Answer: \d+$") == 0.0  # anchored: all of it
    assert regex_reward("", "no", {}, pattern=r"Answer") == 0.0


def test_return_values_and_reference_responses():
    assert as_reward(True) == (1.0, {})
    assert as_reward({"reward": 1, "len": 3, "note": "x"}) == (1.0, {"len": 3.0})  # non-numbers are left out
    for bad in ("1.0", None, [1], {"score": 1}, float("nan")):
        with pytest.raises((TypeError, ValueError)):
            as_reward(bad)
    assert reference_response("math", {"answer": "1/2"}) == "\\boxed{1/2}"
    assert reference_response("choice", {"answer": 2}) == "C"
    assert reference_response("exact", {"label": "yes"}, "label") == "yes"
    with pytest.raises(KeyError, match="reward.answer_key"):
        reference_response("math", {"question": "?"})
    assert tuple(BUILTINS) == BUILTIN_REWARD_FUNCTIONS  # the config's list is the functions'


# ---- a user's function, in worker processes ---------------------------------------------------------
USER_FUNCTIONS = """\
import os
import time


def length(prompt, response, row):
    return {"reward": float(response == str(row["answer"])), "chars": len(response)}


def flaky(prompt, response, row):
    if row["kind"] == "raise":
        raise ValueError(f"bad row {row['i']}")
    if row["kind"] == "hang":
        time.sleep(60)
    if row["kind"] == "string":
        return "1.0"
    if row["kind"] == "exit":
        os._exit(3)
    return 1.0


def always_fails(prompt, response, row):
    raise RuntimeError("the grader is broken")


def many(prompts, responses, rows):
    return [len(r) + (0.5 if p == "half" else 0.0) for p, r in zip(prompts, responses)]


def short(prompts, responses, rows):
    return [1.0]


NOT_A_FUNCTION = 3

"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FUNCTIONS)
    return path


def scorer(text: str, timeout_s: float = 10.0, workers: int = 2, batched: bool = False, **kw) -> RewardScorer:
    return RewardScorer(FunctionRunner(FunctionSpec.parse(text, batched), workers, timeout_s), f"fn {text}", **kw)


def test_a_user_function_by_file_path_and_by_module_path(user_file, tmp_path, monkeypatch):
    by_file = scorer(f"{user_file}:length")
    try:
        assert by_file.score(["p", "p"], ["12", "3"], [{"answer": 12}, {"answer": 4}]) == [1.0, 0.0]
        assert by_file.take_metrics() == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/chars": 1.5}
    finally:
        by_file.close()
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "grading.py").write_text(USER_FUNCTIONS)
    monkeypatch.chdir(tmp_path)  # a module path is imported from the working directory
    by_module = scorer("mypkg.grading:length", workers=1)
    try:
        assert by_module.score(["p"], ["7"], [{"answer": "7"}]) == [1.0]
    finally:
        by_module.close()


def test_functions_that_cannot_be_loaded_say_why(user_file):
    for text, why in (
        (f"{user_file}:missing", "'missing' is not defined there"),
        (f"{user_file}:NOT_A_FUNCTION", "is not callable"),
        (f"{user_file.parent / 'nope.py'}:f", "does not exist"),
        ("no_such_package.mod:f", "no module named 'no_such_package'"),
    ):
        with pytest.raises(FunctionLoadError, match=why):
            load_function(FunctionSpec.parse(text))


def test_faults_are_scored_on_error_counted_and_the_worker_replaced(user_file, capsys):
    kinds = ["ok", "raise", "hang", "string", "ok", "exit", "ok"]
    rows = [{"i": i, "kind": k} for i, k in enumerate(kinds)]
    s = scorer(f"{user_file}:flaky", timeout_s=1.0, on_error=-1.0)
    try:
        start = time.monotonic()
        rewards = s.score(["p"] * len(rows), ["r"] * len(rows), rows)
        assert time.monotonic() - start < 10  # the hung row cost its timeout, not its 60 s
        assert rewards == [1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0]
        assert s.take_metrics() == {"reward/errors": 4.0, "reward/timeouts": 1.0}
        assert s.runner.restarts == 2  # the hung worker and the one that exited were replaced
        first = "ValueError: bad row 1 (my_rewards.py:11)"
        assert (
            capsys.readouterr().err
            == f"rlsys: fn {user_file}:flaky failed on 4 of 7 rows, scored -1 (first: {first})\n"
        )
        assert s.score(["p"], ["r"], [{"i": 9, "kind": "ok"}]) == [1.0]  # the next call works
        assert s.take_metrics()["reward/errors"] == 0.0
    finally:
        s.close()
    assert all(w.proc.poll() is not None for w in s.runner.workers) or not s.runner.workers


def test_the_run_stops_only_when_every_row_fails_for_the_whole_window(user_file):
    mixed = scorer(f"{user_file}:flaky", workers=1)
    flaky_rows = [{"i": 0, "kind": "raise"}, {"i": 1, "kind": "ok"}]
    try:
        for _ in range(5):  # half the rows fail, step after step: never stops with the default rate 1.0
            assert mixed.score(["p", "p"], ["r", "r"], flaky_rows) == [0.0, 1.0]
    finally:
        mixed.close()
    broken = scorer(f"{user_file}:always_fails", workers=1, error_window=3)
    try:
        for _ in range(2):
            assert broken.score(["p"], ["r"], [{}]) == [0.0]
        with pytest.raises(RunFailed) as e:
            broken.score(["p"], ["r"], [{}])
    finally:
        broken.close()
    message = str(e.value)
    assert "\n" not in message and f"{user_file}:always_fails" in message
    assert "3 of 3 rows over the last 3 scoring calls" in message
    assert message.endswith("last error: RuntimeError: the grader is broken (my_rewards.py:22)")


def test_the_batched_form(user_file):
    s = scorer(f"{user_file}:many", batched=True)
    try:
        assert s.score(["half", "x"], ["abc", "de"], [{}, {}]) == [3.5, 2.0]
    finally:
        s.close()
    wrong_length = scorer(f"{user_file}:short", batched=True, on_error=-2.0)
    try:
        assert wrong_length.score(["a", "b"], ["a", "b"], [{}, {}]) == [-2.0, -2.0]
        assert wrong_length.take_metrics()["reward/errors"] == 2.0
    finally:
        wrong_length.close()


def test_builtins_run_in_the_workers_too():
    s = scorer("math", workers=1)
    try:
        assert s.score(["q", "q"], ["\\boxed{\\frac{1}{2}}", "\\boxed{2}"], [{"answer": "0.5"}] * 2) == [1.0, 0.0]
    finally:
        s.close()


def test_code_runs_the_rows_tests(tmp_path):
    from envs.reward_runner import function_spec
    from rlsys.config import SandboxConfig

    spec = function_spec(reward_config(function="code"), sandbox_cfg=SandboxConfig(wall_time_s=3))
    assert spec.options["backend"] == "bwrap" and spec.options["limits"]["wall_time_s"] == 3
    unsafe = FunctionSpec.parse("code", options={"backend": "subprocess-unsafe", "limits": {"wall_time_s": 5.0}})
    s = RewardScorer(FunctionRunner(unsafe, 1, 20.0), "code")  # no isolation: it runs only the code below
    row = {"tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"], "code_prefix": ""}
    right = "```python\ndef add(a, b):\n    return a + b\n```"
    try:
        assert s.score(["q"] * 3, [right, "def add(a, b):\n    return a - b\n", "no code"], [row] * 3) == [1, 0, 0]
        assert s.take_metrics()["reward/tests_passed"] == pytest.approx(0.5)  # (1 + 0.5 + 0) / 3
    finally:
        s.close()


# ---- the reward server ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def reward_server():
    """Rewards the length of each response; the first `fail_first` requests get a 503."""
    state = {"requests": [], "fail_first": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["requests"].append(body)
            if len(state["requests"]) <= state["fail_first"]:
                self.send_response(503)
                self.end_headers()
                return
            rewards = [
                None if it["row"].get("null") else {"reward": len(it["response"]), "ok": 1} for it in body["items"]
            ]
            data = json.dumps({"rewards": rewards}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score", state
    server.shutdown()
    server.server_close()


def test_http_reward_against_a_real_server(reward_server):
    url, state = reward_server
    state["fail_first"] = 1  # one 503, then an answer: retried
    s = RewardScorer(HttpRunner(url, timeout_s=5, retries=2, backoff_s=0.01), f"reward server {url}", on_error=-1)
    rewards = s.score(["p1", "p2", "p3"], ["a", "abc", "x"], [{"answer": 1}, {}, {"null": True}])
    assert rewards == [1.0, 3.0, -1.0]
    assert s.take_metrics() == {"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/ok": 1.0}
    assert len(state["requests"]) == 2  # one POST per call, plus the retry
    assert state["requests"][-1]["items"][0] == {"prompt": "p1", "response": "a", "row": {"answer": 1}}


def test_http_reward_server_down_retries_then_one_line():
    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    runner = HttpRunner(url, timeout_s=2, retries=2, backoff_s=0.05)
    start = time.monotonic()
    with pytest.raises(RunFailed) as e:
        runner.run(["p"], ["r"], [{}])
    assert time.monotonic() - start >= 0.05 + 0.1  # backoff between the 3 tries
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"reward server {url} did not answer after 3 tries (")


# ---- config ----------------------------------------------------------------------------------------
def reward_config(**reward):
    return load_config(data={"reward": reward}).reward


def test_reward_config_keys():
    assert reward_config(function="math").function == "math"
    assert reward_config(source="http", url="http://localhost:8000/r").url == "http://localhost:8000/r"
    assert reward_config(source="http", url="http://[::1]:80", retries=0).retries == 0
    remote = reward_config(source="http", url="https://rewards.example.com/score", allow_remote=True)
    assert remote.allow_remote
    for reward, why in (
        (dict(source="http", url="http://10.1.2.3:8000/score"), "reward.url .* is not a loopback address"),
        (dict(source="http", url="https://rewards.example.com/score"), "set reward.allow_remote: true"),
        (dict(source="http"), "reward.url = None: .*required when reward.source is 'http'"),
        (dict(url="http://127.0.0.1:1/"), "used by reward.source 'http' only"),
        (dict(source="judge", function="math"), "used by reward.source 'rule' only"),
        (dict(function="mth"), "must be a built-in"),
        (dict(function="my rewards.txt:f"), "must be a built-in"),
        (dict(function="regex"), "reward.pattern = None: .*required when reward.function is 'regex'"),
        (dict(function="regex", pattern="("), "not a valid regular expression"),
        (dict(function="math", pattern="x"), "used by reward.function 'regex' only"),
        (dict(function="math", batched=True), "for a user's reward.function"),
        (dict(max_error_rate=0), "reward.max_error_rate"),
    ):
        with pytest.raises(ConfigError, match=why):
            reward_config(**reward)


def test_a_reward_file_is_found_from_the_working_dir_then_the_config_dir(tmp_path, monkeypatch):
    job = tmp_path / "job"
    job.mkdir()
    (job / "grader.py").write_text(USER_FUNCTIONS)
    (job / "job.yaml").write_text("reward:\n  function: grader.py:length\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_config(job / "job.yaml").reward.function == f"{job / 'grader.py'}:length"  # the config's dir
    (elsewhere / "grader.py").write_text(USER_FUNCTIONS)
    assert load_config(job / "job.yaml").reward.function == f"{elsewhere / 'grader.py'}:length"  # cwd first
    with pytest.raises(ConfigError, match="no file missing.py in "):
        load_config(job / "job.yaml", ["reward.function=missing.py:length"])


def test_scorer_checks_the_function_before_any_actor(user_file):
    cfg = reward_config(function=f"{user_file}:missing")
    with pytest.raises(ConfigError, match="'missing' is not defined there"):
        build_scorer(cfg)
    assert build_scorer(reward_config()) is None  # the task's own reward


def test_a_reward_file_outside_the_working_dir_travels_with_a_job(tmp_path):
    from rlsys.jobs import reward_file_shipping

    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    assert reward_file_shipping("math", work) == ([], [])
    assert reward_file_shipping(f"{work / 'sub' / 'r.py'}:f", work) == ([], ["reward.function=sub/r.py:f"])
    outside = tmp_path / "my_grader.py"
    assert reward_file_shipping(f"{outside}:f", work) == ([str(outside)], ["reward.function=my_grader:f"])
    with pytest.raises(ConfigError, match="module 'json', which is taken"):
        reward_file_shipping(f"{tmp_path / 'json.py'}:f", work)


# ---- rlsys reward check ---------------------------------------------------------------------------
@pytest.fixture
def job(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"}, {"prompt": "9+9=", "answer": "18"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "grader.py").write_text(USER_FUNCTIONS)
    config = tmp_path / "job.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            task:
              train_path: {tmp_path / "train.jsonl"}
            reward:
              function: math
            """
        )
    )
    return config


def reward_check(capsys, *argv) -> tuple[int, list[dict]]:
    from rlsys.run.cli import main

    code = main(["reward", "check", *argv])
    return code, [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_reward_check_scores_the_reference_answers(job, capsys):
    code, lines = reward_check(capsys, str(job))
    assert code == 0 and len(lines) == 4
    assert lines[0] == {"row": 0, "response": "\\boxed{2}", "reward": 1.0, "metrics": {}, "error": None}
    assert [l["reward"] for l in lines[:3]] == [1.0, 1.0, 1.0]
    assert lines[-1] == {"mean": 1.0, "rows": 3, "errors": 0}
    code, lines = reward_check(capsys, str(job), "--response", "I think \\boxed{5}", "--row", "1")
    assert code == 0 and lines == [
        {"row": 1, "response": "I think \\boxed{5}", "reward": 1.0, "metrics": {}, "error": None},
        {"mean": 1.0, "rows": 1, "errors": 0},
    ]
    code, lines = reward_check(capsys, str(job), "--limit", "2", "--response", "18")
    assert [l.get("reward") for l in lines] == [0.0, 0.0, None] and lines[-1]["mean"] == 0.0


def test_reward_check_with_a_user_function_and_its_errors(job, capsys):
    code, lines = reward_check(capsys, str(job), "reward.function=grader.py:flaky", "reward.on_error=-1")
    assert code == 0
    assert lines[0]["reward"] == -1.0 and lines[0]["error"].startswith("KeyError: 'kind'")
    assert lines[-1] == {"mean": -1.0, "rows": 3, "errors": 3}
    code, lines = reward_check(capsys, str(job), "reward.function=grader.py:length")  # the answer itself
    assert [l["metrics"] for l in lines[:3]] == [{"chars": 1.0}, {"chars": 1.0}, {"chars": 2.0}]
    assert lines[-1]["mean"] == 1.0


def test_reward_check_one_line_errors(job, capsys):
    from rlsys.run.cli import main

    assert main(["reward", "check", str(job), "--row", "7"]) == 2
    assert capsys.readouterr().err.strip() == "reward check: --row 7 is out of range (the train split has 3 rows)"
    assert main(["reward", "check", str(job), "reward.function=grader.py:missing"]) == 2
    assert "'missing' is not defined there" in capsys.readouterr().err


def test_a_run_failed_raised_in_a_ray_actor_is_one_line(monkeypatch, capsys):
    from ray.exceptions import RayTaskError

    from rlsys.run import cli

    def fails(args):
        cause = RunFailed("reward function 'x' failed on 3 of 3 rows; last error: boom")
        traceback = 'Traceback (most recent call last):\n  File "reward.py", line 1\nRunFailed: ...'
        raise RayTaskError("RewardWorker.score", traceback, cause).as_instanceof_cause()

    import ray

    connected = ray.is_initialized()
    monkeypatch.setattr(cli, "_reward_check", fails)
    assert cli.main(["reward", "check", "any.yaml"]) == 1
    assert capsys.readouterr().err == "rlsys: reward function 'x' failed on 3 of 3 rows; last error: boom\n"
    assert ray.is_initialized() == connected  # called in-process, main leaves the caller's Ray session alone
