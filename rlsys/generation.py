"""Generation requests and results: the rollout backend interface's data (docs/architecture.md, Actors).

Every backend (transformers, or vLLM on GPU machines) takes `GenerationRequest`s and
returns one `Generation` per sampled response, in request order, `n` per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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
    policy_version: int = 0  # of the oldest token (a response resumed under newer weights has several)
    embedding: Optional[list[float]] = None  # when the request asked for one
    token_versions: Optional[list[int]] = None  # per response token, where weights may change mid-generation


@dataclass
class Growing:
    """A response generated chunk by chunk (`generate_in_chunks`): what it has so far."""

    first: Generation
    params: SamplingParams  # its request's (max_new_tokens: the whole budget)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"

    def extend(self, g: Generation) -> None:
        self.response_ids += g.response_ids
        self.logprobs += g.logprobs
        self.token_versions += [g.policy_version] * len(g.response_ids)
        self.finish_reason = g.finish_reason

    @property
    def unfinished(self) -> bool:
        return self.finish_reason == "length" and len(self.response_ids) < self.params.max_new_tokens

    def next_request(self, chunk: int, round_: int) -> GenerationRequest:
        """The resumed request: the prompt and the tokens so far as the prompt, one sample, the next chunk."""
        seed = None if self.params.seed is None else self.params.seed + 1_000_003 * round_
        left = self.params.max_new_tokens - len(self.response_ids)
        params = replace(self.params, n=1, max_new_tokens=min(chunk, left), seed=seed)
        return GenerationRequest(self.first.prompt_ids + self.response_ids, params)

    def generation(self) -> Generation:
        versions = self.token_versions
        return Generation(
            self.first.request_index,
            self.first.prompt_ids,
            self.response_ids,
            self.logprobs,
            self.finish_reason,
            policy_version=min(versions) if versions else self.first.policy_version,
            token_versions=versions,
        )


def generate_in_chunks(generate_each, requests_by_policy: dict, chunk: int) -> dict:
    """Partial rollouts (`rollout.inflight_update: resume`): `generate_each(requests_by_policy)`
    asked for at most `chunk` new tokens a response at a time; a response that is still going is
    stopped there and resumed from its prefix (its prompt and its tokens so far, prefilled again,
    token ids as sampled) by whatever weights the worker holds by then, so new weights reach a
    long generation within `chunk` tokens. Each token keeps the version that sampled it
    (`token_versions`) and its sampler logprob; the stitched generation's `policy_version` is its
    oldest token's. Under unchanged weights greedy decoding gives the unchunked tokens."""
    first = {
        policy: [replace(r, params=replace(r.params, max_new_tokens=min(chunk, r.params.max_new_tokens))) for r in reqs]
        for policy, reqs in requests_by_policy.items()
    }
    rows = {}
    for policy, gens in generate_each(first).items():
        rows[policy] = [Growing(g, requests_by_policy[policy][g.request_index].params) for g in gens]
        for row, g in zip(rows[policy], gens):
            row.extend(g)
    round_ = 1
    while True:
        todo = {policy: [row for row in grown if row.unfinished] for policy, grown in rows.items()}
        todo = {policy: grown for policy, grown in todo.items() if grown}
        if not todo:
            return {policy: [row.generation() for row in grown] for policy, grown in rows.items()}
        resumed = generate_each({p: [row.next_request(chunk, round_) for row in grown] for p, grown in todo.items()})
        for policy, gens in resumed.items():
            for g in gens:
                if not g.response_ids and g.finish_reason == "length":  # would be asked again forever
                    raise RuntimeError(f"a resumed generation gave no token (chunk {round_}, row {g.request_index})")
                todo[policy][g.request_index].extend(g)
        round_ += 1
