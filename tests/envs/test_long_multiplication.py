"""The reasoning task (long multiplication in written steps, configs/reasoning.yaml): its answers
are right, its splits disjoint, its flawed demonstrations wrong exactly from the step they say,
its responses split into several VinePPO steps, and the dataset task teaches the solution columns."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from algorithms.sft import demonstration
from algorithms.vineppo import split_steps
from envs.dataset_task import DatasetTask
from envs.datasets import DatasetError, write_rows
from envs.long_multiplication import add_without_carry, generate, main, num_steps, solution
from envs.reward_functions import math_reward

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "configs" / "data"
LINE_VALUE = re.compile(r"= (-?\d+)\.$")


def lines_and_values(text: str) -> tuple[list[str], list[int]]:
    """The step lines (all but the answer line) and the value each ends with."""
    lines = text.split("\n")
    return lines[:-1], [int(LINE_VALUE.search(line).group(1)) for line in lines[:-1]]


def test_a_solution_is_its_steps_and_the_boxed_product():
    text, answer = solution(47, 38)
    assert answer == 1786
    assert text == (
        "47 * 8 = 40 * 8 + 7 * 8 = 320 + 56 = 376.\n"
        "47 * 30 = 40 * 30 + 7 * 30 = 1200 + 210 = 1410.\n"
        "376 + 1410 = 1786.\n"
        "The answer is \\boxed{1786}."
    )
    assert math_reward("", text, {"answer": "1786"}) == 1.0  # the math reward reads the box
    for a, b in [(10, 10), (99, 99), (305, 27), (123, 456), (50, 20)]:
        text, answer = solution(a, b)
        steps, values = lines_and_values(text)
        assert answer == a * b and values[-1] == a * b and len(steps) == num_steps(b)
        assert text.endswith(f"\\boxed{{{a * b}}}.")


def test_add_without_carry_drops_every_carry_or_adds_one():
    assert add_without_carry(376, 1410) == 1796  # nothing carries: a carry added to the tens
    assert add_without_carry(58, 37) == 85  # 8 + 7 = 15 and 5 + 3 = 8: the 1 dropped
    assert add_without_carry(999, 1) == 990


@pytest.mark.parametrize("a,b", [(47, 38), (91, 19), (305, 27), (64, 50)])
def test_a_flawed_solution_is_right_before_its_flaw_and_wrong_from_it_on(a, b):
    right_steps, right = lines_and_values(solution(a, b)[0])
    for flaw in range(num_steps(b)):
        text, answer = solution(a, b, flaw)
        steps, values = lines_and_values(text)
        assert steps[:flaw] == right_steps[:flaw]  # the same chain up to the wrong step
        assert values[flaw] != right[flaw]
        assert answer != a * b and values[-1] == answer  # carried through to a wrong answer
        assert math_reward("", text, {"answer": str(a * b)}) == 0.0


def test_splits_are_disjoint_the_data_is_what_the_generator_writes_and_rows_say_their_flaw(tmp_path):
    main(["--out", str(tmp_path)])
    for split in ("train", "eval"):
        name = f"multiplication_{split}.jsonl"
        assert (tmp_path / name).read_text() == (DATA / name).read_text()
    task = DatasetTask(DATA / "multiplication_train.jsonl", DATA / "multiplication_eval.jsonl")
    train, held_out = task.rows("train"), task.rows("eval")
    assert len(train) == 4000 and len(held_out) == 200
    prompts = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert len(prompts(train)) == 4000 and not prompts(train) & prompts(held_out)
    for row in random.Random(0).sample(train, 200) + held_out[:50]:
        a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"]))
        assert row["answer"] == str(a * b) and row["solution"] == solution(a, b)[0]
        assert row["flawed_solution"] == solution(a, b, row["flaw_step"])[0]


def test_a_mix_of_shapes_keeps_its_shares_and_disjoint_splits_and_a_bad_mix_is_named():
    import pytest

    from envs.long_multiplication import digit_mix

    mix = digit_mix(["2x2:0.7", "3x3:0.2", "4x4:0.1"])
    rows = generate(100, 20, seed=2, mix=mix)
    for split, n in (("train", 100), ("eval", 20)):
        shapes = [tuple(len(x) for x in re.findall(r"\d+", r["prompt"][0]["content"])) for r in rows[split]]
        assert {s: shapes.count(s) for s in set(shapes)} == {(2, 2): 0.7 * n, (3, 3): 0.2 * n, (4, 4): 0.1 * n}
        assert shapes[: int(0.7 * n)] != [(2, 2)] * int(0.7 * n)  # shuffled, not in blocks
    prompts = [{r["prompt"][0]["content"] for r in rows[split]} for split in ("train", "eval")]
    assert not prompts[0] & prompts[1]
    with pytest.raises(ValueError, match="shares sum to 0.9, not 1"):
        digit_mix(["2x2:0.7", "3x3:0.2"])
    with pytest.raises(ValueError, match=r"--mix '2by2:1': write each as AxB:share"):
        digit_mix(["2by2:1"])


def test_responses_split_into_several_vineppo_steps():
    rows = generate(50, 5, seed=3)["train"]
    counts = [len(split_steps(r["solution"])) for r in rows]
    assert min(counts) >= 3  # two partial products and their sum (the answer line joins the sum)
    three_by_two = generate(20, 5, digits=(3, 3), seed=1)["train"]
    assert min(len(split_steps(r["solution"])) for r in three_by_two) >= 5
    for r in rows:
        assert "".join(split_steps(r["solution"])) == r["solution"]


def test_the_dataset_task_teaches_the_solution_columns(tmp_path):
    rows = generate(4, 2, seed=5)
    write_rows(rows["train"], tmp_path / "train.jsonl")
    write_rows(rows["eval"], tmp_path / "eval.jsonl")
    task = DatasetTask(
        tmp_path / "train.jsonl",
        tmp_path / "eval.jsonl",
        demonstration_key="solution",
        flawed_demonstration_key="flawed_solution",
    )
    row = task.rows("train")[0]
    assert demonstration(task, row) == row["solution"]
    assert demonstration(task, task.flawed_demonstration(row)) == row["flawed_solution"]
    assert task.flawed_demonstration(row)["answer"] == row["answer"]  # the reward's answer is untouched
    assert any(row["solution"] in line for line in task.corpus())  # the tokenizer learns the solutions' text
    assert DatasetTask(tmp_path / "train.jsonl", tmp_path / "eval.jsonl").flawed_demonstration is None
    # a training row without its demonstration fails at load, naming the row and the column
    write_rows([{k: v for k, v in rows["train"][0].items() if k != "solution"}], tmp_path / "bad.jsonl")
    bad = DatasetTask(tmp_path / "bad.jsonl", tmp_path / "eval.jsonl", demonstration_key="solution")
    with pytest.raises(DatasetError, match=r"bad.jsonl row 1: missing key 'solution'"):
        bad.rows("train")


def test_the_reasoning_config_reads_the_shipped_data(monkeypatch):
    from envs.registry import make_task
    from rlsys.config import load_config

    monkeypatch.chdir(ROOT)
    cfg = load_config("configs/reasoning.yaml")
    task = make_task(cfg.task, ROOT / "runs" / "unused", 0)
    assert task.demonstration(task.rows("train")[0]) == task.rows("train")[0]["solution"]
    assert cfg.rollout.max_new_tokens >= 100 and cfg.sft.demo_error > 0
