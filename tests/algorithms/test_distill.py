"""DA-KD (algorithms/distill.py): the BDL's limits and bounded gradients, the keep-ratio
schedule, stratified selection, the difficulty score, the plug-in's epoch plan and state on
real tiny models in-process, config errors, and configs/distill.yaml on a local Ray cluster."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from algorithms.distill import (
    DAKD,
    bdl,
    bdl_grad_bound,
    difficulty_scores,
    epoch_sizes,
    keep_ratio,
    schedule_steps,
    sequence_ce,
    stratified_subset,
    subset_size,
)
from rlsys.config import ConfigError, load_config

P, Q = torch.tensor([0.5, 0.5], dtype=torch.float64), torch.tensor([0.9, 0.1], dtype=torch.float64)


# ---- BDL ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "lam, expected",
    [
        (0.0, 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)),  # KL(p || q)
        (1.0, 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)),  # KL(q || p)
        (0.5, 0.0),  # P_m = Q_m
        (0.9, 0.86 * math.log(0.86 / 0.54) + 0.14 * math.log(0.14 / 0.46)),  # P_m = (.86,.14), Q_m = (.54,.46)
    ],
)
def test_bdl_matches_hand_derived_values(lam, expected):
    assert bdl(P.log(), Q.log(), lam).item() == pytest.approx(expected, abs=1e-12)


def test_bdl_is_nonnegative_and_zero_only_when_p_equals_q():
    g = torch.Generator().manual_seed(0)
    log_p = torch.log_softmax(torch.randn(64, 10, generator=g, dtype=torch.float64) * 3, -1)
    log_q = torch.log_softmax(torch.randn(64, 10, generator=g, dtype=torch.float64) * 3, -1)
    for lam in (0.0, 0.2, 0.9, 1.0):
        assert (bdl(log_p, log_q, lam) > 0).all()
        assert bdl(log_p, log_p, lam).abs().max() < 1e-12


@pytest.mark.parametrize("lam", [0.6, 0.9, 0.99])
def test_bdl_gradient_wrt_q_stays_within_the_bound_where_forward_kl_explodes(lam):
    p = torch.tensor([1 - 1e-12, 1e-12, 0.0], dtype=torch.float64).clamp(min=1e-300)
    q = torch.tensor([1e-30, 1 - 1e-30, 1e-300], dtype=torch.float64, requires_grad=True)
    bdl(p.log(), q.log(), lam).backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().max() <= bdl_grad_bound(lam) + 1e-9
    q_kl = q.detach().clone().requires_grad_(True)
    bdl(p.log(), q_kl.log(), 0.0).backward()  # forward KL: dL/dq_i = -p_i / q_i
    assert q_kl.grad.abs().max() > 1e20


def test_bdl_grad_bound_grows_towards_the_one_sided_kls():
    assert bdl_grad_bound(0.5) == pytest.approx(1.0)  # A = 1: 0.5 (0 + 1) + 0.5
    assert bdl_grad_bound(0.9) == pytest.approx(0.9 * (math.log(9) + 1) + 0.1 * 9)
    assert bdl_grad_bound(0.9) < bdl_grad_bound(0.99) < bdl_grad_bound(0.999) and bdl_grad_bound(1.0) == math.inf


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.9, 1.0])
def test_bdl_gradients_on_extreme_logits_are_finite_and_bounded(lam):
    student = torch.tensor([[1e4, -1e4, 0.0, 50.0], [-3e4, 2e4, 1e4, -1e4]], requires_grad=True)
    teacher = torch.tensor([[-1e4, 1e4, 0.0, -50.0], [3e4, -2e4, 0.0, 1e4]])
    loss = bdl(torch.log_softmax(teacher, -1), torch.log_softmax(student, -1), lam).sum()
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(student.grad).all()
    # dL/dz_j = q_j (g_j - sum_i q_i g_i): its l1 norm is at most 2 max|g| (the softmax Jacobian)
    assert student.grad.abs().sum(-1).max() <= 2 * min(bdl_grad_bound(lam), 1e30) + 1e-4


# ---- schedule and selection ---------------------------------------------------------------------
def test_keep_ratio_schedules():
    assert [keep_ratio(e, 4) for e in range(4)] == pytest.approx(
        [1.0, 0.5 * math.cos(math.pi / 4) + 0.5, 0.5, 0.5 * math.cos(3 * math.pi / 4) + 0.5]
    )
    assert [keep_ratio(e, 4, "linear") for e in range(4)] == pytest.approx([1.0, 0.75, 0.5, 0.25])
    assert keep_ratio(9, 4) == keep_ratio(3, 4)  # past the schedule: the last epoch's ratio
    assert [keep_ratio(e, 4, "full") for e in range(4)] == [1.0] * 4
    with pytest.raises(ValueError, match="cosine, linear"):
        keep_ratio(0, 4, "step")


def test_subset_sizes_follow_the_schedule():
    assert epoch_sizes(100, 4) == [100, 85, 50, 15]  # 85.36, 50, 14.64
    assert epoch_sizes(100, 4, "linear") == [100, 75, 50, 25]
    assert subset_size(10, 0.0) == 1 and subset_size(10, 0.25) == 3 and subset_size(10, 1.0) == 10
    assert schedule_steps(100, 4, 32) == 4 + 3 + 2 + 1


def test_stratified_subset_properties():
    rng = np.random.default_rng(0)
    scores = rng.permutation(200).astype(float)  # sample i has difficulty rank 199 - scores[i]
    for n_keep, tau in [(100, 0.1), (50, 0.0), (37, 0.3), (200, 0.1), (190, 0.5)]:
        chosen = stratified_subset(scores, n_keep, tau, np.random.default_rng(1))
        high = set(np.argsort(-scores)[:n_keep].tolist())
        n_low = min(200 - n_keep, int(math.floor(tau * n_keep + 0.5)))
        assert len(chosen) == len(set(chosen.tolist())) == n_keep
        assert sum(int(i) not in high for i in chosen) == n_low  # tau n_keep from D_low, all of it if smaller
    assert set(stratified_subset(scores, 30, 0.0, rng).tolist()) == set(np.argsort(-scores)[:30].tolist())
    a, b = (stratified_subset(scores, 60, 0.1, np.random.default_rng(s)) for s in (2, 3))
    assert set(a.tolist()) != set(b.tolist())  # D_low and D_high are sampled, not cut


def test_difficulty_score():
    assert sequence_ce([[math.log(0.5), math.log(0.5)], [math.log(0.25)]]) == pytest.approx([math.log(2), math.log(4)])
    assert difficulty_scores([2.0, 1.0], [1.0, 4.0]) == pytest.approx([2.0, 0.25])
    assert np.isfinite(difficulty_scores([1.0], [0.0])).all()


# ---- the plug-in on real tiny models, in-process -------------------------------------------------
class InProcessContext:
    """The RolloutContext DA-KD uses, served by real in-process workers (no Ray)."""

    def __init__(self, task, tokenizer, student_dir, teacher_dir):
        from actors.reference import ReferenceWorker

        self.task, self.tokenizer, self.policy_version = task, tokenizer, 0
        self.student, self.teacher = ReferenceWorker(str(student_dir)), ReferenceWorker(str(teacher_dir))
        self.rng = np.random.default_rng(0)

    def next_seed(self):
        return int(self.rng.integers(0, 2**31 - 1))

    def policy_logprobs(self, table):
        return self.student.logprobs(table)

    def teacher_logprobs(self, table):
        return self.teacher.logprobs(table)

    def teacher_top_logprobs(self, table, k=0):
        return self.teacher.top_logprobs(table, k)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from envs.arithmetic import ArithmeticTask
    from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("dakd")
    task = ArithmeticTask.create(root / "data", 50, 10, 0, 9, ["+"], 0)
    tok = train_tokenizer(task.corpus(), 64)
    spec = TinyModelSpec(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    dirs = [save_model_dir(build_tiny_model(spec, tok, seed=s), tok, root / f"m{s}") for s in (0, 1)]
    return task, tok, dirs


def test_epoch_plan_follows_the_schedule_and_state_resumes_it(tiny):
    task, tok, (student, teacher) = tiny
    algo = DAKD(DAKD.Config(epochs=3, tau=0.2))
    ctx = InProcessContext(task, tok, student, teacher)
    sizes, seen, epochs = epoch_sizes(50, 3), {}, []
    for _ in range(schedule_steps(50, 3, 16)):
        table = algo.rollout(ctx, [None] * 16)
        epochs.append(algo.epoch)
        seen.setdefault(algo.epoch, []).extend(json.loads(m)["sample"] for m in table.column("meta").to_pylist())
        if algo.epoch == 1 and algo.position == 16:
            saved = json.loads(json.dumps(algo.state()))
    assert [len(seen[e]) for e in range(3)] == sizes == [50, 38, 13]
    assert all(len(set(v)) == len(v) for v in seen.values())  # an epoch never repeats a sample
    assert sorted(seen[0]) == list(range(50)) and epochs == sorted(epochs)
    assert algo.epoch_metrics["distill/keep_ratio"] == pytest.approx(0.25)
    other = DAKD(DAKD.Config(epochs=3, tau=0.2))
    other.load_state(saved)
    table = other.rollout(ctx, [None] * 16)
    assert [json.loads(m)["sample"] for m in table.column("meta").to_pylist()] == seen[1][16:32]


def test_scores_prepare_and_loss_on_real_models(tiny):
    task, tok, (student, teacher) = tiny
    algo = DAKD()
    assert algo._scores(InProcessContext(task, tok, teacher, teacher)) == pytest.approx(np.ones(50))  # q = p
    dds = DAKD()._scores(InProcessContext(task, tok, student, teacher))
    assert dds.shape == (50,) and (dds > 0).all() and dds.std() > 0

    from actors.modeling import PolicyOnly
    from rlsys.contract import ModelOutputs
    from rlsys.models import load_model

    ctx = InProcessContext(task, tok, student, teacher)
    model = PolicyOnly(load_model(teacher))
    for top_k, lam in [(0, 0.5), (0, 0.9), (5, 0.9)]:
        algo = DAKD(DAKD.Config(top_k=top_k, bdl_lambda=lam))
        batch = algo.prepare(algo.rollout(ctx, [None] * 8))
        assert batch.extras["teacher_ids"].shape[-1] == (top_k or len(tok))
        logits, logprobs, _ = model(batch.input_ids, batch.attention_mask)
        loss, metrics = algo.loss(ModelOutputs(logits, logprobs), batch)
        assert loss.item() == pytest.approx(0.0, abs=1e-5)  # the teacher distilled into itself
    student_model = PolicyOnly(load_model(student))
    logits, logprobs, _ = student_model(batch.input_ids, batch.attention_mask)
    loss, metrics = algo.loss(ModelOutputs(logits, logprobs), batch)
    loss.backward()
    assert loss.item() > 1e-3 and set(metrics) == {"loss/bdl", "distill/ce_student"}
    assert all(torch.isfinite(p.grad).all() for p in student_model.parameters() if p.grad is not None)


# ---- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, words",
    [
        ("algorithm.bdl_lambda=1.5", ["algorithm.bdl_lambda", "1.5", "less than or equal to 1"]),
        ("algorithm.schedule=step", ["algorithm.schedule", "'step'", "cosine", "linear"]),
        ("algorithm.teacher.path=/no/such/dir", ["algorithm.teacher.path", "/no/such/dir", "model directory"]),
        ("algorithm.teacher.depth=3", ["algorithm.teacher.depth"]),
    ],
)
def test_bad_config_fails_in_one_line(override, words):
    from algorithms.base import build_algorithm

    with pytest.raises(ConfigError) as e:
        build_algorithm(load_config("configs/distill.yaml", [override]))
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_config_steps_run_exactly_its_epochs():
    cfg = load_config("configs/distill.yaml")
    a = cfg.algorithm.model_dump()
    assert cfg.trainer.steps == schedule_steps(
        cfg.task.num_train, a["epochs"], cfg.trainer.prompts_per_step, a["schedule"]
    )


# ---- end to end ---------------------------------------------------------------------------------
TINY = [
    "model.hidden_size=16",
    "model.intermediate_size=32",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "task.num_train=40",
    "task.num_eval=8",
    "task.max_value=9",
    "algorithm.teacher.hidden_size=32",
    "algorithm.teacher.intermediate_size=64",
    "algorithm.teacher.num_hidden_layers=1",
    "algorithm.teacher.sft_steps=20",
    "algorithm.epochs=3",
    "algorithm.top_k=8",
    "rollout.max_new_tokens=3",
    "trainer.prompts_per_step=16",
    "trainer.steps=4",
    "trainer.eval_every=0",
    "trainer.checkpoint_every=4",
]


@pytest.mark.integration
def test_distill_config_runs_on_a_local_cluster(ray_cluster, tmp_path):
    from rlsys.run.controller import Controller

    cfg = load_config("configs/distill.yaml", [*TINY, f"run.output_dir={tmp_path}"])
    summary = Controller(cfg, tmp_path / "distill", progress=False).run()
    rows = [json.loads(l) for l in (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 4 and (tmp_path / "distill" / "teacher" / "config.json").exists()
    assert [r["samples"] for r in rows] == [16, 16, 8, 16]  # epoch 0: all 40; epoch 1: 30 (r = 0.75)
    assert [r["distill/keep_ratio"] for r in rows] == [1.0, 1.0, 1.0, 0.75]
    assert "distill/dds_mean" in rows[3] and all(r["loss/bdl"] > 0 and math.isfinite(r["loss/bdl"]) for r in rows)
    state = json.loads((tmp_path / "distill" / "checkpoints" / "step_4" / "state.json").read_text())["algorithm"]
    assert state["epoch"] == 1 and state["position"] == 16 and len(state["order"]) == 30


def test_teacher_path_must_share_the_students_tokenizer(tiny, tmp_path):
    from algorithms.distill import TeacherConfig
    from rlsys.models import train_tokenizer

    task, tok, (_, teacher) = tiny
    algo = DAKD(DAKD.Config(teacher=TeacherConfig(path=str(teacher))))
    assert algo.teacher_dir(tmp_path, task, tok, 0) == teacher
    other = train_tokenizer(["completely different text for another vocabulary"] * 3, 300, split_digits=False)
    with pytest.raises(ConfigError, match=r"^config error: algorithm.teacher.path = .*tokenizer differs[^\n]*$"):
        algo.teacher_dir(tmp_path, task, other, 0)
