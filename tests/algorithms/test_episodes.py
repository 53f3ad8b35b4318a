"""algorithms/episodes.py: the multi-turn rollout, in-process on a real tiny policy (the rollout
worker's HFBackend), the reward worker with the run's reward function and the reference worker.

The envs here are real Env implementations written for the tests: their turns do not depend on
what the untrained policy writes (it writes noise), so each test knows how its episodes go.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from algorithms.episodes import (
    Episode,
    EpisodeSettings,
    episode_metrics,
    play_episodes,
    sample_episodes,
    summary_metrics,
)
from envs.registry import make_env_factory, make_task
from envs.tool_env import ToolEnv
from envs.tools import load_tools
from rlsys.config import ConfigError, load_config
from rlsys.contract import Prompt
from rlsys.generation import SamplingParams
from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer
from rlsys.prompts import prompt_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = TinyModelSpec(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
)
ROWS = 12  # agent-arithmetic rows the tests' task holds


class EchoEnv:
    """Observations of `obs_chars` characters, a reward of turn/10 per turn, done at the row's
    `done_at`-th turn (never when it is None). Records when each step ended."""

    obs_chars = 6

    def __init__(self, task):
        self.task, self.turn, self.ended = task, 0, []

    def reset(self, row):
        self.row, self.turn = row, 0
        return self.task.messages(row)

    def step(self, text):
        self.turn += 1
        if self.row.get("slow") and self.turn == 1:
            time.sleep(1.0)
        self.ended.append(time.monotonic())
        done = self.row.get("done_at") == self.turn
        return (None if done else "x" * self.obs_chars), self.turn / 10, done, {"correct": done}


class ScriptedToolEnv(ToolEnv):
    """The real ToolEnv (calculator, call penalties, the answer left to the run's reward), playing
    the row's own demonstration whatever the policy writes: a calculator call, then the answer."""

    def step(self, text):
        script = [m["content"] for m in self.row["demonstration"] if m["role"] == "assistant"]
        return super().step(script[self.turn])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(task, tokenizer, model dir, job config) over the first ROWS agent-arithmetic rows."""
    tmp = tmp_path_factory.mktemp("episodes")
    rows = [json.loads(line) for line in Path("configs/data/agent_arithmetic_train.jsonl").read_text().splitlines()]
    path = tmp / "agent.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:ROWS]))
    cfg = load_config("configs/agent.yaml", [f"task.train_path={path}", f"task.eval_path={path}"])
    task = make_task(cfg.task, tmp / "data", 0)
    tokenizer = train_tokenizer(task.corpus() * 4, 400)
    model_dir = save_model_dir(build_tiny_model(SPEC, tokenizer, seed=0), tokenizer, tmp / "policy")
    return task, tokenizer, model_dir, cfg


class LocalContext:
    """The RolloutContext parts the multi-turn rollout uses, in-process: the rollout worker's
    HFBackend (every generation call recorded), the reward worker with the config's reward
    function (math), the reference worker."""

    policy_version = 0

    def __init__(self, setup, make_env, max_turns=3, max_tokens=256, tool_schemas=None, max_new_tokens=8):
        from actors.reference import ReferenceWorker
        from actors.reward import RewardWorker
        from actors.rollout import HFBackend
        from envs.reward_runner import build_scorer

        self.task, self.tokenizer, model_dir, cfg = setup
        self.backend = HFBackend(str(model_dir))
        self.reward = RewardWorker(str(model_dir), task=self.task, scorer=build_scorer(cfg.reward, self.task))
        self.reference = ReferenceWorker(str(model_dir), 1.0)
        self.episodes = EpisodeSettings.for_tokenizer(self.tokenizer, make_env, max_turns, max_tokens, tool_schemas)
        self.max_new_tokens, self.seed = max_new_tokens, 0
        self.calls: list[tuple[float, list]] = []  # (when it returned, its generations)
        self.lock = threading.Lock()

    def sampling(self, **overrides):
        base = SamplingParams(max_new_tokens=self.max_new_tokens, stop_token_ids=(self.tokenizer.eos_token_id,))
        return dataclasses.replace(base, **overrides)

    def next_seed(self):
        self.seed += 1
        return self.seed

    def more_prompts(self, n):
        """The next n training rows after those handed out so far (DAPO's refill), as prompts."""
        rows = self.task.rows("train")
        self.handed_out = getattr(self, "handed_out", 0) + n
        picked = [rows[i % len(rows)] for i in range(self.handed_out - n, self.handed_out)]
        return [
            Prompt(f"more{self.handed_out - n + i}", *prompt_ids(self.task, self.tokenizer, r), r)
            for i, r in enumerate(picked)
        ]

    def generate(self, requests):
        gens = self.backend.generate(requests)
        self.calls.append((time.monotonic(), [(list(r.prompt_ids), g) for r, g in zip(requests, gens)]))
        return gens

    def score(self, table):
        return self.reward.score(table)

    def token_rewards(self, table):
        return None  # no task.shaping with episodes

    def values(self, table):
        return [[0.0] * len(r) for r in table.column("response_ids").to_pylist()]  # a value head's estimates: 0 here

    def ref_logprobs(self, table):
        return self.reference.logprobs(table)

    def close(self):
        if self.reward.scorer is not None:
            self.reward.scorer.close()


def prompts_of(setup, rows) -> list[Prompt]:
    task, tokenizer = setup[0], setup[1]
    return [Prompt(f"p{i}", *prompt_ids(task, tokenizer, r), r) for i, r in enumerate(rows)]


def rows_with(setup, n, **columns) -> list[dict]:
    return [{**r, **columns} for r in setup[0].rows("train")[:n]]


# ---- the episode state machine -------------------------------------------------------------
def test_episodes_end_when_done_at_max_turns_or_at_the_token_budget(setup):
    task = setup[0]
    ctx = LocalContext(setup, lambda: EchoEnv(task), max_turns=3)
    try:
        rows = [{**rows_with(setup, 1)[0], "done_at": 2}, {**rows_with(setup, 1)[0], "done_at": None}]
        done, capped = play_episodes(ctx, prompts_of(setup, rows), 1, ctx.sampling())
        assert (done.stop, done.turns, done.rewards, done.correct) == ("done", 2, [0.1, 0.2], True)
        assert (capped.stop, capped.turns, capped.rewards) == ("max_turns", 3, [0.1, 0.2, 0.3])
        # a budget a few tokens past the prompt: the turn is cut to what is left, the next observation does not fit
        prompt_len = len(done.conversation.prompt_ids)
        budget = prompt_len + 6
        ctx.episodes = dataclasses.replace(ctx.episodes, max_tokens=budget)
        (tight,) = play_episodes(ctx, prompts_of(setup, rows[1:]), 1, ctx.sampling())
        assert tight.stop == "max_tokens" and tight.turns == 1 and tight.conversation.num_tokens <= budget
        assert tight.conversation.num_tokens - prompt_len <= 6
        # the whole budget is the prompt's: one line naming it
        ctx.episodes = dataclasses.replace(ctx.episodes, max_tokens=prompt_len)
        with pytest.raises(ValueError, match=f"is {prompt_len} tokens: no room for a turn within env.max_tokens"):
            play_episodes(ctx, prompts_of(setup, rows[1:]), 1, ctx.sampling())
    finally:
        ctx.close()


class LastWordEnv(EchoEnv):
    """EchoEnv with a last word on an episode stopped before done: +1 and correct, from a pool
    thread (it may run code: RLEF's private tests); the threads it ran on are recorded."""

    def end_early(self):
        self.ended_on = threading.current_thread()
        return 1.0, {"correct": True}


def test_an_env_has_its_last_word_on_an_episode_stopped_before_done(setup):
    """At max_turns and at the token budget `end_early` adds its reward to the last turn's and
    sets `correct`, run in the rollout's thread pool; a done episode never asks for it."""
    task = setup[0]
    ctx = LocalContext(setup, lambda: LastWordEnv(task), max_turns=3)
    try:
        rows = [{**rows_with(setup, 1)[0], "done_at": 2}, {**rows_with(setup, 1)[0], "done_at": None}]
        done, capped = play_episodes(ctx, prompts_of(setup, rows), 1, ctx.sampling())
        assert (done.stop, done.rewards, done.correct) == ("done", [0.1, 0.2], True)
        assert not hasattr(done.env, "ended_on")
        assert (capped.stop, capped.turns, capped.rewards, capped.correct) == ("max_turns", 3, [0.1, 0.2, 1.3], True)
        ctx.episodes = dataclasses.replace(ctx.episodes, max_tokens=len(done.conversation.prompt_ids) + 6)
        (tight,) = play_episodes(ctx, prompts_of(setup, rows[1:]), 1, ctx.sampling())
        assert (tight.stop, tight.turns, tight.rewards, tight.correct) == ("max_tokens", 1, [1.1], True)
        assert {capped.env.ended_on, tight.env.ended_on}.isdisjoint({threading.main_thread()})
    finally:
        ctx.close()


def test_a_row_keeps_the_policy_tokens_as_sampled_and_puts_each_turn_reward_on_its_last_token(setup):
    task, tokenizer = setup[0], setup[1]
    ctx = LocalContext(setup, lambda: EchoEnv(task), max_turns=3)
    try:
        rows = rows_with(setup, 2, done_at=None)
        table = sample_episodes(ctx, prompts_of(setup, rows), 2, with_ref=True)
        assert table.num_rows == 4 and table.column("group").to_pylist() == ["p0", "p0", "p1", "p1"]
        sampled = [g for _, call in ctx.calls for g in call]  # (prompt ids, generation) of every turn
        eot = ctx.episodes.encoder.end_of_turn_id
        for row in table.to_pylist():
            meta = json.loads(row["meta"])
            full = row["prompt_ids"] + row["response_ids"]
            mask, logprobs = row["loss_mask"], row["logprobs"]
            turns = [(p, g) for p, g in sampled if full[: len(p)] == p and full[len(p) : len(p) + len(g.response_ids)]]
            turns = [(p, g) for p, g in turns if full[len(p) : len(p) + len(g.response_ids)] == g.response_ids]
            assert len(turns) == meta["turns"] == 3 and meta["stop"] == "max_turns"
            expected_mask = [0] * len(row["response_ids"])
            for p, g in turns:  # each turn's ids and logprobs, exactly as sampled, at its place in the row
                start = len(p) - len(row["prompt_ids"])
                expected_mask[start : start + len(g.response_ids)] = [1] * len(g.response_ids)
                assert logprobs[start : start + len(g.response_ids)] == pytest.approx(g.logprobs, abs=1e-6)
            assert mask == expected_mask
            assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if m == 0)
            # between the turns: the template's user message of each observation, encoded once
            env_text = tokenizer.decode([t for t, m in zip(row["response_ids"], mask) if m == 0])
            assert env_text.count("<|im_start|>user\nxxxxxx<|im_end|>") == 2
            assert env_text.count("<|im_start|>assistant\n") == 2
            # each turn's reward on its last sampled token; they sum to the reward
            ends = [len(p) - len(row["prompt_ids"]) + len(g.response_ids) - 1 for p, g in turns]
            assert [i for i, r in enumerate(row["token_rewards"]) if r] == ends
            assert [row["token_rewards"][i] for i in ends] == pytest.approx([0.1, 0.2, 0.3])
            assert row["reward"] == pytest.approx(0.6) == pytest.approx(sum(row["token_rewards"]))
            assert len(row["ref_logprobs"]) == len(row["response_ids"])
            assert all(g.response_ids[-1] == eot or g.finish_reason == "length" for _, g in turns)
    finally:
        ctx.close()


def test_a_slow_env_step_does_not_hold_up_the_other_episodes(setup):
    """One episode's first step sleeps 1 s; meanwhile the other three play all their 3 turns."""
    task = setup[0]
    envs: list[EchoEnv] = []

    def make():
        envs.append(EchoEnv(task))
        return envs[-1]

    ctx = LocalContext(setup, make, max_turns=3)
    try:
        rows = [{**r, "done_at": 3, "slow": i == 0} for i, r in enumerate(rows_with(setup, 4))]
        start = time.monotonic()
        episodes = play_episodes(ctx, prompts_of(setup, rows), 1, ctx.sampling())
        wall = time.monotonic() - start
        slow, fast = envs[0], envs[1:]
        assert all(e.stop == "done" and e.turns == 3 for e in episodes)
        slow_first_step = slow.ended[0]
        assert all(len(e.ended) == 3 and e.ended[-1] < slow_first_step for e in fast)
        generated_meanwhile = [t for t, call in ctx.calls if t < slow_first_step]
        assert len(generated_meanwhile) >= 3  # the first turns, then the fast episodes' 2nd and 3rd
        # stepped one episode at a time, the other episodes would have waited the 1 s
        assert wall < 1.0 + 1.0
    finally:
        ctx.close()


def test_lockstep_plays_turn_by_turn_and_a_slow_step_changes_no_token(setup):
    """env.lockstep: every generation call waits for all the steps in flight, so the calls are one
    per turn with every episode in order, and which episode is slow (timing) changes no sampled id."""
    task = setup[0]
    played = []
    for slow in (0, 2):
        ctx = LocalContext(setup, lambda: EchoEnv(task), max_turns=3)
        ctx.episodes = dataclasses.replace(ctx.episodes, lockstep=True)
        try:
            rows = [{**r, "done_at": 3, "slow": i == slow} for i, r in enumerate(rows_with(setup, 4))]
            prompts = prompts_of(setup, rows)
            episodes = play_episodes(ctx, prompts, 1, ctx.sampling(seed=7))
            assert [len(call) for _, call in ctx.calls] == [4, 4, 4]
            for _, call in ctx.calls:  # episode order: each call's k-th request extends episode k's prompt
                assert all(ids[: len(p.prompt_ids)] == list(p.prompt_ids) for (ids, _), p in zip(call, prompts))
            played.append([list(e.conversation.ids) for e in episodes])
        finally:
            ctx.close()
    assert played[0] == played[1]


def test_tool_episodes_append_tool_results_count_calls_and_grade_the_answer_with_the_run_reward(setup):
    task, tokenizer, _, cfg = setup
    tools = load_tools(["calculator"])
    ctx = LocalContext(
        setup,
        lambda: ScriptedToolEnv(task, tools, max_turns=3, call_penalty={"ok": 0.05}, grade_answers=False),
        tool_schemas=[t.schema for t in tools],
    )
    try:
        rows = rows_with(setup, 2)
        table = sample_episodes(ctx, prompts_of(setup, rows), 1, with_ref=False)
        for row, source in zip(table.to_pylist(), rows):
            meta = json.loads(row["meta"])
            assert meta["turns"] == 2 and meta["stop"] == "done" and meta["correct"] is True
            assert meta["tools"] == {"ok": 1, "malformed": 0, "unknown_tool": 0, "error": 0, "timeout": 0}
            # the calculator's result in the template's tool role; the answer graded by reward.function math
            env_text = tokenizer.decode([t for t, m in zip(row["response_ids"], row["loss_mask"]) if m == 0])
            assert f"<|im_start|>tool\n{source['answer']}<|im_end|>" in env_text
            assert meta["turn_rewards"] == pytest.approx([-0.05, 1.0]) and row["reward"] == pytest.approx(0.95)
        metrics = episode_metrics(table)
        assert metrics["tools/ok"] == 2 and metrics["tools/well_formed_per_episode"] == 1.0
        assert metrics["tools/malformed_share"] == 0.0 and metrics["episode/correct"] == 1.0
        assert metrics["episode/turns_mean"] == 2.0 and metrics["episode/stop_done"] == 1.0
    finally:
        ctx.close()


def test_summary_metrics_rates():
    def summary(turns, stop, **tools):
        counts = {"ok": 0, "malformed": 0, "unknown_tool": 0, "error": 0, "timeout": 0, **tools}
        return {"turns": turns, "stop": stop, "correct": stop == "done", "tools": counts, "episode_tokens": 10}

    metrics = summary_metrics([summary(2, "done", ok=2, malformed=1), summary(3, "max_turns", unknown_tool=1)])
    assert metrics["tools/calls"] == 4 and metrics["tools/malformed"] == 1 and metrics["tools/unknown"] == 1
    assert metrics["tools/well_formed_per_episode"] == 1.5 and metrics["tools/malformed_share"] == 0.25
    assert metrics["episode/turns_mean"] == 2.5 and metrics["episode/stop_max_turns"] == 0.5
    assert summary_metrics([]) == {}


def test_an_episode_that_is_not_done_needs_an_observation(setup):
    class Mute:
        def step(self, text):
            return None, 0.0, False, {}

    ctx = LocalContext(setup, lambda: Mute(), max_turns=3)
    try:
        episode = Episode(prompts_of(setup, rows_with(setup, 1))[0], Mute())
        episode.start(setup[0].messages(episode.prompt.meta), ctx.episodes)
        episode.add_turn([5, 6], [-1.0, -1.0], "length", 0)
        with pytest.raises(ValueError, match="Mute: step\\(\\) gave no observation for an episode not done"):
            episode.take_step((None, 0.0, False, {}), ctx.episodes)
    finally:
        ctx.close()


# ---- the env section: factories, a user's class, one-line errors -----------------------------
USER_ENV = '''
class CountdownEnv:
    """Done after two turns; the first observation is the row's prompt text."""

    def __init__(self, task):
        self.task = task

    def reset(self, row):
        self.turns = 0
        return self.task.prompt_text(row)

    def step(self, text):
        self.turns += 1
        return ("again" if self.turns < 2 else None), 0.5, self.turns >= 2, {}
'''


def test_a_users_env_class_is_loaded_by_file_path_and_plays(setup, tmp_path):
    task = setup[0]
    (tmp_path / "my_env.py").write_text(USER_ENV)
    cfg = load_config(
        "configs/agent.yaml", [f"env.name={tmp_path}/my_env.py:CountdownEnv", "env.tools=[]", "env.call_penalty={}"]
    )
    factory = make_env_factory(cfg.env, task)
    assert factory.tool_schemas is None and type(factory.make()).__name__ == "CountdownEnv"
    ctx = LocalContext(setup, factory.make, max_turns=4)
    try:
        table = sample_episodes(ctx, prompts_of(setup, rows_with(setup, 1)), 2, with_ref=False)
        assert table.column("reward").to_pylist() == [1.0, 1.0]
        assert [json.loads(m)["turns"] for m in table.column("meta").to_pylist()] == [2, 2]
    finally:
        ctx.close()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["env.name=nonsense"], "env.name = 'nonsense': Value error, is not tools, path/to/file.py:ClassName nor"),
        (["env.tools=[]"], "env.tools = []: Value error, must name at least one tool with env.name 'tools'"),
        (["env.tools=['bad tool']"], "'bad tool' is not a built-in (calculator, python) nor package.module:function"),
        (["env.tools=[calculator, calculator]"], "names a tool twice"),
        (["env.call_penalty={slow: 1}"], "'slow' is not a call status (ok, malformed, unknown_tool, error, timeout)"),
        (["env.max_turns=0"], "env.max_turns = 0: Input should be greater than or equal to 1"),
        (["env.timeout_s=0"], "env.timeout_s = 0: Input should be greater than 0"),
        (["env.name=null"], "are the tools of env.name 'tools' (a user's env declares its own)"),
        (["env.name=no/such/file.py:Env", "env.tools=[]", "env.call_penalty={}"], "no file no/such/file.py in"),
        (["env.max_tokens=512"], "'env.max_tokens'=512: above the tiny model's context (model.max_position_"),
        (["algorithm.name=vineppo"], "'env.name'='tools': algorithm 'vineppo' has a rollout of its own"),
        (["task.shaping=[repetition]"], "'task.shaping' shapes one response, not an episode of env.name"),
        (["env.tools=[json:nothing_here]"], "env.tools = ['json:nothing_here']: tool 'json:nothing_here': json has no"),
        (["env.name=json:JSONDecoder", "env.tools=[]", "env.call_penalty={}"], "JSONDecoder(task) failed: TypeError"),
        (["env.name=json:dumps", "env.tools=[]", "env.call_penalty={}"], "env.name = 'json:dumps': 'dumps' is not a"),
    ],
)
def test_env_config_errors_are_one_line(setup, overrides, message):
    from algorithms.base import build_algorithm

    with pytest.raises(ConfigError) as e:
        cfg = load_config("configs/agent.yaml", overrides)
        build_algorithm(cfg)
        make_env_factory(cfg.env, setup[0])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_config_knows_the_tools_built_ins_and_call_statuses():
    from envs.tools import BUILTINS, STATUSES
    from rlsys.config import BUILTIN_TOOLS, CALL_STATUSES

    assert BUILTIN_TOOLS == BUILTINS and CALL_STATUSES == STATUSES


# ---- the warm-up on multi-turn demonstrations -----------------------------------------------
def test_the_warm_up_trains_on_the_assistant_turns_of_a_multi_turn_demonstration(setup):
    from algorithms.sft import sft_batch, warmup

    task, tokenizer, _, cfg = setup
    factory = make_env_factory(cfg.env, task)
    rows = task.rows("train")[:3]
    batch = sft_batch(tokenizer, rows, task, factory.tool_schemas)
    settings = EpisodeSettings.for_tokenizer(tokenizer, factory.make, 3, 256, factory.tool_schemas)
    for i, row in enumerate(rows):
        ids = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
        taught = tokenizer.decode([t for t, m in zip(ids[1:], batch.response_mask[i].tolist()) if m])
        demo = [m["content"] for m in row["demonstration"] if m["role"] == "assistant"]
        assert taught == "".join(f"{text}<|im_end|>" for text in demo)
        untaught = tokenizer.decode([t for t, m in zip(ids[1:], batch.response_mask[i].tolist()) if not m])
        assert f"<|im_start|>tool\n{row['answer']}<|im_end|>" in untaught  # the tool message: masked out
        episode = Episode(Prompt("p", [], "", row), factory.make())
        episode.start(factory.make().reset(row), settings)
        assert ids[: episode.conversation.prompt_length] == episode.conversation.prompt_ids  # the episodes' prompt
    # flawed demonstrations are message lists too; the loss comes down over a few steps
    model = build_tiny_model(SPEC, tokenizer, seed=0)
    losses = warmup(model, tokenizer, task, task.rows("train"), 8, 4, 3e-3, 0, demo_error=0.5, tools=None)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_demonstration_columns_may_hold_messages_that_open_with_the_assistant(tmp_path):
    from envs.dataset_task import DatasetTask
    from envs.datasets import DatasetError

    row = {"prompt": "2+2?", "answer": "4", "demo": [{"role": "tool", "content": "4"}]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match="row 1: 'demo' opens with a 'tool' message: a demonstration opens with"):
        DatasetTask(path, path, demonstration_key="demo").rows("train")
    path.write_text(json.dumps({**row, "demo": 7}) + "\n")
    with pytest.raises(DatasetError, match="'demo' is int: expected a string or a list of chat messages"):
        DatasetTask(path, path, demonstration_key="demo").rows("train")
    good = {**row, "demo": [{"role": "assistant", "content": "4"}]}
    path.write_text(json.dumps(good) + "\n")
    task = DatasetTask(path, path, demonstration_key="demo")
    assert task.demonstration(task.rows("train")[0]) == good["demo"]
    assert task.corpus() == ["user\n2+2?\nassistant\n4"]


# ---- every algorithm that plays episodes prepares their rows on the policy's tokens only -----
def test_the_algorithms_that_play_episodes_train_on_the_policy_tokens_only(setup):
    from algorithms.base import available, get_algorithm, set_token_column
    from algorithms.dapo import overlong_penalty, policy_turn_lengths
    from rlsys.contract import PlaysEpisodes

    task = setup[0]
    ctx = LocalContext(setup, lambda: EchoEnv(task), max_turns=3)
    names = [n for n in available() if issubclass(get_algorithm(n), PlaysEpisodes)]
    assert {"grpo", "ppo", "rloo", "dapo"} <= set(names)
    tables = {}
    try:
        prompts = prompts_of(setup, rows_with(setup, 2, done_at=None))
        table = sample_episodes(ctx, prompts, 2, with_ref=True)
        for name in names:  # each algorithm's own rollout (its columns: DAPO's length penalty, ...) over episodes
            cls = get_algorithm(name)
            tables[name] = cls(cls.Config(group_size=2)).rollout(ctx, prompts)
    finally:
        ctx.close()
    for name in names:
        cls = get_algorithm(name)
        played = tables[name]
        assert played.num_rows == 4 and all(json.loads(m)["turns"] == 3 for m in played.column("meta").to_pylist())
        # distinct returns within each group, so group-relative advantages are not all zero
        played = played.set_column(played.schema.get_field_index("reward"), "reward", [[0.6, 0.1, 0.3, 0.9]])
        values = [[0.0] * len(r) for r in played.column("response_ids").to_pylist()]  # a value head's: 0 here
        batch = cls(cls.Config(group_size=2)).prepare(set_token_column(played, "values", values))
        assert bool((batch.advantages[batch.response_mask == 0] == 0).all()), name  # none on the env's tokens
        assert bool((batch.advantages[batch.response_mask.bool()] != 0).any()), name
    # DAPO's length penalty reads the longest policy turn (8 tokens at most here), not the episode's length
    dapo = tables["dapo"]
    turn_cap = ctx.max_new_tokens
    for penalty, mask in zip(dapo.column("overlong_penalty").to_pylist(), dapo.column("loss_mask").to_pylist()):
        longest = max(policy_turn_lengths(mask))
        assert longest <= turn_cap < len(mask)
        assert penalty == pytest.approx(float(overlong_penalty([longest], turn_cap, round(0.2 * turn_cap))[0]))
    values = [[0.0] * len(r) for r in table.column("response_ids").to_pylist()]
    table = table.set_column(table.schema.get_field_index("reward"), "reward", [[0.6, 0.1, 0.3, 0.9]])
    # PPO's GAE reads each turn's reward on its last token: without KL, values or discount, a token's
    # advantage is the rewards of its turn and the turns after it (0.1 + 0.2 + 0.3, 0.2 + 0.3, 0.3)
    ppo = get_algorithm("ppo")
    batch = ppo(ppo.Config(kl_coef=0.0, lam=1.0, whiten_advantages=False)).prepare(
        set_token_column(table, "values", values)
    )
    for row in range(len(batch)):
        advantages = batch.advantages[row][batch.response_mask[row].bool()].tolist()
        assert sorted(set(round(a, 5) for a in advantages)) == [0.3, 0.5, 0.6]
        assert advantages == sorted(advantages, reverse=True)  # turn by turn


# ---- an evaluator attached to a multi-turn run plays its episodes ------------------------------
def test_an_attached_evaluator_plays_the_runs_episodes_and_scores_their_final_answers(setup):
    """EvaluatorWorker (the attached evaluator's actor class, in-process here) over the run's env:
    the scripted calculator env plays each row's demonstration, so every episode is a tool call, its
    result and the right answer. `accuracy` follows the run's reward (math on the \\boxed{} answer,
    through the reward worker) as the run's held-out evaluation does; a metric function scores the
    final answers itself."""
    from actors.reward import RewardWorker
    from envs.reward_runner import build_scorer
    from rlsys.evaluators import EvalEpisodes, EvaluatorWorker

    task, tokenizer, model_dir, cfg = setup
    overrides = ["env.name=tests/run/scripted_envs.py:ScriptedCalculatorEnv", "env.tools=[]", "env.call_penalty={}"]
    episodes = EvalEpisodes(load_config("configs/agent.yaml", overrides).env, 256)
    reward = RewardWorker(str(model_dir), task=task, scorer=build_scorer(cfg.reward, task))
    try:
        spec = {"name": "agent", "split": "train", "limit": 4, "n": 2, "temperature": 1.0}
        worker = EvaluatorWorker(str(model_dir), spec, task, 8, episodes, run_reward=reward)
        rows = task.rows("train")[:4]
        assert worker.prompt_ids == [prompt_ids(task, tokenizer, r)[0] for r in rows]  # the run's prompts
        result = worker.evaluate(0, None)
        m = result["metrics"]
        assert result["policy_version"] == 0 and m["n"] == 4
        assert m["accuracy"] == 1.0 == m["reward"] and m["pass@2"] == 1.0 and m["episode/correct"] == 1.0
        assert m["episode/turns_mean"] == 2.0 and m["tools/ok"] == 8 and m["tools/well_formed_per_episode"] == 1.0
        # a metric function scores the final answers: a wrong expected answer on every row scores 0
        spec = {**spec, "name": "wrong", "n": 1, "metric": "rlsys.evaluators:first_char_match"}
        worker = EvaluatorWorker(str(model_dir), spec, task, 8, episodes, run_reward=reward)
        worker.rows = [{**r, "answer": "?"} for r in rows]
        m = worker.evaluate(0, None)["metrics"]
        assert m["first_char_match"] == 0.0 and m["episode/correct"] == 0.0 and m["episode/turns_mean"] == 2.0
    finally:
        reward.scorer.close()
