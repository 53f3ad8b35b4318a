"""The vocabulary-matching inversion attack (Thomas et al., 2025, arXiv:2505.18332; with
Cascade, ICML 2025 "Hidden No More: Attacking and Defending Private Third-Party LLM
Inference"): rebuild a prompt from one layer's hidden states and the model's open weights.

In a causal decoder the state at position i depends only on tokens 0..i, so position by
position the attacker extends the known prefix with candidate tokens v, ordered by a
proposal (the model's own next-token distribution given the recovered prefix, or plain
vocabulary order), runs prefix + v in batches, and accepts the first v whose layer-l state
h(prefix + v) lies within epsilon of the observed row in L1:

    (V1)  accept v  iff  d(h(prefix + v), y_i) = ||h(prefix + v) - y_i||_1 < epsilon

Permutation defences change what y_i is compared with:

    (V2)  rows permuted (sequence order hidden): d_i(v) = min over unmatched rows r of d(h, y_r);
          the matched row is removed
    (V3)  entries of each row permuted:          d(h, y) = ||sort(h) - sort(y)||_1

What is observed can be the hidden state itself (a plain server, a Cascade compute party) or a
token-local projection of it: the keys and values, or the queries, of one decoder layer (a
Cascade attention party). Those are functions of hidden state l at the same position (norm,
projection, RoPE at that position), so a candidate's are computed the same way as its hidden
state, and (V1) compares them instead. At layer 0 they depend on the token and its position
alone, so no prefix is needed there.

A view that observes only some positions (one Cascade party) leaves the others unverifiable:
there the attacker can only take the proposal's top token, and an observed position after such
a gap is compared under a guessed prefix. With no candidate under epsilon after the budget, the
attacker keeps the nearest candidate it tried. An observer with several views of one prompt (an
attention party's keys/values of one shard and queries of another) is attacked in one pass: each
position is compared with the first view that observes it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .decoder import DecoderWeights, PrefixCache, append_token, candidate_step, head_rows, key_value_rows, project_qkv

PROPOSALS = ("model", "vocab")
OBSERVABLES = ("hidden", "keys_values", "queries")


@dataclass
class View:
    """What one observer holds: rows of hidden state number `layer` of an n_tokens prompt.

    `positions[r]` is the prompt position of row r when the observer knows it (plain view,
    a Cascade party); None when the rows arrive in an unknown order (row permutation).
    `dims_permuted`: each row's entries were shuffled by an unknown permutation.
    `observable`: what a row is. "hidden": hidden state number `layer` (0..n_layers), as
    transformers indexes them; "keys_values": decoder layer `layer`'s (0..n_layers-1) keys then
    values, heads flattened (`key_value_rows`); "queries": that layer's queries (`head_rows`)."""

    states: Tensor
    n_tokens: int
    layer: int
    positions: Tensor | None
    dims_permuted: bool = False
    observable: str = "hidden"

    def __post_init__(self):
        if self.observable not in OBSERVABLES:
            raise ValueError(f"observable={self.observable!r}: expected one of {', '.join(OBSERVABLES)}")


@dataclass
class AttackConfig:
    """Search budget and acceptance rule, the same for every view an evaluation compares.

    budget: candidates tried per observed position (None: the whole vocabulary).
    batch_size: candidates per batched forward pass.
    epsilon: absolute L1 threshold of (V1); None sets it once per view to
    `rel_epsilon` times the mean L1 norm of the observed rows, which lies far above float
    noise (~1e-6 relative) and far below the gap between distinct tokens (~0.5 relative).
    proposal: "model" (the model's next-token distribution) or "vocab" (id order)."""

    budget: int | None = None
    batch_size: int = 128
    epsilon: float | None = None
    rel_epsilon: float = 1e-3
    proposal: str = "model"

    def __post_init__(self):
        if self.proposal not in PROPOSALS:
            raise ValueError(f"proposal={self.proposal!r}: expected one of {', '.join(PROPOSALS)}")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"budget={self.budget}: expected a positive number of candidates")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: expected >= 1")


@dataclass
class AttackResult:
    """Recovered tokens, which passed the threshold (V1), the distance of each (nan where the
    position was unobserved), candidates evaluated in all, wall time and the epsilon used for
    each view attacked."""

    tokens: list[int]
    matched: list[bool]
    candidates: int
    seconds: float
    epsilons: list[float]
    distances: list[float]

    def recovery(self, truth: Tensor | list[int]) -> float:
        """Fraction of prompt positions recovered exactly."""
        truth = list(map(int, truth))
        return sum(a == b for a, b in zip(self.tokens, truth)) / len(truth)


def plain_view(states: Tensor, layer: int) -> View:
    """The unsharded server's view: every row [n, d] of hidden state `layer`, in order."""
    return View(states, states.shape[0], layer, torch.arange(states.shape[0]))


def blind_view(n_tokens: int, layer: int, hidden_size: int) -> View:
    """No rows at all: the attack degenerates to the proposal's guesses (the chance baseline)."""
    return View(torch.zeros(0, hidden_size), n_tokens, layer, torch.zeros(0, dtype=torch.long))


def permuted_view(view: View, rows: bool, dims: bool, generator: torch.Generator) -> View:
    """A permutation defence applied to `view`: shuffle the rows (sequence order), and/or
    shuffle each row's entries with its own permutation."""
    states, positions = view.states, view.positions
    if rows:
        order = torch.randperm(states.shape[0], generator=generator)
        states, positions = states[order], None
    if dims:
        perms = torch.stack([torch.randperm(states.shape[1], generator=generator) for _ in range(states.shape[0])])
        states = torch.gather(states, 1, perms)
    return View(states, view.n_tokens, view.layer, positions, view.dims_permuted or dims, view.observable)


def l1_distances(candidates: Tensor, targets: Tensor, sort_entries: bool) -> Tensor:
    """Pairwise L1 distances [B, M] between candidate states [B, d] and observed rows [M, d]:
    (V1), or (V3) between sorted vectors when entries are permuted."""
    if sort_entries:
        candidates, targets = candidates.sort(-1).values, targets.sort(-1).values
    return torch.cdist(candidates, targets, p=1)


def proposal_order(logits: Tensor | None, vocab_size: int, proposal: str) -> Tensor:
    """Candidate order for the next position: by the model's next-token logits (most likely
    first), or by id when the proposal is "vocab" or there is no prefix yet."""
    if proposal == "vocab" or logits is None:
        return torch.arange(vocab_size)
    return torch.argsort(logits, descending=True)


def default_epsilon(view: View, rel_epsilon: float) -> float:
    """epsilon for (V1): `rel_epsilon` times the mean L1 norm of the observed rows."""
    if view.states.shape[0] == 0:
        return 0.0
    return rel_epsilon * view.states.abs().sum(-1).mean().item()


def check_layer(w: DecoderWeights, view: View) -> None:
    """Hidden states run 0..n_layers; keys, values and queries exist for layers 0..n_layers-1."""
    top = w.n_layers if view.observable == "hidden" else w.n_layers - 1
    if not 0 <= view.layer <= top:
        raise ValueError(f"layer={view.layer}: {view.observable} exist for 0..{top} in this model")


def candidate_observations(w: DecoderWeights, cache: PrefixCache, tokens: Tensor, view: View) -> Tensor:
    """What `view`'s observer would hold for each candidate token [B] at the position after the
    cached prefix, one row each [B, F]: hidden state `view.layer`, or the keys/values or queries
    that layer projects from it (at that position's RoPE angle)."""
    state, _ = candidate_step(w, cache, tokens, view.layer)
    if view.observable == "hidden":
        return state
    q, k, v = project_qkv(w, w.layers[view.layer], state[:, None], torch.tensor([cache.length]))
    return head_rows(q) if view.observable == "queries" else key_value_rows(k, v)


def _targets(view: View, position: int, unmatched: list[int]) -> list[int]:
    """Rows position `position` may be matched to: its own row if observed, every unmatched
    row when the order is hidden (V2)."""
    if view.positions is None:
        return unmatched
    return [r for r in unmatched if int(view.positions[r]) == position]


def _observing(views: list[View], position: int, unmatched: list[list[int]]) -> tuple[int, list[int]]:
    """The first view with rows `position` may be matched to, and those rows; (-1, []) if none."""
    for k, view in enumerate(views):
        rows = _targets(view, position, unmatched[k])
        if rows:
            return k, rows
    return -1, []


@torch.no_grad()
def vocab_matching_attack(w: DecoderWeights, view: View | Sequence[View], config: AttackConfig) -> AttackResult:
    """Recover the prompt behind `view` position by position, (V1)-(V3). `view` may be a sequence
    of views one observer holds of the same prompt; each position is matched against the first
    of them that observes it."""
    start = time.perf_counter()
    views = [view] if isinstance(view, View) else list(view)
    if not views or len({v.n_tokens for v in views}) != 1:
        raise ValueError("expected one or more views of the same prompt (equal n_tokens)")
    for v in views:
        check_layer(w, v)
    eps = [config.epsilon if config.epsilon is not None else default_epsilon(v, config.rel_epsilon) for v in views]
    budget = min(config.budget or w.vocab_size, w.vocab_size)
    cache, logits = PrefixCache.empty(w), None
    unmatched = [list(range(v.states.shape[0])) for v in views]
    tokens, matched, distances, tried = [], [], [], 0
    for position in range(views[0].n_tokens):
        order = proposal_order(logits, w.vocab_size, config.proposal)
        k, rows = _observing(views, position, unmatched)
        if not rows:
            token, hit, dist = int(order[0]), False, float("nan")
        else:
            token, hit, dist, row, n = _search(w, cache, views[k], rows, order[:budget], config.batch_size, eps[k])
            tried += n
            if hit:
                unmatched[k].remove(row)
        tokens.append(token)
        matched.append(hit)
        distances.append(dist)
        cache, logits = append_token(w, cache, token)
    return AttackResult(tokens, matched, tried, time.perf_counter() - start, eps, distances)


def _search(w, cache, view, rows, order, batch_size, eps):
    """Try `order` in batches; return (token, matched, distance, row, candidates tried) for the
    first candidate under eps, else for the nearest candidate tried."""
    targets = view.states[rows]
    best = (float("inf"), int(order[0]), rows[0])
    tried = 0
    for chunk in order.split(batch_size):
        observed = candidate_observations(w, cache, chunk, view)
        tried += chunk.shape[0]
        dist = l1_distances(observed, targets, view.dims_permuted)
        per_candidate, which_row = dist.min(dim=1)
        hits = (per_candidate < eps).nonzero()
        if hits.numel():
            c = int(hits[0])
            return int(chunk[c]), True, float(per_candidate[c]), rows[int(which_row[c])], tried
        c = int(per_candidate.argmin())
        if float(per_candidate[c]) < best[0]:
            best = (float(per_candidate[c]), int(chunk[c]), rows[int(which_row[c])])
    return best[1], False, best[0], best[2], tried
