"""Cascade (Thomas et al., 2025, "Cascade: Token-Sharded Private LLM Inference",
arXiv:2507.05228): a sequence-sharded forward pass of a decoder across parties that each
see only some rows.

Compute party i holds the token positions of shard S_i and runs everything token-local on
them (norms, Q/K/V and output projections, MLP, final norm and lm_head). Attention party
(i, j) receives the queries of shard i and the keys/values of shard j and returns the partial
softmax output and its log-sum-exp, Eqs. (A1)-(A3) of `decoder`; compute party i merges its
blocks exactly, Eq. (A4). The client embeds each shard's tokens, hands the rows to its compute
party and collects the logits. Pairs (i, j) where every key of S_j lies after every query of
S_i (fully masked) are never formed.

Sharding. `c_delta_shards(n, c, delta)` gives each shard at most c positions spaced exactly
delta apart (position p goes to block p // (c * delta), residue p mod delta), so no compute
party sees two positions closer than delta: the vocab-matching attack on its rows must guess the
delta - 1 tokens between them, V^(delta - 1) prefixes per step instead of V candidates. An
attention party (i, j) holds rows of two shards, queries of S_i and keys/values of S_j; when
they share a block their positions interleave, one position apart. Every party holds layer 0,
whose rows are a function of each token and its position alone. (This is our reading of the
paper's c-delta sharding; the shard lists are an input, so any other scheme can be passed.)

Backends: "local" runs the parties as plain objects in this process (unit tests); "ray" puts
each party on a Ray actor (or spreads them over a capped number of actor processes). Tensors
then flow actor to actor as object references; the driver (the client) only ever fetches
logits and, for evaluation, the parties' recorded views.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch
from torch import Tensor

from .attack import View
from .decoder import (
    DecoderWeights,
    finish_layer,
    head_rows,
    key_value_rows,
    logits_of,
    merge_partials,
    output_state,
    partial_attention,
    project_qkv,
)

BACKENDS = ("local", "ray")


def c_delta_shards(n: int, c: int, delta: int) -> list[list[int]]:
    """(c, delta)-sharding of positions 0..n-1: shard (b, r) = {p : p // (c*delta) = b,
    p mod delta = r}; each shard has <= c positions, consecutive ones exactly delta apart."""
    if c < 1 or delta < 1:
        raise ValueError(f"c={c}, delta={delta}: both must be >= 1")
    shards: dict[tuple[int, int], list[int]] = {}
    for p in range(n):
        shards.setdefault((p // (c * delta), p % delta), []).append(p)
    return [shards[k] for k in sorted(shards)]


def check_shards(shards: list[list[int]], n: int) -> None:
    """Shards must partition 0..n-1 into non-empty, sorted lists."""
    flat = sorted(p for s in shards for p in s)
    if flat != list(range(n)) or any(not s or s != sorted(s) for s in shards):
        raise ValueError(f"shards do not partition positions 0..{n - 1} into sorted, non-empty lists")


def attention_pairs(shards: list[list[int]]) -> list[tuple[int, int]]:
    """(i, j) pairs with at least one unmasked (query, key): min(S_j) <= max(S_i)."""
    return [(i, j) for i, j in product(range(len(shards)), repeat=2) if min(shards[j]) <= max(shards[i])]


class ComputeParty:
    """Holds the rows of one shard and runs the token-local ops on them. `seen[l]` records
    hidden state l of its rows (as transformers indexes them): exactly what this party sees."""

    def __init__(self, weights: DecoderWeights, positions: list[int]):
        self.w = weights
        self.positions = torch.tensor(positions)
        self.h: Tensor | None = None
        self.seen: list[Tensor] = []

    def load(self, rows: Tensor) -> None:
        """Take the client's embedding rows [n_i, d] for this shard."""
        self.h = rows[None].clone()
        self.seen = [rows.clone()]

    def qkv(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of this shard's rows for `layer`."""
        return project_qkv(self.w, self.w.layers[layer], self.h, self.positions)

    def merge(self, layer: int, *parts: tuple[Tensor, Tensor]) -> None:
        """Merge the attention parties' blocks (A4) and finish `layer` on this shard."""
        self.h = finish_layer(self.w.layers[layer], self.w, self.h, merge_partials(list(parts)))
        self.seen.append(output_state(self.w, self.h[0], layer + 1))

    def logits(self) -> Tensor:
        """Next-token logits [n_i, V] of this shard's positions."""
        return logits_of(self.w, self.h[0])

    def views(self) -> list[Tensor]:
        return self.seen


class AttentionParty:
    """Attention block (i, j): queries of shard i against keys/values of shard j. `seen[l]`
    records the (q, k, v) it was handed for layer l: exactly what this party sees."""

    def __init__(self, q_positions: list[int], k_positions: list[int]):
        self.q_pos = torch.tensor(q_positions)
        self.k_pos = torch.tensor(k_positions)
        self.seen: list[tuple[Tensor, Tensor, Tensor]] = []

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """(o_ij, lse_ij), Eqs. (A1)-(A3), from the queries of shard i and keys/values of shard j
        (called once per layer, in layer order)."""
        self.seen.append((q, k, v))
        return partial_attention(q, k, v, self.q_pos, self.k_pos)

    def views(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        return self.seen


@dataclass
class CascadeOutput:
    """Logits [n, V] in prompt order; per compute party its hidden states by layer; per
    attention party (i, j) the (q of S_i, k of S_j, v of S_j) it was handed, by layer, each
    [1, heads, shard size, head_dim]."""

    logits: Tensor
    shards: list[list[int]]
    views: list[list[Tensor]]
    attention_views: dict[tuple[int, int], list[tuple[Tensor, Tensor, Tensor]]]


class _Local:
    """Parties as plain objects: a call runs at once."""

    def make(self, cls, *args):
        return cls(*args)

    def call(self, party, method, *args, returns=1):
        return getattr(party, method)(*args)

    def get(self, value):
        return value

    def close(self):
        """Nothing to release in-process."""


class PartyHost:
    """One Ray actor process hosting parties by key. With one host per party every party is
    its own process; fewer hosts simulate many machines in few processes on a small box."""

    def __init__(self):
        self.parties = {}

    def add(self, key, cls, *args) -> None:
        self.parties[key] = cls(*args)

    def call(self, key, method: str, *args):
        return getattr(self.parties[key], method)(*args)


class _Ray:
    """Parties on Ray actors (zero CPUs reserved each); a call returns object references that
    later calls take as arguments, so tensors move actor to actor, never via the driver."""

    def __init__(self, weights: DecoderWeights, hosts: int | None):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("backend 'ray' needs ray.init() first")
        self.ray = ray
        self.weights_ref = ray.put(weights)
        self.host_cls = ray.remote(num_cpus=0)(PartyHost)
        self.limit = hosts
        self.hosts: list = []
        self.made = 0

    def make(self, cls, *args):
        if cls is ComputeParty:
            args = (self.weights_ref, *args[1:])
        if self.limit is None or len(self.hosts) < self.limit:
            self.hosts.append(self.host_cls.remote())
        host, key = self.hosts[self.made % len(self.hosts)], self.made
        self.made += 1
        host.add.remote(key, cls, *args)
        return host, key

    def call(self, party, method, *args, returns=1):
        host, key = party
        return host.call.options(num_returns=returns).remote(key, method, *args)

    def get(self, value):
        return self.ray.get(value)

    def close(self):
        for host in self.hosts:
            self.ray.kill(host)


def cascade_forward(
    w: DecoderWeights, ids: Tensor, shards: list[list[int]], backend: str = "local", hosts: int | None = None
) -> CascadeOutput:
    """Sharded forward pass of one prompt ids [n] over len(shards) compute parties and
    len(attention_pairs(shards)) attention parties. With backend "ray", `hosts` caps the
    actor processes the parties are spread over (None: one actor per party)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    if hosts is not None and hosts < 1:
        raise ValueError(f"hosts={hosts}: expected >= 1 or None")
    check_shards(shards, ids.shape[0])
    run = _Local() if backend == "local" else _Ray(w, hosts)
    compute = [run.make(ComputeParty, w, s) for s in shards]
    pairs = attention_pairs(shards)
    attention = {(i, j): run.make(AttentionParty, shards[i], shards[j]) for i, j in pairs}
    try:
        # Every state-changing call's result is fetched at the end, so a party's failure
        # surfaces as an error instead of stale rows.
        acks = [run.call(party, "load", w.embed[ids[torch.tensor(s)]]) for party, s in zip(compute, shards)]
        for layer in range(w.n_layers):
            qkv = [run.call(party, "qkv", layer, returns=3) for party in compute]
            blocks: dict[int, list] = {i: [] for i in range(len(shards))}
            for i, j in pairs:
                q, k, v = qkv[i][0], qkv[j][1], qkv[j][2]
                blocks[i].append(run.call(attention[(i, j)], "attend", q, k, v))
            acks += [run.call(party, "merge", layer, *blocks[i]) for i, party in enumerate(compute)]
        run.get(acks)
        shard_logits = run.get([run.call(party, "logits") for party in compute])
        views = run.get([run.call(party, "views") for party in compute])
        attention_views = run.get([run.call(attention[pair], "views") for pair in pairs])
    finally:
        run.close()
    logits = torch.empty(ids.shape[0], w.vocab_size)
    for s, lg in zip(shards, shard_logits):
        logits[torch.tensor(s)] = lg
    return CascadeOutput(logits, shards, views, dict(zip(pairs, attention_views)))


def party_view(out: CascadeOutput, party: int, layer: int) -> View:
    """What compute party `party` saw of hidden state `layer`: its rows, at known positions."""
    return View(out.views[party][layer], out.logits.shape[0], layer, torch.tensor(out.shards[party]))


def attention_party_views(out: CascadeOutput, pair: tuple[int, int], layer: int) -> list[View]:
    """What attention party (i, j) saw of decoder layer `layer`, as rows at known positions: the
    keys/values of shard j, then the queries of shard i (for i = j, the same positions)."""
    i, j = pair
    q, k, v = out.attention_views[pair][layer]
    n = out.logits.shape[0]
    return [
        View(key_value_rows(k, v), n, layer, torch.tensor(out.shards[j]), observable="keys_values"),
        View(head_rows(q), n, layer, torch.tensor(out.shards[i]), observable="queries"),
    ]
