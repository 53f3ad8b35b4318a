"""SpeCache's two-tier KV cache as a transformers `Cache`, plus the attention function it needs.

Fast tier ("device" memory; a pool of its own on CPU), per layer:
  * the low-bit copy `K'`, `V'` of every token older than the recent window: keys
    quantised per channel over groups of `group_size` tokens, values per token over the
    head's channels (KIVI), codes packed, zero points and scales in `meta_dtype`;
  * the recent window in full precision: at least `window` and fewer than
    `window + group_size` of the newest tokens (a key group is quantised once complete);
  * the `k` full-precision pairs prefetched for this step, with their indices.
Slow tier ("host" memory): every token's keys and values in full precision.

Phases (set by the decode loop in `generate.py`; SpeCache Algorithms 1-3):
  * PREFILL: the prompt attends exactly; its KV goes to the slow tier and is quantised.
  * PREDECODE: the first output token `x_1` attends over `K'`/`V'` alone; its attention
    picks the first top-k set, and its output is the first speculative token. Nothing is
    committed (x_1 is fed again in the first decode step).
  * DECODE: the inputs are `[x_t, x^_{t+1}]` (real and speculative token). Both attend over
    the mixed tier (low-bit rows with the prefetched top-k replaced by full precision, the
    window, and the new pairs, causally). Only `x_t`'s pair is committed (slow tier + window,
    then quantised as its group completes). The speculative row's attention over the
    quantised rows picks the next top-k, which a background thread gathers from the slow
    tier while the remaining layers and the sampling of this step run.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlsys.kvcache.attention import attention_with_probs, gather_rows, scatter_rows, select_topk
from rlsys.kvcache.quant import SUPPORTED_BITS, Quantized, dequantize, quantize

PREFILL, PREDECODE, DECODE = "prefill", "predecode", "decode"
ATTENTION_NAME = "specache"


@dataclass
class SpeCacheConfig:
    """SpeCache settings: `k` prefetched pairs per KV head, `bits` of the low-bit copy."""

    k: int = 64
    bits: int = 1
    window: int = 32
    group_size: int = 32
    meta_dtype: torch.dtype = torch.float16

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"specache bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.k < 0 or self.window < 0 or self.group_size < 1:
            raise ValueError(f"specache needs k >= 0, window >= 0, group_size >= 1; got {self}")


@dataclass
class SpeCacheStats:
    """What one generation kept where, and how the speculation fared."""

    fast_tier_bytes: int = 0  # at the end of generation
    peak_fast_tier_bytes: int = 0
    slow_tier_bytes: int = 0  # = what a full-precision cache holds for the same tokens
    full_cache_bytes: int = 0
    fetches: int = 0  # layer-steps that used a prefetched top-k set
    fetches_ready: int = 0  # of those, fetches already complete when the layer needed them
    spec_tokens: int = 0  # speculative tokens checked against the real next token
    spec_hits: int = 0

    @property
    def compression(self) -> float:
        return self.full_cache_bytes / max(self.fast_tier_bytes, 1)

    @property
    def spec_accuracy(self) -> float:
        return self.spec_hits / max(self.spec_tokens, 1)

    @property
    def fetch_overlap(self) -> float:
        return self.fetches_ready / max(self.fetches, 1)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class SpeCacheLayer(CacheLayerMixin):
    """One decoder layer's fast and slow tiers (module docstring)."""

    is_sliding = False

    def __init__(self, owner: "SpeCache"):
        super().__init__()
        self.owner = owner
        self.length = 0  # tokens committed (slow tier)
        self.n_quant = 0  # leading tokens held only as low-bit codes in the fast tier
        self.key_q: Quantized | None = None  # codes (B, H, n_groups, G, D/8*bits), meta (B, H, n_groups, 1, D)
        self.value_q: Quantized | None = None  # codes (B, H, n_quant, D/8*bits), meta (B, H, n_quant, 1)
        self.fetched: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # index, keys, values
        self.pending: Future | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.device, self.dtype, self.heads, self.dim = key_states.device, key_states.dtype, heads, dim
        shape = (batch, heads, self.owner.capacity, dim)
        self.slow_keys = key_states.new_zeros(shape)  # preallocated: fetches read it while steps append
        self.slow_values = value_states.new_zeros(shape)
        self.window_keys = key_states[:, :, :0]
        self.window_values = value_states[:, :, :0]
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.owner.capacity

    def update(self, key_states, value_states, *args, **kwargs):
        """Return the keys/values this step attends over (phase rules in the module docstring)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.owner.phase == PREFILL:
            self._commit(key_states, value_states)
            return key_states, value_states
        fast_keys, fast_values = self._fast_kv()
        keys = torch.cat([fast_keys, key_states], dim=2)
        values = torch.cat([fast_values, value_states], dim=2)
        if self.owner.phase == DECODE:
            self._commit(key_states[:, :, :1], value_states[:, :, :1])
        return keys, values

    def _fast_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixed tier: `K'` with the prefetched rows in full precision, then the window."""
        if self.n_quant == 0:
            return self.window_keys, self.window_values
        batch = self.window_keys.shape[0]
        keys = dequantize(self.key_q, self.dtype).reshape(batch, self.heads, self.n_quant, self.dim)
        values = dequantize(self.value_q, self.dtype).reshape(batch, self.heads, self.n_quant, self.dim)
        if self.pending is not None:
            stats = self.owner.stats
            stats.fetches += 1
            stats.fetches_ready += int(self.pending.done())
            self.fetched = self.pending.result()
            self.pending = None
        if self.fetched is not None:
            index, rows_k, rows_v = self.fetched
            keys, values = scatter_rows(keys, index, rows_k), scatter_rows(values, index, rows_v)
        return torch.cat([keys, self.window_keys], dim=2), torch.cat([values, self.window_values], dim=2)

    def _commit(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Offload new pairs to the slow tier, append them to the window, quantise full groups."""
        n = keys.shape[2]
        self.slow_keys[:, :, self.length : self.length + n] = keys
        self.slow_values[:, :, self.length : self.length + n] = values
        self.window_keys = torch.cat([self.window_keys, keys], dim=2)
        self.window_values = torch.cat([self.window_values, values], dim=2)
        self.length += n
        cfg = self.owner.config
        while self.length - self.n_quant >= cfg.window + cfg.group_size:
            self._quantize_group()

    def _quantize_group(self) -> None:
        """Move the oldest `group_size` window tokens to the low-bit copy (KIVI layout)."""
        cfg = self.owner.config
        g, batch = cfg.group_size, self.window_keys.shape[0]
        keys, values = self.window_keys[:, :, :g], self.window_values[:, :, :g]
        valid = self.owner.valid[:, self.n_quant : self.n_quant + g].reshape(batch, 1, 1, g, 1)
        key_q = quantize(
            keys.reshape(batch, self.heads, 1, g, self.dim), cfg.bits, dim=-2, valid=valid, meta_dtype=cfg.meta_dtype
        )
        value_q = quantize(values, cfg.bits, dim=-1, meta_dtype=cfg.meta_dtype)
        self.key_q = _append(self.key_q, key_q, dim=2)
        self.value_q = _append(self.value_q, value_q, dim=2)
        self.window_keys = self.window_keys[:, :, g:].clone()
        self.window_values = self.window_values[:, :, g:].clone()
        self.n_quant += g

    def select(self, probs: torch.Tensor) -> None:
        """Pick the next top-k set from one query row's attention (B, Hq, S); fetch it in the background."""
        if self.n_quant == 0 or self.owner.config.k == 0:
            return
        index = select_topk(probs, self.heads, self.owner.config.k, self.n_quant)
        self.pending = self.owner.executor.submit(self._fetch, index)

    def _fetch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy the selected full-precision pairs from the slow tier into fast-tier buffers."""
        return index, gather_rows(self.slow_keys, index), gather_rows(self.slow_values, index)

    def fast_tier_bytes(self) -> int:
        quant = (self.key_q.nbytes() + self.value_q.nbytes()) if self.key_q is not None else 0
        fetched = _nbytes(*self.fetched) if self.fetched is not None else 0
        return quant + fetched + _nbytes(self.window_keys, self.window_values)

    def slow_tier_bytes(self) -> int:
        return 2 * self.slow_keys[:, :, : self.length].numel() * self.slow_keys.element_size()


def _append(old: Quantized | None, new: Quantized, dim: int) -> Quantized:
    if old is None:
        return new
    cat = lambda a, b: torch.cat([a, b], dim=dim)  # noqa: E731
    return Quantized(cat(old.codes, new.codes), cat(old.zero, new.zero), cat(old.scale, new.scale), new.bits)


class SpeCache(Cache):
    """The per-layer tiers, the current phase, the prefetch thread and the stats.

    `valid` (B, capacity) marks real (non-padding) slots; it keeps left padding out of the
    key groups' min/max. Use as a context manager so the prefetch thread is shut down.
    """

    def __init__(self, num_layers: int, config: SpeCacheConfig, capacity: int, valid: torch.Tensor):
        self.config = config
        self.capacity = capacity
        self.valid = valid.bool()
        self.phase = PREFILL
        self.stats = SpeCacheStats()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specache-fetch")
        super().__init__(layers=[SpeCacheLayer(self) for _ in range(num_layers)])

    def __enter__(self) -> "SpeCache":
        return self

    def __exit__(self, *exc) -> None:
        self.executor.shutdown(wait=True)

    def after_attention(self, layer_idx: int, probs_last_row: torch.Tensor) -> None:
        self.layers[layer_idx].select(probs_last_row)

    def fast_tier_bytes(self) -> int:
        return sum(layer.fast_tier_bytes() for layer in self.layers)

    def slow_tier_bytes(self) -> int:
        return sum(layer.slow_tier_bytes() for layer in self.layers)

    def record_bytes(self) -> None:
        fast = self.fast_tier_bytes()
        self.stats.fast_tier_bytes = fast
        self.stats.peak_fast_tier_bytes = max(self.stats.peak_fast_tier_bytes, fast)
        self.stats.slow_tier_bytes = self.stats.full_cache_bytes = self.slow_tier_bytes()


def specache_attention(
    module, query, key, value, attention_mask, scaling, dropout=0.0, *, specache: SpeCache, **kwargs
):
    """Attention interface "specache": exact SDPA for the prompt; for decode steps the
    explicit `A = MaskedSoftmax(QK^T)`, `O = AV` over the mixed tier, handing the last
    query row's `A` (the speculative token, or x_1 in PREDECODE) to the cache's top-k."""
    if specache.phase == PREFILL:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out, probs = attention_with_probs(query, key, value, attention_mask, scaling)
    specache.after_attention(module.layer_idx, probs[:, :, -1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, specache_attention)


@contextmanager
def attention_implementation(model, name: str):
    """Switch `model` to attention implementation `name` for the duration of the block."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
