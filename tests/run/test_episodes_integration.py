"""GRPO and PPO over multi-turn episodes (env.name) on a real local Ray cluster: configs/agent.yaml
shrunk, its env a ToolEnv with the real calculator whose turns follow each row's demonstration
(tests/run/scripted_envs.py), so every episode is two policy turns around a tool result."""

import json

import pytest
from fakes import TINY_ONE_WORKER as TINY

from rlsys.config import load_config

pytestmark = pytest.mark.integration

ENV = "tests/run/scripted_envs.py:ScriptedCalculatorEnv"


def small_data(tmp_path):
    """The first 16 training rows and 4 held-out rows of the agent-arithmetic data."""
    paths = {}
    for split, n in (("train", 16), ("eval", 4)):
        lines = open(f"configs/data/agent_arithmetic_{split}.jsonl").read().splitlines()[:n]
        paths[split] = tmp_path / f"{split}.jsonl"
        paths[split].write_text("\n".join(lines) + "\n")
    return paths


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_two_steps_over_multi_turn_episodes(ray_cluster, tmp_path, algorithm):
    from rlsys.run.controller import Controller

    data = small_data(tmp_path)
    overrides = [
        *[o for o in TINY if not o.startswith(("task.", "rollout.max_new_tokens"))],
        f"algorithm.name={algorithm}",
        "algorithm.group_size=2",
        f"task.train_path={data['train']}",
        f"task.eval_path={data['eval']}",
        "sft.batch_size=4",
        "rollout.max_new_tokens=6",
        "trainer.prompts_per_step=2",
        f"env.name={ENV}",
        "env.tools=[]",
        "env.call_penalty={}",
        f"run.output_dir={tmp_path}",
        f"run.name={algorithm}",
    ]
    cfg = load_config("configs/agent.yaml", overrides)
    controller = Controller(cfg, tmp_path / algorithm, progress=False)
    summary = controller.run()
    rows = [json.loads(line) for line in (tmp_path / algorithm / "metrics.jsonl").read_text().splitlines()]
    episodes = 2 * 2  # prompts_per_step x group_size
    assert [r["step"] for r in rows] == [1, 2] and summary["steps"] == 2
    for row in rows:
        assert row["samples"] == episodes
        assert row["episode/turns_mean"] == 2.0 and row["episode/correct"] == 1.0
        assert row["tools/ok"] == episodes and row["tools/well_formed_per_episode"] == 1.0
        assert row["reward/mean"] == pytest.approx(0.95) and row["accuracy/train"] == 1.0  # 0.95: the call costs 0.05
        assert "loss/policy" in row and all(v == v for v in row.values() if isinstance(v, float))  # no NaN
    assert ray_cluster.get(controller.workers[0].policy_version.remote()) == 2
    # held-out evaluation plays the episodes too (greedy), before RL and after the last step
    evals = [json.loads(line) for line in (tmp_path / algorithm / "evals.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert r["n"] == 4 and r["accuracy"] == 1.0 == r["episode/correct"] and r["reward"] == 1.0
        assert r["tools/well_formed_per_episode"] == 1.0 and r["tools/malformed_share"] == 0.0

    # one more rollout on the live actors: the tool result outside the loss, the rewards per turn
    table = controller.algorithm.rollout(controller.ctx, controller.stream.next(2))
    tok = controller.tokenizer
    for row in table.to_pylist():
        meta = json.loads(row["meta"])
        env_text = tok.decode([t for t, m in zip(row["response_ids"], row["loss_mask"]) if m == 0])
        assert f"<|im_start|>tool\n{meta['answer']}<|im_end|>" in env_text and meta["turns"] == 2
        nonzero = [r for r in row["token_rewards"] if r]
        assert nonzero == pytest.approx([-0.05, 1.0]) and row["reward"] == pytest.approx(0.95)
        assert len(row["ref_logprobs"]) == len(row["response_ids"])
        if algorithm == "ppo":
            assert len(row["values"]) == len(row["response_ids"])
