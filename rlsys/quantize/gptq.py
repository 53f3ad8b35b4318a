"""Layer-level SliM-LLM: Hessian proxy, group salience, salience-determined bit allocation
(SBA) searched by output KL, and GPTQ quantisation with error compensation.

A layer computes `y = x W^T (+ b)` with `W` of shape `[rows, cols]`; groups are blocks of
`group_size` consecutive input columns (all rows), each with its own bit width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .quantizer import (
    QuantizedWeight,
    calibrate_scale,
    clip_grid,
    dequantize_codes,
    element_salience,
    minmax_params,
    quantize_codes,
    salient_mask,
)


@dataclass
class SQCConfig:
    """Salience-weighted quantizer calibration settings (paper defaults)."""

    lam: float = 1.0  # weight of the salient elements' error
    norm: float = 2.4  # exponent of the error |q - w|^norm
    steps: int = 50  # grid points on each side of p = 1
    span: float = 0.1  # p in [1 - span, 1 + span]
    z_threshold: float = 2.0  # salient = |z-score of element salience| > threshold


def hessian_from_activations(gram: torch.Tensor, count: int, percdamp: float = 0.01):
    """Hessian proxy of the layer-wise loss `||XW^T - XW_q^T||^2`: `H = 2/n sum_x x x^T`
    from the accumulated Gram matrix `sum_x x x^T` of `count` input rows, damped by
    `percdamp * mean(diag H)` on the diagonal (as GPTQ). Input channels that never fired
    (zero diagonal) get `H_jj = 1`; returns `(H, dead)` with `dead` their mask."""
    h = 2.0 * gram.to(torch.float64) / max(count, 1)
    dead = torch.diag(h) == 0
    idx = torch.arange(h.shape[0])
    h[idx[dead], idx[dead]] = 1.0
    h[idx, idx] += percdamp * torch.diag(h).mean()
    return h, dead


def inverse_hessian_cholesky(h: torch.Tensor) -> torch.Tensor:
    """`Hinv`: the upper Cholesky factor `U` of `H^-1` (`H^-1 = U^T U`), computed in float64.
    If `H` is not numerically positive definite the damping is raised tenfold until it is."""
    h = h.to(torch.float64)
    extra = 1e-8 * torch.diag(h).mean()
    for _ in range(12):
        chol, info = torch.linalg.cholesky_ex(h)
        if info == 0:
            inv = torch.cholesky_inverse(chol)
            u, info = torch.linalg.cholesky_ex(inv, upper=True)
            if info == 0:
                return u.to(torch.float32)
        h = h + extra * torch.eye(h.shape[0], dtype=h.dtype)
        extra = extra * 10
    raise RuntimeError("Hessian is not positive definite even after extra damping")


def group_salience(w: torch.Tensor, hinv: torch.Tensor, group_size: int) -> torch.Tensor:
    """Salience of each column group: `s_g = sum_{i, j in g} w_ij^2 / [Hinv]_jj^2`."""
    s = element_salience(w, torch.diag(hinv))
    return s.reshape(w.shape[0], -1, group_size).sum(dim=(0, 2))


def sba_candidates(salience: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """SBA's bit maps: for `k = 1 .. G/2 - 1`, the `k` least salient groups get `bits - 1`,
    the `k` most salient `bits + 1`, the rest `bits`; every map averages exactly `bits`.
    Empty when there are fewer than four groups or `bits == 1` (no 0-bit groups)."""
    groups = salience.numel()
    if bits < 2:
        return []
    order = torch.argsort(salience, stable=True)
    maps = []
    for k in range(1, groups // 2):
        m = torch.full((groups,), bits, dtype=torch.int64)
        m[order[:k]] = bits - 1
        m[order[groups - k :]] = bits + 1
        maps.append(m)
    return maps


def output_kl(y_q: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """SBA's score `KL(softmax(y_q) || softmax(y))` over output features, averaged over rows."""
    logp_q = F.log_softmax(y_q.double(), dim=-1)
    logp = F.log_softmax(y.double(), dim=-1)
    return (logp_q.exp() * (logp_q - logp)).sum(dim=-1).mean()


def rtn_quantize(w: torch.Tensor, bit_map: torch.Tensor, group_size: int) -> QuantizedWeight:
    """Round-to-nearest: each group on its own min-max grid, no error compensation."""
    rows, cols = w.shape
    groups = cols // group_size
    codes = torch.empty(rows, cols, dtype=torch.int16)
    scales, zeros = torch.empty(rows, groups), torch.empty(rows, groups)
    for g in range(groups):
        sl = slice(g * group_size, (g + 1) * group_size)
        params = minmax_params(w[:, sl].float(), int(bit_map[g]))
        codes[:, sl] = quantize_codes(w[:, sl].float(), params).to(torch.int16)
        scales[:, g], zeros[:, g] = params.scale, params.zero
    return QuantizedWeight(codes, bit_map.clone(), scales, zeros, group_size)


def allocate_bits(
    w: torch.Tensor,
    x: torch.Tensor,
    salience: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    include_uniform: bool = False,
) -> tuple[torch.Tensor, list[float]]:
    """Salience-determined bit allocation: among `sba_candidates`, the bit map whose
    round-to-nearest weight `W_q` minimises `KL(softmax(X W_q^T + b) || softmax(X W^T + b))`
    on calibration inputs `x` `[n, cols]`. Returns the map and the KL of every candidate;
    with no candidate (too few groups) the uniform map and `[]`.

    `include_uniform` also scores the uniform map (k = 0; its KL first in the list), so a layer
    keeps uniform bits where no mixed map has a lower KL (not in the paper's search, whose
    k starts at 1: with few groups per row, as on a 128-wide model, k = 1 already binarises a
    quarter of the weights). Consecutive candidates differ in two groups, so the output is
    updated incrementally.
    """
    groups = salience.numel()
    uniform = torch.full((groups,), bits, dtype=torch.int64)
    maps = sba_candidates(salience, bits)
    if not maps:
        return uniform, []
    w, x = w.float(), x.float()
    y = F.linear(x, w, bias)
    by_bits = {
        b: rtn_quantize(w, torch.full((groups,), b), group_size).dequantize() for b in (bits - 1, bits, bits + 1)
    }
    y_q = F.linear(x, by_bits[bits], bias)
    order = torch.argsort(salience, stable=True)
    uniform_kl = float(output_kl(y_q, y))
    kls = []
    for k in range(1, len(maps) + 1):
        for g, b in ((int(order[k - 1]), bits - 1), (int(order[groups - k]), bits + 1)):
            sl = slice(g * group_size, (g + 1) * group_size)
            y_q = y_q + x[:, sl] @ (by_bits[b][:, sl] - by_bits[bits][:, sl]).T
        kls.append(float(output_kl(y_q, y)))
    if include_uniform:  # k = 0, scored first
        maps, kls = [uniform, *maps], [uniform_kl, *kls]
    best = min(range(len(kls)), key=kls.__getitem__)
    return maps[best], kls


def gptq_quantize(
    w: torch.Tensor,
    hinv: torch.Tensor,
    bit_map: torch.Tensor,
    group_size: int,
    sqc: SQCConfig | None = None,
    dead: torch.Tensor | None = None,
) -> QuantizedWeight:
    """GPTQ with error compensation, one column group (= lazy-update block) at a time.

    At the start of each group its grid is fitted on the current, already compensated
    weights: min-max (`sqc=None`) or SQC with salience `w^2 / [Hinv]_jj^2`. Then column by
    column: `q_i = quant(w_i)`, `e_i = (w_i - q_i) / [Hinv]_ii`, and the group's remaining
    columns absorb the error, `W[:, i:] -= e_i Hinv[i, i:]`; after the group, the columns to
    its right absorb `E Hinv[group, right]`. `hinv` is `inverse_hessian_cholesky(H)`.
    """
    w = w.detach().clone().float()
    if dead is not None:
        w[:, dead] = 0.0
    rows, cols = w.shape
    groups = cols // group_size
    codes = torch.empty(rows, cols, dtype=torch.int16)
    scales, zeros = torch.empty(rows, groups), torch.empty(rows, groups)
    grid = clip_grid(sqc.steps, sqc.span) if sqc is not None else None
    for g in range(groups):
        s, e = g * group_size, (g + 1) * group_size
        w1, h1 = w[:, s:e].clone(), hinv[s:e, s:e]
        b = int(bit_map[g])
        if sqc is None:
            params = minmax_params(w1, b)
        else:
            mask = salient_mask(element_salience(w1, torch.diag(h1)), sqc.z_threshold)
            params, _ = calibrate_scale(w1, b, mask, sqc.lam, sqc.norm, grid)
        err = torch.empty_like(w1)
        for i in range(group_size):
            q = quantize_codes(w1[:, i], params)
            codes[:, s + i] = q.to(torch.int16)
            err[:, i] = (w1[:, i] - dequantize_codes(q, params)) / h1[i, i]
            w1[:, i:] -= err[:, i : i + 1] @ h1[i : i + 1, i:]
        w[:, e:] -= err @ hinv[s:e, e:]
        scales[:, g], zeros[:, g] = params.scale, params.zero
    return QuantizedWeight(codes, bit_map.clone(), scales, zeros, group_size)
