"""Model-level SliM-LLM: sequential calibration of a transformers causal LM block by block,
in-place quantisation of every linear layer inside its decoder blocks, and the on-disk
format (packed codes + per-group bit map + float16 scales/zeros in safetensors).

Sequential as in GPTQ: block `i` is calibrated on the outputs of the already quantised
blocks `< i`; all linears of one block share one calibration pass. Embeddings, norms,
biases and the LM head stay in their original precision.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from .gptq import (
    SQCConfig,
    allocate_bits,
    gptq_quantize,
    group_salience,
    hessian_from_activations,
    inverse_hessian_cholesky,
    rtn_quantize,
)
from .quantizer import QuantizedWeight
from .slim_format import CONFIG_FILE, FORMAT, MODULE_FILE, WEIGHTS_FILE, auto_map, load_dense

METHODS = ("slim", "gptq", "rtn")


@dataclass
class QuantConfig:
    """What to quantise and how.

    method: `slim` (SBA + GPTQ + SQC), `gptq` (uniform bits, GPTQ, min-max grid) or
    `rtn` (uniform bits, round-to-nearest, no calibration data needed).
    """

    bits: int = 2
    group_size: int = 128
    method: str = "slim"
    percdamp: float = 0.01
    sqc: SQCConfig = field(default_factory=SQCConfig)
    kl_rows: int = 4096  # calibration input rows kept per layer for the SBA search
    sba_uniform: bool = False  # SBA also weighs uniform bits (k = 0), see `allocate_bits`
    batch_size: int = 8
    seed: int = 0


@dataclass
class LayerStats:
    """Calibration statistics of one linear: `sum x x^T`, the row count, sampled inputs."""

    gram: torch.Tensor
    count: int = 0
    samples: list[torch.Tensor] = field(default_factory=list)


class _StopForward(Exception):
    """Raised after the block being calibrated; nothing later in the model needs to run."""


def decoder_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder blocks `(name, module)`: the `nn.ModuleList` holding the most linears."""
    best, best_count = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList):
            count = sum(isinstance(m, nn.Linear) for m in mod.modules())
            if count > best_count:
                best, best_count = (name, mod), count
    if best is None:
        raise ValueError("model has no list of blocks with linear layers")
    prefix, blocks = best
    return [(f"{prefix}.{i}", b) for i, b in enumerate(blocks)]


def block_linears(block_name: str, block: nn.Module) -> dict[str, nn.Linear]:
    """The linears of one block, by full module name."""
    return {f"{block_name}.{n}": m for n, m in block.named_modules() if isinstance(m, nn.Linear)}


def check_config(model: nn.Module, cfg: QuantConfig) -> None:
    """Raise `ValueError` (one line) if `cfg` cannot quantise `model`."""
    if cfg.method not in METHODS:
        raise ValueError(f"method {cfg.method!r} is not one of {', '.join(METHODS)}")
    if not 1 <= cfg.bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {cfg.bits}")
    if cfg.group_size < 1:
        raise ValueError(f"group size must be positive, got {cfg.group_size}")
    for block_name, block in decoder_blocks(model):
        for name, lin in block_linears(block_name, block).items():
            if lin.in_features % cfg.group_size:
                raise ValueError(f"group size {cfg.group_size} does not divide the width {lin.in_features} of {name}")


def collect_block_stats(
    model: nn.Module, block: nn.Module, linears: dict[str, nn.Linear], calib: torch.Tensor, cfg: QuantConfig
) -> dict[str, LayerStats]:
    """One calibration pass up to and including `block`: per linear, the Gram matrix of
    its inputs (forward hooks) and up to `cfg.kl_rows` sampled input rows."""
    stats = {n: LayerStats(torch.zeros(l.in_features, l.in_features, dtype=torch.float64)) for n, l in linears.items()}
    batches = calib.split(cfg.batch_size)
    per_batch = math.ceil(cfg.kl_rows / len(batches))
    gen = torch.Generator().manual_seed(cfg.seed)

    def hook(name):
        def fn(_mod, inputs, _out):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float64)
            st = stats[name]
            st.gram += x.T @ x
            st.count += x.shape[0]
            pick = torch.randperm(x.shape[0], generator=gen)[:per_batch]
            st.samples.append(x[pick].float())

        return fn

    def stop(*_):
        raise _StopForward

    handles = [lin.register_forward_hook(hook(n)) for n, lin in linears.items()]
    handles.append(block.register_forward_hook(stop))
    try:
        with torch.no_grad():
            for batch in batches:
                try:
                    model(input_ids=batch, use_cache=False)
                except _StopForward:
                    pass
    finally:
        for h in handles:
            h.remove()
    return stats


def quantize_weight(lin: nn.Linear, stats: LayerStats | None, cfg: QuantConfig) -> QuantizedWeight:
    """Quantise one linear's weight by `cfg.method` (stats unused by `rtn`)."""
    w = lin.weight.detach().float()
    groups = w.shape[1] // cfg.group_size
    uniform = torch.full((groups,), cfg.bits, dtype=torch.int64)
    if cfg.method == "rtn":
        return rtn_quantize(w, uniform, cfg.group_size)
    h, dead = hessian_from_activations(stats.gram, stats.count, cfg.percdamp)
    hinv = inverse_hessian_cholesky(h)
    if cfg.method == "gptq":
        return gptq_quantize(w, hinv, uniform, cfg.group_size, sqc=None, dead=dead)
    w_live = w.masked_fill(dead[None, :], 0.0)
    salience = group_salience(w_live, hinv, cfg.group_size)
    bias = None if lin.bias is None else lin.bias.detach().float()
    bit_map, _ = allocate_bits(
        w_live, torch.cat(stats.samples), salience, cfg.bits, cfg.group_size, bias, include_uniform=cfg.sba_uniform
    )
    return gptq_quantize(w, hinv, bit_map, cfg.group_size, sqc=cfg.sqc, dead=dead)


def quantize_model(model: nn.Module, calib: torch.Tensor | None, cfg: QuantConfig) -> dict[str, QuantizedWeight]:
    """Quantise `model` in place (its linears' weights become the dequantised values) and
    return the quantised weights by module name. `calib` is `[n, seqlen]` token ids
    (unused, may be None, for `rtn`)."""
    check_config(model, cfg)
    if cfg.method != "rtn" and (calib is None or calib.numel() == 0):
        raise ValueError(f"method {cfg.method} needs calibration token ids")
    model.eval()
    out: dict[str, QuantizedWeight] = {}
    for block_name, block in decoder_blocks(model):
        linears = block_linears(block_name, block)
        stats = collect_block_stats(model, block, linears, calib, cfg) if cfg.method != "rtn" else {}
        for name, lin in linears.items():
            q = quantize_weight(lin, stats.get(name), cfg)
            with torch.no_grad():
                lin.weight.copy_(q.dequantize().to(lin.weight.dtype))
            out[name] = q
    return out


def average_bits(qweights: dict[str, QuantizedWeight]) -> float:
    """Bits per quantised weight over all layers (excluding scales and zeros)."""
    total = sum(q.codes.numel() for q in qweights.values())
    return sum(q.codes.shape[0] * q.group_size * float(q.bits.sum()) for q in qweights.values()) / total


def _unique_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """State dict without tied duplicates; `aliases` maps each dropped name to its source."""
    state, aliases, seen = {}, {}, {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape, t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        state[name] = t.detach().contiguous()
    return state, aliases


def save_quantized(model: nn.Module, qweights: dict[str, QuantizedWeight], cfg: QuantConfig, path) -> Path:
    """Write `config.json`, `quantize_config.json` and `quantized.safetensors` (other weights
    as they are; each quantised linear as `<name>.qweight/.bits/.scales/.zeros`), and the reader
    `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` uses (slim_format.py)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state, aliases = _unique_state(model)
    tensors = {n: t for n, t in state.items() if n.removesuffix(".weight") not in qweights}
    for name, q in qweights.items():
        for part, t in q.to_tensors().items():
            tensors[f"{name}.{part}"] = t.contiguous()
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": FORMAT})
    model.config.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())  # its reader travels with it (slim_format.py)
    config["architectures"] = [type(model).__name__]
    config["auto_map"] = auto_map(type(model).__name__)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(Path(__file__).with_name("slim_format.py"), path / MODULE_FILE)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(path))
    meta = {
        "format": FORMAT,
        "method": cfg.method,
        "bits": cfg.bits,
        "group_size": cfg.group_size,
        "average_bits": average_bits(qweights),
        "settings": {k: v for k, v in asdict(cfg).items() if k not in ("bits", "group_size", "method")},
        "layers": {n: list(q.codes.shape) for n, q in qweights.items()},
        "aliases": aliases,
    }
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return path


def is_quantized_dir(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / CONFIG_FILE).exists() and (path / WEIGHTS_FILE).exists()


def load_quantized(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Rebuild the model saved by `save_quantized`: a plain transformers model whose quantised
    linears hold the dequantised weights, so `generate` and friends work unchanged."""
    return load_dense(path, dtype)


def quantized_bit_maps(path: str | os.PathLike) -> tuple[int, dict[str, torch.Tensor]]:
    """The group size and each quantised linear's per-group bit map saved at `path`."""
    from safetensors import safe_open

    path = Path(path)
    meta = json.loads((path / CONFIG_FILE).read_text())
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        return meta["group_size"], {name: f.get_tensor(f"{name}.bits").to(torch.int64) for name in meta["layers"]}


@torch.no_grad()
def requantize(model: nn.Module, bit_maps: dict[str, torch.Tensor], group_size: int) -> None:
    """Round each listed linear's current weight to nearest on its saved bit map, in place: a
    served quantised policy keeps SliM-LLM's salience-determined allocation when new weights
    arrive (no calibration data at the server, so no GPTQ compensation or scale search)."""
    for name, bits in bit_maps.items():
        lin = model.get_submodule(name)
        lin.weight.copy_(rtn_quantize(lin.weight.float(), bits, group_size).dequantize().to(lin.weight.dtype))
