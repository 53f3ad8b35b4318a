"""Batched generation with SpeCache, and the same loop over a full-precision DynamicCache.

Both loops take left-padded `input_ids` / `attention_mask` and return
`(sequences, logprobs, stats)`: `sequences` (B, P + T) is the prompt followed by the
generated tokens (`pad_token_id` after a row's EOS), `logprobs` (B, T) the log-probability
of each generated token under `log_softmax(logits / temperature)` (`temperature = 0`:
greedy, unscaled logits), 0 after EOS. Sampling is temperature, then vocabulary top-k
(`top_k`, 0 = off), then nucleus (`top_p`), as in transformers' `generate`. `eos_token_id`
may be one id or several (stop ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from rlsys.kvcache.attention import causal_padding_mask
from rlsys.kvcache.cache import (
    ATTENTION_NAME,
    DECODE,
    PREDECODE,
    SpeCache,
    SpeCacheConfig,
    SpeCacheStats,
    attention_implementation,
)


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator | None):
    """Next tokens (B,) and their log-probabilities (B,) (untruncated, temperature-scaled) from logits (B, V)."""
    logits = logits.float()
    if temperature <= 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits / temperature, -1)
    probs = logp.exp()
    if 0 < top_k < probs.shape[-1]:
        probs = probs.masked_fill(probs < probs.topk(top_k, dim=-1).values[:, -1:], 0.0)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p * sorted_p.sum(
            -1, keepdim=True
        )  # keep the smallest prefix with mass >= top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


@dataclass
class _Outputs:
    """Generated tokens so far; rows stop (and are padded) after their EOS."""

    batch: int
    eos: torch.Tensor  # stop ids (possibly empty)
    pad: int
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)

    def __post_init__(self):
        self.finished = torch.zeros(self.batch, dtype=torch.bool)

    def push(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        self.tokens.append(tokens.masked_fill(self.finished, self.pad))
        self.logprobs.append(logprobs.masked_fill(self.finished, 0.0))
        self.finished = self.finished | torch.isin(tokens, self.eos)

    @property
    def done(self) -> bool:
        return bool(self.finished.all())

    def result(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([input_ids, torch.stack(self.tokens, 1)], 1), torch.stack(self.logprobs, 1)


def _forward(model, ids, valid_past, valid_new, positions, cache, keep, **extra):
    mask = causal_padding_mask(valid_past, valid_new)
    masks = {layer_type: mask for layer_type in set(model.config.layer_types)}
    out = model(
        input_ids=ids,
        attention_mask=masks,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        logits_to_keep=keep,
        **extra,
    )
    return out.logits


def _prepare(model, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id):
    if any(t != "full_attention" for t in model.config.layer_types):
        raise ValueError("specache supports full-attention decoders only (no sliding-window layers)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    valid = attention_mask.bool()
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
    eos = torch.tensor([] if eos is None else [eos] if isinstance(eos, int) else list(eos), dtype=torch.long)
    pad = model.config.pad_token_id if pad_token_id is None else pad_token_id
    return valid, positions, valid.sum(-1), _Outputs(input_ids.shape[0], eos, 0 if pad is None else pad)


@torch.no_grad()
def specache_generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 64,
    k: int = 64,
    bits: int = 1,
    window: int = 32,
    group_size: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, SpeCacheStats]:
    """Generate with the SpeCache two-tier cache (see `rlsys.kvcache.cache`).

    Prefill, then PREDECODE with `x_1` (first top-k set and first speculative token), then
    one DECODE step per further token on `[x_t, x^_{t+1}]`; the speculative token is the
    greedy choice of the speculative row (it only steers prefetching and is never emitted).
    """
    config = SpeCacheConfig(k=k, bits=bits, window=window, group_size=group_size)
    valid, positions, next_pos, outputs = _prepare(
        model, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id
    )
    batch, prompt_len = input_ids.shape
    slots = torch.cat([valid, torch.ones(batch, max_new_tokens + 1, dtype=torch.bool)], 1)
    cache = SpeCache(model.config.num_hidden_layers, config, capacity=slots.shape[1], valid=slots)
    ones = torch.ones(batch, 2, dtype=torch.bool)
    with cache, attention_implementation(model, ATTENTION_NAME):
        logits = _forward(model, input_ids, valid[:, :0], valid, positions, cache, 1, specache=cache)
        tokens, logprobs = sample(logits[:, -1], temperature, top_p, top_k, generator)
        outputs.push(tokens, logprobs)
        if max_new_tokens > 1 and not outputs.done:
            cache.phase = PREDECODE
            logits = _forward(
                model, tokens[:, None], slots[:, :prompt_len], ones[:, :1], next_pos[:, None], cache, 1, specache=cache
            )
            speculative = logits[:, -1].argmax(-1)
            cache.phase = DECODE
            for step in range(1, max_new_tokens):
                length = prompt_len + step - 1
                ids = torch.stack([tokens, speculative], 1)
                pos = torch.stack([next_pos, next_pos + 1], 1) + step - 1
                logits = _forward(model, ids, slots[:, :length], ones, pos, cache, 2, specache=cache)
                tokens, logprobs = sample(logits[:, 0], temperature, top_p, top_k, generator)
                live = ~outputs.finished
                cache.stats.spec_tokens += int(live.sum())
                cache.stats.spec_hits += int(((speculative == tokens) & live).sum())
                outputs.push(tokens, logprobs)
                cache.record_bytes()
                if outputs.done:
                    break
                speculative = logits[:, 1].argmax(-1)
        cache.record_bytes()
    sequences, logprobs = outputs.result(input_ids)
    return sequences, logprobs, cache.stats


@torch.no_grad()
def full_cache_generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, SpeCacheStats]:
    """The baseline: the same masks, positions and sampling over a full-precision DynamicCache.

    Its stats hold the cache's bytes (all of it is "fast tier")."""
    valid, positions, next_pos, outputs = _prepare(
        model, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id
    )
    batch = input_ids.shape[0]
    cache = DynamicCache(config=model.config)
    logits = _forward(model, input_ids, valid[:, :0], valid, positions, cache, 1)
    one = torch.ones(batch, 1, dtype=torch.bool)
    for step in range(max_new_tokens):
        tokens, logprobs = sample(logits[:, -1], temperature, top_p, top_k, generator)
        outputs.push(tokens, logprobs)
        if outputs.done or step == max_new_tokens - 1:
            break
        valid = torch.cat([valid, one], 1)
        logits = _forward(model, tokens[:, None], valid[:, :-1], one, (next_pos + step)[:, None], cache, 1)
    nbytes = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    sequences, logprobs = outputs.result(input_ids)
    return (
        sequences,
        logprobs,
        SpeCacheStats(fast_tier_bytes=nbytes, peak_fast_tier_bytes=nbytes, full_cache_bytes=nbytes),
    )
