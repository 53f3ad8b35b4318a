"""Evaluators attached mid-run: spec validation, attach/detach on a live run on a real local
Ray cluster (the CLI reaching it through runs/<name>/cluster.json), and resume."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fakes import TINY_JOB

from rlsys.config import ConfigError, load_config
from rlsys.evaluators import load_spec, parse_spec
from rlsys.tracking import read_jsonl

TINY = [
    *TINY_JOB,
    "trainer.eval_every=0",
    "rollout.max_new_tokens=4",
    "trainer.checkpoint_every=4",
    "trainer.keep_checkpoints=2",
]


@pytest.mark.parametrize(
    "data, message",
    [
        ({}, "evaluator error: 'name' is required"),
        ({"name": "a b"}, "evaluator error: name = 'a b': String should match pattern"),
        ({"name": "heldout"}, "is the built-in evaluator's name"),
        ({"name": "x", "every": 0}, "evaluator error: every = 0: Input should be greater than or equal to 1"),
        ({"name": "x", "split": "test"}, "evaluator error: split = 'test': Input should be 'train' or 'eval'"),
        ({"name": "x", "metric": "bleu"}, "evaluator error: metric = 'bleu': must be 'accuracy' or an import path"),
        ({"name": "x", "metric": "no_such_mod:f"}, "evaluator error: metric = 'no_such_mod:f': cannot import"),
        ({"name": "x", "metric": "rlsys.evaluators:nope"}, "cannot import (AttributeError"),
        ({"name": "x", "dataset": "/no/such.jsonl"}, "evaluator error: dataset = '/no/such.jsonl': no such file"),
        ({"name": "x", "temperature": -1}, "evaluator error: temperature = -1"),
        ({"name": "x", "samples": 3}, "evaluator error: unknown key 'samples'"),
    ],
)
def test_bad_specs_fail_in_one_line(data, message):
    with pytest.raises(ConfigError) as e:
        parse_spec(data)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_spec_from_yaml_and_flags(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("name: acc\nmetric: rlsys.evaluators:first_char_match\nevery: 3\nn: 2\n")
    spec = load_spec(str(path), {"every": 5, "temperature": None})
    assert (spec.name, spec.every, spec.n, spec.metric_key) == ("acc", 5, 2, "first_char_match")
    path.write_text("- name\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_spec(str(path))
    p = subprocess.run(
        [sys.executable, "-m", "rlsys.run.cli", "eval", "attach", str(tmp_path), "--name", "x", "--n", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        p.returncode == 2 and p.stderr.strip() == "evaluator error: n = 0: Input should be greater than or equal to 1"
    )
    p = subprocess.run(
        [sys.executable, "-m", "rlsys.run.cli", "eval", "list", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stderr.strip().endswith("has no cluster.json (has the run started?)"), p.stderr


def cli(*args):
    """The real CLI in a fresh process that knows the cluster only from cluster.json."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    p = subprocess.run(
        [sys.executable, "-m", "rlsys.run.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def rows_of(run_dir: Path, name: str) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "evals.jsonl") if r["evaluator"] == name]


def wait_for(condition, what: str, timeout: float = 120.0):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def run_in_thread(cfg, run_dir, resume=False):
    from rlsys.run.controller import Controller

    controller = Controller(cfg, run_dir, progress=False)
    box = {}

    def target():
        try:
            box["summary"] = controller.run(resume=resume)
        except BaseException as e:  # surfaced by the test after join
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return controller, thread, box


@pytest.mark.integration
def test_attach_detach_and_resume_on_a_live_run(ray_cluster, tmp_path):
    from rlsys import evaluators

    run_dir = tmp_path / "evals_run"
    cfg = load_config(
        "configs/quickstart.yaml", [*TINY, f"run.output_dir={tmp_path}", "run.name=evals_run", "trainer.steps=8"]
    )
    controller, thread, box = run_in_thread(cfg, run_dir)
    wait_for(lambda: (run_dir / "cluster.json").exists() or "error" in box, "cluster.json")
    info = json.loads((run_dir / "cluster.json").read_text())
    assert info["address"].startswith("127.0.0.1:") and info["auth_mode"] == "token"
    # attached during the warm-up: a by the CLI, b in-process (the functions the CLI calls)
    assert "attached evaluator a" in cli("eval", "attach", str(run_dir), "--name", "a", "--limit", "8")
    spec_b = {"name": "b", "every": 2, "n": 2, "temperature": 1.0, "metric": "rlsys.evaluators:first_char_match"}
    evaluators.attach(str(run_dir), parse_spec(spec_b))
    wait_for(lambda: len(rows_of(run_dir, "a")) >= 2 or "error" in box, "two rows of evaluator a")
    assert evaluators.detach(str(run_dir), "a") and not evaluators.detach(str(run_dir), "a")
    detached_after = read_jsonl(run_dir / "metrics.jsonl")[-1]["step"]
    assert [s["name"] for s in evaluators.list_specs(str(run_dir))] == ["b"]
    thread.join(timeout=300)
    assert "error" not in box, box.get("error")
    assert detached_after + 1 < 8, "the run ended before the detach could be seen; lengthen it"

    a, b = rows_of(run_dir, "a"), rows_of(run_dir, "b")
    a_steps = [r["step"] for r in a]
    # every step from the first boundary after the attach until the detach (none skipped here: a
    # checkpoint every 4 steps drains the evaluations in flight, and up to 4 may be in flight)
    assert a_steps == list(range(a_steps[0], a_steps[-1] + 1)) and len(a) >= 2 and a_steps[-1] <= detached_after + 1
    assert all(r["policy_version"] == r["step"] and r["n"] == 8 and 0 <= r["accuracy"] <= 1 for r in a)
    assert [r["step"] for r in b] == [2, 4, 6, 8] and all(r["policy_version"] == r["step"] for r in b)
    assert all("first_char_match" in r and "pass@2" in r and r["n"] == 16 for r in b)
    # the loop hands evaluations off without waiting for them: once step 1 has started the evaluators'
    # actors, the hand-offs together take a fraction of the steps they sit between
    later = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > 1]
    assert sum(r["time/eval_handoff"] for r in later) < 0.5 * sum(r["time/step"] for r in later)
    state = json.loads((run_dir / "checkpoints" / "step_8" / "state.json").read_text())
    assert [s["name"] for s in state["evaluators"]] == ["b"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert {"eval/a/accuracy", "eval/b/first_char_match", "eval/b/pass@2"} <= set(acc.Tags()["scalars"])
    del controller

    # resume with more steps: b (in the checkpoint) continues on the new policy versions, a stays gone
    cfg = load_config(run_dir / "config.yaml", ["trainer.steps=10"])
    controller, thread, box = run_in_thread(cfg, run_dir, resume=True)
    thread.join(timeout=300)
    assert "error" not in box, box.get("error")
    assert [(r["step"], r["policy_version"]) for r in rows_of(run_dir, "b")] == [(s, s) for s in (2, 4, 6, 8, 10)]
    assert [r["step"] for r in rows_of(run_dir, "a")] == a_steps


@pytest.mark.integration
def test_a_registry_left_by_this_process_is_replaced_one_of_another_live_run_refused(ray_cluster):
    from rlsys.evaluators import AttachedEvaluators

    left = AttachedEvaluators("twice")  # never closed, as after a run that raised
    ray_cluster.get(left.registry.attach.remote({"name": "x", "every": 1}))
    fresh = AttachedEvaluators("twice")
    assert ray_cluster.get(fresh.registry.list.remote()) == []
    other = ray_cluster.remote(lambda: AttachedEvaluators("twice") and None).remote()  # another process
    with pytest.raises(Exception, match="a run named twice is already live on this cluster"):
        ray_cluster.get(other)
    fresh.close()


def test_pass_at_k_on_the_code_env(tmp_path):
    """An evaluator with metric accuracy on the code task scores each sample on the private
    tests in the real bwrap sandbox; n > 1 gives pass@n. A tiny policy that memorised two
    short HumanEval solutions passes them greedily; a random-init one passes none."""
    import itertools

    from conftest import sandbox_skip_reason

    why = sandbox_skip_reason("bwrap")
    if why:
        pytest.skip(why)
    import torch

    from algorithms.sft import warmup
    from envs.code import CodeTask
    from rlsys.evaluators import EvaluatorWorker
    from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer
    from sandbox.types import Limits

    torch.set_num_threads(1)
    rows = Path("configs/data/humaneval_short.jsonl").read_text().splitlines()
    data = tmp_path / "two.jsonl"
    data.write_text("\n".join(itertools.islice(rows, 2)) + "\n")  # HumanEval/23 strlen, /53 add
    task = CodeTask(data, data)
    task.use_sandbox("bwrap", Limits(wall_time_s=10))
    tok = train_tokenizer(task.corpus(), 256)
    spec = TinyModelSpec(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=256,
    )
    random_dir = save_model_dir(build_tiny_model(spec, tok, seed=0), tok, tmp_path / "random")
    model = build_tiny_model(spec, tok, seed=0)
    warmup(model, tok, task, task.rows("train"), steps=120, batch_size=2, lr=1e-2, seed=0)
    trained_dir = save_model_dir(model, tok, tmp_path / "trained")

    def evaluate(policy_dir, **spec):
        worker = EvaluatorWorker(str(policy_dir), {"name": "code", **spec}, task, max_new_tokens=24)
        return worker.evaluate(0, None)["metrics"]

    greedy = evaluate(trained_dir)
    assert greedy == {"accuracy": 1.0, "n": 2.0}
    sampled = evaluate(trained_dir, n=4, temperature=1.0)
    assert sampled["pass@4"] >= sampled["accuracy"] and sampled["pass@4"] > 0
    assert evaluate(random_dir, n=4, temperature=1.0) == {"accuracy": 0.0, "n": 2.0, "pass@4": 0.0}
