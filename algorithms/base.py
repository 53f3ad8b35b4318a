"""The algorithm registry and the rollout helpers algorithms share.

The contract an algorithm implements (the `Algorithm` protocol and its named capabilities)
is in `rlsys/contract.py`. Algorithms register by name:

    @register("grpo")
    class GRPO(Algorithm, ...): ...

and `get_algorithm(name)` returns the class; `algorithm.name` in the config picks one.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa

from rlsys.config import AlgorithmSection, ConfigError, check_job, validate_section
from rlsys.contract import Prompt, RolloutContext
from rlsys.experience import TOKEN_VERSIONS, make_experience, new_uid
from rlsys.generation import GenerationRequest

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


def build_algorithm(cfg):
    """The algorithm a JobConfig names, its own keys validated (ConfigError names a bad one), and
    the rules across sections checked (`rlsys.config.check_job`). Built once per command. Under
    `algorithm.name=X` over a file written for another algorithm, the file's keys X has no field
    for are left out of `cfg` (named on stderr; X's defaults serve, and the run's saved config has
    X's keys only); keys given on the command line stay, so a wrong one still fails."""
    try:
        cls = get_algorithm(cfg.algorithm.name)
    except KeyError as e:
        raise ConfigError(f"config error: algorithm.name = {cfg.algorithm.name!r}: {e.args[0]}") from None
    left_out = sorted(cfg.algorithm.written_for_another() - set(cls.Config.model_fields))
    if left_out:  # `algorithm.name=X` over a file written for another algorithm: X's defaults serve
        name = cfg.algorithm.name
        print(
            f"config: algorithm.name={name} leaves out the file's algorithm keys that {name} does not have: "
            + ", ".join(left_out),
            file=sys.stderr,
        )
        cfg.algorithm = AlgorithmSection(**{k: v for k, v in cfg.algorithm.model_dump().items() if k not in left_out})
    algorithm = cls(validate_section(cls.Config, cfg.algorithm_params(), prefix="algorithm"))
    check_job(cfg, algorithm)
    return algorithm


BUILTIN_MODULES = (
    "ppo",
    "grpo",
    "gspo",
    "cispo",
    "dapo",
    "rloo",
    "rloo_clipped",
    "reinforce_pp",
    "vineppo",
    "pilaf",
    "ampo",
    "distill",
    "opd",
    "cdg",
    "brite",
    "rlef",
)


def _import_builtins() -> None:
    """Import the built-in algorithm modules (explicit list, no package scanning)."""
    import importlib

    for module in BUILTIN_MODULES:
        importlib.import_module(f"algorithms.{module}")


def sample_groups(ctx: RolloutContext, prompts: Sequence[Prompt], n: int, with_ref: bool = True) -> pa.Table:
    """The common rollout: n responses per prompt (one group per prompt), rewards from the
    reward worker and, when asked, reference logprobs. Returns an Experience table. With
    `env.name` set (`ctx.episodes`), n multi-turn episodes per prompt instead, one row each
    (algorithms/episodes.py)."""
    if getattr(ctx, "episodes", None) is not None:  # getattr: stand-in contexts of tests predate episodes
        from algorithms.episodes import sample_episodes  # brings in the tools' schema reader: multi-turn runs only

        return sample_episodes(ctx, prompts, n, with_ref)
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
                token_versions=g.token_versions,
            )
        )
    chunked = any(g.token_versions is not None for g in generations)  # rollout.inflight_update: resume
    table = make_experience(rows, TOKEN_VERSIONS if chunked else None)
    if not with_ref:
        return set_rewards(table, ctx.score(table))
    rewards, ref_logprobs = score_and_ref_logprobs(ctx, table)
    return set_token_column(set_rewards(table, rewards), "ref_logprobs", ref_logprobs)


def score_and_ref_logprobs(ctx: RolloutContext, table: pa.Table) -> tuple[list[float], list[list[float]]]:
    """`ctx.score(table)` and `ctx.ref_logprobs(table)`, the reward and reference workers at once."""
    return ctx.score_and_ref_logprobs(table)


def set_rewards(table: pa.Table, rewards: Sequence[float]) -> pa.Table:
    return table.set_column(table.schema.get_field_index("reward"), "reward", pa.array(rewards, type=pa.float32()))


def set_token_column(table: pa.Table, name: str, values: Sequence[Sequence[float]]) -> pa.Table:
    """Replace a list<float32> column of the Experience table."""
    idx = table.schema.get_field_index(name)
    return table.set_column(idx, name, pa.array([list(map(float, v)) for v in values], type=pa.list_(pa.float32())))


def rewards_of(table: pa.Table) -> np.ndarray:
    return np.asarray(table.column("reward").to_pylist(), dtype=np.float64)
