"""Long chain-of-thought reward shaping (Yeo et al. 2025, ../shared/papers/long-cot-rewards.md)
as composable reward functions any task can use.

The config's `task.shaping` is a list applied in order to the task's reward, each entry a
name or `{name: {params}}`:

    task:
      shaping:
        - cosine_length: {max_length: 24}      # L_max in tokens: set it for the task
        - repetition: {ngram: 40, penalty: -0.05}

- `cosine_length`: replaces the reward by `r(L) = a + 0.5*(b - a)*(1 + cos(pi*L/L_max))`
  with (a, b) = (1, 2) for a correct answer and (0, -10) for a wrong one, and by -10 when
  `L + 16 >= L_max` (a truncated response). L is the response's length in tokens.
- `repetition` (mode dense): -0.05 on every token of each repeated n-gram (n = 40), the
  first occurrence free; a token inside several repeats is penalised once.
- `repetition` (mode sparse): on wrong answers only, `(1 - unique/total n-grams) * max_penalty`
  over the response's token n-grams.

Token-level penalties are *summed into the scalar reward* (`ShapedReward.reward`), which
every algorithm consumes. `ShapedReward.token_rewards` keeps the dense form, the sequence-level
part on the last token, summing to the same scalar: PPO takes it (the reward actor keeps it per
row, `take_token_rewards`), so GAE gives each penalty to the tokens before it, not to the
whole response.

`with_shaping(task, entries)` (called by `envs.registry.make_task`) returns the task wrapped
so that its `shaping` attribute is the built `RewardShaping`; the reward actor applies it
with the responses' token ids, to the task's own reward or a reward function's (`reward.function`;
"correct" is then a reward >= 1). The task's own `reward`/`is_correct` are unchanged, so
held-out accuracy still measures correctness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlsys.config import ConfigError, validate_section


def cosine_length_reward(
    length: int,
    correct: bool,
    max_length: int,
    correct_at_zero: float = 2.0,
    correct_at_max: float = 1.0,
    wrong_at_zero: float = -10.0,
    wrong_at_max: float = 0.0,
    truncated_reward: float = -10.0,
    margin: int = 16,
) -> float:
    """Eq. of the cosine length reward: `a + 0.5*(b - a)*(1 + cos(pi*L/L_max))`, b at L = 0 and
    a at L = L_max; `truncated_reward` when `L + margin >= L_max`."""
    if length + margin >= max_length:
        return truncated_reward
    a, b = (correct_at_max, correct_at_zero) if correct else (wrong_at_max, wrong_at_zero)
    return a + 0.5 * (b - a) * (1.0 + math.cos(math.pi * min(length, max_length) / max_length))


def ngrams(tokens: Sequence[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def repetition_token_penalties(tokens: Sequence[int], n: int = 40, penalty: float = -0.05) -> list[float]:
    """Dense repetition penalty: `penalty` on every token covered by an n-gram that already
    occurred earlier in the response (the first occurrence is free), once per token."""
    out = [0.0] * len(tokens)
    seen: set[tuple[int, ...]] = set()
    for start, gram in enumerate(ngrams(tokens, n)):
        if gram in seen:
            for i in range(start, start + n):
                out[i] = penalty
        seen.add(gram)
    return out


def sparse_repetition_penalty(tokens: Sequence[int], n: int = 40, max_penalty: float = -1.0) -> float:
    """Sparse variant: `(1 - unique/total n-grams) * max_penalty` (0 with no n-gram at all)."""
    grams = ngrams(tokens, n)
    return (1.0 - len(set(grams)) / len(grams)) * max_penalty if grams else 0.0


# ---- config: one pydantic model per reward function (unknown keys are errors) ----------


class ShaperConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CosineLengthConfig(ShaperConfig):
    max_length: int = Field(
        ...,
        ge=1,
        description="L_max in tokens; no default suits every task "
        "(the paper's 14336 is its generation budget): use about rollout.max_new_tokens + margin",
    )
    correct_at_zero: float = 2.0
    correct_at_max: float = 1.0
    wrong_at_zero: float = -10.0
    wrong_at_max: float = 0.0
    truncated_reward: float = -10.0
    margin: int = Field(16, ge=0, description="a response with L + margin >= max_length counts as truncated")

    @model_validator(mode="after")
    def _margin_below_max(self):
        if self.margin >= self.max_length:
            raise ValueError(
                f"margin {self.margin} must be below max_length {self.max_length} "
                "(else every response counts as truncated)"
            )
        return self


class RepetitionConfig(ShaperConfig):
    mode: Literal["dense", "sparse"] = Field(
        "dense", description="dense: per token, every answer; sparse: one scalar, wrong answers only"
    )
    ngram: int = Field(40, ge=1)
    penalty: float = Field(-0.05, le=0, description="dense: reward of each repeated token")
    max_penalty: float = Field(-1.0, le=0, description="sparse: reward when every n-gram is a repeat")


@dataclass
class ShapedReward:
    """The shaped reward of one response: `reward` (the scalar every algorithm reads) =
    `sequence` + sum(`tokens`)."""

    sequence: float
    tokens: list[float]

    @property
    def reward(self) -> float:
        return self.sequence + sum(self.tokens)

    @property
    def token_rewards(self) -> list[float]:
        """Per-token rewards summing to `reward`: the penalties, the sequence part on the last token."""
        out = list(self.tokens)
        if out:
            out[-1] += self.sequence
        return out


@dataclass
class CosineLength:
    config: CosineLengthConfig

    def __call__(self, shaped: ShapedReward, tokens: Sequence[int], correct: bool) -> ShapedReward:
        c = self.config
        shaped.sequence = cosine_length_reward(
            len(tokens),
            correct,
            c.max_length,
            c.correct_at_zero,
            c.correct_at_max,
            c.wrong_at_zero,
            c.wrong_at_max,
            c.truncated_reward,
            c.margin,
        )
        return shaped


@dataclass
class Repetition:
    config: RepetitionConfig

    def __call__(self, shaped: ShapedReward, tokens: Sequence[int], correct: bool) -> ShapedReward:
        c = self.config
        if c.mode == "dense":
            shaped.tokens = [
                t + p for t, p in zip(shaped.tokens, repetition_token_penalties(tokens, c.ngram, c.penalty))
            ]
        elif not correct:
            shaped.sequence += sparse_repetition_penalty(tokens, c.ngram, c.max_penalty)
        return shaped


SHAPERS: dict[str, tuple[type[ShaperConfig], type]] = {
    "cosine_length": (CosineLengthConfig, CosineLength),
    "repetition": (RepetitionConfig, Repetition),
}


@dataclass
class RewardShaping:
    """Reward functions applied in order to a task's reward."""

    shapers: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.shapers)

    def apply(self, base_reward: float, correct: bool, response_ids: Sequence[int]) -> ShapedReward:
        shaped = ShapedReward(float(base_reward), [0.0] * len(response_ids))
        for shaper in self.shapers:
            shaped = shaper(shaped, response_ids, correct)
        return shaped


def build_shaping(entries: Sequence[Any] | None, prefix: str = "task.shaping") -> RewardShaping:
    """`task.shaping` entries -> RewardShaping; a bad entry raises a one-line ConfigError."""
    shapers = []
    for i, entry in enumerate(entries or []):
        where = f"{prefix}[{i}]"
        if isinstance(entry, str):
            name, params = entry, {}
        elif isinstance(entry, dict) and len(entry) == 1:
            ((name, params),) = entry.items()
            params = {} if params is None else params
        else:
            raise ConfigError(
                f"config error: {where} = {entry!r}: must be a reward function name or "
                f"{{name: {{params}}}} (available: {', '.join(SHAPERS)})"
            )
        if name not in SHAPERS:
            raise ConfigError(
                f"config error: {where} = {name!r}: unknown reward function (available: {', '.join(SHAPERS)})"
            )
        if not isinstance(params, dict):
            raise ConfigError(f"config error: {where}.{name} = {params!r}: parameters must be a mapping")
        config_cls, shaper_cls = SHAPERS[name]
        shapers.append(shaper_cls(validate_section(config_cls, params, prefix=f"{where}.{name}")))
    return RewardShaping(shapers)


class ShapedTask:
    """A task whose rewards the reward actor shapes: `shaping` plus the task itself, every
    other attribute delegated to it."""

    def __init__(self, task, shaping: RewardShaping):
        self.task, self.shaping = task, shaping

    def __getattr__(self, name: str):
        if name in ("task", "shaping") or name.startswith("__"):  # unpickling: not set yet
            raise AttributeError(name)
        return getattr(self.task, name)


def with_shaping(task, entries: Sequence[Any] | None):
    """The task with `task.shaping` applied by the reward actor; the task itself when empty."""
    shaping = build_shaping(entries)
    return ShapedTask(task, shaping) if shaping else task
