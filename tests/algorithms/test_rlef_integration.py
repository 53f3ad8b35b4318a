"""Two RLEF steps on HumanEval on a real local Ray cluster with the real bwrap SandboxPool."""

import json

import pytest
from conftest import sandbox_skip_reason

from rlsys.config import load_config

pytestmark = pytest.mark.integration

TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "task.name=humaneval",
    "task.train_path=null",
    "task.eval_path=null",  # HumanEval from the wheel
    "task.num_train=4",
    "task.num_eval=2",
    "sft.steps=3",
    "sft.batch_size=4",
    "trainer.prompts_per_step=2",
    "trainer.steps=2",
    "trainer.eval_every=0",
    "rollout.max_new_tokens=12",
    "rollout.num_workers=1",
    "algorithm.samples_per_prompt=2",
    "algorithm.feedback_chars=200",
]


def test_two_rlef_steps_with_the_sandbox_pool(ray_cluster, tmp_path):
    why = sandbox_skip_reason("bwrap")
    if why:
        pytest.skip(why)
    from rlsys.run.controller import Controller
    from sandbox.pool import SandboxPool

    cfg = load_config("configs/rlef.yaml", [*TINY, f"run.output_dir={tmp_path}", "run.name=rlef"])
    controller = Controller(cfg, tmp_path / "rlef", progress=False)
    summary = controller.run()
    rows = [json.loads(l) for l in (tmp_path / "rlef" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and summary["steps"] == 2
    for row in rows:
        assert row["samples"] == 2 * 2
        for key in (
            "time/sandbox",
            "loss/policy",
            "loss/value",
            "is_weight_mean",
            "rlef/private_pass",
            "rlef/turns_mean",
            "rlef/turns_3",
        ):
            assert key in row, key
        assert 1 <= row["rlef/turns_mean"] <= 3
        assert all(v == v for v in row.values() if isinstance(v, float))  # no NaN
    assert ray_cluster.get(controller.workers[0].policy_version.remote()) == 2
    # held-out evaluation plays multi-turn episodes (1@3), before RL and after the last step
    evals = [json.loads(l) for l in (tmp_path / "rlef" / "evals.jsonl").read_text().splitlines()]
    assert [(r["step"], r["evaluator"]) for r in evals] == [(0, "heldout"), (2, "heldout")]
    for r in evals:
        assert r["n"] == 2 and 1 <= r["turns_mean"] <= 3 and 0 <= r["accuracy"] <= 1 and "public_pass" in r

    # an evaluator attached to the run plays RLEF's code dialogs in its own actor, with its own pool
    from rlsys.evaluators import AttachedEvaluators, parse_spec

    attached = AttachedEvaluators("rlef-evals")
    spec = parse_spec({"name": "dialogs", "split": "eval"}).model_dump()  # what `rlsys eval attach` registers
    attached.start(controller.policy_dir, controller.task, 8, [spec], controller.evaluator_episodes())
    try:
        attached.poll(2, 2, lambda: controller.learners[0].weights.remote())
        ((step, name, metrics, version),) = attached.drain(timeout=300)
    finally:
        attached.close()
    assert (step, name, version, metrics["n"]) == (2, "dialogs", 2, 2)
    assert 0 <= metrics["accuracy"] <= 1 and 1 <= metrics["episode/turns_mean"] <= 3
    assert metrics["episode/stop_done"] == 1.0  # every dialog ended by the env: a public pass or its last answer

    # One more rollout on the live actors (the run closed its pool): feedback tokens carry
    # loss_mask 0 and decode to the env's feedback turns; answer tokens carry 1.
    controller.ctx.sandbox = SandboxPool("bwrap", workers=2)
    try:
        table = controller.algorithm.rollout(controller.ctx, controller.stream.next(2))
    finally:
        controller.ctx.sandbox.close()
    tok = controller.tokenizer
    for ids, mask, meta in zip(
        table.column("response_ids").to_pylist(),
        table.column("loss_mask").to_pylist(),
        table.column("meta").to_pylist(),
    ):
        meta = json.loads(meta)
        assert len(meta["answer_lengths"]) == len(meta["feedback_lengths"]) + 1 <= 3
        assert sum(mask) == sum(meta["answer_lengths"]) and len(mask) == len(ids)
        env_text = tok.decode([t for t, m in zip(ids, mask) if m == 0])
        assert env_text.count("# Feedback:") == len(meta["feedback_lengths"])
        assert (meta["private_passed"] is True) == (meta["turn_rewards"][-1] >= 0)
