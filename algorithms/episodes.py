"""The multi-turn rollout: episodes of an environment, played side by side, one Experience row each.

`sample_groups` (algorithms/base.py) plays them when the run has `env.name` set (`ctx.episodes`,
an `EpisodeSettings`), so every algorithm whose rollout is the common one (the `PlaysEpisodes`
marker: GRPO, RLOO, PPO, ...) trains on episodes. An episode on a prompt's row:

    env.reset(row)                  the first observation: a text (one user message) or chat
                                    messages, rendered with the chat template (and its `tools=`)
    policy turn                     `ctx.generate` with the episode's ids so far as the prompt,
                                    stopped at the template's end-of-turn token (ChatML's
                                    `<|im_end|>`) or eos; its ids and logprobs kept as sampled
    env.step(turn text)             -> (observation, reward, done, info)
    observation                     `info["messages"]` (tool results in the template's tool
                                    role) or the text as a user message, encoded once
                                    (envs/conversation.py) and appended
    ... until done, `max_turns` policy turns, or `max_tokens` (an observation that does not
    fit, or no token left for a turn, ends the episode)

Token-in/token-out: the row is built by appending (envs/conversation.py `Conversation`): the
policy's ids exactly as sampled, the observations' template tokens encoded once; no decoded text
is encoded again into the row.

Side by side: the episodes of a call run at once. Each generation call batches the episodes that
are waiting for the policy; env resets and steps run in a thread pool, so a slow step (a tool,
the sandbox) holds up only its own episode: after a generation call the rollout waits at most
`gather_s` for the env steps in flight (to batch the fast ones), then generates for those ready,
the slow ones joining a later call. With `lockstep` (`env.lockstep`) every call waits for all the
steps in flight instead: the episodes advance turn by turn, and which share a call no longer
depends on timing. A call's requests are in episode order either way.

Rewards: an episode's per-turn rewards are its env steps' rewards. An env that leaves the final
answer to the run (`info["answer"]` in its last step: ToolEnv here) has it graded with the run's
reward, `ctx.score` on a table of (prompt, final answer) rows: the task's rule or
`reward.function` (e.g. `math` on the answer's `\\boxed{}`), a reward model or a judge, as
single-turn rows are; the grade is added to the last turn's reward. `correct` is grade >= 1
there, else the env's `info["correct"]`. An episode stopped by `max_turns` or `max_tokens` before
its env was done asks an env that has `end_early()` for its last word, in the pool (RLEF's code
env runs the last answer on the private tests): a reward added to the last turn's, and `correct`
and `answer` as at done.

One Experience row per episode: `prompt_ids` the rendered first observation, `response_ids`
every later token (policy turns and observations), `loss_mask` 1 exactly on the policy's
tokens, `logprobs` the sampler's (0 elsewhere), `reward` the episode's return (the sum of its
turns' rewards), `token_rewards` each turn's reward on that turn's last sampled token (what
PPO's GAE reads; they sum to `reward`), `ref_logprobs` when asked; `meta`: the row's columns
and `turns`, `correct`, `stop` (done, max_turns or max_tokens), `turn_rewards`,
`finish_reasons` and `tools` (the episode's call statuses counted). `episode_metrics` turns a
step's rows into `episode/*` and `tools/*` metrics (the loop logs them).

Checkpoints: a step's episodes start and finish inside its rollout; checkpoints are taken
between steps, so no episode is in flight at one and no env state is saved (an interrupted
step's episodes are played again from the start on resume, as its single-turn samples are).

Reruns: without lockstep, which episodes share a generation call follows the env steps' timing,
so a rerun may batch (and so sample) differently; with it, a rerun of the same config and seed
plays the same episodes bit for bit (given envs that answer the same text the same way).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from envs.conversation import ChatEncoder, Conversation, PlainEncoder, end_of_turn_id
from envs.tools import METRIC_NAMES, STATUSES, ToolCounts
from rlsys.contract import Prompt, RolloutContext
from rlsys.experience import make_experience, meta_of, new_uid
from rlsys.generation import GenerationRequest, SamplingParams

GATHER_S = 0.05  # after a generation call, how long the env steps in flight are waited for before generating again
SEED_STRIDE = 104_729  # a rollout's k-th generation call samples with seed + k * this (each call its own noise)
MAX_THREADS = 32  # env steps at once (a step that waits on the sandbox or a server holds a thread)
STOPS = ("done", "max_turns", "max_tokens")


@dataclass
class EpisodeSettings:
    """How a run plays its episodes (`ctx.episodes`): `make_env()` a fresh env per episode,
    `encoder` the chat template as token ids (its end-of-turn token stops each policy turn),
    `tool_schemas` the template's `tools=`, the bounds `max_turns` and `max_tokens`, `threads`
    env steps at once, `gather_s` and `lockstep` (see the module's docstring)."""

    make_env: Callable[[], Any]
    encoder: ChatEncoder | PlainEncoder
    max_turns: int
    max_tokens: int
    tool_schemas: list[dict] | None = None
    threads: int = MAX_THREADS
    gather_s: float = GATHER_S
    lockstep: bool = False

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns is {self.max_turns}: an episode needs at least 1 turn")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens is {self.max_tokens}: an episode needs room for a prompt and a turn")

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer,
        make_env: Callable[[], Any],
        max_turns: int,
        max_tokens: int,
        tool_schemas: Sequence[dict] | None = None,
        **options,
    ) -> "EpisodeSettings":
        """Settings over `tokenizer`'s chat template, checked now: ValueError (one line) when the
        tokenizer has no chat template, TemplateMismatch when its turns cannot be appended to."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn episodes (env.name) need a tokenizer with a chat template")
        encoder = ChatEncoder(tokenizer, end_of_turn_id(tokenizer))
        schemas = list(tool_schemas) if tool_schemas else None
        probe = [{"role": "tool", "content": "1"}] if schemas else [{"role": "user", "content": "1"}]
        encoder.observation_ids(probe, schemas)  # TemplateMismatch now, not at the first observation
        return cls(make_env, encoder, max_turns, max_tokens, schemas, **options)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """What ends a policy turn: the template's end-of-turn token and eos."""
        eos = self.encoder.tokenizer.eos_token_id
        return tuple(dict.fromkeys(t for t in (self.encoder.end_of_turn_id, eos) if t is not None))


@dataclass
class Episode:
    """One episode's state: its env, its token row (`conversation`, None until reset), one reward
    per policy turn (its env step's), each turn's finish reason and policy version, its call
    statuses, and once over why (`stop`), the final answer to grade and whether it is correct."""

    prompt: Prompt
    env: Any
    conversation: Conversation | None = None
    rewards: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tool_counts: ToolCounts = field(default_factory=ToolCounts)
    stop: str = ""
    answer: str | None = None
    correct: bool | None = None

    @property
    def turns(self) -> int:
        return len(self.conversation.policy_turns) if self.conversation else 0

    @property
    def over(self) -> bool:
        return bool(self.stop)

    def start(self, first, settings: EpisodeSettings) -> None:
        """The row's prompt: the env's first observation through the chat template."""
        messages = [{"role": "user", "content": first}] if isinstance(first, str) else list(first)
        self.conversation = Conversation.start(settings.encoder, messages, settings.tool_schemas)
        if self.conversation.num_tokens >= settings.max_tokens:
            raise ValueError(
                f"prompt {self.prompt.uid} is {self.conversation.num_tokens} tokens: no room for a turn within "
                f"env.max_tokens={settings.max_tokens}"
            )

    def add_turn(self, ids: Sequence[int], logprobs: Sequence[float], finish_reason: str, version: int) -> None:
        self.conversation.add_policy(ids, logprobs)
        self.finish_reasons.append(finish_reason)
        self.versions.append(version)

    def take_step(self, outcome: tuple, settings: EpisodeSettings) -> None:
        """The env's answer to the last turn: its reward and counts kept; the episode ends (done,
        max_turns, or an observation past max_tokens) or the observation is appended."""
        observation, reward, done, info = outcome
        info = info or {}
        self.rewards.append(float(reward))
        if info.get("tool_counts") is not None:
            self.tool_counts = self.tool_counts.merge(info["tool_counts"])
        if done:
            self.stop, self.answer = "done", info.get("answer")
            self.correct = None if info.get("correct") is None else bool(info["correct"])
            return
        if self.turns >= settings.max_turns:
            self.stop = "max_turns"
            return
        if observation is None and not info.get("messages"):
            raise ValueError(f"env {type(self.env).__name__}: step() gave no observation for an episode not done")
        messages = info.get("messages") or [{"role": "user", "content": observation}]
        if self.conversation.add_messages(messages, budget=settings.max_tokens - 1) is None:  # 1: a turn's token
            self.stop = "max_tokens"

    @property
    def ends_early(self) -> bool:
        """Stopped before its env was done (max_turns, max_tokens) in an env that has a last word on
        that (`end_early()`, envs/base.py Env)."""
        return self.stop in ("max_turns", "max_tokens") and hasattr(self.env, "end_early")

    def take_end(self, outcome: tuple[float, dict]) -> None:
        """The env's `end_early()`: its final reward, added to the last turn's, and `correct` and `answer`."""
        reward, info = outcome
        self.rewards[-1] += float(reward)
        self.correct = None if info.get("correct") is None else bool(info["correct"])
        self.answer = info.get("answer")

    def summary(self) -> dict:
        """What the Experience row's meta keeps of the episode."""
        counts = self.tool_counts.counts
        return {
            "turns": self.turns,
            "correct": bool(self.correct),
            "stop": self.stop,
            "turn_rewards": list(self.rewards),
            "finish_reasons": list(self.finish_reasons),
            "tools": {status: int(counts[status]) for status in STATUSES},
            "episode_tokens": self.conversation.num_tokens,
        }

    def token_rewards(self) -> list[float]:
        """Each turn's reward on its last sampled token, over the response (0 elsewhere)."""
        c = self.conversation
        out = [0.0] * (c.num_tokens - c.prompt_length)
        for reward, (_, end) in zip(self.rewards, c.policy_turns):
            out[end - 1 - c.prompt_length] += reward
        return out


def play_episodes(
    ctx: RolloutContext,
    prompts: Sequence[Prompt],
    n: int,
    params: SamplingParams,
    settings: EpisodeSettings | None = None,
) -> list[Episode]:
    """n episodes per prompt (prompt by prompt), played to the end side by side as the module's
    docstring says; each policy turn sampled with `params` (one sample per request; its
    `max_new_tokens` cut to what the episode's budget has left, stopped at the end of the turn; the
    k-th generation call's seed is `params.seed + k * SEED_STRIDE`). `settings`: the run's
    (`ctx.episodes`) unless an algorithm plays episodes of its own (RLEF's code dialogs)."""
    settings = settings or ctx.episodes
    episodes = [Episode(p, settings.make_env()) for p in prompts for _ in range(n)]
    if not episodes:
        return []
    tokenizer, calls = settings.encoder.tokenizer, 0
    order = {id(e): i for i, e in enumerate(episodes)}
    with ThreadPoolExecutor(max_workers=min(len(episodes), settings.threads)) as pool:
        pending: dict[Future, tuple[Episode, str]] = {
            pool.submit(e.env.reset, e.prompt.meta): (e, "reset") for e in episodes
        }
        while pending:
            if settings.lockstep:
                done, _ = wait(pending)
            else:
                done, _ = wait(pending, timeout=settings.gather_s)  # all of them, or those done by then
                if not done:  # every episode is in its env: wait for the first back
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
            ready = []
            for future in done:
                episode, what = pending.pop(future)
                if what == "reset":
                    episode.start(future.result(), settings)
                elif what == "step":
                    episode.take_step(future.result(), settings)
                    if episode.ends_early:  # in the pool too: it may run code (RLEF's private tests)
                        pending[pool.submit(episode.env.end_early)] = (episode, "end")
                else:
                    episode.take_end(future.result())
                if not episode.over:
                    ready.append(episode)
            if not ready:
                continue
            ready.sort(key=lambda e: order[id(e)])
            seeded = params if params.seed is None else dataclasses.replace(params, seed=call_seed(params, calls))
            requests = [GenerationRequest(list(e.conversation.ids), turn_params(seeded, e, settings)) for e in ready]
            calls += 1
            generations = sorted(ctx.generate(requests), key=lambda g: g.request_index)
            texts = tokenizer.batch_decode([g.response_ids for g in generations], skip_special_tokens=True)
            for episode, g, text in zip(ready, generations, texts):
                episode.add_turn(g.response_ids, g.logprobs, g.finish_reason, g.policy_version)
                pending[pool.submit(episode.env.step, text)] = (episode, "step")
    return episodes


def call_seed(params: SamplingParams, call: int) -> int:
    """The seed of a rollout's `call`-th generation call (a 31-bit int, as `ctx.next_seed` draws)."""
    return (params.seed + call * SEED_STRIDE) % (2**31 - 1)


def turn_params(params: SamplingParams, episode: Episode, settings: EpisodeSettings) -> SamplingParams:
    """`params` for one policy turn of `episode`: one sample, at most the tokens its budget has
    left, stopped at the end of the turn."""
    left = settings.max_tokens - episode.conversation.num_tokens
    return dataclasses.replace(
        params,
        n=1,
        max_new_tokens=max(1, min(params.max_new_tokens, left)),
        stop_token_ids=tuple(dict.fromkeys((*params.stop_token_ids, *settings.stop_token_ids))),
    )


def final_answers(episodes: Sequence[Episode]) -> list[int]:
    """The episodes whose env left their final answer to the run's reward (`info["answer"]`)."""
    return [i for i, e in enumerate(episodes) if isinstance(e.answer, str)]


def answer_table(episodes: Sequence[Episode], tokenizer) -> pa.Table:
    """The final answers as (prompt, answer) Experience rows, for `ctx.score`: the response is the
    last turn's sampled ids where the answer is that turn's text, else the answer encoded (these
    rows are only graded, never trained on)."""
    rows = []
    for e in episodes:
        c = e.conversation
        start, end = c.policy_turns[-1]
        last = c.ids[start:end]
        if tokenizer.decode(last, skip_special_tokens=True) != e.answer:
            last = tokenizer(e.answer, add_special_tokens=False)["input_ids"]
        rows.append(
            dict(
                uid=new_uid(),
                group=e.prompt.uid,
                prompt_ids=c.prompt_ids,
                response_ids=list(last),
                logprobs=[0.0] * len(last),
                reward=0.0,
                policy_version=min(e.versions),
                meta=e.prompt.meta,
            )
        )
    return make_experience(rows)


def grade(ctx: RolloutContext, episodes: Sequence[Episode]) -> None:
    """The final answers left to the run graded with its reward (`ctx.score`), each grade added to
    its episode's last turn reward; `correct` is grade >= 1 (as `accuracy/train` counts)."""
    graded = [episodes[i] for i in final_answers(episodes)]
    if not graded:
        return
    scores = ctx.score(answer_table(graded, ctx.episodes.encoder.tokenizer))
    for e, score in zip(graded, scores):
        e.rewards[-1] += float(score)
        e.correct = float(score) >= 1.0


def episode_rows(episodes: Sequence[Episode], extra_meta: Callable[[Episode], dict] | None = None) -> pa.Table:
    """One Experience row per episode (see the module's docstring), episodes in order;
    `extra_meta(episode)`: more of the row's meta (an algorithm's own episode facts)."""
    rows = []
    for e in episodes:
        rows.append(
            dict(
                uid=new_uid(),
                group=e.prompt.uid,
                **e.conversation.experience_fields(),
                reward=float(sum(e.rewards)),
                token_rewards=e.token_rewards(),
                policy_version=min(e.versions),
                meta={**e.prompt.meta, **e.summary(), **(extra_meta(e) if extra_meta else {})},
            )
        )
    return make_experience(rows)


def sample_episodes(ctx: RolloutContext, prompts: Sequence[Prompt], n: int, with_ref: bool = True) -> pa.Table:
    """The multi-turn rollout: n episodes per prompt (one group per prompt), played side by side,
    final answers graded with the run's reward and, when asked, reference logprobs. Returns an
    Experience table, one row per episode."""
    episodes = play_episodes(ctx, prompts, n, ctx.sampling(n=1, seed=ctx.next_seed()))
    grade(ctx, episodes)
    table = episode_rows(episodes)
    if not with_ref:
        return table
    ref = pa.array([list(map(float, v)) for v in ctx.ref_logprobs(table)], type=pa.list_(pa.float32()))
    return table.set_column(table.schema.get_field_index("ref_logprobs"), "ref_logprobs", ref)


# ---- metrics -----------------------------------------------------------------------------------
def summary_metrics(summaries: Sequence[dict]) -> dict[str, float]:
    """`episode/*` (turns, tokens, correct share, how episodes ended) and `tools/*` (each status's
    calls, well-formed calls per episode, the malformed share of calls) of episode summaries."""
    if not summaries:
        return {}
    counts = ToolCounts()
    for s in summaries:
        counts.counts.update(s["tools"])
    out = {
        "episode/turns_mean": float(np.mean([s["turns"] for s in summaries])),
        "episode/tokens_mean": float(np.mean([s["episode_tokens"] for s in summaries])),
        "episode/correct": float(np.mean([bool(s["correct"]) for s in summaries])),
    }
    out |= {f"episode/stop_{stop}": float(np.mean([s["stop"] == stop for s in summaries])) for stop in STOPS}
    out |= counts.metrics()
    calls, malformed = out["tools/calls"], out[METRIC_NAMES["malformed"]]
    out["tools/well_formed_per_episode"] = (calls - malformed) / len(summaries)
    out["tools/malformed_share"] = malformed / calls if calls else 0.0
    return out


def episode_metrics(table: pa.Table) -> dict[str, float]:
    """`summary_metrics` of a step's episode rows (their meta); {} for single-turn rows."""
    summaries = [m for m in meta_of(table) if "turns" in m and "tools" in m]
    return summary_metrics(summaries)
