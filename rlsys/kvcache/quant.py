"""Low-bit KV quantiser of SpeCache (KIVI-style asymmetric min/max quantisation).

For a group with minimum `m` and maximum `M` the quantiser keeps a zero point `z`, a
scale `s` and integer codes `q = clamp(round((x - z) / s), 0, 2^b - 1)`; the dequantised
value is `x' = z + q * s`.

* b >= 2 (KIVI): `z = m`, `s = (M - m) / (2^b - 1)`; the error is at most `s / 2`.
* b = 1 (SpeCache's midpoint quantiser): the two levels sit at the midpoints of the lower
  and upper halves of `[m, M]`, i.e. `z = (3m + M) / 4` and `s = (M - m) / 2`, so the
  levels are `(3m + M) / 4` and `(m + 3M) / 4` and the error is at most `(M - m) / 4`
  (instead of `(M - m) / 2` for levels at `m` and `M`).

Codes are packed `8 / b` to a byte along the last dimension, so a quantised tensor holds
`b` bits per element plus its zero points and scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (1, 2, 4)


@dataclass
class Quantized:
    """Packed codes plus the per-group zero point and scale (broadcastable to the codes)."""

    codes: torch.Tensor  # uint8, last dim packed 8 // bits codes per byte
    zero: torch.Tensor
    scale: torch.Tensor
    bits: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.zero, self.scale))


def quant_params(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero point and scale for groups with minimum `lo` and maximum `hi` (module docstring)."""
    if bits == 1:
        return (3 * lo + hi) / 4, (hi - lo) / 2
    return lo, (hi - lo) / ((1 << bits) - 1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (< 2^bits) along the last dim, `8 // bits` per byte."""
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise ValueError(f"last dim {codes.shape[-1]} is not a multiple of {per_byte} ({bits}-bit codes)")
    grouped = codes.reshape(*codes.shape[:-1], -1, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, dtype=torch.int32, device=codes.device) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 codes with the last dim `8 // bits` times longer."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.uint8, device=packed.device) * bits
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)


def quantize(
    x: torch.Tensor,
    bits: int,
    dim: int,
    valid: torch.Tensor | None = None,
    meta_dtype: torch.dtype | None = None,
) -> Quantized:
    """Quantise `x` with one (zero, scale) per slice along `dim` (the group dimension).

    `valid` (broadcastable to `x`) excludes entries, e.g. left padding, from the min/max.
    `meta_dtype` stores zero points and scales in another dtype (KIVI keeps them in 16 bit);
    the codes are computed against the stored (rounded) values, so dequantisation is
    consistent with them.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if valid is None:
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    else:
        lo = x.masked_fill(~valid, float("inf")).amin(dim, keepdim=True)
        hi = x.masked_fill(~valid, float("-inf")).amax(dim, keepdim=True)
        empty = torch.isinf(lo)
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    zero, scale = quant_params(lo, hi, bits)
    meta_dtype = meta_dtype or x.dtype
    zero, scale = zero.to(meta_dtype), scale.to(meta_dtype)
    z, s = zero.to(x.dtype), scale.to(x.dtype)
    inv = torch.where(s > 0, 1.0 / s.clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(s))
    codes = ((x - z) * inv).round().clamp_(0, (1 << bits) - 1).to(torch.uint8)
    return Quantized(pack_codes(codes, bits), zero, scale, bits)


def dequantize(q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """`x' = z + q * s` (module docstring), in `dtype`."""
    return unpack_codes(q.codes, q.bits).to(dtype) * q.scale.to(dtype) + q.zero.to(dtype)
