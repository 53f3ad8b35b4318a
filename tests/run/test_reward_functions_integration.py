"""A user's reward function in a run: the reward actor's class in-process, `rlsys run`'s check
before Ray starts, then real runs on a local Ray cluster: rows that raise, hang or return a
string are scored reward.on_error and counted, and no step is lost; a function that fails on
every row stops the run with one line."""

import json

import pytest
from fakes import TINY_JOB

from rlsys.config import load_config
from rlsys.errors import RunFailed

pytestmark = pytest.mark.integration

TINY = [
    *TINY_JOB,
    "task.num_eval=8",
    "trainer.eval_every=0",
    "rollout.max_new_tokens=4",
    "algorithm.group_size=4",
    "reward.timeout_s=1",
]

GRADER = """\
import time


def flaky(prompt, response, row):
    left = int(row["prompt"].split("+")[0])
    if left % 4 == 0:
        raise ValueError(f"no grade for {row['prompt']}")
    if left % 4 == 1:
        time.sleep(30)
    if left % 4 == 2:
        return "full marks"
    return {"reward": float(response.strip() == row["answer"]), "length": len(response)}


def broken(prompt, response, row):
    raise RuntimeError("the grader is down")


def prompted(prompt, response, row):
    return {"reward": float(response.strip() == row["answer"]), "saw_prompt": float(prompt == "Q: " + row["prompt"])}
"""


def grader(tmp_path):
    (tmp_path / "grader.py").write_text(GRADER)
    return tmp_path / "grader.py"


def test_the_reward_worker_scores_through_a_scorer_and_hands_on_its_metrics(tmp_path):
    from actors.reward import RewardWorker
    from envs.reward_functions import FunctionSpec
    from envs.reward_runner import FunctionRunner, RewardScorer
    from rlsys.experience import make_experience
    from rlsys.models import save_tokenizer, train_tokenizer

    tokenizer = train_tokenizer(["1+2=3", "Q: 4+4=8"], 64)
    save_tokenizer(tokenizer, tmp_path / "policy")

    class Task:
        def prompt_text(self, row):
            return "Q: " + row["prompt"]

    row = {"prompt": "1+2=", "answer": "3"}
    rows = [dict(uid=t, group="g", prompt_ids=[1], response_ids=tokenizer(t)["input_ids"]) for t in "34"]
    table = make_experience([dict(r, logprobs=[0.0], reward=0.0, policy_version=0, meta=row) for r in rows])
    scorer = RewardScorer(FunctionRunner(FunctionSpec.parse(f"{grader(tmp_path)}:prompted"), 1), "prompted")
    worker = RewardWorker(str(tmp_path / "policy"), task=Task(), scorer=scorer)
    try:
        assert worker.score(table) == [1.0, 0.0]  # the decoded responses, the task's prompt, the row
        assert worker.take_metrics() == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/saw_prompt": 1.0}
        per_row = {"reward/saw_prompt": 1.0}  # each row's own, for samples.jsonl, handed on once
        assert worker.take_row_metrics(["4", "3", "unknown"]) == {"4": per_row, "3": per_row}
        assert worker.take_row_metrics(["3"]) == {}
        assert worker.heldout_rewards(["3", "5"], [row, row]) == [1.0, 0.0]  # held-out: not in the step's metrics
        assert worker.take_metrics() == {"reward/errors": 0.0, "reward/timeouts": 0.0}
    finally:
        scorer.close()
    assert RewardWorker(str(tmp_path / "policy"), task=Task()).take_metrics() == {}  # the task's own reward

    # task.shaping on a reward function's rewards: correct is a reward >= 1
    from envs.rewards import cosine_length_reward, with_shaping

    scorer = RewardScorer(FunctionRunner(FunctionSpec.parse(f"{grader(tmp_path)}:prompted"), 1), "prompted")
    shaped = RewardWorker(
        str(tmp_path / "policy"), task=with_shaping(Task(), [{"cosine_length": {"max_length": 64}}]), scorer=scorer
    )
    try:
        lengths = [len(r) for r in table.column("response_ids").to_pylist()]
        expected = [cosine_length_reward(lengths[0], True, 64), cosine_length_reward(lengths[1], False, 64)]
        assert shaped.score(table) == pytest.approx(expected)
        assert [sum(t) for t in shaped.take_token_rewards(["3", "4"])] == pytest.approx(expected)
    finally:
        scorer.close()


def test_rlsys_run_checks_the_reward_function_before_ray_or_the_warm_up(tmp_path, capsys, monkeypatch):
    import rlsys.cluster
    from rlsys.run.cli import main

    monkeypatch.setattr(rlsys.cluster, "init_ray", lambda *a, **k: pytest.fail("Ray started"))
    assert main(["run", "configs/quickstart.yaml", f"reward.function={grader(tmp_path)}:missing"]) == 2
    assert capsys.readouterr().err.strip().endswith("'missing' is not defined there")


def controller_for(tmp_path, name: str, function: str, steps: int):
    from rlsys.run.controller import Controller

    path = grader(tmp_path)
    cfg = load_config(
        "configs/quickstart.yaml",
        [
            *TINY,
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            f"trainer.steps={steps}",
            f"reward.function={path}:{function}",
        ],
    )
    return Controller(cfg, tmp_path / name, progress=False)


def test_rows_that_raise_hang_or_return_a_string_lose_no_step(ray_cluster, tmp_path):
    controller = controller_for(tmp_path, "flaky", "flaky", steps=3)
    summary = controller.run()
    rows = [json.loads(line) for line in (tmp_path / "flaky" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and [r["step"] for r in rows] == [1, 2, 3]
    assert all("reward/errors" in r and "reward/timeouts" in r for r in rows)
    assert sum(r["reward/errors"] for r in rows) > sum(r["reward/timeouts"] for r in rows) > 0
    assert all(r["reward/errors"] <= r["samples"] for r in rows)
    assert any("reward/length" in r for r in rows)  # a dict's extra numbers, as means
    samples = [json.loads(line) for line in (tmp_path / "flaky" / "samples.jsonl").read_text().splitlines()]
    scored = [s for s in samples if "reward/length" in s]  # and each row's own in the samples log
    assert scored and all(0 <= s["reward/length"] <= len(s["response"]) for s in scored)  # special tokens shown
    evals = [json.loads(line) for line in (tmp_path / "flaky" / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 3] and all(0.0 <= e["reward"] <= 1.0 for e in evals)
    assert all(e["accuracy"] <= e["reward"] for e in evals)  # held-out: scored by the function, >= 1 correct


def test_a_function_failing_on_every_row_stops_the_run_in_one_line(ray_cluster, tmp_path):
    controller = controller_for(tmp_path, "broken", "broken", steps=5)
    controller.start_actors(controller.prepare_policy())
    try:
        with pytest.raises(RunFailed) as e:
            for _ in range(5):
                controller.train_step()
        assert controller.step == 2  # the third all-failing step stops it (reward.error_window 3)
    finally:
        controller.shutdown()
    message = str(getattr(e.value, "cause", e.value))  # what `rlsys run` prints (rlsys/run/cli.py main)
    assert "\n" not in message
    assert message.startswith(f"reward function '{tmp_path / 'grader.py'}:broken' failed on 48 of 48 rows")
    assert message.endswith("last error: RuntimeError: the grader is down (grader.py:16)")
