"""SliM-LLM: salience-driven mixed-precision post-training quantisation (Huang et al., 2024).

`quantize_model` quantises a transformers causal LM in place, `save_quantized` writes the
packed form, `load_quantized` rebuilds a servable model; `rlsys quantize` is `cli.main`.
"""

from .gptq import SQCConfig
from .model import QuantConfig, average_bits, is_quantized_dir, load_quantized, quantize_model, save_quantized
from .quantizer import QuantizedWeight

__all__ = [
    "QuantConfig",
    "QuantizedWeight",
    "SQCConfig",
    "average_bits",
    "is_quantized_dir",
    "load_quantized",
    "quantize_model",
    "save_quantized",
]
