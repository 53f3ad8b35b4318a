"""CDG self-play (../shared/papers/cdg.md): the prover reward table, critic routing, ReST
filtering, role masking in stored transcripts, algorithm state, and two steps per mode on a
real local Ray cluster."""

import json

import numpy as np
import pytest
import torch
from fakes import TINY_JOB

from algorithms.cdg import (
    CDG,
    CDGConfig,
    add_to_pool,
    flip_rate,
    game_rows,
    prover_reward,
    rest_keep,
    sft_sample,
    table_phase,
)
from envs.arithmetic import answer_text
from envs.cdg_game import Templates, Turn, critic_context, play_games, revision_context
from rlsys.batch import collate
from rlsys.config import ConfigError, load_config
from rlsys.experience import make_experience, meta_of

PROBLEMS = [
    ("p0", {"prompt": "3+4=", "answer": "7"}),
    ("p1", {"prompt": "2+2=", "answer": "4"}),
    ("p2", {"prompt": "5+1=", "answer": "6"}),
]


@pytest.fixture(scope="module")
def tokenizer():
    from rlsys.models import train_tokenizer

    return train_tokenizer([f"{a}+{b}={a + b}" for a in range(10) for b in range(10)], vocab_size=300)


@pytest.fixture(scope="module")
def templates(tokenizer):
    return Templates.from_text(tokenizer, "helpful critic:", "misleading critic:", " critique:", " final:")


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class ScriptedSampler:
    """Stands in for the rollout workers (these tests are about the game's bookkeeping, not about
    sampling): solution i of a problem is right when i is even, critique j is the text "c<j>",
    final k is right when k is even. Records every context it is asked about."""

    def __init__(self, tokenizer):
        self.tok, self.calls, self.roles = tokenizer, [], []
        self.answers = {tuple(ids(tokenizer, r["prompt"])): r["answer"] for _, r in PROBLEMS}

    def turn(self, text, n_tokens):
        t = ids(self.tok, text) + [self.tok.eos_token_id]
        return Turn(t, [-0.1 * (k + 1) for k in range(len(t))])

    def answer_for(self, context):
        for prompt, answer in self.answers.items():  # the problem the context ends with / starts with
            if tuple(context[: len(prompt)]) == prompt:
                return answer
        raise AssertionError("context holds no known problem")

    def __call__(self, contexts, n, max_new_tokens, roles):
        call = len(self.calls)
        self.calls.append([list(c) for c in contexts])
        self.roles.append(list(roles))
        out = []
        for c in contexts:
            if call == 0:
                out.append([self.turn(self.answer_for(c) if i % 2 == 0 else "99", max_new_tokens) for i in range(n)])
            elif call == 1:
                out.append([self.turn(f"{j}", max_new_tokens) for j in range(n)])
            else:
                out.append([self.turn(self.answer_for(c) if k % 2 == 0 else "98", max_new_tokens) for k in range(n)])
        return out


def play(tokenizer, templates, solutions=4, critiques=2, finals=3):
    sampler = ScriptedSampler(tokenizer)
    checker = lambda row, t: answer_text(tokenizer.decode(t, skip_special_tokens=True)) == row["answer"]
    problems = [(uid, row, ids(tokenizer, row["prompt"])) for uid, row in PROBLEMS]
    games = play_games(problems, sampler, checker, templates, solutions, critiques, finals, 4, 4, 4)
    return games, sampler


# ---- rewards --------------------------------------------------------------------------------
@pytest.mark.parametrize("eta", [0.0, 0.5, 2.0])
def test_prover_reward_four_cases(eta):
    assert prover_reward(True, True, eta) == 1.0 + eta  # kept a correct answer (against a misleader)
    assert prover_reward(True, False, eta) == eta  # misled: right -> wrong
    assert prover_reward(False, True, eta) == 1.0  # corrected: wrong -> right
    assert prover_reward(False, False, eta) == 0.0
    if eta > 0:  # keeping a correct answer pays most
        assert prover_reward(True, True, eta) > max(prover_reward(False, True, eta), prover_reward(True, False, eta))


def test_critic_rewards_are_flip_rates():
    finals_ok = [True, False, True, True]
    assert flip_rate("helpful", finals_ok) == 0.75  # saw a wrong z: wrong -> right
    assert flip_rate("misleading", finals_ok) == 0.25  # saw a correct z: right -> wrong
    with pytest.raises(ValueError, match="unknown critic role"):
        flip_rate("prover", finals_ok)


def test_game_rows_carry_the_rewards(tokenizer, templates):
    games, _ = play(tokenizer, templates)
    rows = game_rows(games, templates, eta=0.5, policy_version=3, phase="online")
    for r in rows:
        m = r["meta"]
        if m["role"] == "prover":
            assert r["reward"] == prover_reward(m["solution_ok"], m["final_ok"], 0.5)
        else:
            game = next(g for g in games if f"{g.problem_uid}/{g.solution_index}" == m["game"])
            critique = next(c for c in game.critiques if c.turn.ids == r["response_ids"])
            assert r["reward"] == flip_rate(m["role"], critique.finals_ok) == m["rate"]
    # finals alternate right/wrong (2 of 3 right): flip rates 2/3 for helpful, 1/3 for misleading
    assert {round(r["reward"], 4) for r in rows if r["meta"]["role"] == "helpful"} == {0.6667}
    assert {round(r["reward"], 4) for r in rows if r["meta"]["role"] == "misleading"} == {0.3333}
    assert len(rows) == 3 * 4 * 2 * (1 + 3)


# ---- routing ----------------------------------------------------------------------------------
def test_critics_see_only_solutions_of_their_kind(tokenizer, templates):
    games, sampler = play(tokenizer, templates)
    assert {g.solution_ok for g in games} == {True, False}  # both kinds were played
    critic_calls = sampler.calls[1]
    assert len(critic_calls) == len(games)
    for g, context in zip(games, critic_calls):
        assert g.role == ("misleading" if g.solution_ok else "helpful")
        prefix = templates.misleading if g.solution_ok else templates.helpful
        assert context == critic_context(templates, g.role, g.problem_ids, g.solution.ids)
        assert context[: len(prefix)] == prefix
        z = tokenizer.decode(g.solution.ids, skip_special_tokens=True)
        assert (answer_text(z) == g.row["answer"]) == (g.role == "misleading")
    # the prover never sees who wrote the critique
    for context in sampler.calls[2]:
        for prefix in (templates.helpful, templates.misleading):
            assert not any(context[i : i + len(prefix)] == prefix for i in range(len(context)))

    # the sampler is told which role plays each context: the prover for z and z', the critic z selects
    assert sampler.roles[0] == ["prover"] * len(PROBLEMS) and set(sampler.roles[2]) == {"prover"}
    assert sampler.roles[1] == [g.role for g in games]


class RecordingContext:
    """Stands in for the controller's ActorContext (this test is about which model is asked, not
    about sampling): answers every request with the request's index as its one token."""

    def __init__(self):
        self.asked: list[tuple[str, list]] = []

    def sampling(self, **overrides):
        from rlsys.generation import SamplingParams

        return SamplingParams(**overrides)

    def next_seed(self):
        return 0

    def generate(self, requests, policy=None):
        from rlsys.generation import Generation

        self.asked.append((policy, [list(r.prompt_ids) for r in requests]))
        return [
            Generation(
                request_index=i,
                prompt_ids=list(r.prompt_ids),
                response_ids=[i],
                logprobs=[-1.0],
                finish_reason="stop",
                policy_version=0,
            )
            for i, r in enumerate(requests)
        ]

    def generate_each(self, requests_by_policy):
        return {policy: self.generate(requests, policy) for policy, requests in requests_by_policy.items()}


@pytest.mark.parametrize(
    "models, expected",
    [
        ("shared", {"policy": ["prover", "helpful", "misleading", "helpful"]}),
        ("prover_critic", {"prover": ["prover"], "critic": ["helpful", "misleading", "helpful"]}),
        ("per_role", {"prover": ["prover"], "helpful": ["helpful", "helpful"], "misleading": ["misleading"]}),
    ],
)
def test_each_context_is_sampled_by_its_roles_model(models, expected):
    from algorithms.cdg import role_models, sampler

    ctx, roles = RecordingContext(), ["prover", "helpful", "misleading", "helpful"]
    contexts = [[10 + i] for i in range(len(roles))]
    turns = sampler(ctx, role_models(models))(contexts, 1, 4, roles)
    assert {p: [roles[c[0] - 10] for c in asked] for p, asked in ctx.asked} == expected
    # turns come back to their own contexts, in context order
    by_policy = {p: [c[0] for c in asked] for p, asked in ctx.asked}
    for i, t in enumerate(turns):
        policy = role_models(models)[roles[i]]
        assert t[0].ids == [by_policy[policy].index(10 + i)]
    algo = CDG(CDGConfig(models=models))
    assert algo.policy_names[0] == role_models(models)["prover"] and set(algo.policy_names) == set(expected)


def test_split_by_policy_gives_each_model_its_roles_rows(tokenizer, templates):
    games, _ = play(tokenizer, templates)
    table = make_experience(game_rows(games, templates, 0.5, 0, "online"))
    roles = [m["role"] for m in meta_of(table)]
    for models in ("shared", "prover_critic", "per_role"):
        algo = CDG(CDGConfig(models=models))
        parts = algo.split_by_policy(table)
        assert list(parts) == [n for n in algo.policy_names if n in parts]
        assert sum(p.num_rows for p in parts.values()) == table.num_rows
        for name, part in parts.items():
            assert {m["role"] for m in meta_of(part)} == {r for r in set(roles) if algo.models[r] == name}
            batch = algo.prepare(part)  # GRPO groups stay whole: each group is one role's
            assert batch.advantages.shape == batch.response_mask.shape
        if models == "per_role":  # a prover row keeps its mask (z and z' only) in the prover's part
            prover = parts["prover"].to_pylist()
            full = [r for r in table.to_pylist() if json.loads(r["meta"])["role"] == "prover"]
            assert [r["loss_mask"] for r in prover] == [r["loss_mask"] for r in full]


# ---- ReST --------------------------------------------------------------------------------------
def test_rest_filter_keeps_exactly_the_samples_above_threshold():
    thresholds = {"prover": 0.5, "helpful": 0.75, "misleading": 0.5}
    rates = [0.0, 0.25, 0.5, 0.5000001, 0.75, 0.76, 1.0]
    for role, thr in thresholds.items():
        for final_ok in (True, False):
            kept = [r for r in rates if rest_keep(role, r, final_ok if role == "prover" else None, thresholds)]
            expected = [r for r in rates if r > thr] if (role != "prover" or final_ok) else []
            assert kept == expected, (role, final_ok)


def test_rest_play_step_pools_exactly_the_kept_rows(tokenizer, templates):
    cfg = CDGConfig(mode="rest", prover_threshold=0.5, helpful_threshold=0.6, misleading_threshold=0.5)
    algo = CDG(cfg)
    games, _ = play(tokenizer, templates, finals=3)
    rows = game_rows(games, templates, cfg.eta, 0, "play")
    kept = [r for r in rows if rest_keep(r["meta"]["role"], r["meta"]["rate"], r["meta"]["final_ok"], algo._thresholds)]
    # helpful flip 2/3 > 0.6 kept; misleading 1/3 dropped; prover contexts 2/3 > 0.5: their right finals kept
    assert {r["meta"]["role"] for r in kept} == {"helpful", "prover"}
    assert all(r["meta"]["final_ok"] for r in kept if r["meta"]["role"] == "prover")
    assert sum(r["meta"]["role"] == "prover" for r in kept) == 3 * 4 * 2 * 2
    assert add_to_pool(algo.pool, [sft_sample(r) for r in kept], cap=10) == 10 + 10
    assert {k: len(v) for k, v in algo.pool.items()} == {"prover": 10, "helpful": 10, "misleading": 0}


# ---- transcripts in the buffer -----------------------------------------------------------------
def test_stored_transcript_masks_each_role_for_the_others(tokenizer, templates):
    games, _ = play(tokenizer, templates, solutions=2, critiques=1, finals=1)
    table = make_experience(game_rows(games, templates, 0.5, 0, "online"))
    batch = collate(table)
    g = games[1]  # a wrong solution: helpful critic
    c = g.critiques[0]
    metas = meta_of(table)
    for i, m in enumerate(metas):
        if m["game"] != f"{g.problem_uid}/{g.solution_index}":
            continue
        trained = batch.input_ids[i, 1:][batch.response_mask[i] > 0].tolist()
        if m["role"] == "prover":
            # the whole transcript is stored: problem + z + glue + critique + glue (+ problem) + z'
            sequence = batch.input_ids[i][batch.attention_mask[i] > 0].tolist()
            assert sequence == [
                *revision_context(templates, g.problem_ids, g.solution.ids, c.turn.ids),
                *c.finals[0].ids,
            ]
            assert trained == [*g.solution.ids, *c.finals[0].ids]  # only the prover's tokens
            assert table.column("logprobs")[i].as_py()[: len(g.solution.ids)] == pytest.approx(g.solution.logprobs)
        else:
            assert m["role"] == "helpful"
            assert trained == c.turn.ids  # only the critic's tokens; the prover's z is in its prompt, untrained
            assert table.column("prompt_ids")[i].as_py() == critic_context(
                templates, "helpful", g.problem_ids, g.solution.ids
            )
    # a supervised prover sample trains on z' alone after a wrong z, on z and z' after a right one
    rows = game_rows(games, templates, 0.5, 0, "play")
    for r in rows:
        if r["meta"]["role"] == "prover":
            s = sft_sample(r)
            n = r["meta"]["solution_len"]
            assert s["loss_mask"][:n] == [int(r["meta"]["solution_ok"])] * n
            assert sum(s["loss_mask"][n:]) == r["meta"]["final_len"]


def test_revision_warmup_rows_tokenize_to_the_games_revision_context(tokenizer, templates, tmp_path):
    from envs.arithmetic import ArithmeticTask
    from envs.cdg_game import RevisionWarmupTask

    task = ArithmeticTask.create(tmp_path, 30, 5, 0, 9, ["+"], 0)
    warm = CDG(CDGConfig(warmup_revision=True)).warmup_task(task, tokenizer)
    assert isinstance(warm, RevisionWarmupTask) and CDG(CDGConfig()).warmup_task(task, tokenizer) is task
    rows = warm.rows("train")
    assert rows[:30] == task.rows("train") and len(rows) == 60 and warm.rows("eval") == task.rows("eval")
    eos = tokenizer.eos_token
    for row in rows[30:]:
        problem = task.prompt_text(row)
        earlier, rest = row["revision_prompt"][len(problem) :].split(eos, 1)
        critique = rest[len(" critique:") :].split(eos)[0]
        game = revision_context(
            templates,
            ids(tokenizer, problem),
            ids(tokenizer, earlier) + [tokenizer.eos_token_id],
            ids(tokenizer, critique) + [tokenizer.eos_token_id],
        )
        assert ids(tokenizer, warm.prompt_text(row)) == game  # the warm-up teaches the exact format the game plays
        assert warm.is_correct(row, row["answer"])


# ---- algorithm: phases, batches, losses, state -------------------------------------------------
class SeededContext:  # only the two attributes sft_table reads
    policy_version = 7
    next_seed = staticmethod(lambda: 1)


def test_rest_phases_and_state_round_trip(tokenizer, templates):
    algo = CDG(CDGConfig(mode="rest", play_steps=2, sft_steps=3))
    assert (algo.round, algo.phase) == (0, "play")
    for _ in range(3):  # an empty pool keeps it playing
        algo._advance()
    assert algo.phase == "play"
    games, _ = play(tokenizer, templates)
    add_to_pool(algo.pool, [sft_sample(r) for r in game_rows(games, templates, 0.5, 0, "play")[:5]], 100)
    algo._advance()
    assert (algo.round, algo.phase, algo.phase_step) == (0, "sft", 0)
    first = algo._sft_table(SeededContext())
    algo._advance()
    second = algo._sft_table(SeededContext())
    assert algo.restarts_policy(first) and not algo.restarts_policy(second)  # only a round's first SFT step restarts
    assert not CDG(CDGConfig(mode="rest", restart_each_round=False)).restarts_policy(first)
    state = json.loads(json.dumps(algo.state()))  # checkpoints store it as json
    other = CDG(CDGConfig(mode="rest", play_steps=2, sft_steps=3))
    other.load_state(state)
    assert other.state() == algo.state() and (other.phase, other.phase_step) == ("sft", 1)
    for _ in range(2):
        other._advance()
    assert (other.round, other.phase, other.phase_step) == (1, "play", 0)
    with pytest.raises(ValueError, match="mode 'rest'"):
        CDG(CDGConfig(mode="online")).load_state(state)


def test_prepare_and_loss_follow_the_phase(tokenizer, templates):
    games, _ = play(tokenizer, templates)
    algo = CDG(CDGConfig(mode="rest", kl_coef=0.0))
    play_table = make_experience(game_rows(games, templates, 0.5, 0, "play"))
    assert table_phase(play_table) == "play" and algo.prepare(play_table) is None  # no update while playing
    metrics = algo.prepare_metrics(play_table)
    assert metrics["cdg/solution_acc"] == 0.5 and metrics["cdg/final_acc"] == pytest.approx(2 / 3)
    assert metrics["cdg/helpful_flip_rate"] == pytest.approx(2 / 3) and metrics[
        "cdg/misleading_flip_rate"
    ] == pytest.approx(1 / 3)

    algo.pool["prover"] = [
        sft_sample(r) for r in game_rows(games, templates, 0.5, 0, "play") if r["meta"]["role"] == "prover"
    ]

    sft = algo._sft_table(SeededContext())
    assert table_phase(sft) == "sft" and sft.num_rows == min(64, len(algo.pool["prover"]))
    assert set(sft.column("policy_version").to_pylist()) == {SeededContext.policy_version}
    assert algo.prepare_metrics(sft)["cdg/sft_prover"] == sft.num_rows
    batch = algo.prepare(sft)
    logprobs = torch.log(torch.rand(batch.response_mask.shape) * 0.9 + 0.05)
    from algorithms.sft import sft_loss
    from rlsys.contract import ModelOutputs

    loss, metrics = algo.loss(ModelOutputs(None, logprobs), batch)
    assert torch.isclose(loss, sft_loss(logprobs, batch.response_mask)) and "loss/sft" in metrics

    online = CDG(CDGConfig(mode="online", kl_coef=0.0))
    table = make_experience(game_rows(games, templates, 0.5, 0, "online"))
    batch = online.prepare(table)
    groups = np.array(table.column("group").to_pylist())
    adv = batch.advantages.sum(1) / batch.response_mask.sum(1)
    for g in set(groups):
        assert abs(float(adv[torch.from_numpy(groups == g)].sum())) < 1e-4  # group-relative
    loss, metrics = online.loss(ModelOutputs(None, batch.old_logprobs.clone().requires_grad_()), batch)
    assert "loss/policy" in metrics and "loss/sft" not in metrics


def test_bad_config_is_one_line_error():
    from algorithms.base import build_algorithm

    for override, key in [
        ("algorithm.mode=offline", "algorithm.mode"),
        ("algorithm.eta=-1", "algorithm.eta"),
        ("algorithm.helpful_threshold=1.5", "algorithm.helpful_threshold"),
        ("algorithm.rounds=2", "algorithm.rounds"),
        ("algorithm.models=two", "algorithm.models"),
        ("algorithm.advantage=ppo", "algorithm.advantage"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
            build_algorithm(load_config("configs/cdg.yaml", [override]))
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="'gae' is for mode online") as e:
        build_algorithm(load_config("configs/cdg.yaml", ["algorithm.mode=rest", "algorithm.advantage=gae"]))
    assert "\n" not in str(e.value)
    for override in ("rollout.backend=vllm", "trainer.weight_sync=broadcast"):  # one model per role: hf, object store
        with pytest.raises(ConfigError, match="trains 3 policies") as e:
            build_algorithm(load_config("configs/cdg.yaml", ["algorithm.models=per_role", override]))
        assert "\n" not in str(e.value)


def test_gae_mode_is_ppo_with_a_value_head_stepping_over_the_critique(tokenizer, templates):
    """advantage=gae: a value head only in online play; the episode reward sits on a row's last
    token and GAE steps over the tokens its model did not write (in the prover's row, the
    critique), so with zero values the advantage at z's last token is lam^len(z') x reward; the
    loss is PPO's, value loss included; `values_by_model` asks each row's own model."""
    from algorithms.ppo import ppo_loss
    from rlsys.contract import ModelOutputs

    assert not CDG(CDGConfig()).needs_value_head and not CDG(CDGConfig(mode="rest")).needs_value_head
    algo = CDG(CDGConfig(advantage="gae", kl_coef=0.0, whiten_advantages=False, lam=0.9, models="prover_critic"))
    assert algo.needs_value_head
    games, _ = play(tokenizer, templates)
    table = make_experience(game_rows(games, templates, 0.5, 0, "online"))

    class ValueContext:  # stands in for the controller's ActorContext: only `values` is used here
        asked = []

        def values(self, part, policy=None):
            self.asked.append((policy, sorted({m["role"] for m in meta_of(part)})))
            return [[0.0] * len(r) for r in part.column("response_ids").to_pylist()]

    ctx = ValueContext()
    values = algo._values_by_model(ctx, table)
    assert sorted(ctx.asked) == [("critic", ["helpful", "misleading"]), ("prover", ["prover"])]
    from algorithms.base import set_token_column

    table = set_token_column(table, "values", values)
    table = set_token_column(table, "ref_logprobs", table.column("logprobs").to_pylist())
    batch = algo.prepare(table)
    metas, rewards = meta_of(table), table.column("reward").to_pylist()
    prover = next(i for i, m in enumerate(metas) if m["role"] == "prover" and rewards[i] != 0)
    mask = batch.response_mask[prover]
    on = torch.nonzero(mask).squeeze(1).tolist()
    gaps = [a for a, b in zip(on, on[1:]) if b != a + 1]
    assert len(gaps) == 1  # z, then the critique (mask 0), then z'
    z_last, final_len = gaps[0], len([t for t in on if t > gaps[0]])
    assert batch.advantages[prover, z_last].item() == pytest.approx(0.9**final_len * rewards[prover], rel=1e-5)
    assert bool(algo.gradient_rows(batch).all())
    outputs = ModelOutputs(
        None, batch.old_logprobs.clone().requires_grad_(), values=torch.zeros_like(batch.old_logprobs)
    )
    loss, metrics = algo.loss(outputs, batch)
    assert torch.isclose(loss, ppo_loss(outputs, batch, algo.config)[0]) and metrics["loss/value"] > 0


# ---- two steps on a real local Ray cluster -----------------------------------------------------
TINY = [
    *TINY_JOB,
    "trainer.eval_every=2",
    "rollout.max_new_tokens=4",
    "rollout.num_workers=1",
    "trainer.steps=2",
    "algorithm.solutions=2",
    "algorithm.critiques=2",
    "algorithm.finals=2",
]
MODES = {
    "online": ([], ["loss/policy", "kl_ref", "cdg/prover_reward", "cdg/solution_acc", "groups_without_signal"]),
    # PPO with a value head on each of two models (the critic model's rows get its own values)
    "online-gae": (
        ["algorithm.advantage=gae", "algorithm.models=prover_critic"],
        ["loss/policy", "loss/value", "critic/loss/value", "cdg/prover_reward"],
    ),
    # a warm-up that memorises 4 problems (about 1 in 5 sampled solutions right) and thresholds 0
    # (a sample with one success is kept): the first play step fills the pool
    "rest": (
        [
            "task.num_train=4",
            "sft.steps=30",
            "sft.lr=0.01",
            "algorithm.solutions=4",
            "algorithm.play_steps=1",
            "algorithm.sft_steps=1",
            "algorithm.prover_threshold=0",
            "algorithm.helpful_threshold=0",
            "algorithm.misleading_threshold=0",
            "trainer.checkpoint_every=2",
        ],
        [],
    ),
}


@pytest.mark.integration
@pytest.mark.parametrize("mode", sorted(MODES))
def test_two_steps_on_a_local_cluster(ray_cluster, tmp_path, mode):
    from rlsys.run.controller import Controller

    extra, keys = MODES[mode]
    cfg = load_config(
        "configs/cdg.yaml",
        [*TINY, *extra, f"algorithm.mode={mode.split('-')[0]}", f"run.output_dir={tmp_path}", f"run.name=cdg-{mode}"],
    )
    controller = Controller(cfg, tmp_path / mode, progress=False)
    summary = controller.run()
    rows = [json.loads(l) for l in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and summary["steps"] == 2
    for row in rows:
        for key in keys:
            assert key in row, key
        assert all(v == v for v in row.values() if isinstance(v, float))  # no NaN
    version = ray_cluster.get(controller.workers[0].policy_version.remote())
    if mode.startswith("online"):
        assert rows[0]["samples"] == 4 * 2 * 2 * (1 + 2) and version == 2
        return
    # rest: step 1 plays (no update), step 2 fine-tunes on the pool
    assert rows[0]["cdg/phase_sft"] == 0 and "loss" not in rows[0] and rows[0]["cdg/pool_added"] > 0
    assert rows[1]["cdg/phase_sft"] == 1 and rows[1]["loss/sft"] > 0 and version == 1
    assert rows[1]["samples"] == min(64, rows[0]["cdg/pool_added"])
    state = json.loads((tmp_path / mode / "checkpoints" / "step_2" / "state.json").read_text())["algorithm"]
    assert (state["mode"], state["round"], state["phase"]) == ("rest", 1, "play")
    assert sum(len(v) for v in state["pool"].values()) == rows[0]["cdg/pool_added"]
    # the round's fine-tuning started from the initial model; a restart puts its weights back exactly
    assert "time/restart" in rows[1] and "time/restart" not in rows[0]
    import numpy as np

    from actors.modeling import state_dict_numpy
    from rlsys.models import load_model

    initial = state_dict_numpy(load_model(tmp_path / mode / "policy_init"))
    learner = controller.learners[0]
    assert any(not np.array_equal(initial[k], v) for k, v in ray_cluster.get(learner.weights.remote()).items())
    ray_cluster.get(learner.restart.remote(str(tmp_path / mode / "policy_init")))
    restarted = ray_cluster.get(learner.weights.remote())
    assert restarted.keys() == initial.keys() and all(np.array_equal(initial[k], v) for k, v in restarted.items())


@pytest.mark.integration
def test_one_model_per_role_learns_from_its_own_rows_and_resumes(ray_cluster, tmp_path):
    """algorithm.models=per_role, ReST: three models start from the warmed-up policy; the
    round's fine-tuning changes exactly the models whose role kept samples; each is saved
    beside the prover's in the checkpoint and comes back from it on resume."""
    import numpy as np

    from actors.modeling import state_dict_numpy
    from rlsys.models import load_model
    from rlsys.run.controller import Controller

    run_dir = tmp_path / "per_role"
    overrides = [
        *TINY,
        *MODES["rest"][0],
        "algorithm.mode=rest",
        "algorithm.models=per_role",
        f"run.output_dir={tmp_path}",
        "run.name=per_role",
    ]
    first = Controller(load_config("configs/cdg.yaml", [*overrides, "trainer.steps=2"]), run_dir, progress=False)
    first.run()
    assert list(first.policies) == ["prover", "helpful", "misleading"]
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pool = json.loads((run_dir / "checkpoints" / "step_2" / "state.json").read_text())["algorithm"]["pool"]
    assert pool["prover"] and rows[1]["loss/sft"] > 0
    initial = state_dict_numpy(load_model(run_dir / "policy_init"))
    trained = {}
    for name, policy in first.policies.items():
        trained[name] = ray_cluster.get(policy.learners[0].weights.remote())
        changed = any(not np.array_equal(initial[k], v) for k, v in trained[name].items())
        assert changed == bool(pool[name]), name  # only its own role's rows train a model
        assert (f"{name}/loss/sft" in rows[1]) == (bool(pool[name]) and name != "prover")
        assert ray_cluster.get(policy.workers[0].policy_version.remote()) == 1
        played = name == "prover" or rows[0][f"cdg/{name}_critiques"] > 0
        assert (ray_cluster.get(policy.workers[0].stats.remote())["tokens"] > 0) == played, name  # its own worker
        sub = "" if name == "prover" else f"-{name}"
        assert (run_dir / "checkpoints" / "step_2" / f"learner{sub}").is_dir()
        assert (run_dir / "checkpoints" / "step_2" / f"hf{sub}" / "config.json").exists()
    # the first SFT round fine-tuned the prover and helpful models on different rows: they differ
    assert pool["helpful"] and any(not np.array_equal(trained["prover"][k], v) for k, v in trained["helpful"].items())
    first.shutdown()

    resumed = Controller(load_config("configs/cdg.yaml", [*overrides, "trainer.steps=3"]), run_dir, progress=False)
    assert resumed.run(resume=True)["steps"] == 3  # step 3 plays: no update, the restored weights serve
    for name, policy in resumed.policies.items():
        back = ray_cluster.get(policy.learners[0].weights.remote())
        assert all(np.array_equal(trained[name][k], v) for k, v in back.items()), name
