"""SpeCache: speculative KV-cache offloading (low-bit fast tier, full-precision slow tier).

`specache_generate` is the entry point for the rollout worker; `full_cache_generate` is the
same loop over a full-precision cache (the baseline).
"""

from rlsys.kvcache.cache import SpeCache, SpeCacheConfig, SpeCacheStats
from rlsys.kvcache.generate import full_cache_generate, sample, specache_generate
from rlsys.kvcache.quant import Quantized, dequantize, quantize

__all__ = [
    "SpeCache",
    "SpeCacheConfig",
    "SpeCacheStats",
    "Quantized",
    "dequantize",
    "full_cache_generate",
    "quantize",
    "sample",
    "specache_generate",
]
