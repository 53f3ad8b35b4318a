"""On-policy distillation (algorithms/opd.py) against hand-computed values: the per-token advantage
(teacher minus sampler logprob, the task reward on the last token, the discounted return), the
importance-sampling and PPO losses and their gradients, the mask, the reverse KL as the loss's
expectation, no signal when the student is the teacher (on real tiny models too), config errors,
registration and capabilities."""

from __future__ import annotations

import math

import pytest
import torch

from algorithms.base import get_algorithm
from algorithms.opd import (
    OPD,
    OPDConfig,
    discounted_advantages,
    importance_sampling_loss,
    opd_token_rewards,
    teacher_metrics,
)
from rlsys.batch import TrainBatch
from rlsys.config import ConfigError, load_config
from rlsys.contract import (
    HasTeacher,
    ModelOutputs,
    ReportsPrepareMetrics,
    SkipsRowsWithoutGradient,
    Stateful,
    TrainsOnStaleRows,
)
from rlsys.experience import make_experience

pytestmark = pytest.mark.usefixtures("one_torch_thread")

F64 = torch.float64
# 3 responses in collate's layout (T = 4 targets): prompts of 2, 3, 1 tokens and responses of 2, 2, 3
MASK = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 0]], dtype=F64)
# sampler (pi_old) and teacher logprobs; the 9s and -9s sit on prompt/padding positions and must not count
OLD = torch.tensor([[9.0, -1.0, -2.0, 9.0], [9.0, 9.0, -0.5, -1.0], [-1.0, -2.0, -1.0, 9.0]], dtype=F64)
TEACHER = torch.tensor([[-9.0, -0.5, -3.0, -9.0], [-9.0, -9.0, -0.5, -2.0], [-2.0, -1.0, -1.0, -9.0]], dtype=F64)
REWARDS = torch.tensor([1.0, 0.0, 2.0], dtype=F64)
# r_t = teacher - old on the response tokens
R = torch.tensor([[0.0, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, -1.0], [-1.0, 1.0, 0.0, 0.0]], dtype=F64)
# pi_theta / pi_old on the response tokens (1 elsewhere)
RATIO = torch.tensor([[1.0, 2.0, 0.5, 1.0], [1.0, 1.0, 1.0, 3.0], [1.5, 1.0, 0.25, 1.0]], dtype=F64)
N = 7  # response tokens


def batch(advantages=R) -> TrainBatch:
    return TrainBatch(
        input_ids=torch.zeros(3, 5, dtype=torch.long),
        attention_mask=torch.ones(3, 5),
        response_mask=MASK,
        old_logprobs=OLD,
        advantages=advantages,
    )


def logprobs_of(b: TrainBatch) -> torch.Tensor:
    return (b.old_logprobs + torch.log(RATIO)).clone().requires_grad_()


# ---- advantages ---------------------------------------------------------------------------------
def test_token_reward_is_teacher_minus_sampler_on_response_tokens_only():
    r = opd_token_rewards(TEACHER, OLD, MASK, REWARDS, 0.0)
    assert torch.equal(r, R)


def test_task_reward_is_added_on_each_rows_last_token():
    r = opd_token_rewards(TEACHER, OLD, MASK, REWARDS, 0.5)
    expected = R.clone()
    expected[0, 2] += 0.5 * 1.0  # row 0 ends at target 2
    expected[1, 3] += 0.5 * 0.0
    expected[2, 2] += 0.5 * 2.0
    assert torch.equal(r, expected)
    assert r.tolist() == [[0.0, 0.5, -0.5, 0.0], [0.0, 0.0, 0.0, -1.0], [-1.0, 1.0, 1.0, 0.0]]


def test_advantage_is_the_token_reward_at_discount_zero_and_the_return_otherwise():
    assert torch.equal(discounted_advantages(R, MASK, 0.0), R)
    # discount 0.5: A_t = r_t + 0.5 A_{t+1} within each row
    #   row 0: A_2 = -1, A_1 = 0.5 + 0.5 (-1) = 0
    #   row 1: A_3 = -1, A_2 = 0 + 0.5 (-1) = -0.5
    #   row 2: A_2 = 0, A_1 = 1, A_0 = -1 + 0.5 * 1 = -0.5
    expected = [[0.0, 0.0, -1.0, 0.0], [0.0, 0.0, -0.5, -1.0], [-0.5, 1.0, 0.0, 0.0]]
    assert discounted_advantages(R, MASK, 0.5).tolist() == expected
    # discount 1: each token gets the sum of the rest of its row
    assert discounted_advantages(R, MASK, 1.0).tolist() == [[0, -0.5, -1, 0], [0, 0, -1, -1], [0, 1, 0, 0]]


def test_a_masked_out_token_inside_a_response_is_stepped_over():
    """An environment token (mask 0) between two response tokens: its reward is not summed and
    it gets no advantage; the return skips it."""
    r = torch.tensor([[1.0, 5.0, 2.0]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0, 1.0]], dtype=F64)
    assert discounted_advantages(r, mask, 0.5).tolist() == [[1.0 + 0.5 * 2.0, 0.0, 2.0]]
    assert discounted_advantages(r, mask, 0.0).tolist() == [[1.0, 0.0, 2.0]]


def test_student_equal_to_teacher_gives_zero_advantages_and_no_gradient():
    for discount in (0.0, 0.5, 1.0):
        adv = discounted_advantages(opd_token_rewards(OLD, OLD, MASK, REWARDS, 0.0), MASK, discount)
        assert torch.equal(adv, torch.zeros_like(adv))
        b = batch(advantages=adv)
        for loss_name in ("importance_sampling", "ppo"):
            logprobs = logprobs_of(b)
            loss, _ = OPD(OPDConfig(loss=loss_name)).loss(ModelOutputs(None, logprobs), b)
            loss.backward()
            assert loss.item() == 0.0 and torch.equal(logprobs.grad, torch.zeros_like(logprobs))


# ---- loss and gradient --------------------------------------------------------------------------
# sum_{i,t} ratio * A on the response tokens:
#   row 0: 2 * 0.5 + 0.5 * (-1) = 0.5;  row 1: 1 * 0 + 3 * (-1) = -3;  row 2: 1.5 * (-1) + 1 * 1 + 0.25 * 0 = -0.5
IS_LOSS = -(0.5 - 3.0 - 0.5) / N  # 3/7
# PPO, clip 0.2: min(r A, clip(r) A): row 0: min(1, 0.6) + min(-0.5, -0.8); row 1: 0 + min(-3, -1.2);
# row 2: min(-1.5, -1.2) + 1 + 0 -> 0.6 - 0.8 - 3 - 1.5 + 1 = -3.7
PPO_LOSS = 3.7 / N


def test_importance_sampling_loss_and_gradient():
    b = batch()
    logprobs = logprobs_of(b)
    loss, approx_kl = importance_sampling_loss(logprobs, b.old_logprobs, b.advantages, MASK)
    assert loss.item() == pytest.approx(IS_LOSS, rel=1e-12)
    logs = [math.log(2.0), math.log(0.5), 0.0, math.log(3.0), math.log(1.5), 0.0, math.log(0.25)]
    assert approx_kl.item() == pytest.approx(sum(0.5 * x * x for x in logs) / N, rel=1e-12)
    loss.backward()
    # d loss / d log pi_theta = -ratio * A / N on response tokens, 0 on prompt and padding
    expected = -RATIO * R * MASK / N
    assert torch.allclose(logprobs.grad, expected, atol=1e-15)
    assert torch.allclose(
        logprobs.grad, torch.tensor([[0, -1, 0.5, 0], [0, 0, 0, 3], [1.5, -1, 0, 0]], dtype=F64) / N, atol=1e-15
    )
    # the plug-in's loss is this one by default
    loss, metrics = OPD().loss(ModelOutputs(None, logprobs_of(b)), b)
    assert loss.item() == pytest.approx(IS_LOSS, rel=1e-12)
    assert set(metrics) == {"loss/policy", "approx_kl_old"}


def test_gradient_pushes_up_the_tokens_the_teacher_prefers():
    """A gradient-descent step raises log pi of a token whose teacher logprob is above the
    sampler's (A > 0) and lowers it where the teacher's is below (A < 0)."""
    b = batch()
    logprobs = logprobs_of(b)
    OPD().loss(ModelOutputs(None, logprobs), b)[0].backward()
    step = -logprobs.grad  # the descent direction
    teacher_prefers, teacher_rejects = (TEACHER > OLD) & (MASK > 0), (TEACHER < OLD) & (MASK > 0)
    assert teacher_prefers.sum() == 2 and teacher_rejects.sum() == 3
    assert (step[teacher_prefers] > 0).all() and (step[teacher_rejects] < 0).all()


def test_ppo_loss_and_gradient_drop_clipped_tokens():
    b = batch()
    logprobs = logprobs_of(b)
    loss, metrics = OPD(OPDConfig(loss="ppo")).loss(ModelOutputs(None, logprobs), b)
    assert loss.item() == pytest.approx(PPO_LOSS, rel=1e-12)
    assert metrics["clip_frac"] == pytest.approx(5 / N)  # ratios 2, 0.5, 3, 1.5, 0.25 are outside [0.8, 1.2]
    loss.backward()
    # row 0's two tokens are clipped on the side A pushes them (min picks the constant): no gradient
    assert torch.allclose(
        logprobs.grad, torch.tensor([[0, 0, 0, 0], [0, 0, 0, 3], [1.5, -1, 0, 0]], dtype=F64) / N, atol=1e-15
    )


def test_expected_loss_and_gradient_are_the_reverse_kl_and_its_gradient():
    """Over the exact distribution of a sampled token (every token y of a 5-token vocabulary,
    weighted by pi_old(y): a mask of probabilities makes the masked mean an expectation), at
    theta = old the loss is KL(pi || teacher) and its gradient in the logits is grad KL."""
    z = torch.tensor([0.3, -1.2, 2.0, 0.0, 0.7], dtype=F64, requires_grad=True)
    log_q = torch.log_softmax(torch.tensor([1.0, 0.5, -0.5, 2.0, 0.0], dtype=F64), -1)
    logprobs = torch.log_softmax(z, -1)
    old = logprobs.detach()
    weights = old.exp()[None]  # pi_old(y)
    adv = opd_token_rewards(log_q[None], old[None], torch.ones_like(weights), torch.zeros(1, dtype=F64), 0.0)
    loss, _ = importance_sampling_loss(logprobs[None], old[None], adv, weights)
    (grad,) = torch.autograd.grad(loss, z)

    z_kl = z.detach().clone().requires_grad_()
    log_p = torch.log_softmax(z_kl, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum()
    kl.backward()
    assert loss.item() == pytest.approx(kl.item(), rel=1e-12)
    assert torch.allclose(grad, z_kl.grad, atol=1e-12)


# ---- prepare and metrics on Experience rows -----------------------------------------------------
def table():
    rows = [  # the batch above as rows: prompt ids, sampler and teacher logprobs of each response token
        ([5, 6], [10, 11], [-1.0, -2.0], [-0.5, -3.0], 1.0),
        ([5, 6, 7], [12, 13], [-0.5, -1.0], [-0.5, -2.0], 0.0),
        ([5], [10, 11, 12], [-1.0, -2.0, -1.0], [-2.0, -1.0, -1.0], 2.0),
    ]
    import pyarrow as pa

    t = make_experience(
        [
            dict(uid=f"u{i}", group=f"g{i}", prompt_ids=p, response_ids=r, logprobs=lp, reward=rw, policy_version=0)
            for i, (p, r, lp, _, rw) in enumerate(rows)
        ]
    )
    return t.append_column("teacher_logprobs", pa.array([row[3] for row in rows], type=pa.list_(pa.float32())))


def test_prepare_puts_the_advantages_on_the_response_tokens():
    b = OPD().prepare(table())
    assert torch.equal(b.response_mask.double(), MASK)
    assert b.advantages.double().tolist() == R.tolist()
    assert b.token_rewards.double().tolist() == R.tolist()
    b = OPD(OPDConfig(reward_coef=0.5, discount=0.5)).prepare(table())
    # r with the task reward (test above), then A_t = r_t + 0.5 A_{t+1}:
    #   row 0: A_2 = -0.5, A_1 = 0.5 - 0.25;  row 1: A_3 = -1, A_2 = -0.5;  row 2: A_2 = 1, A_1 = 1.5, A_0 = -1 + 0.75
    assert b.advantages.double().tolist() == [[0.0, 0.25, -0.5, 0.0], [0.0, 0.0, -0.5, -1.0], [-0.25, 1.5, 1.0, 0.0]]


def test_prepare_metrics_report_the_sampled_reverse_kl():
    metrics = OPD().prepare_metrics(table())
    # mean(old - teacher) over the 7 tokens: -(sum of R) / 7 = 1.5 / 7; teacher: -10 / 7
    assert metrics == {"opd/reverse_kl": pytest.approx(1.5 / N), "opd/teacher_logprob": pytest.approx(-10 / N)}
    assert teacher_metrics([[-1.0, -2.0]], [[-1.0, -5.0]], [[1, 0]]) == {
        "opd/reverse_kl": 0.0,  # the environment token (loss mask 0) does not count
        "opd/teacher_logprob": -1.0,
    }


# ---- on real tiny models, in-process ------------------------------------------------------------
class InProcessContext:
    """What OPD's rollout uses, served by real in-process workers (no Ray): the rollout worker's
    HFBackend on the student, the rule reward, a ReferenceWorker on the teacher."""

    def __init__(self, task, tokenizer, student_dir, teacher_dir):
        from actors.reference import ReferenceWorker
        from actors.reward import RewardWorker
        from actors.rollout import HFBackend

        self.task, self.tokenizer, self.policy_version = task, tokenizer, 0
        self.backend = HFBackend(str(student_dir))
        self.reward = RewardWorker(str(student_dir), task)
        self.teacher = ReferenceWorker(str(teacher_dir))
        self.seed = 0

    def sampling(self, **overrides):
        from rlsys.generation import SamplingParams

        return SamplingParams(**{"max_new_tokens": 4, "stop_token_ids": (self.tokenizer.eos_token_id,), **overrides})

    def next_seed(self):
        self.seed += 1
        return self.seed

    def generate(self, requests, policy=None):
        return self.backend.generate(requests)

    def score(self, table):
        return self.reward.score(table)

    def teacher_logprobs(self, table):
        return self.teacher.logprobs(table)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from envs.arithmetic import ArithmeticTask
    from rlsys.contract import Prompt
    from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer

    root = tmp_path_factory.mktemp("opd")
    task = ArithmeticTask.create(root / "data", 20, 4, 0, 9, ["+"], 0)
    tok = train_tokenizer(task.corpus(), 64)
    spec = TinyModelSpec(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    dirs = [save_model_dir(build_tiny_model(spec, tok, seed=s), tok, root / f"m{s}") for s in (0, 1)]
    prompts = [
        Prompt(f"p{i}", tok(task.prompt_text(r), add_special_tokens=False)["input_ids"], task.prompt_text(r), r)
        for i, r in enumerate(task.rows("train")[:3])
    ]
    return task, tok, dirs, prompts


def test_one_step_on_real_models_and_no_signal_from_the_student_itself(tiny):
    from actors.modeling import PolicyOnly
    from rlsys.models import load_model

    task, tok, (student, teacher), prompts = tiny
    algo = OPD(OPDConfig(group_size=2))
    table = algo.rollout(InProcessContext(task, tok, student, student), prompts)
    assert table.num_rows == 6 and "teacher_logprobs" in table.schema.names
    b = algo.prepare(table)
    assert b.advantages.abs().max().item() < 1e-4  # the teacher is the student: r_t = 0 up to numerics
    assert algo.prepare_metrics(table)["opd/reverse_kl"] == pytest.approx(0.0, abs=1e-4)

    table = algo.rollout(InProcessContext(task, tok, student, teacher), prompts)
    b = algo.prepare(table)
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    assert b.response_mask.sum().item() == sum(lengths) and (b.advantages[b.response_mask == 0] == 0).all()
    assert b.advantages.abs().max().item() > 1e-2
    model = PolicyOnly(load_model(student))
    logits, logprobs, _ = model(b.input_ids, b.attention_mask)
    loss, metrics = algo.loss(ModelOutputs(logits, logprobs), b)
    # at the sampler's weights the ratio is 1 (up to numerics): the loss is the sampled reverse KL
    assert loss.item() == pytest.approx(algo.prepare_metrics(table)["opd/reverse_kl"], abs=1e-4)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ---- config, registration -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, words",
    [
        ("algorithm.discount=1.5", ["algorithm.discount", "1.5", "less than or equal to 1"]),
        ("algorithm.loss=kl", ["algorithm.loss", "'kl'", "importance_sampling", "ppo"]),
        ("algorithm.reward_coef=-1", ["algorithm.reward_coef", "greater than or equal to 0"]),
        ("algorithm.group_size=0", ["algorithm.group_size", "greater than or equal to 1"]),
        ("algorithm.teacher.path=/no/such/dir", ["algorithm.teacher.path", "/no/such/dir", "model directory"]),
        ("algorithm.kl_coef=0.1", ["algorithm.kl_coef"]),
    ],
)
def test_bad_config_fails_in_one_line(override, words):
    from algorithms.base import build_algorithm

    with pytest.raises(ConfigError) as e:
        build_algorithm(load_config("configs/opd.yaml", [override]))
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_config_builds_with_the_documented_defaults():
    from algorithms.base import build_algorithm

    algo = build_algorithm(load_config("configs/opd.yaml"))
    assert isinstance(algo, OPD) and algo.config.loss == "importance_sampling"
    c = OPDConfig()
    assert (c.group_size, c.loss, c.clip_eps, c.discount, c.reward_coef) == (4, "importance_sampling", 0.2, 0.0, 0.0)
    assert all(f.description for f in OPDConfig.model_fields.values())


def test_registered_with_the_capabilities_it_has():
    assert get_algorithm("opd") is OPD
    algo = OPD()
    assert isinstance(algo, HasTeacher) and isinstance(algo, ReportsPrepareMetrics)
    assert isinstance(algo, TrainsOnStaleRows)
    assert not isinstance(algo, Stateful) and not isinstance(algo, SkipsRowsWithoutGradient)
    assert not algo.needs_value_head


def test_teacher_is_dakds(tiny, tmp_path):
    """teacher.path is checked as DA-KD checks it (same function): returned as is when the
    tokenizer is the student's."""
    from algorithms.distill import TeacherConfig

    task, tok, (_, teacher), _ = tiny
    algo = OPD(OPDConfig(teacher=TeacherConfig(path=str(teacher))))
    assert algo.teacher_dir(tmp_path, task, tok, 0) == teacher
