"""Group quantisers: asymmetric min-max integer grids, 1-bit binarisation, the
salience-weighted clipping search (SQC) and bit packing.

Every function here works on one *group*: a `[rows, group_size]` slice of a weight
matrix with one (scale, zero) pair per row. Scales and zeros are rounded to float16
before codes are computed, so what is stored (float16) dequantises to exactly the
weights the model ran with.

Paper: SliM-LLM (Huang et al., 2024, arXiv:2405.14917). SBA = salience-determined bit
allocation, SQC = salience-weighted quantizer calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .slim_format import dequantize, group_codes, packed_nbytes, unpack_codes  # noqa: F401 (pack_codes' inverse)

_MIN_SCALE = 2.0**-24  # smallest float16 subnormal: a scale never rounds to zero


@dataclass
class GroupParams:
    """Per-row quantisation parameters of one group (float16-representable, held as float32).

    For `bits >= 2`: `w ~= scale * (q - zero)`, `q` in `[0, 2**bits - 1]`, `zero` an integer.
    For `bits == 1`: `w ~= zero + scale * (2q - 1)`, `zero` the row mean, `scale` the mean
    absolute deviation (binarisation: SliM-LLM binarises its 1-bit groups).
    """

    bits: int
    scale: torch.Tensor  # [rows]
    zero: torch.Tensor  # [rows]


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def minmax_params(w: torch.Tensor, bits: int, p: float | torch.Tensor = 1.0) -> GroupParams:
    """Asymmetric min-max grid of a group, its range shrunk or stretched by `p` (SQC).

    `p` is a float or a `[P]` tensor; with a tensor, scale and zero get a leading `[P]`
    axis. As in GPTQ the range always contains 0. `p = 1` is plain min-max (no clipping).
    """
    if bits == 1:
        return binary_params(w)
    maxq = 2**bits - 1
    zeros = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
    xmin = torch.minimum(w.min(dim=1).values, zeros)
    xmax = torch.maximum(w.max(dim=1).values, zeros)
    flat = (xmin == 0) & (xmax == 0)
    xmin = torch.where(flat, -torch.ones_like(xmin), xmin)
    xmax = torch.where(flat, torch.ones_like(xmax), xmax)
    p = torch.as_tensor(p, dtype=w.dtype, device=w.device)
    if p.ndim == 1:
        xmin, xmax = p[:, None] * xmin, p[:, None] * xmax
    else:
        xmin, xmax = p * xmin, p * xmax
    scale = _fp16(((xmax - xmin) / maxq).clamp(min=_MIN_SCALE))
    zero = torch.round(-xmin / scale).clamp(0, maxq)
    return GroupParams(bits, scale, zero)


def binary_params(w: torch.Tensor) -> GroupParams:
    """1-bit parameters: row mean and mean |w - mean| (the L2-optimal binary scale)."""
    zero = _fp16(w.mean(dim=1))
    scale = _fp16((w - zero[:, None]).abs().mean(dim=1).clamp(min=_MIN_SCALE))
    return GroupParams(1, scale, zero)


def quantize_codes(w: torch.Tensor, params: GroupParams) -> torch.Tensor:
    """Integer codes of `w` (`[rows, n]` or `[rows]`) under `params` (one pair per row)."""
    scale, zero = params.scale, params.zero
    if w.ndim == scale.ndim + 1:
        scale, zero = scale[..., None], zero[..., None]
    if params.bits == 1:
        return (w >= zero).to(torch.uint8)
    q = torch.clamp(torch.round(w / scale) + zero, 0, 2**params.bits - 1)
    return q.to(torch.int16 if params.bits > 8 else torch.uint8)


def dequantize_codes(q: torch.Tensor, params: GroupParams) -> torch.Tensor:
    """Weights from codes: `scale * (q - zero)`, or `zero + scale * (2q - 1)` for 1 bit."""
    return dequantize(q, params.bits, params.scale, params.zero)


def fake_quantize(w: torch.Tensor, params: GroupParams) -> torch.Tensor:
    """Round-to-nearest on the grid: `dequantize_codes(quantize_codes(w))`."""
    return dequantize_codes(quantize_codes(w, params), params)


def element_salience(w: torch.Tensor, hinv_diag: torch.Tensor) -> torch.Tensor:
    """Element salience `w_ij^2 / [Hinv]_jj^2` (the salience of SBA and SQC), `hinv_diag` the group's
    Cholesky diagonal."""
    return w.pow(2) / hinv_diag.pow(2)[None, :]


def salient_mask(salience: torch.Tensor, z_threshold: float = 2.0) -> torch.Tensor:
    """Salient elements of a group: `|z-score| > threshold` over the whole group (SQC)."""
    std = salience.std()
    if not torch.isfinite(std) or std == 0:
        return torch.zeros_like(salience, dtype=torch.bool)
    return ((salience - salience.mean()) / std).abs() > z_threshold


def clip_grid(steps: int = 50, span: float = 0.1) -> torch.Tensor:
    """Clipping factors searched by SQC: `{1} ∪ steps up to 1+span ∪ steps down to 1-span`.

    `p = 1` comes first, so on ties the search keeps the unclipped grid.
    """
    up = torch.linspace(1.0, 1.0 + span, steps + 1)[1:]
    down = torch.linspace(1.0, 1.0 - span, steps + 1)[1:]
    return torch.cat([torch.ones(1), up, down])


def sqc_error(
    w: torch.Tensor,
    params: GroupParams,
    salient: torch.Tensor,
    lam: float = 1.0,
    norm: float = 2.4,
) -> torch.Tensor:
    """SQC objective per row: `sum |q - w|^norm` over non-salient elements plus
    `lam` times the same sum over salient ones. Broadcasts over a leading `[P]` axis."""
    err = (fake_quantize(w, params) - w).abs().pow(norm)
    weight = torch.where(salient, torch.full_like(w, lam), torch.ones_like(w))
    return (err * weight).sum(dim=-1)


def calibrate_scale(
    w: torch.Tensor,
    bits: int,
    salient: torch.Tensor,
    lam: float = 1.0,
    norm: float = 2.4,
    grid: torch.Tensor | None = None,
) -> tuple[GroupParams, torch.Tensor]:
    """Salience-weighted quantiser calibration (SQC): per row, the clipping factor
    `p` on the grid that minimises `sqc_error`. Returns the parameters and the chosen `p`.

    1-bit groups are binarised in closed form (no search). Since `p = 1` is on the grid
    the result is never worse than plain min-max.
    """
    if bits == 1:
        return binary_params(w), torch.ones(w.shape[0])
    grid = clip_grid() if grid is None else grid
    cand = minmax_params(w, bits, grid.to(w))  # scale/zero: [P, rows]
    errors = sqc_error(w[None], cand, salient[None], lam, norm)  # [P, rows]
    best = errors.argmin(dim=0)  # first minimum: p = 1 wins ties
    rows = torch.arange(w.shape[0])
    params = GroupParams(bits, cand.scale[best, rows], cand.zero[best, rows])
    return params, grid[best]


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned `bits`-wide codes (any shape, row-major) into a flat uint8 tensor,
    least significant bit first; the tail byte is zero-padded."""
    flat = q.reshape(-1).to(torch.int64)
    shifts = torch.arange(bits, dtype=torch.int64)
    bitstream = ((flat[:, None] >> shifts) & 1).reshape(-1)
    pad = (-bitstream.numel()) % 8
    bitstream = torch.cat([bitstream, bitstream.new_zeros(pad)]).reshape(-1, 8)
    return (bitstream << torch.arange(8, dtype=torch.int64)).sum(dim=1).to(torch.uint8)


@dataclass
class QuantizedWeight:
    """A quantised `[rows, cols]` weight: integer codes, the per-group bit map and per-row,
    per-group float16 scales/zeros. Group `g` covers columns `g*group_size .. (g+1)*group_size`."""

    codes: torch.Tensor  # [rows, cols], integer
    bits: torch.Tensor  # [G], int
    scales: torch.Tensor  # [rows, G], float16-representable float32
    zeros: torch.Tensor  # [rows, G]
    group_size: int

    def group_params(self, g: int) -> GroupParams:
        return GroupParams(int(self.bits[g]), self.scales[:, g], self.zeros[:, g])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the quantised layer computes with."""
        gs = self.group_size
        cols = [
            dequantize_codes(self.codes[:, g * gs : (g + 1) * gs], self.group_params(g))
            for g in range(self.bits.numel())
        ]
        return torch.cat(cols, dim=1)

    def average_bits(self) -> float:
        return float(self.bits.double().mean())

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Storage form: `qweight` (each group's codes packed at its own width, concatenated),
        `bits` (uint8 bit map), `scales`/`zeros` (float16)."""
        gs = self.group_size
        packed = [pack_codes(self.codes[:, g * gs : (g + 1) * gs], int(b)) for g, b in enumerate(self.bits.tolist())]
        return {
            "qweight": torch.cat(packed),
            "bits": self.bits.to(torch.uint8),
            "scales": self.scales.to(torch.float16),
            "zeros": self.zeros.to(torch.float16),
        }

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], rows: int, group_size: int) -> "QuantizedWeight":
        """Inverse of `to_tensors` for a weight with `rows` output rows."""
        bits = t["bits"].to(torch.int64)
        chunks = group_codes(t["qweight"], bits, rows, group_size)
        return cls(
            codes=torch.cat(chunks, dim=1),
            bits=bits,
            scales=t["scales"].to(torch.float32),
            zeros=t["zeros"].to(torch.float32),
            group_size=group_size,
        )

    def nbytes(self) -> int:
        """Bytes of the storage form: packed codes, one byte of bit map per group and two
        float16 values (scale, zero) per row per group."""
        rows, groups = self.scales.shape
        packed = sum(packed_nbytes(rows * self.group_size, int(b)) for b in self.bits.tolist())
        return packed + groups + 2 * 2 * rows * groups
