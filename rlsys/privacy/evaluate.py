"""The attack as an evaluator of a serving setup: run it, under one search budget, against the
views a plain server, a permuting server and one Cascade compute party would hold, and score
token recovery and search cost. Shared by `rlsys privacy attack` and benchmarks/privacy.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .attack import AttackConfig, blind_view, permuted_view, plain_view, vocab_matching_attack
from .cascade import c_delta_shards, cascade_forward, party_view
from .decoder import DecoderWeights

PLAIN_VIEWS = (
    ("plain", False, False),
    ("rows permuted", True, False),
    ("entries permuted", False, True),
    ("rows + entries permuted", True, True),
)


@dataclass
class ViewScore:
    """Attack outcome on one kind of view, pooled over prompts (and parties).

    recovery: fraction of prompt tokens recovered exactly; matched: fraction accepted under
    epsilon (V1) and correct; candidates_per_token / ms_per_token: search cost per prompt token;
    worst_recovery: the highest recovery of any single attacked view (prompt, party)."""

    view: str
    recovery: float
    matched: float
    candidates_per_token: float
    ms_per_token: float
    worst_recovery: float
    attacks: int


@dataclass
class Evaluation:
    """Scores per view, how far Cascade's logits were from the served model's, and how many
    compute parties each prompt was sharded over."""

    scores: list[ViewScore]
    cascade_max_logit_diff: float
    n_parties: int


class _Pool:
    """Accumulates attack results on one kind of view."""

    def __init__(self, name: str):
        self.name, self.correct, self.matched, self.tokens = name, 0, 0, 0
        self.candidates, self.seconds, self.worst, self.attacks = 0, 0.0, 0.0, 0

    def add(self, result, truth: Tensor) -> None:
        truth = truth.tolist()
        hits = [a == b for a, b in zip(result.tokens, truth)]
        self.correct += sum(hits)
        self.matched += sum(h and m for h, m in zip(hits, result.matched))
        self.tokens += len(truth)
        self.candidates += result.candidates
        self.seconds += result.seconds
        self.worst = max(self.worst, sum(hits) / len(truth))
        self.attacks += 1

    def score(self) -> ViewScore:
        n = max(self.tokens, 1)
        return ViewScore(
            self.name,
            self.correct / n,
            self.matched / n,
            self.candidates / n,
            1000 * self.seconds / n,
            self.worst,
            self.attacks,
        )


@torch.no_grad()
def transformers_states(model, ids: Tensor, layer: int) -> Tensor:
    """Hidden state `layer` [n, d] of one prompt as the served transformers model computes it."""
    return model(ids[None], output_hidden_states=True).hidden_states[layer][0].float()


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[Tensor]:
    """n prompts of uniformly random token ids."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=g) for _ in range(n)]


@torch.no_grad()
def attack_cascade_parties(
    model,
    prompts: list[Tensor],
    layer: int,
    config: AttackConfig,
    c: int,
    delta: int,
    backend: str = "local",
    hosts: int | None = None,
) -> tuple[ViewScore, float, int]:
    """Run each prompt through Cascade with (c, delta)-sharding and attack every compute
    party's rows of state `layer`. Returns the pooled score, the largest |logit| difference
    from the served model, and the number of compute parties."""
    w = DecoderWeights.from_hf(model)
    pool = _Pool("cascade: one compute party")
    max_diff, n_parties = 0.0, 0
    for ids in prompts:
        out = cascade_forward(w, ids, c_delta_shards(ids.shape[0], c, delta), backend, hosts)
        max_diff = max(max_diff, (out.logits - model(ids[None]).logits[0].float()).abs().max().item())
        n_parties = max(n_parties, len(out.shards))
        for party in range(len(out.shards)):
            pool.add(vocab_matching_attack(w, party_view(out, party, layer), config), ids)
    return pool.score(), max_diff, n_parties


@torch.no_grad()
def evaluate(
    model,
    prompts: list[Tensor],
    layer: int,
    config: AttackConfig,
    c: int = 2,
    delta: int = 3,
    backend: str = "local",
    seed: int = 0,
    hosts: int | None = None,
) -> Evaluation:
    """Attack every prompt's plain, permuted, Cascade-party and empty views at `layer`."""
    w = DecoderWeights.from_hf(model)
    if not 0 <= layer <= w.n_layers:
        raise ValueError(f"layer={layer}: the model has hidden states 0..{w.n_layers}")
    g = torch.Generator().manual_seed(seed)
    pools = {name: _Pool(name) for name, _, _ in PLAIN_VIEWS}
    blind = _Pool("no view (chance)")
    for ids in prompts:
        base = plain_view(transformers_states(model, ids, layer), layer)
        for name, rows, dims in PLAIN_VIEWS:
            view = permuted_view(base, rows, dims, g) if rows or dims else base
            pools[name].add(vocab_matching_attack(w, view, config), ids)
        blind.add(vocab_matching_attack(w, blind_view(ids.shape[0], layer, w.embed.shape[1]), config), ids)
    cascade, max_diff, n_parties = attack_cascade_parties(model, prompts, layer, config, c, delta, backend, hosts)
    return Evaluation([*(p.score() for p in pools.values()), cascade, blind.score()], max_diff, n_parties)


def markdown_table(scores: list[ViewScore]) -> str:
    """The scores as a markdown table."""
    lines = [
        "| view | tokens recovered | matched under epsilon | worst single view | candidates / token | ms / token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in scores:
        lines.append(
            f"| {s.view} | {100 * s.recovery:.1f}% | {100 * s.matched:.1f}% | {100 * s.worst_recovery:.1f}% "
            f"| {s.candidates_per_token:.1f} | {s.ms_per_token:.2f} |"
        )
    return "\n".join(lines)
