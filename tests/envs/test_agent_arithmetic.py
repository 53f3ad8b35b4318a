"""The tool-use task's data (envs/agent_arithmetic.py): answers right, splits disjoint, the same
seed the same files (the shipped ones), demonstrations whose call parses, runs and is answered
as a ToolEnv plays it, flawed demonstrations wrong in the way they say, and a demonstration as a
token row whose tool result is outside the loss mask."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from envs.agent_arithmetic import (
    FLAWS,
    OPERAND,
    OPERATOR_SWAP,
    TEMPLATES,
    Problem,
    call_text,
    final_text,
    generate,
    guess,
    main,
    swap_operator,
    typo,
)
from envs.conversation import ChatEncoder, Conversation
from envs.dataset_task import DatasetTask
from envs.reward_functions import math_reward
from envs.tool_env import ToolEnv
from envs.tools import calculator, parse_tool_calls
from rlsys.models import train_tokenizer
from sandbox import make_backend

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "configs" / "data"


@pytest.fixture(scope="module")
def rows():
    return generate(300, 60, seed=7)


class MathRewardTask:
    """The dataset task as a run with `reward.function: math` scores it: the real DatasetTask's
    rows and prompts, the math reward of the final answer's `\\boxed{}`."""

    def __init__(self, task: DatasetTask):
        self.task, self.name = task, task.name

    def rows(self, split: str) -> list[dict]:
        return self.task.rows(split)

    def prompt_text(self, row: dict) -> str:
        return self.task.prompt_text(row)

    def reward(self, row: dict, response_text: str) -> float:
        return math_reward(self.prompt_text(row), response_text, row)

    def is_correct(self, row: dict, response_text: str) -> bool:
        return self.reward(row, response_text) == 1.0


def calls(messages: list[dict]):
    """Every tool call of the assistant messages."""
    return [c for m in messages if m["role"] == "assistant" for c in parse_tool_calls(m["content"])]


def test_answers_are_the_templates_values_and_the_calculators(rows):
    for row in rows["train"] + rows["eval"]:
        expression = row["expression"]
        operands = tuple(int(x) for x in OPERAND.findall(expression))
        (problem,) = [  # the one template whose text the prompt starts with
            p
            for p in (Problem(t, operands) for t in TEMPLATES if len(t.digits) == len(operands))
            if row["prompt"][0]["content"].startswith(p.text)
        ]
        assert problem.expression == expression
        assert row["answer"] == str(problem.answer) == calculator(expression)
        assert row["prompt"] == [{"role": "user", "content": row["prompt"][0]["content"]}]
        template = problem.template
        assert all(len(str(x)) == d for x, d in zip(operands, template.digits))
        assert problem.answer > 0


def test_every_template_is_used_and_its_numbers_are_large(rows):
    used = {row["expression"].translate(str.maketrans("", "", "0123456789")) for row in rows["train"]}
    assert used == {t.expression.format(a="", b="", c="") for t in TEMPLATES}
    assert min(len(row["answer"]) for row in rows["train"]) >= 5


def test_splits_share_no_problem(rows):
    train, held_out = rows["train"], rows["eval"]
    assert len(train) == 300 and len(held_out) == 60
    for key in (lambda r: r["expression"], lambda r: r["prompt"][0]["content"]):
        assert len({key(r) for r in train}) == 300 and len({key(r) for r in held_out}) == 60
        assert not {key(r) for r in train} & {key(r) for r in held_out}


def test_the_same_seed_writes_the_same_files_and_the_shipped_data_is_the_default(tmp_path, rows):
    assert generate(300, 60, seed=7) == rows
    assert generate(300, 60, seed=8)["train"] != rows["train"]
    main(["--out", str(tmp_path)])
    for split in ("train", "eval"):
        name = f"agent_arithmetic_{split}.jsonl"
        assert (tmp_path / name).read_text() == (DATA / name).read_text()
    task = DatasetTask(DATA / "agent_arithmetic_train.jsonl", DATA / "agent_arithmetic_eval.jsonl")
    assert len(task.rows("train")) == 2000 and len(task.rows("eval")) == 200  # the dataset path reads them


def test_a_demonstration_is_one_calculator_call_whose_result_is_the_answer(rows):
    for row in rows["train"]:
        demo = row["demonstration"]
        assert [m["role"] for m in demo] == ["assistant", "tool", "assistant"]
        (call,) = parse_tool_calls(demo[0]["content"])
        assert call.ok and call.name == "calculator" and call.arguments == {"expression": row["expression"]}
        assert calculator(**call.arguments) == demo[1]["content"] == row["answer"]
        assert math_reward("", final_text(demo), row) == 1.0


def test_a_tool_env_plays_the_demonstration_to_reward_one():
    task = MathRewardTask(DatasetTask(DATA / "agent_arithmetic_train.jsonl", DATA / "agent_arithmetic_eval.jsonl"))
    env = ToolEnv.from_names(task, ["calculator"], max_turns=3)
    for row in task.rows("eval")[:20]:
        demo = row["demonstration"]
        assert env.reset(row) == row["prompt"][0]["content"]
        observation, reward, done, info = env.step(demo[0]["content"])
        assert info["messages"] == [demo[1]] and observation == demo[1]["content"] and not done
        observation, reward, done, info = env.step(demo[2]["content"])
        assert (observation, reward, done, info["correct"]) == (None, 1.0, True, True)
        env.reset(row)
        flawed = [m for m in row["flawed_demonstration"] if m["role"] == "assistant"]
        outcomes = [env.step(m["content"]) for m in flawed]
        assert outcomes[-1][1:3] == (0.0, True) and not outcomes[-1][3]["correct"]


def test_the_python_form_calls_python_with_what_the_real_tool_returns(rows):
    python_rows = generate(300, 60, seed=7, tool="python")
    assert [r["expression"] for r in python_rows["train"]] == [r["expression"] for r in rows["train"]]
    assert [r["flaw"] for r in python_rows["train"]] == [r["flaw"] for r in rows["train"]]
    assert call_text("1+2") == '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    for row in python_rows["train"][:20]:
        assert row["prompt"][0]["content"].endswith("Use python, then give the final answer as \\boxed{}.")
        (call,) = calls(row["demonstration"])
        assert call.ok and call.name == "python" and call.arguments == {"code": f"print({row['expression']})"}
        assert row["demonstration"][1] == {"role": "tool", "name": "python", "content": row["answer"]}
        assert all(c.name == "python" for c in calls(row["flawed_demonstration"]))
    # the tool messages are what the python tool gives when the program really runs (on the host:
    # the unsandboxed backend, enough to run print(<expression>))
    task = MathRewardTask(DatasetTask(DATA / "agent_arithmetic_train.jsonl", DATA / "agent_arithmetic_eval.jsonl"))
    host = make_backend("subprocess-unsafe")
    env = ToolEnv.from_names(task, ["python"], run=lambda requests: [host.run(r) for r in requests], max_turns=3)
    for row in [r for r in python_rows["train"] if r["flaw"] != "guess"][:4]:
        for key in ("demonstration", "flawed_demonstration"):
            env.reset(row)
            demo = row[key]
            observation, _, done, info = env.step(demo[0]["content"])
            assert info["messages"] == [demo[1]] and not done
            observation, reward, done, info = env.step(demo[2]["content"])
            assert done and reward == (1.0 if key == "demonstration" else 0.0)
    with pytest.raises(ValueError, match="unknown tool 'shell'"):
        generate(1, 1, tool="shell")


def test_flawed_demonstrations_are_wrong_in_the_way_they_say(rows):
    seen = set()
    for row in rows["train"] + rows["eval"]:
        flawed, flaw = row["flawed_demonstration"], row["flaw"]
        seen.add(flaw)
        assert math_reward("", final_text(flawed), row) == 0.0
        if flaw == "guess":
            assert flawed == [
                {"role": "assistant", "content": f"The answer is \\boxed{{{guess(int(row['answer']))}}}."}
            ]
            continue
        (call,) = calls(flawed)
        wrong = call.arguments["expression"]
        assert flawed[1] == {"role": "tool", "name": "calculator", "content": calculator(wrong)}
        assert final_text(flawed) == f"The answer is \\boxed{{{flawed[1]['content']}}}."
        right = row["expression"]
        assert len(wrong) == len(right) and wrong != right
        differences = [(x, y) for x, y in zip(right, wrong) if x != y]
        if flaw == "operator":
            assert len(differences) == 1 and OPERATOR_SWAP[differences[0][0]] == differences[0][1]
        else:
            changed = [(x, y) for x, y in zip(OPERAND.findall(right), OPERAND.findall(wrong)) if x != y]
            assert len(changed) == 1 and not changed[0][1].startswith("0")
    assert seen == set(FLAWS)


@pytest.mark.parametrize("number", ["10", "48213", "1000", "90", "7777", "101"])
def test_a_typo_is_another_number_of_as_many_digits(number):
    rng = random.Random(0)
    for _ in range(50):
        slip = typo(number, rng)
        assert slip != number and len(slip) == len(number) and slip[0] != "0"


def test_guesses_are_rounded_and_never_right():
    assert guess(35629407) == 36000000
    assert guess(36000000) == 37000000
    assert guess(448158) == 450000
    assert swap_operator("(12+34)*5", random.Random(0)) in ("(12-34)*5", "(12+34)+5")


def demonstration_conversation(encoder: ChatEncoder, row: dict, key: str) -> Conversation:
    """A demonstration as the token row a multi-turn warm-up would train on: the prompt, each
    assistant message as a policy turn (its tokens and the end-of-turn token), each run of tool
    messages as an observation."""
    conv = Conversation.start(encoder, row["prompt"])
    pending: list[dict] = []
    for message in row[key]:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            conv.add_messages(pending)
            pending = []
        ids = encoder.tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [encoder.end_of_turn_id]
        conv.add_policy(ids, [0.0] * len(ids))
    return conv


def test_a_demonstration_is_a_token_row_with_its_tool_result_outside_the_loss(rows):
    sample = rows["train"][:40]
    corpus = [m["content"] for r in sample for m in r["prompt"] + r["demonstration"] + r["flawed_demonstration"]]
    tokenizer = train_tokenizer(corpus * 3, vocab_size=400)  # rlsys.models.CHAT_TEMPLATE: ChatML, any role
    encoder = ChatEncoder(tokenizer, end_of_turn_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    for row in sample[:10]:
        conv = demonstration_conversation(encoder, row, "demonstration")
        whole = tokenizer.apply_chat_template(row["prompt"] + row["demonstration"], tokenize=True, return_dict=True)
        assert conv.ids == list(whole["input_ids"])[: len(conv.ids)]  # the template's rendering, token for token
        taught = tokenizer.decode([t for t, m in zip(conv.ids, conv.loss_mask) if m])
        demo = row["demonstration"]
        assert taught == f"{demo[0]['content']}<|im_end|>{demo[2]['content']}<|im_end|>"
        untaught = tokenizer.decode(conv.response_ids[len(tokenizer(demo[0]["content"])["input_ids"]) + 1 :])
        assert f"<|im_start|>tool\n{row['answer']}<|im_end|>" in untaught
        fields = conv.experience_fields()
        assert len(fields["response_ids"]) == len(fields["loss_mask"]) and 0 in fields["loss_mask"]
