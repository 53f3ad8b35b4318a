"""The supervised warm-up and its flawed demonstrations (sft.demo_error)."""

import pytest
import torch

from algorithms.sft import warmup
from envs.arithmetic import ArithmeticTask, carry_dropped_answer
from rlsys.config import ConfigError, load_config


@pytest.mark.parametrize(
    "prompt, flawed",
    [
        ("37+58=", "85"),
        ("5+7=", "2"),
        ("49+49=", "88"),
        ("10+3=", "13"),
        ("105+7=", "102"),
        ("3*4=", None),
        ("9-5=", None),
    ],
)
def test_carry_dropped_answer(prompt, flawed):
    assert carry_dropped_answer(prompt) == flawed


class CountingTask:
    """An arithmetic task that counts the flawed demonstrations the warm-up asks for."""

    def __init__(self, task):
        self.task, self.flawed = task, 0

    def prompt_text(self, row):
        return self.task.prompt_text(row)

    def flawed_demonstration(self, row):
        self.flawed += 1
        return self.task.flawed_demonstration(row)


@pytest.mark.parametrize("demo_error, low, high", [(0.0, 0, 0), (0.5, 60, 100), (1.0, 160, 160)])
def test_warmup_draws_flawed_demonstrations_at_the_configured_rate(tmp_path, one_torch_thread, demo_error, low, high):
    from rlsys.models import TinyModelSpec, build_tiny_model, train_tokenizer

    task = ArithmeticTask.create(tmp_path, 100, 10, 0, 49, ["+"], 0)
    tok = train_tokenizer(task.corpus(), 64)
    model = build_tiny_model(
        TinyModelSpec(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
        ),
        tok,
        seed=0,
    )
    counting = CountingTask(task)
    losses = warmup(
        model, tok, counting, task.rows("train"), steps=20, batch_size=8, lr=1e-3, seed=0, demo_error=demo_error
    )
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))
    assert low <= counting.flawed <= high  # 160 draws


def test_flawed_demonstration_keeps_the_row_but_the_answer(tmp_path):
    task = ArithmeticTask.create(tmp_path, 50, 5, 0, 49, ["+"], 0)
    row = {"prompt": "37+58=", "answer": "95"}
    assert task.flawed_demonstration(row) == {"prompt": "37+58=", "answer": "85"} and row["answer"] == "95"
    assert task.flawed_demonstration({"prompt": "3*4=", "answer": "12"})["answer"] == "12"


def test_demo_error_is_validated():
    assert load_config("configs/quickstart.yaml", ["sft.demo_error=0"]).sft.demo_error == 0
    with pytest.raises(ConfigError, match="sft.demo_error"):
        load_config("configs/quickstart.yaml", ["sft.demo_error=1.5"])
