"""BRiTE (../shared/papers/brite.md): the closed-form psi-step optimum is the Bayes posterior on
a discrete toy, the psi-step estimator reaches it, repeated theta-steps raise log P(y*|x), the
phase schedule and its checkpointed state, and the shaped reward equals a real model's
log-prob of the gold answer."""

import json
import math

import numpy as np
import pytest
import torch
from fakes import TINY_JOB

from algorithms.brite import (
    BRiTE,
    PhasePosition,
    RationaleWarmupTask,
    close_rationale,
    kl_regularised_returns,
    kl_rl_optimum,
    phase_at,
    posterior_weights,
    shaped_rewards,
    weighted_sft_loss,
)
from algorithms.common import clipped_policy_loss, rloo_advantages
from algorithms.sft import sft_loss
from rlsys.config import ConfigError, load_config


# ---- pure functions ------------------------------------------------------------------------------
def test_shaped_reward_sums_the_logprobs_after_the_rationale():
    rows = [[-1.0, -2.0, -0.5, -0.25], [-3.0, -0.125], [-1.0]]
    assert shaped_rewards(rows, [2, 1, 0]).tolist() == [-0.75, -0.125, -1.0]
    assert shaped_rewards([[-1.0, -2.0]], [2]).tolist() == [0.0]  # nothing after the rationale: log 1


def test_closed_form_optimum_is_the_bayes_posterior_and_the_maximiser():
    rng = np.random.default_rng(0)
    for m in (2, 5, 12):
        prior = rng.dirichlet(np.ones(m))  # P(z | x)
        success = rng.uniform(0.01, 0.99, m)  # P(o = 1 | x, z), the binary outcome
        q = kl_rl_optimum(np.log(prior), np.log(success))  # r = log P(o=1 | x, z), beta = 1
        posterior = prior * success / np.sum(prior * success)  # Bayes: P(z | x, o = 1)
        assert q == pytest.approx(posterior, abs=1e-12)

        def objective(dist):  # E_Q[r] - KL(Q || P)
            return float(np.sum(dist * (np.log(success) - np.log(dist / prior))))

        assert objective(q) == pytest.approx(math.log(np.sum(prior * success)))  # = log P(o = 1 | x)
        assert all(objective(rng.dirichlet(np.ones(m))) < objective(q) for _ in range(200))
    # beta scales the reward: beta -> 0 puts all mass on the best rationale, beta -> inf keeps the prior
    prior, r = np.array([0.7, 0.2, 0.1]), np.log([0.1, 0.5, 0.9])
    assert kl_rl_optimum(np.log(prior), r, beta=1e-3) == pytest.approx([0, 0, 1], abs=1e-9)
    assert kl_rl_optimum(np.log(prior), r, beta=1e6) == pytest.approx(prior, abs=1e-5)


def test_posterior_weights_take_samples_of_any_sampler_to_the_posterior():
    """theta_weights: posterior. Rationales drawn from a sampler Q far from Q*, weighted by
    `posterior_weights` (anchor P = the prior, r = log P(o=1|x,z)), have the weighted
    frequencies of Q* = P(z|x, o=1) as the group grows (self-normalised per group: biased toward
    the sampler for small groups, still closer to Q* than the unweighted samples); weights have
    mean 1 per group and are shift-invariant."""
    rng = np.random.default_rng(0)
    prior, success = np.array([0.5, 0.25, 0.15, 0.1]), np.array([0.05, 0.6, 0.2, 0.9])
    posterior = prior * success / np.sum(prior * success)
    sampler = np.array([0.1, 0.1, 0.7, 0.1])  # an unconverged psi-step: mostly rationale 2
    for size, tolerance in ((256, 0.01), (4, None)):
        n_groups = 64_000 // size
        z = rng.choice(4, size=(n_groups, size), p=sampler).ravel()
        groups = [str(i // size) for i in range(len(z))]
        w = posterior_weights(np.log(success)[z], np.log(sampler)[z], np.log(prior)[z], groups)
        assert np.allclose(w.reshape(n_groups, size).mean(1), 1.0)
        weighted = np.bincount(z, weights=w, minlength=4) / w.sum()
        unweighted = np.bincount(z, minlength=4) / len(z)
        if tolerance:
            assert weighted == pytest.approx(posterior, abs=tolerance)
        assert np.abs(weighted - posterior).sum() < 0.6 * np.abs(unweighted - posterior).sum()
        shifted = posterior_weights(np.log(success)[z] - 5.0, np.log(sampler)[z], np.log(prior)[z], groups)
        assert shifted == pytest.approx(w)


def test_weighted_sft_loss_reduces_to_the_likelihood_loss():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.2, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert weighted_sft_loss(logp, mask, torch.ones(2)) == pytest.approx(sft_loss(logp, mask).item())
    only_first = weighted_sft_loss(logp, mask, torch.tensor([2.0, 0.0]))  # a zero weight drops a row's tokens
    assert only_first.item() == pytest.approx(-2 * (math.log(0.5) + math.log(0.25)) / 5)


def test_psi_step_estimator_converges_to_the_posterior():
    """The psi-step as the learner runs it (KL-regularised returns, leave-one-out baseline,
    clipped surrogate) on a tabular sampler Q over M rationales reaches Q* = P(z | x, o=1)."""
    gen = torch.Generator().manual_seed(0)
    prior = torch.tensor([0.5, 0.25, 0.15, 0.1])
    success = torch.tensor([0.05, 0.6, 0.2, 0.9])
    posterior = prior * success / (prior * success).sum()
    logits = torch.log(prior).clone().requires_grad_(True)  # Q starts at the prior P(. | x, theta)
    opt = torch.optim.SGD([logits], lr=1.0)
    for _ in range(200):
        logq = torch.log_softmax(logits, 0)
        z = torch.multinomial(logq.exp().detach(), 64, replacement=True, generator=gen)
        returns = kl_regularised_returns(
            torch.log(success[z]).numpy(), logq[z].detach().numpy(), torch.log(prior[z]).numpy(), beta=1.0
        )
        adv = torch.tensor(rloo_advantages(returns, ["x"] * 64), dtype=torch.float32)
        loss, _, _ = clipped_policy_loss(logq[z][:, None], logq[z].detach()[:, None], adv[:, None], torch.ones(64, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    q = torch.softmax(logits, 0).detach()
    assert 0.5 * (q - posterior).abs().sum().item() < 0.03, (q, posterior)
    assert 0.5 * (prior - posterior).abs().sum().item() > 0.3  # far from where it started
    # at the posterior every return is log P(o=1|x): zero advantages, the estimator's fixed point
    at_posterior = kl_regularised_returns(
        torch.log(success).numpy(), torch.log(posterior).numpy(), torch.log(prior).numpy(), beta=1.0
    )
    assert at_posterior == pytest.approx([math.log((prior * success).sum().item())] * 4, abs=1e-6)


def test_repeated_theta_steps_increase_log_likelihood_of_the_gold_answer():
    """Tabular P(z|x) and P(y|x,z) over M rationales and K answers. Each iteration: the psi-step's
    closed-form Q* under the current theta, then a theta-step: sft_loss (mean NLL of the rationale
    and gold-answer tokens) on rationales sampled from Q*. log P(y*|x) rises every iteration."""
    torch.manual_seed(0)
    m, k, gold = 6, 5, 3
    z_logits = torch.randn(m).requires_grad_(True)
    y_logits = (torch.randn(m, k) - 2.0 * torch.nn.functional.one_hot(torch.tensor(gold), k)).requires_grad_(True)
    opt = torch.optim.SGD([z_logits, y_logits], lr=0.5)

    def log_p_gold():
        return torch.logsumexp(torch.log_softmax(z_logits, 0) + torch.log_softmax(y_logits, 1)[:, gold], 0).item()

    history = [log_p_gold()]
    for _ in range(8):
        with torch.no_grad():
            r = torch.log_softmax(y_logits, 1)[:, gold]  # shaped reward log P(y*|x,z,theta)
            q = kl_rl_optimum(torch.log_softmax(z_logits, 0).numpy(), r.numpy())
        z = torch.multinomial(torch.tensor(q), 256, replacement=True)
        for _ in range(5):
            token_logprobs = torch.stack(
                [torch.log_softmax(z_logits, 0)[z], torch.log_softmax(y_logits, 1)[z, gold]], 1
            )
            loss = sft_loss(token_logprobs, torch.ones_like(token_logprobs))
            opt.zero_grad()
            loss.backward()
            opt.step()
        history.append(log_p_gold())
    assert all(b > a for a, b in zip(history, history[1:])), history
    assert history[-1] > history[0] + 1.0, history


@pytest.mark.parametrize("psi, theta", [(1, 1), (2, 1), (3, 2), (0, 2), (2, 0)])
def test_phase_schedule(psi, theta):
    pos = PhasePosition().settle(psi, theta)
    for step in range(20):
        assert (pos.phase, pos.iteration) == phase_at(step, psi, theta)
        pos = pos.advance(psi, theta)
    assert [phase_at(s, 2, 1)[0] for s in range(6)] == ["psi", "psi", "theta"] * 2
    assert [phase_at(s, 2, 1)[1] for s in range(6)] == [0, 0, 0, 1, 1, 1]


def test_state_round_trips_and_resumes_inside_the_phase():
    algo = BRiTE(BRiTE.Config(psi_steps=3, theta_steps=2))
    algo.position = PhasePosition("psi", 4, 2)
    other = BRiTE(BRiTE.Config(psi_steps=3, theta_steps=2))
    other.load_state(json.loads(json.dumps(algo.state())))
    assert other.position == PhasePosition("psi", 4, 2)
    shorter = BRiTE(BRiTE.Config(psi_steps=2, theta_steps=2))  # psi phase shortened on resume: theta next
    shorter.load_state(algo.state())
    assert shorter.position == PhasePosition("theta", 4, 0)
    with pytest.raises(ValueError, match="phase 'rl'"):
        other.load_state({"phase": "rl", "iteration": 0, "step_in_phase": 0})


def test_close_rationale():
    marker, eos = 7, 2
    assert close_rationale([5, 6, 7], [-1.0, -2.0, -0.5], marker, eos) == ([5, 6, 7], [-1.0, -2.0, -0.5], [1, 1, 1])
    assert close_rationale([5, 2], [-1.0, -3.0], marker, eos) == ([5, 7], [-1.0, 0.0], [1, 0])  # eos dropped
    assert close_rationale([5, 6], [-1.0, -2.0], marker, eos) == ([5, 6, 7], [-1.0, -2.0, 0.0], [1, 1, 0])  # length
    assert close_rationale([2], [-0.1], marker, eos) == ([7], [0.0], [0])


def test_answer_after_the_marker():
    from envs.arithmetic import ANSWER_MARKER, ArithmeticTask, answer_text

    assert ANSWER_MARKER == "#"
    assert answer_text("7+8=15 1#95") == "95" and answer_text("#95<eos>") == "95" and answer_text("95 3") == "95"
    assert answer_text("1#2#3") == "3" and answer_text("12#") == ""
    row = {"prompt": "37+58=", "answer": "95"}
    assert ArithmeticTask.is_correct(None, row, "85#95") and not ArithmeticTask.is_correct(None, row, "95#85")


@pytest.mark.parametrize(
    "override, words",
    [
        ("algorithm.psi_steps=-1", ["algorithm.psi_steps", "-1", "greater than or equal to 0"]),
        ("algorithm.group_size=1", ["algorithm.group_size", "1", "greater than or equal to 2"]),
        ("algorithm.theta_steps=0", ["algorithm.theta_steps", "0", "psi_steps + theta_steps must be at least 1"]),
        ("algorithm.phases=3", ["unknown key 'algorithm.phases'"]),
        ("algorithm.warmup=cot", ["algorithm.warmup", "cot", "'rationale' or 'answer'"]),
    ],
)
def test_bad_config_fails_in_one_line(override, words):
    from algorithms.base import build_algorithm

    extra = ["algorithm.psi_steps=0"] if "theta_steps=0" in override else []
    with pytest.raises(ConfigError) as e:
        build_algorithm(load_config("configs/brite.yaml", [override, *extra]))
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


# ---- the plug-in on a real tiny model, in-process --------------------------------------------------
class InProcessContext:
    """The RolloutContext BRiTE uses, served in-process by the real HF rollout backend and a real
    ReferenceWorker forward on the same weights (no Ray: this test is about the scoring pass)."""

    def __init__(self, task, tokenizer, model_dir):
        from actors.reference import ReferenceWorker
        from actors.rollout import HFBackend

        self.task, self.tokenizer, self.policy_version = task, tokenizer, 0
        self.backend, self.scorer = HFBackend(str(model_dir)), ReferenceWorker(str(model_dir))
        self.rng = np.random.default_rng(0)

    def sampling(self, **overrides):
        from rlsys.generation import SamplingParams

        base = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=(self.tokenizer.eos_token_id,))
        return SamplingParams(**{**base.__dict__, **overrides})

    def generate(self, requests):
        return self.backend.generate(requests)

    def next_seed(self):
        return int(self.rng.integers(0, 2**31 - 1))

    def policy_logprobs(self, table):
        return self.scorer.logprobs(table)

    ref_logprobs = policy_logprobs  # the reference here is always the current policy:

    def anchor_reference(self):  # so anchoring it at theta_t changes nothing
        pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from envs.arithmetic import ArithmeticTask
    from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("brite")
    task = ArithmeticTask.create(root / "data", 50, 10, 0, 49, ["+"], 0)
    tok = train_tokenizer(task.corpus(), 64)
    spec = TinyModelSpec(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    model = build_tiny_model(spec, tok, seed=0).eval()
    return task, tok, model, save_model_dir(model, tok, root / "m")


def _prompts(task, tok, n):
    from rlsys.contract import Prompt

    rows = task.rows("train")[:n]
    return [
        Prompt(f"p{i}", tok(r["prompt"], add_special_tokens=False)["input_ids"], r["prompt"], r)
        for i, r in enumerate(rows)
    ]


@torch.no_grad()
def test_shaped_reward_equals_the_models_logprob_of_the_gold_answer(tiny):
    from actors.modeling import PolicyOnly
    from rlsys.contract import ModelOutputs

    task, tok, model, model_dir = tiny
    algo = BRiTE(BRiTE.Config(group_size=3, rationale_tokens=4, answer_tokens=3))
    table = algo.rollout(InProcessContext(task, tok, model_dir), _prompts(task, tok, 4))
    assert table.num_rows == 12 and set(table.column("phase").to_pylist()) == {"psi"}
    marker = tok("#", add_special_tokens=False)["input_ids"][0]
    for row in table.to_pylist():
        meta, n = json.loads(row["meta"]), row["rationale_len"]
        z, gold = row["response_ids"][:n], row["response_ids"][n:]
        assert z[-1] == marker and marker not in z[:-1] and tok.eos_token_id not in z
        assert gold == tok(meta["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert row["loss_mask"] == [1] * (n - 1) + [int(meta["marker_sampled"])] + [0] * len(gold)
        # direct forward, one token at a time: log P(y* eos | x, z) by the chain rule
        prefix, direct = list(row["prompt_ids"]) + z, 0.0
        for t in gold:
            direct += torch.log_softmax(model(torch.tensor([prefix])).logits[0, -1].float(), -1)[t].item()
            prefix.append(t)
        assert row["shaped_reward"] == pytest.approx(direct, abs=1e-4)
        assert row["reward"] == float(task.is_correct(meta, meta["sampled"]))
        assert meta["sampled"].startswith(tok.decode(z, skip_special_tokens=True))

    # psi-step: advantages only on sampled rationale tokens, leave-one-out: they sum to 0 per prompt
    batch = algo.prepare(table)
    assert algo.position == PhasePosition("theta", 0, 0)
    assert ((batch.advantages != 0) <= (batch.response_mask > 0)).all()
    returns = algo._returns(table)  # sampler = reference here: the KL term is ~0, R = r
    assert returns == pytest.approx(table.column("shaped_reward").to_pylist(), abs=1e-3)
    expected = rloo_advantages(returns, table.column("group").to_pylist())
    for a, m, e in zip(batch.advantages, batch.response_mask, expected):
        assert a[m > 0].tolist() == pytest.approx([e] * int(m.sum()), abs=1e-5)
    policy = PolicyOnly(model)
    logits, logprobs, _ = policy(batch.input_ids, batch.attention_mask)
    loss, metrics = algo.loss(ModelOutputs(logits, logprobs), batch)
    assert "loss/psi_policy" in metrics and metrics["clip_frac"] == 0.0  # same weights: ratio 1

    # theta-step: the mean NLL of rationale + gold answer tokens
    theta_table = algo.rollout(InProcessContext(task, tok, model_dir), _prompts(task, tok, 4))
    assert set(theta_table.column("phase").to_pylist()) == {"theta"}
    assert all(set(m) == {1} for m in theta_table.column("loss_mask").to_pylist())
    batch = algo.prepare(theta_table)
    assert algo.position == PhasePosition("psi", 1, 0)
    logits, logprobs, _ = policy(batch.input_ids, batch.attention_mask)
    loss, metrics = algo.loss(ModelOutputs(logits, logprobs), batch)
    nll = -np.concatenate([np.asarray(s) for s in InProcessContext(task, tok, model_dir).policy_logprobs(theta_table)])
    assert loss.item() == pytest.approx(nll.mean(), rel=1e-4) and set(metrics) == {"loss/theta_nll"}
    assert algo.prepare_metrics(theta_table)["brite/theta_phase"] == 1.0


def test_rollout_needs_temperature_one(tiny):
    task, tok, model, model_dir = tiny
    ctx = InProcessContext(task, tok, model_dir)
    ctx.sampling = lambda **kw: InProcessContext.sampling(ctx, **{"temperature": 0.7, **kw})
    with pytest.raises(ValueError, match="rollout.temperature must be 1.0"):
        BRiTE().rollout(ctx, _prompts(task, tok, 1))


# ---- the warm-up in the rationale format -----------------------------------------------------------
@pytest.mark.parametrize(
    "prompt, step, target",
    [
        ("18+17=", 15, "15#35"),
        ("12+13=", 5, "5#25"),
        ("9+9=", 18, "18#18"),
        ("0+0=", 0, "0#0"),
        ("37-58=", -1, "-1#-21"),
        ("40-3=", -3, "-3#37"),
        ("17*18=", 56, "56#306"),
        ("20*7=", 0, "0#140"),
    ],
)
def test_rationale_is_the_ones_digit_step(prompt, step, target):
    from algorithms.brite import rationale_row
    from envs.arithmetic import _OPS, ones_digit_step, parse_problem

    a, op, b = parse_problem(prompt)
    assert ones_digit_step(prompt) == step and (_OPS[op](a, b) - step) % 10 == 0  # the answer is the step + 10k
    row = rationale_row({"prompt": prompt, "answer": str(_OPS[op](a, b))}, prompt)
    assert row["answer"] == target and row["rationale"] == str(step) and row["gold_answer"] == str(_OPS[op](a, b))


def test_rationale_warmup_rows_tokenise_as_rationale_marker_answer_eos(tiny):
    from algorithms.sft import sft_ids
    from envs.arithmetic import ones_digit_step

    task, tok, _, _ = tiny
    warm = BRiTE().warmup_task(task, tok)
    assert isinstance(warm, RationaleWarmupTask) and warm.name == task.name and warm.corpus() == task.corpus()
    train, rows = task.rows("train"), warm.rows("train")
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in train]
    marker, eos = tok("#", add_special_tokens=False)["input_ids"][0], tok.eos_token_id
    prompts, targets = sft_ids(tok, rows, warm)
    for row, orig, prompt_ids, target in zip(rows, train, prompts, targets):
        assert prompt_ids == tok(orig["prompt"], add_special_tokens=False)["input_ids"]
        z, y = str(ones_digit_step(orig["prompt"])), orig["answer"]
        digits = [tok(d, add_special_tokens=False)["input_ids"] for d in z + y]
        assert all(len(d) == 1 for d in digits)  # one token a digit
        assert target == [d[0] for d in digits[: len(z)]] + [marker] + [d[0] for d in digits[len(z) :]] + [eos]
        assert target.count(marker) == 1 and target.index(marker) + 1 <= BRiTE.Config().rationale_tokens
        assert warm.is_correct(row, tok.decode(target, skip_special_tokens=True)) and warm.reward(row, "0#" + y) == 1.0
        assert not warm.is_correct(row, z + "#" + y + "1")
    assert warm.rows("eval") == task.rows("eval") and warm.prompt_text(rows[0]) == task.prompt_text(train[0])


@pytest.mark.parametrize(
    "prompt, answer, flawed",
    [
        ("18+17=", "35", "5#25"),
        ("9+9=", "18", "8#8"),
        ("12+13=", "25", "5#25"),  # no carry: as it was
        ("37-58=", "-21", "-1#-21"),
        ("17*18=", "306", "56#306"),  # other operations: as they were
    ],
)
def test_flawed_demonstration_drops_carries_in_rationale_and_answer(prompt, answer, flawed):
    from algorithms.brite import rationale_row

    class Task:
        name = "arithmetic"

        def rows(self, split):
            return [{"prompt": prompt, "answer": answer}]

        def prompt_text(self, row):
            return row["prompt"]

        def is_correct(self, row, text):
            return text.rsplit("#", 1)[-1] == row["answer"]

    warm = RationaleWarmupTask(Task())
    row = warm.rows("train")[0]
    assert row == rationale_row({"prompt": prompt, "answer": answer}, prompt)
    bad = warm.flawed_demonstration(row)
    assert bad["answer"] == flawed and bad["rationale"] == flawed.split("#")[0] and bad["gold_answer"] == answer
    assert warm.is_correct(bad, bad["answer"]) == (flawed == row["answer"])  # graded against the gold answer
    rationale, final = (int(t) for t in flawed.rsplit("#", 1))
    assert (final - rationale) % 10 == 0  # the answer still follows the rationale


def test_other_operations_and_the_answer_warmup(tmp_path):
    from envs.arithmetic import ArithmeticTask
    from rlsys.models import train_tokenizer

    task = ArithmeticTask.create(tmp_path / "data", 60, 10, 0, 19, ["-", "*"], 0)
    tok = train_tokenizer(task.corpus(), 64)
    assert BRiTE(BRiTE.Config(warmup="answer")).warmup_task(task, tok) is task
    marker = tok("#", add_special_tokens=False)["input_ids"][0]
    for row in BRiTE().warmup_task(task, tok).rows("train"):
        ids = tok(row["answer"], add_special_tokens=False)["input_ids"]
        assert ids.count(marker) == 1 and tok.decode(ids) == row["answer"]
        assert tok.decode(ids[: ids.index(marker)]) == row["rationale"]


class ProseTask:
    name = "prose"

    def rows(self, split):
        return [{"prompt": "Write a haiku:", "answer": "..."}]

    def prompt_text(self, row):
        return row["prompt"]


@pytest.mark.parametrize(
    "task_kind, config, words",
    [
        ("prose", {}, ["'algorithm.warmup'=rationale", "task 'prose'", "set algorithm.warmup=answer"]),
        ("tiny", {"rationale_tokens": 2}, ["'algorithm.rationale_tokens'=2", "take 3 tokens"]),  # "18" + marker
    ],
)
def test_warmup_task_errors_in_one_line(tiny, task_kind, config, words):
    task, tok, _, _ = tiny
    with pytest.raises(ConfigError) as e:
        BRiTE(BRiTE.Config(**config)).warmup_task(ProseTask() if task_kind == "prose" else task, tok)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


# ---- a phase-crossing run on a real local Ray cluster, checkpointed and resumed ---------------------
TINY = [
    *TINY_JOB,
    "trainer.eval_every=2",
    "rollout.max_new_tokens=6",
    "rollout.num_workers=1",
    "algorithm.psi_steps=1",
    "algorithm.theta_steps=1",
    "algorithm.group_size=2",
    "algorithm.rationale_tokens=3",
    "algorithm.answer_tokens=3",
    "trainer.checkpoint_every=1",
]


@pytest.mark.integration
def test_psi_then_theta_across_a_resume_on_a_local_cluster(ray_cluster, tmp_path):
    """Steps 1-3 (psi, theta, psi) run and checkpoint; a fresh controller resumes from step 3
    and runs step 4, the theta-step: the phase came back from the checkpoint. The psi-step's KL
    anchor is theta_t: at the first psi-step of each iteration the KL to it is zero, and the
    anchor (theta after step 2) is saved and restored with the checkpoint. The theta-steps run
    with posterior weights (theta_weights: posterior)."""
    import numpy as np

    from actors.modeling import state_dict_numpy
    from rlsys.models import load_model
    from rlsys.run.controller import Controller
    from rlsys.tracking import read_jsonl

    run_dir = tmp_path / "brite"
    overrides = [*TINY, f"run.output_dir={tmp_path}", "run.name=brite", "algorithm.theta_weights=posterior"]
    first = Controller(load_config("configs/brite.yaml", [*overrides, "trainer.steps=3"]), run_dir, progress=False)
    assert first.run()["steps"] == 3
    saved = json.loads((run_dir / "checkpoints" / "step_3" / "state.json").read_text())
    assert saved["algorithm"] == {"phase": "theta", "iteration": 1, "step_in_phase": 0}
    assert saved["reference_version"] == 2  # anchored at step 3 on the weights after steps 1-2
    theta_2 = state_dict_numpy(load_model(run_dir / "checkpoints" / "step_2" / "hf"))
    initial = state_dict_numpy(load_model(run_dir / "policy_init"))
    assert any(not np.array_equal(initial[k], v) for k, v in theta_2.items())  # the theta-step moved theta
    first.shutdown()

    resumed = Controller(load_config("configs/brite.yaml", [*overrides, "trainer.steps=4"]), run_dir, progress=False)
    assert resumed.run(resume=True)["steps"] == 4
    anchor = ray_cluster.get(resumed.reference.__ray_call__.remote(lambda w: state_dict_numpy(w.model)))
    assert all(np.allclose(theta_2[k], v, atol=1e-6) for k, v in anchor.items())  # theta after step 2, restored
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["brite/theta_phase"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    assert [r["brite/iteration"] for r in rows] == [0.0, 0.0, 1.0, 1.0]
    for psi in (rows[0], rows[2]):  # sampler == anchor at an iteration's first psi-step: KL 0
        assert "loss/psi_policy" in psi and abs(psi["brite/kl_ref"]) < 1e-4, psi["brite/kl_ref"]
    for row in rows:
        assert row["samples"] == 4 * 2 and row["brite/shaped_reward"] < 0
        assert 1 <= row["brite/rationale_tokens"] <= 3 + 1  # a cut rationale: 3 sampled tokens + the marker
        assert all(v == v for v in row.values() if isinstance(v, float))  # no NaN
    for theta in (rows[1], rows[3]):  # theta_weights=posterior: weighted by the anchor, the sampler and r
        assert (
            theta["loss/theta_nll"] > 0 and theta["loss/theta_weighted_nll"] > 0 and 0 < theta["brite/theta_ess"] <= 1
        )
    assert json.loads((run_dir / "checkpoints" / "step_4" / "state.json").read_text())["algorithm"] == {
        "phase": "psi",
        "iteration": 2,
        "step_in_phase": 0,
    }
    assert ray_cluster.get(resumed.workers[0].policy_version.remote()) == 4
