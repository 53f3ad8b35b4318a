"""The algorithm contract: what an algorithm must offer, what it may offer, and what it is given.

An algorithm decides three things: how to sample (`rollout`), how to turn samples into a
training batch (`prepare`), and what the learner minimises (`loss`). Everything else is shared
machinery. The optional parts are named capabilities, declared on the algorithm's class line

    @register("grpo")
    class GRPO(Algorithm, ReportsPrepareMetrics, SkipsRowsWithoutGradient, TrainsOnStaleRows): ...

and tested with `isinstance` by the controller and the learner. tests/architecture/test_contract.py checks
that every registered algorithm defines each member of what it declares and has no public
member that none of them names (a misspelt hook would otherwise never be called).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Protocol, Sequence, runtime_checkable

import pyarrow as pa
import torch
from pydantic import BaseModel, ConfigDict

from rlsys.batch import TrainBatch
from rlsys.generation import Generation, GenerationRequest, SamplingParams


class AlgorithmConfig(BaseModel):
    """Base for each algorithm's own config section (`algorithm.*`); unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class ModelOutputs:
    """What the learner computes on a TrainBatch before calling `Algorithm.loss`.
    `logprobs` and `values` are [B, L-1], aligned with the batch's targets."""

    logits: torch.Tensor  # [B, L-1, V] (temperature-scaled)
    logprobs: torch.Tensor
    values: Optional[torch.Tensor] = None


@dataclass
class Prompt:
    """One task prompt: its token ids and the task's metadata (answer, tests, ...)."""

    uid: str
    prompt_ids: list[int]
    text: str
    meta: dict


@runtime_checkable
class RolloutContext(Protocol):
    """What `Algorithm.rollout` is given: the run's actors behind plain calls. `policy` names one
    of the trained policies (None: the run's policy)."""

    policy_version: int
    tokenizer: Any
    task: Any

    def sampling(self, **overrides) -> SamplingParams: ...
    def next_seed(self) -> int: ...
    def more_prompts(self, n: int) -> list[Prompt]: ...  # the next n of the run's prompt stream (DAPO's refill)
    def generate(self, requests: Sequence[GenerationRequest], policy: str | None = None) -> list[Generation]: ...
    def generate_each(
        self, requests_by_policy: dict[str, Sequence[GenerationRequest]]
    ) -> dict[str, list[Generation]]: ...
    def score(self, table: pa.Table) -> list[float]: ...
    def token_rewards(self, table: pa.Table) -> list[list[float]] | None: ...  # `score`'s per token (task.shaping)
    def ref_logprobs(self, table: pa.Table) -> list[list[float]]: ...
    def score_and_ref_logprobs(self, table: pa.Table) -> tuple[list[float], list[list[float]]]: ...
    def values(self, table: pa.Table, policy: str | None = None) -> list[list[float]]: ...
    def policy_logprobs(self, table: pa.Table) -> list[list[float]]: ...
    def anchor_reference(self) -> None: ...  # the reference becomes the current policy (BRiTE's theta_t)
    def teacher_logprobs(self, table: pa.Table) -> list[list[float]]: ...
    def teacher_top_logprobs(self, table: pa.Table, k: int = 0) -> Any: ...
    def execute(self, requests: Sequence[Any]) -> list[Any]: ...  # sandbox.ExecRequest -> ExecResult

    # multi-turn episodes (env.name): algorithms/episodes.py's EpisodeSettings, None for single-turn rollouts
    episodes: Any
    # an episode's token budget where the run plays episodes (env.name or HasOwnEpisodes), else None
    episode_tokens: int | None


@runtime_checkable
class Algorithm(Protocol):
    """Required of every algorithm. `prepare` may return None: no update this step."""

    name: str
    Config: ClassVar[type[AlgorithmConfig]]
    needs_value_head: bool

    def rollout(self, ctx: RolloutContext, prompts: Sequence[Prompt]) -> pa.Table: ...
    def prepare(self, table: pa.Table) -> TrainBatch | None: ...
    def loss(self, outputs: ModelOutputs, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]: ...


# ---- capabilities: each names one optional part --------------------------------------------
@runtime_checkable
class Stateful(Protocol):
    """Keeps state between steps; checkpoints hold it and a resumed run gets it back."""

    def state(self) -> dict: ...
    def load_state(self, state: dict) -> None: ...


@runtime_checkable
class ReportsPrepareMetrics(Protocol):
    """Logs its own metrics of each step's rows (group stats, selection rates, ...)."""

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]: ...


@runtime_checkable
class SkipsRowsWithoutGradient(Protocol):
    """`gradient_rows(batch) -> bool[B]`: rows whose loss term has no gradient are left out of the
    forward and backward. The loss must be a mean over what `loss_denominator` counts (the
    learner rescales the kept rows' loss by their share of it)."""

    def gradient_rows(self, batch: TrainBatch) -> torch.Tensor: ...


@runtime_checkable
class AveragesLossOver(Protocol):
    """`loss_denominator(batch) -> float`: what the loss divides its sum by on `batch` when it is
    not the response tokens (rows for a mean over responses, the pairs' weights for a weighted mean
    over pairs). The learner's packed micro-batches (learner.max_tokens_per_microbatch) each count
    by their denominator over the minibatch's, so the gradients they accumulate are the minibatch's."""

    def loss_denominator(self, batch: TrainBatch) -> float: ...


@runtime_checkable
class EvaluatesItself(Protocol):
    """Measures held-out metrics its own way (RLEF: multi-turn episodes, 1@3); returns at least
    `accuracy`."""

    def evaluate(self, ctx: RolloutContext, prompts: Sequence[Prompt], params: SamplingParams) -> dict[str, float]: ...


@runtime_checkable
class HasWarmupTask(Protocol):
    """The SFT warm-up trains on this task instead of the run's (CDG's game format)."""

    def warmup_task(self, task: Any, tokenizer: Any) -> Any: ...


@runtime_checkable
class HasTeacher(Protocol):
    """Distils from a teacher: its model directory, trained or checked before any actor starts."""

    def teacher_dir(self, run_dir: Path, task: Any, tokenizer: Any, seed: int) -> Path: ...


@runtime_checkable
class RestartsPolicy(Protocol):
    """`restarts_policy(rows)`: True when this step retrains from the initial policy (ReST rounds)."""

    def restarts_policy(self, table: pa.Table) -> bool: ...


@runtime_checkable
class TrainsSeveralPolicies(Protocol):
    """Trains several policies (CDG's per-role models), the run's policy first; each gets its own
    rollout worker and learner. `prepare` runs once per policy's rows."""

    policy_names: tuple[str, ...]

    def split_by_policy(self, table: pa.Table) -> dict[str, pa.Table]: ...


@runtime_checkable
class UsesProximalLogprobs(Protocol):
    """The loss reads `batch.proximal_logprobs`, the learner's logprobs of the step's rows before
    the step's first update (an off-policy correction: algorithms/common.py `behaviour_weights`);
    the learner computes them when `proximal_logprobs_needed()` says so (from the loss's own
    forward when the step is one optimizer step, by a forward without gradient first otherwise)."""

    def proximal_logprobs_needed(self) -> bool: ...


@runtime_checkable
class HasOwnEpisodes(Protocol):
    """Plays multi-turn episodes of its own env rather than `env.name`'s (RLEF's code dialogs):
    `episode_settings(tokenizer, task, run, max_tokens)`, an algorithms/episodes.py EpisodeSettings
    whose envs run programs through `run` (a list of sandbox ExecRequests -> their results) and
    whose episodes keep within `max_tokens` (the run's budget: env.max_tokens, at most and by
    default the policy's context; the rollout context's `episode_tokens`). The rollout passes the
    run's sandbox pool; an attached evaluator passes its own and plays them too."""

    def episode_settings(self, tokenizer: Any, task: Any, run: Callable, max_tokens: int) -> Any: ...


class TrainsOnStaleRows:
    """A marker: rows a policy version or more old are corrected by the loss (the clipped ratio
    to their rollout logprobs), so the rollout may run ahead of the learner (`trainer.mode:
    overlap | async`)."""


class PlaysEpisodes:
    """A marker: the rollout is the common one (`sample_groups`), so with `env.name` set it plays
    multi-turn episodes (algorithms/episodes.py), and `prepare` trains on the policy's tokens only
    (`loss_mask`), taking the episode's return as the reward (and, where it reads them, the
    per-turn `token_rewards`)."""


class UnpackedOnly:
    """A marker: the loss adds means over different units (RLEF: its policy term over response
    tokens, its value term over turns), which no one weight per packed micro-batch keeps exact, so
    `learner.max_tokens_per_microbatch` is refused for it and `learner.auto_pack` never packs it."""


class MovesReference:
    """A marker: the KL anchor moves during the run (`ctx.anchor_reference` loads the current
    policy into it), so under learner.lora the reference stays a worker of its own instead of the
    learner's base weights with the adapters off."""


CAPABILITIES: tuple[type, ...] = (
    Stateful,
    ReportsPrepareMetrics,
    SkipsRowsWithoutGradient,
    AveragesLossOver,
    EvaluatesItself,
    HasWarmupTask,
    HasTeacher,
    RestartsPolicy,
    TrainsSeveralPolicies,
    UsesProximalLogprobs,
    TrainsOnStaleRows,
    PlaysEpisodes,
    HasOwnEpisodes,
    UnpackedOnly,
    MovesReference,
)


def policy_names(algorithm: Algorithm) -> tuple[str, ...]:
    """The policies an algorithm trains, the run's policy first (most train one: "policy")."""
    return tuple(algorithm.policy_names) if isinstance(algorithm, TrainsSeveralPolicies) else ("policy",)


def loss_denominator(algorithm: Algorithm, batch: TrainBatch) -> float:
    """What `algorithm`'s loss averages over on `batch`: its `AveragesLossOver` denominator, else
    the response tokens."""
    if isinstance(algorithm, AveragesLossOver):
        return float(algorithm.loss_denominator(batch))
    return float(batch.num_tokens())


def algorithm_state(algorithm: Algorithm) -> dict:
    """What a checkpoint keeps of the algorithm (nothing for a stateless one)."""
    return algorithm.state() if isinstance(algorithm, Stateful) else {}
