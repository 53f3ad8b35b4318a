"""Generation requests and results: the rollout backend interface's data (DESIGN.md Actors).

Every backend (transformers now, vLLM on GPU machines) takes `GenerationRequest`s and
returns one `Generation` per sampled response, in request order, `n` per request.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k truncation
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Generation:
    request_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # log pi(token) under the policy, temperature-scaled, one per response token
    finish_reason: str  # "stop" (eos/stop id) or "length"
    policy_version: int = 0
