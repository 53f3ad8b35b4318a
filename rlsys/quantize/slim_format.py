"""A quantised model directory, read without rlsys: the packed codes, the per-group bit maps and
the float16 scales/zeros of `quantized.safetensors` back to a dense transformers model.

This file imports only torch, safetensors and transformers: `save_quantized` copies it into
every quantised directory as `rlsys_slim_llm.py` and names it in `config.json`'s `auto_map`, so
the directory loads with the standard pair (no transformers class reads the packed format):

    model = AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)  # dequantised
    tokenizer = AutoTokenizer.from_pretrained(dir)

Layout: every tensor of the model as it is, except each quantised linear `<name>.weight`, held
as `<name>.qweight` (each column group's codes packed at its own width, least significant bit
first, groups concatenated), `<name>.bits` (uint8, one per group), `<name>.scales` and
`<name>.zeros` (float16, `[rows, groups]`). A group's weights are `scale * (q - zero)`, or
`zero + scale * (2q - 1)` at 1 bit. `quantize_config.json` names the format, the group size,
each quantised linear's shape and the tied weights (`aliases`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FORMAT = "rlsys-slim-llm/1"
WEIGHTS_FILE = "quantized.safetensors"
CONFIG_FILE = "quantize_config.json"
MODULE_FILE = "rlsys_slim_llm.py"  # this file's name inside a quantised directory


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that `count` codes of `bits` bits take packed."""
    return (count * bits + 7) // 8


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` `bits`-wide codes of a packed uint8 stream, as int64."""
    bitstream = (packed.to(torch.int64)[:, None] >> torch.arange(8, dtype=torch.int64)) & 1
    bitstream = bitstream.reshape(-1)[: count * bits].reshape(count, bits)
    return (bitstream << torch.arange(bits, dtype=torch.int64)).sum(dim=1)


def dequantize(codes: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Weights from codes: `scale * (q - zero)`, or `zero + scale * (2q - 1)` for 1 bit; a `[rows]`
    scale/zero broadcasts over a `[rows, n]` group."""
    if codes.ndim == scale.ndim + 1:
        scale, zero = scale[..., None], zero[..., None]
    q = codes.to(torch.float32)
    return zero + scale * (2.0 * q - 1.0) if bits == 1 else scale * (q - zero)


def group_codes(qweight: torch.Tensor, bits: torch.Tensor, rows: int, group_size: int) -> list[torch.Tensor]:
    """Each group's `[rows, group_size]` codes from a linear's packed `qweight`."""
    groups, offset = [], 0
    for b in bits.tolist():
        n = packed_nbytes(rows * group_size, b)
        groups.append(unpack_codes(qweight[offset : offset + n], b, rows * group_size).reshape(rows, group_size))
        offset += n
    if offset != qweight.numel():
        raise ValueError(f"qweight holds {qweight.numel()} bytes, bit map needs {offset}")
    return groups


def dense_weight(parts: dict[str, torch.Tensor], rows: int, group_size: int) -> torch.Tensor:
    """A quantised linear's float32 weight from its `qweight`, `bits`, `scales`, `zeros`."""
    bits = parts["bits"].to(torch.int64)
    scales, zeros = parts["scales"].to(torch.float32), parts["zeros"].to(torch.float32)
    groups = group_codes(parts["qweight"], bits, rows, group_size)
    columns = [dequantize(q, int(b), scales[:, g], zeros[:, g]) for g, (q, b) in enumerate(zip(groups, bits))]
    return torch.cat(columns, dim=1)


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    if not ((path / CONFIG_FILE).exists() and (path / WEIGHTS_FILE).exists()):
        raise FileNotFoundError(f"{path} is not a quantised model directory (no {CONFIG_FILE} / {WEIGHTS_FILE})")
    meta = json.loads((path / CONFIG_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown format {meta.get('format')!r}, expected {FORMAT}")
    return meta


def load_dense(path: str | Path, dtype: torch.dtype = torch.float32, config=None):
    """The model saved at `path` as its own transformers class (`config.architectures[0]`), every
    quantised linear holding its dequantised weight: `generate` and friends work unchanged."""
    import transformers
    from safetensors.torch import load_file

    path = Path(path)
    meta = read_meta(path)
    config = config or transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    model = getattr(transformers, config.architectures[0])(config).to(dtype)
    tensors = load_file(str(path / WEIGHTS_FILE))
    for name, (rows, _cols) in meta["layers"].items():
        parts = {p: tensors.pop(f"{name}.{p}") for p in ("qweight", "bits", "scales", "zeros")}
        tensors[f"{name}.weight"] = dense_weight(parts, rows, meta["group_size"])
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    aliases = meta["aliases"]
    if unexpected or set(missing) - set(aliases):
        raise ValueError(
            f"{path}: weights do not match the config "
            f"(missing {sorted(set(missing) - set(aliases))}, unexpected {unexpected})"
        )
    params = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    with torch.no_grad():
        for alias, source in aliases.items():
            if params[alias].data_ptr() != params[source].data_ptr():
                params[alias].copy_(params[source])
    if (path / "generation_config.json").exists():
        model.generation_config = transformers.GenerationConfig.from_pretrained(str(path))
    return model.eval()


def auto_map(architecture: str) -> dict[str, str]:
    """`config.json`'s `auto_map` for a quantised model of `architecture` (e.g. Qwen2ForCausalLM)."""
    return {"AutoModelForCausalLM": f"{Path(MODULE_FILE).stem}.Slim{architecture}"}


def _slim_class(base: type) -> type:
    """`base` whose `from_pretrained` reads a quantised directory (and any other as `base` does)."""

    class Slim(base):
        @classmethod
        def from_pretrained(cls, path, *args, config=None, dtype=None, torch_dtype=None, **kwargs):
            if not (Path(path) / CONFIG_FILE).exists():
                return base.from_pretrained(path, *args, config=config, dtype=dtype or torch_dtype, **kwargs)
            chosen = dtype or torch_dtype
            return load_dense(path, chosen if isinstance(chosen, torch.dtype) else torch.float32, config)

    Slim.__name__ = Slim.__qualname__ = f"Slim{base.__name__}"
    return Slim


def __getattr__(name: str):
    """`Slim<Architecture>`, the class `auto_map` names, made on first use for any causal LM class
    of transformers."""
    if name.startswith("Slim"):
        import transformers

        base = getattr(transformers, name.removeprefix("Slim"), None)
        if isinstance(base, type):
            globals()[name] = cls = _slim_class(base)
            return cls
    raise AttributeError(name)
