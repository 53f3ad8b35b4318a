"""A lean batched decode loop for Llama-family decoders (Qwen2, Qwen3, Llama, Mistral, Phi-3, Gemma): the
rollout backend's fast path in place of `model.generate`.

What it saves over `generate` on a small model (profiled on the quickstart's, batch 32):
the DynamicCache grows by `torch.cat` every step (27% of generate's CPU time), causal masks
are rebuilt per step, and `multinomial` draws an exponential per vocabulary entry. Here the
KV cache is preallocated once for prompt + new tokens and written in place, attention reads
only the filled prefix, a token is drawn by one uniform per row (inverse CDF), rows that
have stopped leave the batch, so the cost follows the live rows, and a prompt sampled n times
(a GRPO group) is prefilled once.

The arithmetic reads the model's own weights, fused per layer (q/k/v and gate/up each one
matmul, the RMSNorm weights folded into their columns; kept until a weight changes) and its
rotary module, so weights loaded into the model (weight sync, re-quantisation) are what this
loop uses; logits match the model's forward to float rounding (tests/actors/test_lean_decode.py).
The loop runs under `torch.inference_mode` (nothing it makes is ever differentiated).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from rlsys.generation import interpolated_logits

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "phi3", "gemma")
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}  # Gemma's is the second


def activation_name(cfg) -> str | None:
    return getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)


def norm_weight(norm, offset: float) -> torch.Tensor:
    """What an RMSNorm multiplies the normalised row by: its weight, or Gemma's 1 + weight."""
    return norm.weight + offset if offset else norm.weight


def attends_to_whole_context(cfg) -> bool:
    """No sliding window: Qwen2/Qwen3 switch theirs on with `use_sliding_window`; Mistral has one
    whenever `sliding_window` is set below its longest context (Mistral 7B v0.1: 4096)."""
    if hasattr(cfg, "use_sliding_window"):
        return not cfg.use_sliding_window
    window = getattr(cfg, "sliding_window", None)
    return window is None or window >= cfg.max_position_embeddings


def supports_lean_decode(model) -> bool:
    """A decoder whose layers are exactly: RMSNorm, q/k/v/o projections (Phi-3: q/k/v as one;
    Qwen3: an RMSNorm of each query and key head) with rotary over the whole head and
    (grouped-query) softmax attention over the whole context, RMSNorm, SiLU-gated MLP (Phi-3:
    gate/up as one; Gemma: tanh-GELU-gated, its norms scale by 1 + weight and its embeddings
    by sqrt(hidden))."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if not attends_to_whole_context(cfg) or activation_name(cfg) not in ACTIVATIONS:
        return False
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    head_norms = ("q_norm", "k_norm") if cfg.model_type == "qwen3" else ()
    qkv = ("qkv_proj",) if hasattr(attn, "qkv_proj") else ("q_proj", "k_proj", "v_proj")
    gate_up = ("gate_up_proj",) if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj")
    if not (
        all(hasattr(attn, p) for p in (*qkv, "o_proj", *head_norms))
        and all(hasattr(mlp, p) for p in (*gate_up, "down_proj"))
    ):
        return False
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    probe = model.model.embed_tokens.weight[:1]
    cos, _ = model.model.rotary_emb(probe, torch.zeros(1, 1, dtype=torch.long, device=probe.device))
    return cos.shape[-1] == head_dim  # a partial rotary (Phi-4-mini's 0.75) is not this loop's


def norm_eps(norm, like: torch.Tensor) -> torch.Tensor:
    """An HF RMSNorm module's epsilon as a 0-d float32 tensor (`rms_scale`'s `addcmul` takes a tensor)."""
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps")
    return torch.tensor(eps, dtype=torch.float32, device=like.device)


def rms_scale(h: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(mean(h^2) + eps) per row of h ([N, hidden] -> [N, 1]) in h's dtype, the mean
    computed in float32 (as HF's RMSNorm upcasts a bf16 row): RMSNorm without its weight, in three
    ops (F.rms_norm runs about nine on CPU)."""
    norm = torch.linalg.vector_norm(h, dim=-1, keepdim=True, dtype=torch.float32)
    return torch.addcmul(eps, norm, norm, value=1.0 / h.shape[-1]).rsqrt_().to(h.dtype)


def residual_linear(
    h: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """h + x W^T (+ bias), the matmul and the residual add in one `addmm`."""
    out = torch.addmm(h, x, weight_t)
    return out if bias is None else out.add_(bias)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token in its own row of a left-padded batch (pads get 0), as `generate` counts."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def prefill_mask(key_ok: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] boolean from [B, T] `key_ok`: causal and not a pad key. A pad query also sees itself, so no row of
    the softmax is empty (an empty row is NaN, and 0 x NaN would leak into the cache)."""
    t = key_ok.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=key_ok.device).tril()
    return (causal & key_ok[:, None, None, :]) | torch.eye(t, dtype=torch.bool, device=key_ok.device)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, greedy: bool) -> torch.Tensor:
    """Next token per row: argmax, or a draw from softmax(logits / T) restricted to the top-k
    tokens and then to the smallest set with mass >= top_p (`generate`'s order of warpers).
    One uniform per row, mapped through the inverse CDF."""
    if greedy:
        return logits.argmax(-1)
    scores = logits / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1)  # ascending, as transformers' TopPLogitsWarper
        tail_mass = sorted_scores.softmax(-1).cumsum(-1)
        drop = tail_mass <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return draw_from(scores.softmax(-1))


def draw_from(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [B, V]: one uniform per row through the inverse CDF."""
    cdf = probs.cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


class Decoded(NamedTuple):
    tokens: torch.Tensor  # [B, N] new tokens, `pad_id` after a row's first stop token
    logprobs: torch.Tensor  # [B, N] the sampler's logprobs (0 at pads)
    step_versions: list[int] | None  # with `weights_between_steps`: the policy version that sampled each step


class LeanDecoder:
    """Runs the decoder stack of an HF Llama-family model over a preallocated KV cache, in
    `dtype` (rollout.dtype): the fused weights, activations and KV cache; norms reduce in float32
    and the logits are returned as float32. The model's own weights keep their dtype."""

    def __init__(self, model, dtype: torch.dtype | None = None):
        if not supports_lean_decode(model):
            raise ValueError(f"lean decode supports {SUPPORTED_MODEL_TYPES} decoders, not {model.config.model_type}")
        self.model = model
        self.dtype = dtype or model.lm_head.weight.dtype
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.head_norms = hasattr(model.model.layers[0].self_attn, "q_norm")  # Qwen3
        self.norm_offset = 1.0 if cfg.model_type == "gemma" else 0.0  # Gemma's norms: x_normed * (1 + w)
        self.act = ACTIVATIONS[activation_name(cfg)]
        self._fused, self._fused_of = None, None

    def weights_changed(self) -> None:
        """Forget the fused weights: the next generate fuses the model's weights again. Needed
        where weights change without new tensors or in-place ops in this process (a shared-memory
        slot rewritten by the learner); `current_fused` notices the others itself."""
        self._fused = None

    def current_fused(self) -> list[dict]:
        """`fused_weights`, kept between calls while the model's parameters are the same tensors,
        unchanged in place (fusing costs a copy of every layer's weights, ~10% of a short rollout)."""
        fingerprint = [(p.data_ptr(), p._version) for p in self.model.parameters()]
        if self._fused is None or fingerprint != self._fused_of:
            self._fused, self._fused_of = self.fused_weights(), fingerprint
        return self._fused

    def fused_weights(self) -> list[dict]:
        """Per layer, read from the model's current weights: q/k/v as one matrix and gate/up as
        another (one matmul each instead of three and two), each with its RMSNorm's weight folded
        into its columns (W (w * x) = (W diag(w)) x) and q's rows pre-multiplied by the attention
        scale (which commutes with the rotary rotation; with Qwen3's per-head norms the scale goes
        into the query norm's weight instead, as a norm undoes a scale before it); o and down
        transposed for `addmm`, which adds the residual in the same call. No module is called
        per step."""

        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            """In the decoder's dtype (no copy when it is already)."""
            return None if t is None else t.to(self.dtype)

        def cat(pieces, scales, norm):
            """[(weight, bias)] pieces stacked by rows, each times its scale, times the norm's weight."""
            weight = torch.cat([w * s for (w, _), s in zip(pieces, scales)]) * norm_weight(norm, self.norm_offset)
            if all(b is None for _, b in pieces):
                return cast(weight), None
            return cast(weight), cast(
                torch.cat([(b if b is not None else w.new_zeros(w.shape[0])) * s for (w, b), s in zip(pieces, scales)])
            )

        def rows(linear, sizes):
            """A fused projection (Phi-3's qkv_proj, gate_up_proj) as (weight, bias) row blocks."""
            biases = linear.bias.split(sizes) if linear.bias is not None else [None] * len(sizes)
            return list(zip(linear.weight.split(sizes), biases))

        self.final_eps = norm_eps(self.model.model.norm, self.model.model.norm.weight)
        self.final_weight = cast(norm_weight(self.model.model.norm, self.norm_offset))
        head = self.model.lm_head
        self.head = (cast(head.weight), cast(head.bias))
        scale = getattr(self.model.model.embed_tokens, "embed_scale", None)  # Gemma: sqrt(hidden)
        self.embed_scale = None if scale is None else cast(scale)
        fused = []
        q_scale = 1.0 if self.head_norms else self.scale
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for layer in self.model.model.layers:
            a, mlp, norm1, norm2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
            qkv = (
                rows(a.qkv_proj, [q_rows, kv_rows, kv_rows])
                if hasattr(a, "qkv_proj")
                else [(m.weight, m.bias) for m in (a.q_proj, a.k_proj, a.v_proj)]
            )
            gate_up = (
                rows(mlp.gate_up_proj, [mlp.gate_up_proj.weight.shape[0] // 2] * 2)
                if hasattr(mlp, "gate_up_proj")
                else [(m.weight, m.bias) for m in (mlp.gate_proj, mlp.up_proj)]
            )
            fused.append(
                {
                    "qkv": cat(qkv, (q_scale, 1.0, 1.0), norm1),
                    "gate_up": cat(gate_up, (1.0, 1.0), norm2),
                    "o": (cast(a.o_proj.weight).t(), cast(a.o_proj.bias)),
                    "down": (cast(mlp.down_proj.weight).t(), cast(mlp.down_proj.bias)),
                    "eps1": norm_eps(norm1, norm1.weight),
                    "eps2": norm_eps(norm2, norm2.weight),
                }
            )
            if self.head_norms:  # [q heads + kv heads, head_dim]: each head's norm weight, q's times the scale
                q_norm, k_norm = norm_weight(a.q_norm, self.norm_offset), norm_weight(a.k_norm, self.norm_offset)
                fused[-1]["head_norm"] = cast(
                    torch.cat([(q_norm * self.scale).expand(self.num_heads, -1), k_norm.expand(self.num_kv_heads, -1)])
                )
                fused[-1]["eps_head"] = norm_eps(a.q_norm, a.q_norm.weight)
        return fused

    def rotary_tables(self, length: int, like: torch.Tensor) -> torch.Tensor:
        """[length, 2, head_dim]: cos and sign-folded sin for positions 0..length-1 (one gather a
        step reads both), from the model's rotary module: rotate_half(x) * sin == x.roll(d/2) * signed_sin."""
        positions = torch.arange(length, device=like.device)[None]
        cos, sin = self.model.model.rotary_emb(like, positions)
        half = self.head_dim // 2
        return torch.stack([cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)], dim=1)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        start: int,
        mask: torch.Tensor,
        fused: list[dict],
        rotary: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden state of each row's last token of `ids` ([B, T], at cache slots start..start+T)
        after the final norm: [B, hidden]. `mask`: for a prompt, `prefill_mask` ([B, 1, T, T],
        start 0); for one token a row, the additive mask over the slots [B * kv heads, 1, start+1].
        Rows of B x T tokens are kept as one 2-D matrix throughout."""
        core = self.model.model
        b, t = ids.shape
        h = F.embedding(ids.reshape(-1), core.embed_tokens.weight).to(self.dtype)  # [B*T, hidden], its own tensor
        if self.embed_scale is not None:  # Gemma
            h = h * self.embed_scale
        end = start + t
        d, nh, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        cos_sin = rotary[positions.reshape(-1)]
        cos, sin = cos_sin[:, :1], cos_sin[:, 1:]  # [B*T, 1, d] each
        for (k_cache, v_cache), w in zip(cache, fused):
            qkv = F.linear(h * rms_scale(h, w["eps1"]), *w["qkv"]).view(b * t, nh + 2 * nkv, d)
            qk = qkv[:, : nh + nkv]
            if "head_norm" in w:  # Qwen3: RMSNorm of each query and key head before the rotation
                qk = qk * rms_scale(qk, w["eps_head"]) * w["head_norm"]
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
            k_cache[:, :, start:end] = qk[:, nh:].view(b, t, nkv, d).transpose(1, 2)
            v_cache[:, :, start:end] = qkv[:, nh + nkv :].view(b, t, nkv, d).transpose(1, 2)
            if mask.dim() == 3:  # a decode step (a 1-token prompt's prefill has the 4-d mask): [B*kv heads,
                # grouped queries, d] against the kv head's cached keys (a view: the cache is the leading rows
                # of contiguous buffers)
                q = qk[:, :nh].reshape(b * nkv, nh // nkv, d)
                keys, values = (c[:, :, :end].reshape(b * nkv, end, d) for c in (k_cache, v_cache))
                scores = torch.baddbmm(mask, q, keys.transpose(1, 2))
                out = torch.bmm(scores.softmax(-1), values).view(b, nh * d)
            else:
                q = qk[:, :nh].view(b, t, nh, d).transpose(1, 2)
                out = F.scaled_dot_product_attention(
                    q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask, scale=1.0, enable_gqa=nkv != nh
                )
                out = out.transpose(1, 2).reshape(b * t, nh * d)
            h = residual_linear(h, out, *w["o"])
            gate, up = F.linear(h * rms_scale(h, w["eps2"]), *w["gate_up"]).chunk(2, dim=-1)
            h = residual_linear(h, self.act(gate).mul_(up), *w["down"])
        last = h.view(b, t, -1)[:, -1]
        return last * rms_scale(last, self.final_eps) * self.final_weight

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, total: int) -> "DecodeStream":
        """Prefill a left-padded prompt batch into a fresh cache of `total` slots. A prompt that
        fills several rows (n samples of one prompt, GRPO's group) is prefilled once and its
        cache copied to each of its rows."""
        like = self.model.lm_head.weight.new_empty(0, dtype=self.dtype)  # the cache's dtype and device
        rows = len(input_ids)  # the cache buffers' rows: the batch only shrinks after the prompts are copied out
        distinct, row_of = torch.unique(torch.cat([input_ids, attention_mask.long()], 1), dim=0, return_inverse=True)
        repeated = len(distinct) < len(input_ids)
        if repeated:
            input_ids, attention_mask = distinct[:, : input_ids.shape[1]], distinct[:, input_ids.shape[1] :]
        shape = (rows, self.num_kv_heads, total, self.head_dim)
        buffers = [(like.new_zeros(shape), like.new_zeros(shape)) for _ in self.model.model.layers]
        cache = [(k[: len(input_ids)], v[: len(input_ids)]) for k, v in buffers]
        # the decode steps' additive mask: -inf at the prompts' pad slots, per kv head (a view per step, no copy)
        pads = torch.zeros(len(input_ids), total, dtype=torch.bool, device=like.device)
        pads[:, : attention_mask.shape[1]] = ~attention_mask.bool()
        key_bias = like.new_zeros(len(input_ids), total).masked_fill_(pads, float("-inf"))
        stream = DecodeStream(
            self,
            buffers,
            cache,
            self.current_fused(),
            self.rotary_tables(total, like),
            key_bias[:, None].expand(-1, self.num_kv_heads, -1).contiguous(),
        )
        stream.hidden = self.forward(
            input_ids,
            positions_from_mask(attention_mask),
            cache,
            0,
            prefill_mask(attention_mask.bool()),
            stream.fused,
            stream.rotary,
        )
        if repeated:
            stream.keep(row_of, filled=input_ids.shape[1])
        return stream

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        greedy: bool = False,
        stop_ids: set[int] = frozenset(),
        pad_id: int = 0,
        reference: "LeanDecoder | None" = None,
        interpolation=None,
        weights_between_steps: Callable[[], int] | None = None,
    ) -> Decoded:
        """New tokens and their logprobs for a left-padded prompt batch; a row is padded with
        `pad_id` (logprob 0) after its first stop token. Logprobs are log softmax(logits / T), the
        raw logits' (greedy: T = 1), before top-k/top-p, as the HF backend records them.
        With `reference` and `interpolation` (PILAF), tokens are drawn from
        `interpolated_logits(policy, reference, beta, mode)`; the logprobs stay the policy's.
        `weights_between_steps` (rollout.inflight_update continue) is called before the prefill and
        after each step's draw: it loads any weights offered meanwhile into the model and returns the
        policy version the model holds. A new version is used from the next forward on (the drawn
        tokens' own), over the KV cache the older weights wrote, which is kept."""
        b, p = input_ids.shape
        total = p + max_new_tokens
        version = None if weights_between_steps is None else weights_between_steps()
        step_versions = None if version is None else []
        streams = [self.start(input_ids, attention_mask, total)]
        if interpolation is not None:
            streams.append(reference.start(input_ids, attention_mask, total))
        next_position = positions_from_mask(attention_mask)[:, -1] + 1
        tokens = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=input_ids.device)
        logprobs = torch.zeros(b, max_new_tokens, dtype=torch.float32, device=input_ids.device)
        live = torch.arange(b, device=input_ids.device)  # batch rows still decoding, in cache order
        stops = sorted(stop_ids)
        stops_t = torch.tensor(stops, dtype=torch.long, device=input_ids.device)
        scale = 1.0 if greedy else temperature
        # plain sampling draws from the recorded softmax itself; greedy, top-k/top-p and PILAF's mix warp first
        warped = greedy or 0 < top_k < self.model.config.vocab_size or top_p < 1.0 or interpolation is not None
        recorded = Recorded(tokens, logprobs, live)
        for step in range(max_new_tokens):
            logits = streams[0].logits()
            step_logprobs = torch.log_softmax(logits if scale == 1.0 else logits / scale, -1)
            if warped:
                scores = (
                    logits
                    if interpolation is None
                    else interpolated_logits(logits, streams[1].logits(), interpolation.beta, interpolation.mode)
                )
                token = sample_next(scores, temperature, top_k, top_p, greedy)
            else:
                token = draw_from(step_logprobs.exp())
            recorded.add(token, step_logprobs.gather(-1, token[:, None]).squeeze(-1))
            if step_versions is not None:
                step_versions.append(version)
            if step + 1 == max_new_tokens:
                break
            done = token == stops[0] if len(stops) == 1 else torch.isin(token, stops_t)
            if stops and bool(done.any()):  # finished rows leave the batch
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                recorded.keep(keep)
                token, next_position = token[keep], next_position[keep]
                for stream in streams:
                    stream.keep(keep, filled=p + step)
            if weights_between_steps is not None:
                held = weights_between_steps()
                if held != version:  # new weights: re-fused, this step's tokens forwarded by them
                    version, streams[0].fused = held, self.current_fused()
            for stream in streams:
                stream.step(token, next_position, p + step)
            next_position.add_(1)
        recorded.flush()
        return Decoded(tokens, logprobs, step_versions)


@dataclass
class Recorded:
    """Each step's tokens and logprobs of the live rows, written into the [B, N] outputs once
    per run of steps with the same live rows (one stack and one indexed write, not two per step)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    live: torch.Tensor  # output rows still decoding, in cache order
    first_step: int = 0
    pending: list = field(default_factory=list)

    def add(self, token: torch.Tensor, logprob: torch.Tensor) -> None:
        self.pending.append((token, logprob))

    def flush(self) -> None:
        if self.pending:
            steps = slice(self.first_step, self.first_step + len(self.pending))
            self.tokens[self.live, steps] = torch.stack([t for t, _ in self.pending], 1)
            self.logprobs[self.live, steps] = torch.stack([lp for _, lp in self.pending], 1)
            self.first_step, self.pending = steps.stop, []

    def keep(self, rows: torch.Tensor) -> None:
        self.flush()
        self.live = self.live[rows]


@dataclass
class DecodeStream:
    """One model's decode state over a batch: its KV cache (the leading rows of its buffers),
    the additive mask over its cache slots per kv head, and the hidden state of the last token."""

    decoder: LeanDecoder
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    cache: list[tuple[torch.Tensor, torch.Tensor]]
    fused: list[dict]
    rotary: torch.Tensor  # [slots, 2, head_dim]: cos, signed sin
    key_bias: torch.Tensor  # [B, kv heads, slots]: 0, or -inf at a pad
    hidden: torch.Tensor | None = None

    def logits(self) -> torch.Tensor:
        return F.linear(self.hidden, *self.decoder.head).float()

    def keep(self, rows: torch.Tensor, filled: int) -> None:
        """The batch becomes these rows of the current one (rows may repeat, up to the buffers'
        rows). Only the first `filled` cache slots hold tokens: they are gathered (into a small
        temporary: a row may be another's target) and written to the front of the same buffers,
        so no cache is allocated again and the slots after `filled` are not copied."""
        n = len(rows)
        cache = []
        for (k, v), (k_buf, v_buf) in zip(self.cache, self.buffers):
            k_buf[:n, :, :filled] = k[:, :, :filled].index_select(0, rows)
            v_buf[:n, :, :filled] = v[:, :, :filled].index_select(0, rows)
            cache.append((k_buf[:n], v_buf[:n]))
        self.cache = cache
        self.key_bias = self.key_bias.index_select(0, rows)
        if self.hidden is not None:
            self.hidden = self.hidden.index_select(0, rows)

    def step(self, token: torch.Tensor, position: torch.Tensor, slot: int) -> None:
        """Append one token per row at cache `slot` (every row's slot holds a real token)."""
        b, nkv, _ = self.key_bias.shape
        bias = self.key_bias[:, :, : slot + 1].reshape(b * nkv, 1, slot + 1)
        self.hidden = self.decoder.forward(
            token[:, None], position[:, None], self.cache, slot, bias, self.fused, self.rotary
        )
