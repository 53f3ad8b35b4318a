"""The Algorithm plug-in protocol, its registry, and the rollout context it is given.

An algorithm decides three things (DESIGN.md): how to sample (`rollout`), how to turn
samples into a training batch (`prepare`), and what the learner minimises (`loss`).
Everything else is shared machinery. Algorithms register by name:

    @register("grpo")
    class GRPO: ...

and `get_algorithm(name)` returns the class; `algorithm.name` in the config picks one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np
import pyarrow as pa
import torch
from pydantic import BaseModel, ConfigDict

from rlsys.batch import TrainBatch
from rlsys.experience import make_experience, new_uid
from rlsys.generation import Generation, GenerationRequest, SamplingParams


class AlgorithmConfig(BaseModel):
    """Base for each algorithm's own config section; unknown keys are errors."""

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


class RolloutContext(Protocol):
    """What the controller gives `Algorithm.rollout`: the actors behind plain calls."""

    policy_version: int
    tokenizer: Any
    task: Any

    def sampling(self, **overrides) -> SamplingParams: ...
    def generate(self, requests: Sequence[GenerationRequest], policy: str | None = None) -> list[Generation]: ...
    def generate_each(self, requests_by_policy: dict[str, Sequence[GenerationRequest]]) -> dict[str, list[Generation]]: ...
    def score(self, table: pa.Table) -> list[float]: ...
    def ref_logprobs(self, table: pa.Table) -> list[list[float]]: ...
    # optional: score_and_ref_logprobs(table) -> (rewards, ref logprobs), both actors at once
    def values(self, table: pa.Table) -> list[list[float]]: ...
    def anchor_reference(self) -> None: ...  # the reference becomes the current policy (BRiTE's theta_t)
    def next_seed(self) -> int: ...


class Algorithm(Protocol):
    name: str
    Config: type[AlgorithmConfig]
    needs_value_head: bool

    def rollout(self, ctx: RolloutContext, prompts: Sequence[Prompt]) -> pa.Table: ...
    def prepare(self, table: pa.Table) -> TrainBatch: ...
    def loss(self, outputs: ModelOutputs, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]: ...
    def state(self) -> dict: ...
    def load_state(self, state: dict) -> None: ...
    # Optional hooks the controller looks for: warmup_task, teacher_dir, restarts_policy,
    # prepare_metrics, allows_overlap, `evaluate(ctx, prompts, params) -> {"accuracy": ...}`
    # (held-out metrics measured the algorithm's way, e.g. RLEF's multi-turn 1@3), and for an
    # algorithm that trains several policies (CDG's per-role models) `policy_names` (the run's
    # policy first; each gets its own rollout worker and learner) with
    # `split_by_policy(table) -> {name: rows}`. `prepare` then runs once per policy's rows;
    # `generate(requests, policy=name)` samples from one.
    # The learner looks for `gradient_rows(batch) -> bool[B]`: rows whose loss term has no
    # gradient are left out of the forward and backward (the loss must be a token mean over
    # `response_mask`: the learner rescales it to the whole minibatch's tokens).


_REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"algorithm '{name}' is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available() -> list[str]:
    _import_builtins()
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> type:
    _import_builtins()
    if name not in _REGISTRY:
        raise KeyError(f"unknown algorithm '{name}' (available: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name]


def policy_names(algorithm) -> tuple[str, ...]:
    """The policies an algorithm trains, the run's policy first (most train one: "policy")."""
    return tuple(getattr(algorithm, "policy_names", ("policy",)))


def build_algorithm(cfg):
    """The algorithm a JobConfig names, its own keys validated (ConfigError names a bad one)."""
    from rlsys.config import ConfigError, validate_section

    try:
        cls = get_algorithm(cfg.algorithm.name)
    except KeyError as e:
        raise ConfigError(f"config error: algorithm.name = {cfg.algorithm.name!r}: {e.args[0]}") from None
    if cfg.trainer.overlap_rollout:
        if not getattr(cls, "allows_overlap", False):
            raise ConfigError(f"config error: 'trainer.overlap_rollout': algorithm '{cfg.algorithm.name}' needs its "
                              f"rollout on the current policy (overlap: grpo, rloo)")
        if cfg.buffer.max_staleness < 1:
            raise ConfigError("config error: 'trainer.overlap_rollout' trains on rows one policy version old: "
                              "set buffer.max_staleness >= 1")
    algorithm = cls(validate_section(cls.Config, cfg.algorithm_params(), prefix="algorithm"))
    policies = policy_names(algorithm)
    if len(policies) > 1 and (cfg.rollout.backend != "hf" or cfg.trainer.weight_sync == "broadcast"):
        raise ConfigError(f"config error: algorithm '{cfg.algorithm.name}' trains {len(policies)} policies "
                          f"({', '.join(policies)}): that needs rollout.backend=hf and a trainer.weight_sync other "
                          f"than broadcast")
    return algorithm


BUILTIN_MODULES = ("ppo", "grpo", "rloo", "vineppo", "pilaf", "ampo", "distill", "cdg", "brite", "rlef")


def _import_builtins() -> None:
    """Import the built-in algorithm modules (explicit list, no package scanning)."""
    import importlib

    for module in BUILTIN_MODULES:
        importlib.import_module(f"algorithms.{module}")


class StatelessMixin:
    """Default `state`/`load_state` for algorithms that keep nothing between steps."""

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


def sample_groups(ctx: RolloutContext, prompts: Sequence[Prompt], n: int, with_ref: bool = True) -> pa.Table:
    """The common rollout: n responses per prompt (one group per prompt), rewards from the
    reward worker and, when asked, reference logprobs. Returns an Experience table."""
    params = ctx.sampling(n=n, seed=ctx.next_seed())
    requests = [GenerationRequest(list(p.prompt_ids), params) for p in prompts]
    generations = ctx.generate(requests)
    rows = []
    for g in generations:
        prompt = prompts[g.request_index]
        rows.append(
            dict(
                uid=new_uid(),
                group=prompt.uid,
                prompt_ids=g.prompt_ids,
                response_ids=g.response_ids,
                logprobs=g.logprobs,
                reward=0.0,
                policy_version=g.policy_version,
                meta={**prompt.meta, "finish_reason": g.finish_reason},
            )
        )
    table = make_experience(rows)
    if not with_ref:
        return set_rewards(table, ctx.score(table))
    rewards, ref_logprobs = score_and_ref_logprobs(ctx, table)
    return set_token_column(set_rewards(table, rewards), "ref_logprobs", ref_logprobs)


def score_and_ref_logprobs(ctx: RolloutContext, table: pa.Table) -> tuple[list[float], list[list[float]]]:
    """`ctx.score(table)` and `ctx.ref_logprobs(table)`; the reward and reference workers answer
    at once where the context can ask both together (the controller's `score_and_ref_logprobs`)."""
    both = getattr(ctx, "score_and_ref_logprobs", None)
    return both(table) if both is not None else (ctx.score(table), ctx.ref_logprobs(table))


def set_rewards(table: pa.Table, rewards: Sequence[float]) -> pa.Table:
    return table.set_column(table.schema.get_field_index("reward"), "reward", pa.array(rewards, type=pa.float32()))


def set_token_column(table: pa.Table, name: str, values: Sequence[Sequence[float]]) -> pa.Table:
    """Replace a list<float32> column of the Experience table."""
    idx = table.schema.get_field_index(name)
    return table.set_column(idx, name, pa.array([list(map(float, v)) for v in values], type=pa.list_(pa.float32())))


def rewards_of(table: pa.Table) -> np.ndarray:
    return np.asarray(table.column("reward").to_pylist(), dtype=np.float64)
