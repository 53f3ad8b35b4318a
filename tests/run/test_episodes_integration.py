"""GRPO and PPO over multi-turn episodes (env.name) on a real local Ray cluster: configs/agent.yaml
shrunk, its env a ToolEnv with the real calculator whose turns follow each row's demonstration
(tests/run/scripted_envs.py), so every episode is two policy turns around a tool result."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest
import ray
from fakes import TINY_ONE_WORKER as TINY

from rlsys.config import load_config
from rlsys.tracking import read_jsonl

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


def small_job(tmp_path, data, env: str) -> list[str]:
    """configs/agent.yaml's overrides for a tiny job of 2 prompts x 2 episodes a step on `data`."""
    return [
        *[o for o in TINY if not o.startswith(("task.", "rollout.max_new_tokens"))],
        "algorithm.group_size=2",
        f"task.train_path={data['train']}",
        f"task.eval_path={data['eval']}",
        "sft.batch_size=4",
        "rollout.max_new_tokens=6",
        "trainer.prompts_per_step=2",
        f"env.name={env}",
        "env.tools=[]",
        "env.call_penalty={}",
        f"run.output_dir={tmp_path}",
    ]


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_two_steps_over_multi_turn_episodes(ray_cluster, tmp_path, algorithm):
    from rlsys.run.controller import Controller

    overrides = [
        *small_job(tmp_path, small_data(tmp_path), ENV),
        f"algorithm.name={algorithm}",
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

    if algorithm == "grpo":  # an evaluator attached to the run plays its episodes in its own actor
        from rlsys.evaluators import AttachedEvaluators, parse_spec

        attached = AttachedEvaluators("episodes-evals")
        spec = parse_spec({"name": "agent", "split": "eval"}).model_dump()  # what `rlsys eval attach` registers
        run_reward = controller.reward if controller.reward_has_scorer else None
        attached.start(controller.policy_dir, controller.task, 6, [spec], controller.evaluator_episodes(), run_reward)
        try:
            attached.poll(2, 2, lambda: controller.learners[0].weights.remote())  # the trained policy's
            ((step, name, metrics, version),) = attached.drain(timeout=300)
        finally:
            attached.close()
        assert (step, name, version) == (2, "agent", 2) and metrics["n"] == 4
        assert metrics["accuracy"] == 1.0 == metrics["reward"] and metrics["episode/turns_mean"] == 2.0
        assert metrics["tools/ok"] == 4

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


def test_a_lockstep_multi_turn_run_twice_is_bit_identical(ray_cluster, tmp_path):
    """env.lockstep with env steps of random length: the same config and seed twice end with the
    same weights and the same metrics, evaluation and sample rows (timings aside)."""
    from rlsys.run.controller import Controller

    data, runs = small_data(tmp_path), []
    for name in ("first", "second"):
        overrides = [
            *small_job(tmp_path, data, "tests/run/scripted_envs.py:JitteryCalculatorEnv"),
            "env.lockstep=true",
            f"run.name={name}",
        ]
        controller = Controller(load_config("configs/agent.yaml", overrides), tmp_path / name, progress=False)
        controller.run()
        weights = ray.get(controller.learners[0].weights.remote())
        controller.shutdown()
        logs = [read_jsonl(tmp_path / name / f) for f in ("metrics.jsonl", "evals.jsonl", "samples.jsonl")]
        logs[0] = [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in logs[0]]
        runs.append((weights, logs))
    (first, first_logs), (second, second_logs) = runs
    assert max(float(np.abs(first[k] - second[k]).max()) for k in first) == 0.0
    assert first_logs == second_logs and len(first_logs[0]) == 2


def test_a_run_killed_while_a_steps_episodes_are_in_flight_plays_that_step_again_on_resume(tmp_path):
    """docs/agents.md's rule: checkpoints fall between steps and no env state is saved, so a run
    SIGKILLed inside step 3's episodes resumes from step 2's checkpoint and plays step 3's episodes
    again from the start: the resumed run's episodes are those of steps 3-4 of the same run left
    uninterrupted, on the same training rows, none lost or doubled."""
    data = small_data(tmp_path)
    train = {json.loads(line)["expression"] for line in data["train"].read_text().splitlines()}
    env = "tests/run/scripted_envs.py:LoggedSlowCalculatorEnv"
    overrides = [
        *small_job(tmp_path, data, env),
        "trainer.steps=4",
        "trainer.checkpoint_every=2",
        "trainer.eval_every=0",
    ]

    started = []

    def rlsys(name: str, *args):  # output to files (a pipe nobody reads could fill and stall the run)
        env = {**os.environ, "RLSYS_EPISODE_LOG": str(tmp_path / f"{name}.log")}
        with open(tmp_path / f"{name}.out", "w") as out:
            started.append(
                subprocess.Popen(
                    [sys.executable, "-m", "rlsys.run.cli", *args, "--no-progress"],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        return started[-1]

    def output(name: str) -> str:
        return (tmp_path / f"{name}.out").read_text()[-2000:]

    def played(name: str) -> list[str]:  # the training episodes' rows, in the order they started
        path = tmp_path / f"{name}.log"
        return [e for e in path.read_text().splitlines() if e in train] if path.exists() else []

    try:
        full = rlsys("full", "run", "configs/agent.yaml", *overrides, "run.name=full")
        killed = rlsys("killed", "run", "configs/agent.yaml", *overrides, "run.name=killed")
        deadline = time.time() + 300
        while len(played("killed")) <= 8:  # steps 1-2: 2 prompts x 2 episodes each; then step 3 starts
            assert killed.poll() is None, output("killed")
            assert time.time() < deadline, "step 3 did not start within 5 minutes"
            time.sleep(0.01)
        os.killpg(killed.pid, signal.SIGKILL)  # each env step takes 0.2 s: step 3's episodes are in flight
        killed.wait()
        assert (tmp_path / "killed" / "checkpoints" / "latest").read_text() == "step_2"
        assert len((tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()) == 2  # step 3 unfinished
        assert full.wait(timeout=300) == 0, output("full")
        interrupted = played("killed")[8:]

        resumed = rlsys("resumed", "resume", str(tmp_path / "killed"))
        assert resumed.wait(timeout=300) == 0, output("resumed")
        assert "resumed killed from step_2" in (tmp_path / "resumed.out").read_text()
    finally:
        for p in started:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    everything = played("full")
    assert len(everything) == 16 and Counter(played("killed")[:8]) == Counter(everything[:8])
    assert Counter(played("resumed")) == Counter(everything[8:])  # steps 3 and 4, played whole
    assert not Counter(interrupted) - Counter(everything[8:12])  # what was in flight was step 3's
    rows = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["samples"] == 4 for r in rows)
