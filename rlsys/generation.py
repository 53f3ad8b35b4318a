"""Generation requests and results: the rollout backend interface's data (docs/architecture.md, Actors).

Every backend (transformers, or vLLM on GPU machines) takes `GenerationRequest`s and
returns one `Generation` per sampled response, in request order, `n` per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

INTERPOLATION_MODES = ("plus", "minus")


@dataclass(frozen=True)
class Interpolation:
    """Sample from a token-by-token mix of the policy's and the reference's logits (PILAF,
    ../shared/papers/pilaf.md): `plus` is softmax((1+beta)*h_theta - beta*h_ref), the
    optimistic pi_theta^(1+beta) * pi_ref^(-beta); `minus` is softmax((1-beta)*h_theta +
    beta*h_ref), the pessimistic pi_theta^(1-beta) * pi_ref^(beta). Temperature, top-k and
    top-p apply to the mixed logits. A backend that serves it holds the reference model too."""

    beta: float
    mode: Literal["plus", "minus"]

    def __post_init__(self):
        if self.mode not in INTERPOLATION_MODES:
            raise ValueError(f"interpolation mode {self.mode!r} (allowed: {', '.join(INTERPOLATION_MODES)})")


def interpolated_logits(policy_logits, reference_logits, beta: float, mode: str):
    """h_plus = (1+beta)*h_theta - beta*h_ref;  h_minus = (1-beta)*h_theta + beta*h_ref.
    Works on tensors or arrays of any shape; beta = 0 returns the policy's logits."""
    if mode == "plus":
        return (1.0 + beta) * policy_logits - beta * reference_logits
    if mode == "minus":
        return (1.0 - beta) * policy_logits + beta * reference_logits
    raise ValueError(f"interpolation mode {mode!r} (allowed: {', '.join(INTERPOLATION_MODES)})")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k truncation
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    interpolation: Optional[Interpolation] = None  # None: sample from the policy alone

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # "policy" or "reference": also return the mean over the response tokens of that
    # model's last hidden states (Generation.embedding), e.g. for AMPO's diversity selection
    embedding: Optional[Literal["policy", "reference"]] = None


@dataclass
class Generation:
    request_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # log pi(token) under the policy, temperature-scaled, one per response token
    finish_reason: str  # "stop" (eos/stop id) or "length"
    policy_version: int = 0
    embedding: Optional[list[float]] = None  # when the request asked for one
