"""A decoder forward pass split into its token-local and attention parts, as pure functions
of plain weight tensors (no transformers import), for Llama-family models (Llama, Qwen2,
Qwen3 with its per-head query/key norms, Mistral without a sliding window, Phi-3's fused
projections).

Cascade (Thomas et al., 2025, "Cascade: Token-Sharded Private LLM Inference") runs the
token-local parts (norms, QKV and output projections, MLP) on compute parties and the
attention on attention parties. Attention is written as partial softmax blocks with their
log-sum-exp, merged exactly (Cascade's attention merge; the same identity as blockwise /
flash attention):

    (A1)  s_j   = q k_j^T / sqrt(d_h) + m_j              (m_j: causal mask, 0 or -inf)
    (A2)  lse_j = log sum_k exp(s_j)
    (A3)  o_j   = softmax(s_j) v_j
    (A4)  lse   = logsumexp_j lse_j,   o = sum_j exp(lse_j - lse) o_j

The plain forward is the one-block case of the same code, so the only difference between the
plain and the sharded pass is which rows each function sees. Hidden-state indices follow
transformers' `output_hidden_states`: state 0 is the embedding, state l the output of layer l,
and the last state has the final norm applied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LayerWeights:
    """One decoder layer's tensors (nn.Linear layout: [out, in]); biases may be None."""

    input_norm: Tensor
    q_w: Tensor
    q_b: Tensor | None
    k_w: Tensor
    k_b: Tensor | None
    v_w: Tensor
    v_b: Tensor | None
    o_w: Tensor
    o_b: Tensor | None
    post_norm: Tensor
    gate_w: Tensor
    up_w: Tensor
    down_w: Tensor
    q_norm: Tensor | None = None  # Qwen3: an RMSNorm of each query head, and of each key head
    k_norm: Tensor | None = None


@dataclass
class DecoderWeights:
    """The open weights of a decoder plus the shape facts the functions need."""

    embed: Tensor
    layers: list[LayerWeights]
    final_norm: Tensor
    lm_head: Tensor
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    inv_freq: Tensor
    rope_scale: float

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    @classmethod
    def from_hf(cls, model) -> "DecoderWeights":
        """Detached copies of a transformers Llama-family causal LM's tensors (float32), a fused
        q/k/v or gate/up projection (Phi-3) split into its parts.

        Raises ValueError for what these functions do not implement (non-SiLU MLPs, sliding
        window layers, dynamic or partial RoPE)."""
        cfg = model.config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r}: only silu MLPs are supported")
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])) or (
            window is not None and window < cfg.max_position_embeddings
        ):
            raise ValueError("sliding-window layers are not supported; use full attention")
        rotary = model.model.rotary_emb
        if "dynamic" in getattr(rotary, "rope_type", "default"):
            raise ValueError(f"rope_type={rotary.rope_type!r}: dynamic RoPE is not supported")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if 2 * rotary.inv_freq.numel() != head_dim:
            raise ValueError(
                f"RoPE over {2 * rotary.inv_freq.numel()} of {head_dim} head dims: partial RoPE is not supported"
            )

        def t(x):
            return None if x is None else x.detach().to(torch.float32).clone()

        def parts(linear, sizes):
            """A fused projection's (weight, bias) row blocks."""
            biases = linear.bias.split(sizes) if linear.bias is not None else [None] * len(sizes)
            return [(t(w), t(b)) for w, b in zip(linear.weight.split(sizes), biases)]

        q_rows, kv_rows = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            (q_w, q_b), (k_w, k_b), (v_w, v_b) = (
                parts(a.qkv_proj, [q_rows, kv_rows, kv_rows])
                if hasattr(a, "qkv_proj")
                else [(t(p.weight), t(p.bias)) for p in (a.q_proj, a.k_proj, a.v_proj)]
            )
            (gate_w, _), (up_w, _) = (
                parts(m.gate_up_proj, [m.gate_up_proj.weight.shape[0] // 2] * 2)
                if hasattr(m, "gate_up_proj")
                else [(t(m.gate_proj.weight), None), (t(m.up_proj.weight), None)]
            )
            layers.append(
                LayerWeights(
                    input_norm=t(layer.input_layernorm.weight),
                    q_w=q_w,
                    q_b=q_b,
                    k_w=k_w,
                    k_b=k_b,
                    v_w=v_w,
                    v_b=v_b,
                    o_w=t(a.o_proj.weight),
                    o_b=t(a.o_proj.bias),
                    post_norm=t(layer.post_attention_layernorm.weight),
                    gate_w=gate_w,
                    up_w=up_w,
                    down_w=t(m.down_proj.weight),
                    q_norm=t(getattr(getattr(a, "q_norm", None), "weight", None)),
                    k_norm=t(getattr(getattr(a, "k_norm", None), "weight", None)),
                )
            )
        return cls(
            embed=t(model.model.embed_tokens.weight),
            layers=layers,
            final_norm=t(model.model.norm.weight),
            lm_head=t(model.lm_head.weight),
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            norm_eps=cfg.rms_norm_eps,
            inv_freq=t(rotary.inv_freq),
            rope_scale=float(rotary.attention_scaling),
        )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm: w * x / sqrt(mean(x^2) + eps)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_cos_sin(w: DecoderWeights, positions: Tensor) -> tuple[Tensor, Tensor]:
    """RoPE tables for absolute `positions` [n] -> cos, sin [n, head_dim]."""
    freqs = positions.to(torch.float32)[:, None] * w.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * w.rope_scale, emb.sin() * w.rope_scale


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., n, head_dim] by its positions' angles (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _heads(x: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """[B, n, H*hd] -> [B, H, n, hd]."""
    b, n, _ = x.shape
    return x.view(b, n, n_heads, head_dim).transpose(1, 2)


def project_qkv(w: DecoderWeights, layer: LayerWeights, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Token-local: pre-attention norm, Q/K/V projections and RoPE of rows h [B, n, d] at
    absolute `positions` [n] -> q [B, H, n, hd], k and v [B, H_kv, n, hd]."""
    x = rms_norm(h, layer.input_norm, w.norm_eps)
    cos, sin = rope_cos_sin(w, positions)
    q = _heads(_linear(x, layer.q_w, layer.q_b), w.n_heads, w.head_dim)
    k = _heads(_linear(x, layer.k_w, layer.k_b), w.n_kv_heads, w.head_dim)
    if layer.q_norm is not None:  # Qwen3: each head normed before the rotation
        q, k = rms_norm(q, layer.q_norm, w.norm_eps), rms_norm(k, layer.k_norm, w.norm_eps)
    v = _heads(_linear(x, layer.v_w, layer.v_b), w.n_kv_heads, w.head_dim)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def head_rows(x: Tensor) -> Tensor:
    """Per-head tensors [B, H, n, hd] as one row per (batch, position): [B * n, H * hd]."""
    return x.transpose(1, 2).reshape(-1, x.shape[1] * x.shape[3])


def key_value_rows(k: Tensor, v: Tensor) -> Tensor:
    """Keys and values [B, H_kv, n, hd] as one row per (batch, position), keys then values:
    [B * n, 2 * H_kv * hd]; what an attention party holds of each position of its key shard."""
    return torch.cat([head_rows(k), head_rows(v)], dim=-1)


def partial_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
    """One attention block, Eqs. (A1)-(A3): queries q [B, H, nq, hd] at positions q_pos
    against keys/values [B, H_kv, nk, hd] at k_pos, causal (key position <= query position).
    Returns o [B, H, nq, hd] and lse [B, H, nq]; a query that sees no key here gets o = 0 and
    lse = -inf, which the merge (A4) weighs by exp(-inf) = 0."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    masked = k_pos[None, :] > q_pos[:, None]
    scores = scores.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - finite[..., None])
    return torch.matmul(probs, v), lse


def merge_partials(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Exact merge of partial attention blocks, Eq. (A4): o = sum_j exp(lse_j - lse) o_j."""
    lses = torch.stack([lse for _, lse in parts])
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total[None])
    return sum(wj[..., None] * oj for wj, (oj, _) in zip(weights, parts))


def finish_layer(layer: LayerWeights, w: DecoderWeights, h: Tensor, attn: Tensor) -> Tensor:
    """Token-local: output projection, residual, post-attention norm, SiLU MLP, residual.
    h [B, n, d] are the layer's input rows, attn [B, H, n, hd] their merged attention."""
    b, _, n, _ = attn.shape
    h = h + _linear(attn.transpose(1, 2).reshape(b, n, -1), layer.o_w, layer.o_b)
    x = rms_norm(h, layer.post_norm, w.norm_eps)
    mlp = _linear(
        torch.nn.functional.silu(_linear(x, layer.gate_w, None)) * _linear(x, layer.up_w, None), layer.down_w, None
    )
    return h + mlp


def output_state(w: DecoderWeights, h: Tensor, index: int) -> Tensor:
    """Hidden state number `index` as transformers reports it: the final one is normed."""
    return rms_norm(h, w.final_norm, w.norm_eps) if index == w.n_layers else h


def logits_of(w: DecoderWeights, h: Tensor) -> Tensor:
    """Next-token logits of residual rows h after the last layer: lm_head(norm(h))."""
    return _linear(rms_norm(h, w.final_norm, w.norm_eps), w.lm_head, None)


@torch.no_grad()
def hidden_states(w: DecoderWeights, ids: Tensor) -> list[Tensor]:
    """Plain (unsharded) forward of one sequence ids [n]: all n_layers + 1 hidden states [n, d],
    indexed as transformers' `output_hidden_states`."""
    positions = torch.arange(ids.shape[0])
    h = w.embed[ids][None]
    states = [h[0]]
    for layer in w.layers:
        q, k, v = project_qkv(w, layer, h, positions)
        h = finish_layer(layer, w, h, merge_partials([partial_attention(q, k, v, positions, positions)]))
        states.append(h[0])
    states[-1] = output_state(w, h[0], w.n_layers)
    return states


@torch.no_grad()
def plain_logits(w: DecoderWeights, ids: Tensor) -> Tensor:
    """Plain forward of one sequence ids [n] -> logits [n, V]."""
    states = hidden_states(w, ids)
    return _linear(states[-1], w.lm_head, None)


@dataclass
class PrefixCache:
    """Per-layer keys/values [1, H_kv, n, hd] of a known prefix, for batched candidate steps."""

    keys: list[Tensor]
    values: list[Tensor]

    @classmethod
    def empty(cls, w: DecoderWeights) -> "PrefixCache":
        shape = (1, w.n_kv_heads, 0, w.head_dim)
        return cls([torch.zeros(shape) for _ in w.layers], [torch.zeros(shape) for _ in w.layers])

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


@torch.no_grad()
def candidate_step(
    w: DecoderWeights, cache: PrefixCache, tokens: Tensor, upto: int
) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """Run a batch of candidate tokens [B] at the position after the cached prefix through the
    first `upto` layers. Each candidate's attention is the merge (A4) of a block over the
    shared prefix and a block over itself. Returns hidden state number `upto` [B, d] and the
    candidates' per-layer (k, v) [B, H_kv, 1, hd] for the layers run."""
    pos = torch.tensor([cache.length])
    prefix_pos = torch.arange(cache.length)
    b = tokens.shape[0]
    h = w.embed[tokens][:, None, :]
    new_kv = []
    for i in range(upto):
        layer = w.layers[i]
        q, k, v = project_qkv(w, layer, h, pos)
        parts = [partial_attention(q, k, v, pos, pos)]
        if cache.length:
            pk = cache.keys[i].expand(b, -1, -1, -1)
            pv = cache.values[i].expand(b, -1, -1, -1)
            parts.insert(0, partial_attention(q, pk, pv, pos, prefix_pos))
        h = finish_layer(layer, w, h, merge_partials(parts))
        new_kv.append((k, v))
    return output_state(w, h[:, 0], upto), new_kv


@torch.no_grad()
def append_token(w: DecoderWeights, cache: PrefixCache, token: int) -> tuple[PrefixCache, Tensor]:
    """Extend the prefix by one token through every layer; return the longer cache and the
    next-token logits [V] after it (the model's own proposal for the next position)."""
    state, kv = candidate_step(w, cache, torch.tensor([token]), w.n_layers)
    keys = [torch.cat([ck, k], dim=2) for ck, (k, _) in zip(cache.keys, kv)]
    values = [torch.cat([cv, v], dim=2) for cv, (_, v) in zip(cache.values, kv)]
    return PrefixCache(keys, values), _linear(state[0], w.lm_head, None)
