"""The attack as an evaluator of a serving setup: run it, under one search budget, against the
views a plain server, a permuting server and each kind of Cascade party (compute party, attention
party (i, i), attention party (i, j) with i != j) would hold, and score token recovery and search
cost. Shared by `rlsys privacy attack` and benchmarks/privacy.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .attack import AttackConfig, View, blind_view, permuted_view, plain_view, vocab_matching_attack
from .cascade import CascadeOutput, attention_party_views, c_delta_shards, cascade_forward, party_view
from .decoder import DecoderWeights

PLAIN_VIEWS = (
    ("plain", False, False),
    ("rows permuted", True, False),
    ("entries permuted", False, True),
    ("rows + entries permuted", True, True),
)
COMPUTE_PARTY = "cascade: one compute party"
DIAGONAL_ATTENTION_PARTY = "cascade: one attention party (i = j)"
OFF_DIAGONAL_ATTENTION_PARTY = "cascade: one attention party (i != j)"
PARTY_TYPES = (COMPUTE_PARTY, DIAGONAL_ATTENTION_PARTY, OFF_DIAGONAL_ATTENTION_PARTY)


@dataclass
class ViewScore:
    """Attack outcome on one kind of view, pooled over prompts (and parties).

    recovery: fraction of prompt tokens recovered exactly; matched: fraction accepted under
    epsilon (V1) and correct; held_recovery: fraction of the positions the observer holds a row
    of that were recovered (nan when it holds none); candidates_per_token / ms_per_token: search
    cost per prompt token; worst_recovery: the highest recovery of any single attacked view
    (prompt, party), on prompt number `worst_prompt`."""

    view: str
    recovery: float
    matched: float
    held_recovery: float
    candidates_per_token: float
    ms_per_token: float
    worst_recovery: float
    worst_prompt: int
    attacks: int


@dataclass
class Evaluation:
    """Scores per view, how far Cascade's logits were from the served model's, and how many
    compute parties each prompt was sharded over."""

    scores: list[ViewScore]
    cascade_max_logit_diff: float
    n_parties: int


def held_positions(views: list[View]) -> set[int]:
    """Prompt positions the observer holds a row of. A row-permuted view counts as holding every
    position: the permuted views here are of whole prompts."""
    held: set[int] = set()
    for view in views:
        held |= set(range(view.n_tokens)) if view.positions is None else set(view.positions.tolist())
    return held


class _Pool:
    """Accumulates attack results on one kind of view."""

    def __init__(self, name: str):
        self.name, self.correct, self.matched, self.tokens = name, 0, 0, 0
        self.held_correct, self.held = 0, 0
        self.candidates, self.seconds, self.attacks = 0, 0.0, 0
        self.worst, self.worst_prompt = 0.0, 0

    def add(self, result, truth: Tensor, held: set[int], prompt: int) -> None:
        """One attack on prompt number `prompt`, whose observer held rows of `held` positions."""
        truth = truth.tolist()
        hits = [a == b for a, b in zip(result.tokens, truth)]
        self.correct += sum(hits)
        self.matched += sum(h and m for h, m in zip(hits, result.matched))
        self.held_correct += sum(hits[p] for p in held)
        self.held += len(held)
        self.tokens += len(truth)
        self.candidates += result.candidates
        self.seconds += result.seconds
        if self.attacks == 0 or sum(hits) / len(truth) > self.worst:
            self.worst, self.worst_prompt = sum(hits) / len(truth), prompt
        self.attacks += 1

    def score(self) -> ViewScore:
        n = max(self.tokens, 1)
        return ViewScore(
            self.name,
            self.correct / n,
            self.matched / n,
            self.held_correct / self.held if self.held else math.nan,
            self.candidates / n,
            1000 * self.seconds / n,
            self.worst,
            self.worst_prompt,
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


def cascade_party_views(out: CascadeOutput, layer: int) -> dict[str, list[list[View]]]:
    """Every Cascade party's view at `layer`, by party type (`PARTY_TYPES`): a compute party's
    rows of hidden state `layer`; an attention party's keys/values and queries of decoder layer
    `layer` (none when `layer` is the final hidden state, which no attention party sees)."""
    views: dict[str, list[list[View]]] = {name: [] for name in PARTY_TYPES}
    views[COMPUTE_PARTY] = [[party_view(out, p, layer)] for p in range(len(out.shards))]
    if layer < len(out.views[0]) - 1:
        for i, j in out.attention_views:
            kind = DIAGONAL_ATTENTION_PARTY if i == j else OFF_DIAGONAL_ATTENTION_PARTY
            views[kind].append(attention_party_views(out, (i, j), layer))
    return views


def sample_parties(parties: list, k: int | None, generator: torch.Generator) -> list:
    """At most k of `parties`, drawn uniformly without replacement, in their original order;
    all of them when k is None."""
    if k is None or len(parties) <= k:
        return parties
    keep = sorted(torch.randperm(len(parties), generator=generator)[:k].tolist())
    return [parties[i] for i in keep]


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
    party_types: tuple[str, ...] = PARTY_TYPES,
    max_parties: int | None = None,
    seed: int = 0,
) -> tuple[list[ViewScore], float, int]:
    """Run each prompt through Cascade with (c, delta)-sharding and attack the views, at `layer`,
    of the parties of each type in `party_types` (at most `max_parties` of a type per prompt, a
    seeded sample). Returns a score per party type that had a view to attack, the largest |logit|
    difference from the served model, and the number of compute parties."""
    unknown = set(party_types) - set(PARTY_TYPES)
    if unknown:
        raise ValueError(f"party types {sorted(unknown)}: expected some of {', '.join(PARTY_TYPES)}")
    w = DecoderWeights.from_hf(model)
    g = torch.Generator().manual_seed(seed)
    pools = {name: _Pool(name) for name in party_types}
    max_diff, n_parties = 0.0, 0
    for index, ids in enumerate(prompts):
        out = cascade_forward(w, ids, c_delta_shards(ids.shape[0], c, delta), backend, hosts)
        max_diff = max(max_diff, (out.logits - model(ids[None]).logits[0].float()).abs().max().item())
        n_parties = max(n_parties, len(out.shards))
        by_type = cascade_party_views(out, layer)
        for name, pool in pools.items():
            for views in sample_parties(by_type[name], max_parties, g):
                pool.add(vocab_matching_attack(w, views, config), ids, held_positions(views), index)
    return [p.score() for p in pools.values() if p.attacks], max_diff, n_parties


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
    max_parties: int | None = None,
) -> Evaluation:
    """Attack every prompt's plain, permuted, Cascade-party (each type; at most `max_parties` of
    a type per prompt) and empty views at `layer`."""
    w = DecoderWeights.from_hf(model)
    if not 0 <= layer <= w.n_layers:
        raise ValueError(f"layer={layer}: the model has hidden states 0..{w.n_layers}")
    g = torch.Generator().manual_seed(seed)
    pools = {name: _Pool(name) for name, _, _ in PLAIN_VIEWS}
    blind = _Pool("no view (chance)")
    for index, ids in enumerate(prompts):
        base = plain_view(transformers_states(model, ids, layer), layer)
        for name, rows, dims in PLAIN_VIEWS:
            view = permuted_view(base, rows, dims, g) if rows or dims else base
            pools[name].add(vocab_matching_attack(w, view, config), ids, held_positions([view]), index)
        empty = blind_view(ids.shape[0], layer, w.embed.shape[1])
        blind.add(vocab_matching_attack(w, empty, config), ids, set(), index)
    parties, max_diff, n_parties = attack_cascade_parties(
        model, prompts, layer, config, c, delta, backend, hosts, max_parties=max_parties, seed=seed
    )
    return Evaluation([*(p.score() for p in pools.values()), *parties, blind.score()], max_diff, n_parties)


def percent(x: float) -> str:
    """x as a percentage with one decimal; '-' for nan (nothing to score)."""
    return "-" if math.isnan(x) else f"{100 * x:.1f}%"


def markdown_table(scores: list[ViewScore]) -> str:
    """The scores as a markdown table."""
    lines = [
        "| view | tokens recovered | matched under epsilon | held positions recovered | worst single view "
        "| candidates / token | ms / token |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in scores:
        lines.append(
            f"| {s.view} | {percent(s.recovery)} | {percent(s.matched)} | {percent(s.held_recovery)} "
            f"| {percent(s.worst_recovery)} | {s.candidates_per_token:.1f} | {s.ms_per_token:.2f} |"
        )
    return "\n".join(lines)
