"""The dataset task (task.name=dataset): readers, row checks, chat-template prompts, long prompts,
its default reward, and the example job's data. No Ray."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from envs.dataset_task import DatasetTask, fit_to_model, prompt_budget
from envs.datasets import DatasetError, load_rows
from envs.reward_functions import normalize_text
from rlsys.config import ConfigError, load_config
from rlsys.models import train_tokenizer
from rlsys.prompts import prompt_ids

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "configs" / "examples"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROWS = [
    {"prompt": [{"role": "user", "content": "Mia has 3 pens. She buys 4 more. How many now?"}], "answer": "7", "n": 1},
    {"prompt": [{"role": "user", "content": "Leo had 9 cards and gave 2 away. How many left?"}], "answer": "7", "n": 2},
    {"prompt": [{"role": "user", "content": "Ana buys 2 bags of 5 shells. How many shells?"}], "answer": "10", "n": 3},
]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def corpus() -> list[str]:
    return [m["content"] for r in ROWS for m in r["prompt"]] + ["system user assistant You solve word problems."]


@pytest.fixture(scope="module")
def chat_tok():
    """A tokenizer the project trains, with a ChatML template where it has none of its own."""
    tok = train_tokenizer(corpus(), 300)
    if not tok.chat_template:
        tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def plain_tok():
    tok = train_tokenizer(corpus(), 300)
    tok.chat_template = None
    return tok


def template_ids(tok, messages: list[dict]) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# ---- readers ------------------------------------------------------------------------------


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_json(rows: list[dict], path: Path) -> Path:
    path.write_text(json.dumps(rows), encoding="utf-8")
    return path


def write_parquet(rows: list[dict], path: Path) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def write_disk(rows: list[dict], path: Path) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


WRITERS = {"data.jsonl": write_jsonl, "data.json": write_json, "data.parquet": write_parquet, "data_dir": write_disk}


@pytest.mark.parametrize("name", list(WRITERS))
def test_each_format_reads_every_row_and_column(tmp_path, name):
    path = WRITERS[name](ROWS, tmp_path / name)
    task = DatasetTask(path, path)
    assert task.rows("train") == ROWS and task.rows("eval") == ROWS
    assert task.messages(ROWS[0]) == ROWS[0]["prompt"]


def test_a_string_prompt_column_is_one_user_message(tmp_path, chat_tok):
    path = write_jsonl([{"question": "2 pens and 3 pens?", "solution": 5}], tmp_path / "q.jsonl")
    task = DatasetTask(path, path, prompt_key="question", answer_key="solution")
    row = task.rows("train")[0]
    assert task.messages(row) == user("2 pens and 3 pens?") and task.answer(row) == "5"
    assert task.prompt_text(row) == "2 pens and 3 pens?"


def test_reading_never_opens_a_socket(tmp_path, monkeypatch):
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("the dataset reader tried the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    for name, write in WRITERS.items():
        assert load_rows(write(ROWS, tmp_path / name)) == ROWS


def test_a_split_dataset_dict_dir_names_its_splits(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"several splits \(train\).*dd/train"):
        load_rows(tmp_path / "dd")


def unreadable(root: Path, case: str) -> Path:
    """A dataset path the reader refuses."""
    if case == "csv":
        (root / "rows.csv").write_text("a\n")
        return root / "rows.csv"
    if case == "empty":
        (root / "empty.jsonl").write_text("")
        return root / "empty.jsonl"
    if case == "plain dir":
        (root / "plain").mkdir()
        return root / "plain"
    return root / "missing.jsonl"


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "does not exist"),
        ("csv", "unsupported format '.csv'"),
        ("empty", "no rows|not readable"),
        ("plain dir", "not a directory written by Dataset.save_to_disk"),
    ],
)
def test_unreadable_datasets_fail_in_one_line(tmp_path, case, message):
    with pytest.raises(DatasetError, match=message) as err:
        load_rows(unreadable(tmp_path, case))
    assert "\n" not in str(err.value)


# ---- bad rows: one line, the file, the row ---------------------------------------------------

GOOD = ROWS[0]
BAD_ROWS = {
    "missing answer": ({"prompt": user("hi")}, r"row 2: missing key 'answer'"),
    "missing prompt": ({"answer": "1"}, r"row 2: missing key 'prompt'"),
    "empty prompt": ({"prompt": "   ", "answer": "1"}, r"row 2: empty prompt"),
    "prompt of a wrong type": ({"prompt": 5, "answer": "1"}, r"row 2: 'prompt' is int: expected a string or a list"),
    "message without content": ({"prompt": [{"role": "user"}], "answer": "1"}, r"row 2: malformed messages.*'content'"),
    "message not an object": ({"prompt": ["hello"], "answer": "1"}, r"row 2: malformed messages.*message 1 is str"),
    "no messages": ({"prompt": [], "answer": "1"}, r"row 2: malformed messages in 'prompt': no messages"),
    "empty messages": ({"prompt": user(" "), "answer": "1"}, r"row 2: malformed messages.*every message is empty"),
    "answer of a wrong type": ({"prompt": user("hi"), "answer": ["1"]}, r"row 2: 'answer' is list"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
@pytest.mark.parametrize("fmt", ["data.jsonl", "data.parquet"])
def test_a_bad_row_fails_with_the_file_and_row_number(tmp_path, case, fmt):
    bad, message = BAD_ROWS[case]
    if fmt == "data.parquet" and case in ("prompt of a wrong type", "message not an object", "answer of a wrong type"):
        pytest.skip("parquet columns hold one type: such a file cannot be written")
    good = {"prompt": "hi", "answer": "1"} if isinstance(bad.get("prompt"), str) else GOOD  # one type a column
    path = (write_jsonl if fmt.endswith("jsonl") else write_parquet)([good, bad, good], tmp_path / fmt)
    with pytest.raises(DatasetError, match=message) as err:
        DatasetTask(path, path).rows("train")
    assert "\n" not in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", answer}\n', r"line 2: not valid JSON"),
        ('{"prompt": "a", "answer": "1"}\n[1, 2]\n', r"row 2: expected an object, got list"),
    ],
)
def test_unparsable_json_lines_are_named(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(DatasetError, match=message) as err:
        load_rows(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_make_task_checks_both_splits_before_anything_starts(tmp_path):
    from envs.registry import make_task

    good = write_jsonl(ROWS, tmp_path / "train.jsonl")
    bad = write_jsonl([GOOD, {"prompt": user("hi")}], tmp_path / "eval.jsonl")
    cfg = load_config(data={"task": {"name": "dataset", "train_path": str(good), "eval_path": str(bad)}})
    with pytest.raises(DatasetError, match=rf"dataset {bad} row 2: missing key 'answer'"):
        make_task(cfg.task, tmp_path / "data", 0)


def test_task_dataset_needs_a_train_path():
    with pytest.raises(ConfigError, match=r"task.train_path.*required when task.name is 'dataset'"):
        load_config(data={"task": {"name": "dataset"}})


# ---- prompts: chat template, system prompt, plain text ----------------------------------------


def test_prompt_ids_are_the_chat_template_of_the_messages(tmp_path, chat_tok):
    path = write_jsonl(ROWS, tmp_path / "d.jsonl")
    task = DatasetTask(path, path)
    for row in task.rows("train"):
        ids, text = prompt_ids(task, chat_tok, row)
        assert ids == template_ids(chat_tok, row["prompt"])
        assert text == chat_tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)


def test_the_system_prompt_comes_first_unless_the_row_has_one(tmp_path, chat_tok):
    own = {"prompt": [{"role": "system", "content": "Be brief."}, *user("3 pens and 4 pens?")], "answer": "7"}
    path = write_jsonl([ROWS[0], own], tmp_path / "d.jsonl")
    task = DatasetTask(path, path, system_prompt="You solve word problems.")
    first, second = task.rows("train")
    system = {"role": "system", "content": "You solve word problems."}
    assert task.messages(first) == [system, *first["prompt"]]
    assert prompt_ids(task, chat_tok, first)[0] == template_ids(chat_tok, [system, *first["prompt"]])
    assert task.messages(second) == own["prompt"]  # the row's own system message, not a second one


def test_without_a_template_the_text_is_tokenized_as_it_is(tmp_path, chat_tok, plain_tok):
    path = write_jsonl(ROWS, tmp_path / "d.jsonl")
    row = DatasetTask(path, path).rows("train")[0]
    content = row["prompt"][0]["content"]
    expected = (plain_tok(content, add_special_tokens=False)["input_ids"], content)
    assert prompt_ids(DatasetTask(path, path), plain_tok, row) == expected  # null: no template, none used
    off = DatasetTask(path, path, chat_template=False)
    assert prompt_ids(off, chat_tok, row) == (chat_tok(content, add_special_tokens=False)["input_ids"], content)
    with_system = DatasetTask(path, path, system_prompt="Be brief.", chat_template=False)
    assert prompt_ids(with_system, chat_tok, row)[1] == f"Be brief.\n\n{content}"
    with pytest.raises(ConfigError, match=r"task.chat_template'=true: the tokenizer has no chat template"):
        prompt_ids(DatasetTask(path, path, chat_template=True), plain_tok, row)
    with pytest.raises(ConfigError, match=r"task.chat_template'=true"):  # before any actor, with no limit known
        DatasetTask(path, path, chat_template=True).fit_prompts(plain_tok, None, drop=True)


def test_a_shaped_dataset_task_still_builds_chat_prompts(tmp_path, chat_tok):
    from envs.registry import make_task

    path = write_jsonl(ROWS, tmp_path / "d.jsonl")
    cfg = load_config(data={"task": {"name": "dataset", "train_path": str(path), "shaping": ["repetition"]}})
    task = make_task(cfg.task, tmp_path / "data", 0)
    assert type(task).__name__ == "ShapedTask"
    row = task.rows("train")[0]
    assert prompt_ids(task, chat_tok, row)[0] == template_ids(chat_tok, row["prompt"])


def test_arithmetic_prompt_ids_are_unchanged(tmp_path, chat_tok):
    from envs.arithmetic import ArithmeticTask
    from envs.rewards import with_shaping

    task = ArithmeticTask.create(tmp_path, 20, 5, 0, 49, ["+"], seed=0)
    tok = train_tokenizer(task.corpus(), 64)
    for t in (task, with_shaping(task, ["repetition"])):
        for row in task.rows("train"):
            assert prompt_ids(t, tok, row) == (tok(row["prompt"], add_special_tokens=False)["input_ids"], row["prompt"])
            assert prompt_ids(t, chat_tok, row)[0] == chat_tok(row["prompt"], add_special_tokens=False)["input_ids"]


def test_the_controller_and_the_warm_up_take_the_same_prompts(tmp_path, chat_tok):
    from algorithms.sft import sft_ids
    from rlsys.run.controller import Controller  # the roof: only this test builds a Controller

    path = write_jsonl(ROWS, tmp_path / "d.jsonl")
    task = DatasetTask(path, path, answer_key="answer")
    controller = Controller.__new__(Controller)  # _prompt needs only the task and the tokenizer
    controller.task, controller.tokenizer = task, chat_tok
    rows = task.rows("train")
    prompts, answers = sft_ids(chat_tok, rows, task)
    for i, row in enumerate(rows):
        prompt = controller._prompt(f"train-{i}", row)
        assert prompt.prompt_ids == prompts[i] == template_ids(chat_tok, row["prompt"]) and prompt.meta == row
        assert answers[i] == chat_tok(row["answer"], add_special_tokens=False)["input_ids"] + [chat_tok.eos_token_id]


# ---- long prompts --------------------------------------------------------------------------


def long_rows() -> list[dict]:
    return [*ROWS, {"prompt": user("Mia has pens. " * 40), "answer": "1", "n": 4}]


def test_long_prompts_are_dropped_with_one_count(tmp_path, chat_tok, capsys):
    path = write_jsonl(long_rows(), tmp_path / "d.jsonl")
    task = DatasetTask(path, path)
    budget = max(len(prompt_ids(task, chat_tok, r)[0]) for r in ROWS)
    task.fit_prompts(chat_tok, budget, drop=True)
    task.fit_prompts(chat_tok, budget, drop=True)  # a second call with the same budget: nothing new
    assert task.rows("train") == ROWS and task.rows("eval") == ROWS
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rlsys: dropped 1 of 4 train and 1 of 4 eval prompts over {budget} tokens (task.max_prompt_tokens)"]


def test_long_prompts_are_rejected_when_dropping_is_off(tmp_path, chat_tok):
    path = write_jsonl(long_rows(), tmp_path / "d.jsonl")
    task = DatasetTask(path, path)
    budget = max(len(prompt_ids(task, chat_tok, r)[0]) for r in ROWS)
    with pytest.raises(DatasetError, match=rf"{path} row 4: prompt is \d+ tokens, over the limit of {budget}") as err:
        task.fit_prompts(chat_tok, budget, drop=False)
    assert "\n" not in str(err.value)


def test_every_prompt_too_long_is_an_error(tmp_path, chat_tok):
    path = write_jsonl(ROWS, tmp_path / "d.jsonl")
    with pytest.raises(DatasetError, match="every prompt is over the limit of 2 tokens"):
        DatasetTask(path, path).fit_prompts(chat_tok, 2, drop=True)


def test_the_budget_is_the_context_less_the_response_unless_set(tmp_path, chat_tok, capsys):
    assert (
        prompt_budget(None, 256, 6) == 250 and prompt_budget(30, 256, 6) == 30 and prompt_budget(None, None, 6) is None
    )
    with pytest.raises(ConfigError, match="rollout.max_new_tokens'=300: leaves no room"):
        prompt_budget(None, 256, 300)
    path = write_jsonl(long_rows(), tmp_path / "d.jsonl")
    cfg = load_config(data={"task": {"name": "dataset", "train_path": str(path)}, "rollout": {"max_new_tokens": 8}})
    task = DatasetTask.from_config(cfg.task)
    longest = max(len(prompt_ids(task, chat_tok, r)[0]) for r in ROWS)
    fit_to_model(task, chat_tok, cfg, {"max_position_embeddings": longest + 8})
    assert task.rows("train") == ROWS and "dropped 1 of 4 train" in capsys.readouterr().err
    off = load_config(
        data={
            "task": {"name": "dataset", "train_path": str(path), "drop_long_prompts": False},
            "rollout": {"max_new_tokens": 8},
        }
    )
    with pytest.raises(DatasetError, match="row 4: prompt is"):
        fit_to_model(DatasetTask.from_config(off.task), chat_tok, off, {"n_positions": longest + 8})
    fit_to_model(DatasetTask.from_config(off.task), chat_tok, off, {})  # no context known: nothing dropped


def test_prepare_policy_drops_long_prompts_before_the_warm_up(tmp_path, capsys):
    from rlsys.run.controller import Controller  # the roof: only this test builds a Controller

    path = write_jsonl(long_rows(), tmp_path / "d.jsonl")
    tiny = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    cfg = load_config(
        data={
            "task": {"name": "dataset", "train_path": str(path), "max_prompt_tokens": 60},
            "model": {**tiny, "num_key_value_heads": 1},
            "sft": {"steps": 0},
        }
    )
    controller = Controller(cfg, tmp_path / "run", progress=False)
    controller.prepare_policy()
    assert len(controller.task.rows("train")) == 3
    assert "dropped 1 of 4 train and 1 of 4 eval prompts over 60 tokens" in capsys.readouterr().err


# ---- answers and the default reward ---------------------------------------------------------


def test_the_default_reward_is_a_normalised_exact_match(tmp_path):
    path = write_jsonl(
        [{"prompt": "Name the colour.", "answer": "Sky  Blue"}, {"prompt": "2+2?", "answer": 4}], tmp_path / "d.jsonl"
    )
    task = DatasetTask(path, path)
    colour, four = task.rows("train")
    assert normalize_text("  Sky \n blue ") == "sky blue" == normalize_text("Sky blue.")
    assert task.reward(colour, " sky blue\n") == 1.0 and task.is_correct(colour, "SKY BLUE")
    assert task.reward(colour, "sky-blue") == 0.0 and not task.is_correct(colour, "blue")
    assert task.reward(four, "4") == 1.0 and task.reward(four, "four") == 0.0
    assert task.demonstration(four) == "4"


def test_the_corpus_holds_roles_prompts_and_answers(tmp_path):
    path = write_jsonl(ROWS, tmp_path / "d.jsonl")
    lines = DatasetTask(path, path, system_prompt="Be brief.").corpus()
    assert lines[0] == f"system\nBe brief.\nuser\n{ROWS[0]['prompt'][0]['content']}\nassistant\n7"


def test_the_task_crosses_a_process_boundary_with_its_rows(tmp_path, chat_tok):
    import pickle

    path = write_jsonl(long_rows(), tmp_path / "d.jsonl")
    task = DatasetTask(path, path)
    task.fit_prompts(chat_tok, 60, drop=True)
    path.unlink()  # a worker gets the kept rows with the task, without reading the file again
    assert pickle.loads(pickle.dumps(task)).rows("train") == ROWS


# ---- the example job's data -----------------------------------------------------------------


def test_the_example_dataset_loads_and_every_answer_is_a_number():
    train_path, eval_path = (
        EXAMPLES / "data" / "word_problems_train.jsonl",
        EXAMPLES / "data" / "word_problems_eval.jsonl",
    )
    task = DatasetTask(train_path, eval_path)
    train, held_out = task.rows("train"), task.rows("eval")
    assert len(train) == 4000 and len(held_out) == 100
    for row in train + held_out:
        assert float(row["answer"]) == int(row["answer"])
        assert [m["role"] for m in row["prompt"]] == ["user"] and row["steps"] in (1, 2)
    texts = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert not texts(train) & texts(held_out)


def test_the_example_dataset_is_what_its_script_writes(tmp_path):
    sys.path.insert(0, str(EXAMPLES))
    try:
        import make_word_problems
    finally:
        sys.path.remove(str(EXAMPLES))
    make_word_problems.main(["--out", str(tmp_path)])
    for split in ("train", "eval"):
        name = f"word_problems_{split}.jsonl"
        assert (tmp_path / name).read_text() == (EXAMPLES / "data" / name).read_text()


def test_the_example_reward_function_gives_full_marks_and_a_bonus():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import my_reward
    finally:
        sys.path.remove(str(EXAMPLES))
    row = {"answer": "42"}
    assert my_reward.reward("p", "42", row) == {"reward": 1.1, "correct": 1.0}
    assert my_reward.reward("p", "The answer is 42", row) == {"reward": 1.0, "correct": 1.0}
    assert my_reward.reward("p", "41", row) == {"reward": 0.0, "correct": 0.0}


@pytest.mark.parametrize("name", ["word_problems.yaml", "word_problems_custom_reward.yaml"])
def test_the_example_configs_task_reads_the_shipped_data(name, monkeypatch):
    from envs.registry import make_task
    from rlsys.config import TaskConfig, load_yaml, validate_section

    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository root
    task_cfg = validate_section(TaskConfig, load_yaml(EXAMPLES / name)["task"], prefix="task")
    assert task_cfg.name == "dataset" and task_cfg.chat_template is True
    task = make_task(task_cfg, ROOT / "runs" / "unused", 0)
    assert len(task.rows("train")) == 4000 and len(task.rows("eval")) == 100
