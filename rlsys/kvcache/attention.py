"""Pure functions for SpeCache's attention over the two tiers and its top-k selection.

Notation (SpeCache, Algorithms 2-3): `K'`/`V'` are the low-bit copies in the fast tier,
`K_kappa`/`V_kappa` the full-precision pairs of the top-k set `kappa` fetched from the slow
tier, `K_t`/`V_t` the pairs of the tokens decoded this step.

* mixed keys: `K = [K' with rows kappa replaced by K_kappa, K_window, K_t]` (values alike);
  with `kappa` covering every quantised row this is exactly the full-precision cache.
* attention: `A = MaskedSoftmax(Q K^T * scale)`, `O = A V`.
* next top-k: `kappa_{t+1} = ArgTopK(A[spec])` over the quantised rows, where `A[spec]` is
  the speculative token's row, averaged over the query heads that share a KV head (GQA).
"""

from __future__ import annotations

import torch


def causal_padding_mask(valid_past: torch.Tensor, valid_new: torch.Tensor) -> torch.Tensor:
    """Boolean (B, 1, n, L + n) mask, True = attend, for `n` new tokens after `L` cached ones.

    `valid_past` (B, L) and `valid_new` (B, n) mark real (non-padding) slots. Query `i` sees
    valid keys up to its own slot `L + i`, and always itself, so padding rows stay finite.
    """
    batch, past = valid_past.shape
    n = valid_new.shape[1]
    keys = torch.cat([valid_past, valid_new], dim=1).bool()
    slot = torch.arange(past + n, device=keys.device)
    query_slot = past + torch.arange(n, device=keys.device)
    causal = slot[None, :] <= query_slot[:, None]
    allowed = keys[:, None, :] & causal[None] | (slot[None, :] == query_slot[:, None])[None]
    return allowed[:, None]


def scatter_rows(base: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`base` (B, H, S, D) with rows `index` (B, H, k) replaced by `rows` (B, H, k, D) (out of place)."""
    return base.scatter(2, index[..., None].expand(-1, -1, -1, base.shape[-1]), rows)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (B, H, k) of `x` (B, H, S, D), as a new tensor (B, H, k, D)."""
    return torch.gather(x, 2, index[..., None].expand(-1, -1, -1, x.shape[-1]))


def attention_with_probs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`A = MaskedSoftmax(Q K^T * scaling)`, `O = A V` with GQA; returns (O (B, Hq, n, D), A (B, Hq, n, S)).

    `query` (B, Hq, n, D), `key`/`value` (B, Hkv, S, D), `mask` boolean broadcastable to A.
    """
    batch, q_heads, n, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(batch, kv_heads, q_heads // kv_heads * n, dim)
    scores = (q @ key.transpose(-1, -2) * scaling).reshape(batch, q_heads, n, -1)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = probs.reshape(batch, kv_heads, -1, probs.shape[-1]) @ value
    return out.reshape(batch, q_heads, n, dim), probs


def select_topk(probs: torch.Tensor, kv_heads: int, k: int, candidates: int) -> torch.Tensor:
    """`ArgTopK` of one query row's attention over the first `candidates` slots, per KV head.

    `probs` (B, Hq, S) is averaged over the `Hq / kv_heads` query heads of each KV head
    (GQA), then the `min(k, candidates)` largest slots are returned, sorted, as (B, Hkv, k).
    """
    batch, q_heads, _ = probs.shape
    per_kv = probs[..., :candidates].reshape(batch, kv_heads, q_heads // kv_heads, candidates).mean(2)
    index = per_kv.topk(min(k, candidates), dim=-1).indices
    return index.sort(dim=-1).values


def topk_recall(chosen: torch.Tensor, true: torch.Tensor) -> float:
    """Fraction of the true top-k set (B, H, k) found in the chosen set (B, H, k')."""
    hits = (chosen[..., :, None] == true[..., None, :]).any(-2)
    return hits.float().mean().item()
