"""Round-to-nearest on llama.cpp's K-quant grids (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), ported from ggml-quants.c.

A super-block of 256 weights of a row holds sub-blocks of 16 or 32, each with an integer scale code (and min
code) under the super-block's fp16 d (and dmin): weight = d * sc * q (- dmin * mn). `quantize_k` is llama.cpp's
own quantizer: `quantize_row_qN_K_ref`, or `quantize_row_qN_K_impl` given an importance per input column (an
imatrix). It is ported step by step in float32 and ggml's order of operations (sums left to right, rounding
half to even, fp16 by rounding to nearest), so its codes and bytes are llama.cpp's. Every step is vectorised
over all sub-blocks of a weight; the Python loops run over the search grids and the 16 or 32 weights of a
sub-block. Never divide by a Python number here: torch divides a tensor by a scalar as a multiplication by the
scalar's reciprocal on CUDA, and a scalar by a tensor so everywhere, which is not IEEE division.

GPTQ takes the two halves apart: `choose_k_qparams` on a super-block's columns fixes the grid (what llama.cpp
computes for them), then `round_k` rounds columns onto it as they are updated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from quantkit.quant.ggml_blocks import FORMATS, BlockFormat, pack

Q = GGMLQuantizationType
K_QTYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
SUPER_BLOCK = 256
_GROUP_MAX_EPS = float(np.float32(1e-15))


@dataclass
class KQParams:
    """A K-quant grid without its codes. scales (and mins): int8 [rows, cols // sub_block] scale codes; d (and
    dmin): float16 [rows, cols // 256]. Q2_K, Q4_K, Q5_K have mins; Q3_K and Q6_K are symmetric."""

    qtype: GGMLQuantizationType
    scales: torch.Tensor
    d: torch.Tensor
    mins: torch.Tensor | None = None
    dmin: torch.Tensor | None = None

    @property
    def format(self) -> BlockFormat:
        return FORMATS[self.qtype]

    def sub_block_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 [rows, n_sub]: each sub-block's step float(d) * sc and offset float(dmin) * mn, as ggml forms them."""
        per_super = SUPER_BLOCK // self.format.sub_block
        step = self.d.float().repeat_interleave(per_super, dim=1) * self.scales.float()
        if self.mins is None:
            return step, None
        return step, self.dmin.float().repeat_interleave(per_super, dim=1) * self.mins.float()

    def column_scales(self, first_column: int, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`sub_block_scales` for columns first_column .. first_column + count - 1: float32 [rows, count]."""
        steps = self.sub_block_scales()
        sub = self.format.sub_block
        index = torch.arange(first_column, first_column + count, device=self.scales.device) // sub
        return tuple(None if s is None else s[:, index] for s in steps)

    def dequantize(self, codes: torch.Tensor, first_column: int = 0) -> torch.Tensor:
        """float32 values of `codes` (the columns from `first_column` on), exactly as ggml decodes them."""
        step, offset = self.column_scales(first_column, codes.shape[1])
        values = step * codes.float()
        return values if offset is None else values - offset


@dataclass
class KQuantizedWeight:
    """codes: int8 [rows, cols] (in [0, 2^bits - 1] for the types with mins, centred on 0 for Q3_K and Q6_K);
    scales, mins, d, dmin as `KQParams`."""

    codes: torch.Tensor
    qtype: GGMLQuantizationType
    scales: torch.Tensor
    d: torch.Tensor
    mins: torch.Tensor | None = None
    dmin: torch.Tensor | None = None

    @property
    def qparams(self) -> KQParams:
        return KQParams(self.qtype, self.scales, self.d, self.mins, self.dmin)

    def dequantize(self) -> torch.Tensor:
        return self.qparams.dequantize(self.codes)

    def ggml_blocks(self) -> np.ndarray:
        """The GGUF tensor data: uint8 [rows, cols // 256 * type_bytes]."""
        fields = {"scales": self.scales, "d": self.d, "mins": self.mins, "dmin": self.dmin}
        arrays = {k: v.cpu().numpy() for k, v in fields.items() if v is not None}
        return pack(self.qtype, self.codes.cpu().numpy(), **arrays)


def quantize_k(weight: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor | None = None) -> KQuantizedWeight:
    """llama.cpp's quantization of a [rows, cols] weight to `qtype` (cols a multiple of 256): its codes, scale
    codes and d exactly. `importance`: float [cols], the imatrix (llama-quantize --imatrix); None is ggml's
    reference quantizer (llama-quantize without one)."""
    qparams, search_codes = _search(weight, qtype, importance)
    codes = round_k(weight, qparams)
    # Where a sub-block's step is 0 every code decodes alike: llama.cpp leaves its search's there.
    step, _ = qparams.sub_block_scales()
    zero = (step == 0).repeat_interleave(qparams.format.sub_block, dim=1)
    codes = torch.where(zero, search_codes, codes)
    return KQuantizedWeight(codes, qtype, qparams.scales, qparams.d, qparams.mins, qparams.dmin)


def choose_k_qparams(weight: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor | None = None) -> KQParams:
    """The grid llama.cpp chooses for `weight` [rows, cols] (one or more whole super-blocks of columns): sub-block
    scales and mins searched, then quantized to their codes under fp16 d and dmin."""
    return _search(weight, qtype, importance)[0]


def round_k(weight: torch.Tensor, qparams: KQParams, first_column: int = 0) -> torch.Tensor:
    """int8 codes of `weight`'s columns (the grid's columns from `first_column` on) rounded to nearest on the
    fixed grid `qparams`, as ggml's final pass does. Columns whose step is 0 get code 0 (any code decodes alike)."""
    step, offset = qparams.column_scales(first_column, weight.shape[1])
    low, high = qparams.format.code_range
    x = weight.float()
    scaled = _div(x if offset is None else x + offset, step)
    codes = _clamp(torch.round(scaled), low, high)
    return torch.where(step == 0, 0.0, codes).to(torch.int8)


# ---- float32 helpers in ggml's order


def _f32(value: float) -> float:
    """A constant as ggml's float arithmetic holds it."""
    return float(np.float32(value))


def _div(numerator, denominator: torch.Tensor) -> torch.Tensor:
    """IEEE float32 division, also of a constant by a tensor (see the module docstring)."""
    if not isinstance(numerator, torch.Tensor):
        numerator = torch.full_like(denominator, numerator)
    if not isinstance(denominator, torch.Tensor):
        denominator = torch.full_like(numerator, denominator)
    return torch.div(numerator, denominator)


def _sqrt(values: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt, as sqrtf (torch's vectorised CPU float32 sqrt is off by an ulp at times;
    rounding the double root to float32 is exact)."""
    return torch.sqrt(values.double()).float()


def _clamp(values: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    return values if low is None and high is None else values.clamp(min=low, max=high)


def _levels(iscale: torch.Tensor, x: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """ggml's nearest_int(iscale * x) (round half to even), clamped; float32, rows of x [B, n] by iscale [B]."""
    return _clamp(torch.round(iscale[:, None] * x), low, high)


def _ordered_sum(terms: torch.Tensor) -> torch.Tensor:
    """Sum of each row of [B, n] from left to right, as ggml's loops add (torch.sum's order differs)."""
    total = terms[:, 0]
    for i in range(1, terms.shape[1]):
        total = total + terms[:, i]
    return total


def _first_absmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's value of largest magnitude, the first of ties (ggml's `if (ax > amax)` scan)."""
    return x.gather(1, x.abs().argmax(1, keepdim=True))[:, 0]


# ---- ggml's sub-block searches


def _fit_scale_and_min(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                       use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants / make_qkx3_quants on each row of x [B, n]: x ~ scale * L - min, L in [0, nmax], by weighted
    least squares on the rounding of nstep + 1 trial grids. Returns scale, min (>= 0) and L, float32."""
    low, high = x.amin(1), x.amax(1)
    low = torch.where(low > 0, 0.0, low)
    sum_w, sum_x = _ordered_sum(weights), _ordered_sum(weights * x)
    iscale = _div(float(nmax), high - low)
    scale, offset = _div(1.0, iscale), low
    levels = _levels(iscale, x - low[:, None], 0, nmax)
    best = _fit_error(scale, levels, offset, x, weights, use_mad)
    for step in range(nstep + 1):
        # ggml's trial grids start from the best min so far, not from the data's
        numerator = _f32(np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax))
        trial = _levels(_div(numerator, high - offset), x - offset[:, None], 0, nmax)
        sum_l, sum_l2 = _ordered_sum(weights * trial), _ordered_sum(weights * trial * trial)
        sum_xl = _ordered_sum(weights * trial * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = _div(sum_w * sum_xl - sum_x * sum_l, det)
        this_min = _div(sum_l2 * sum_x - sum_l * sum_xl, det)
        clipped = this_min > 0
        this_min = torch.where(clipped, 0.0, this_min)
        this_scale = torch.where(clipped, _div(sum_xl, sum_l2), this_scale)
        error = _fit_error(this_scale, trial, this_min, x, weights, use_mad)
        better = (det > 0) & (error < best)
        levels = torch.where(better[:, None], trial, levels)
        best, scale = torch.where(better, error, best), torch.where(better, this_scale, scale)
        offset = torch.where(better, this_min, offset)
    flat = high == low
    offset = torch.where(flat, low, offset)
    return torch.where(flat, 0.0, scale), -offset, torch.where(flat[:, None], 0.0, levels)


def _fit_error(scale, levels, offset, x, weights, use_mad: bool) -> torch.Tensor:
    diff = scale[:, None] * levels + offset[:, None] - x
    return _ordered_sum(weights * (diff.abs() if use_mad else diff * diff))


def _fit_signed_scale(x: torch.Tensor, nmax: int, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants (rmse_type 1) on each row of x [B, n]: x ~ scale * l, l in [-nmax, nmax - 1], the scale of
    least weighted error (weights x^2 by default) over 19 trial grids around -nmax / the signed absmax. Returns
    scale and l, float32; an all-zero row gets scale 0 and l = -nmax."""
    peak = _first_absmax(x)
    weights = x * x if weights is None else weights
    levels = _levels(_div(float(-nmax), peak), x, -nmax, nmax - 1)
    sum_lx, sum_l2 = _ordered_sum(weights * x * levels), _ordered_sum(weights * levels * levels)
    scale = torch.where(sum_l2 != 0, _div(sum_lx, sum_l2), 0.0)
    best = scale * sum_lx
    for step in [s for s in range(-9, 10) if s]:
        trial = _levels(_div(-_f32(np.float32(nmax) + np.float32(0.1) * np.float32(step)), peak), x, -nmax, nmax - 1)
        trial_lx, trial_l2 = _ordered_sum(weights * x * trial), _ordered_sum(weights * trial * trial)
        take = (trial_l2 > 0) & (trial_lx * trial_lx > best * trial_l2)
        levels = torch.where(take[:, None], trial, levels)
        scale = torch.where(take, _div(trial_lx, trial_l2), scale)
        best = torch.where(take, scale * trial_lx, best)
    zero = peak.abs() < _GROUP_MAX_EPS
    return torch.where(zero, 0.0, scale), torch.where(zero[:, None], float(-nmax), levels)


def _fit_q3(x: torch.Tensor, nmax: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants (do_rmse): the absmax grid, then up to five passes that move single levels while the
    x^2-weighted fit improves. Returns scale and l in [-nmax, nmax - 1]; an all-zero row: 0 and -nmax."""
    peak = _first_absmax(x)
    weights = x * x
    levels = _levels(_div(float(-nmax), peak), x, -nmax, nmax - 1)
    sum_lx, sum_l2 = _ordered_sum(weights * x * levels), _ordered_sum(weights * levels * levels)
    levels, sum_lx, sum_l2 = _refine_levels(x, weights, levels, sum_lx, sum_l2, -nmax, nmax - 1, scale_codes=False)
    zero = peak.abs() < _GROUP_MAX_EPS
    scale = torch.where(sum_l2 > 0, _div(sum_lx, sum_l2), 0.0)
    return torch.where(zero, 0.0, scale), torch.where(zero[:, None], float(-nmax), levels)


def _refine_levels(x, weights, levels, sum_lx, sum_l2, low, high, scale_codes: bool, passes: int = 5):
    """The coordinate passes of make_q3_quants and (`scale_codes`) make_qp_quants: each level in turn moves to the
    rounding of x under the scale fitted without it, kept if the fit sum_lx^2 / sum_l2 grows. A pass that changes
    nothing leaves the next alike, so always running all passes equals ggml's early stop."""
    levels = levels.clone()
    for _ in range(passes):
        for i in range(x.shape[1]):
            xi, wi, li = x[:, i], weights[:, i], levels[:, i]
            slx, sl2 = sum_lx - wi * xi * li, sum_l2 - wi * li * li
            new = _clamp(torch.round(_div(xi * sl2, slx)), low, high)
            new_lx, new_l2 = slx + wi * xi * new, sl2 + wi * new * new
            positive = sl2 > 0 if scale_codes else new_l2 > 0  # make_qp_quants asks before the move, make_q3_quants after
            accept = (slx > 0) & positive & (new != li) & (new_lx * new_lx * sum_l2 > sum_lx * sum_lx * new_l2)
            levels[:, i] = torch.where(accept, new, li)
            sum_lx, sum_l2 = torch.where(accept, new_lx, sum_lx), torch.where(accept, new_l2, sum_l2)
    return levels, sum_lx, sum_l2


def _fit_scale_codes(values: torch.Tensor, nmax: int, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qp_quants on rows [B, n] of non-negative sub-block scales (or mins): one float scale d and codes in
    [0, nmax] with values ~ d * code, weighted by the sub-blocks' total importance. Returns d and the codes."""
    peak = values.amax(1).clamp(min=0)
    iscale = _div(float(nmax), peak)
    scale = _div(1.0, iscale)
    best = _qp_error(values, weights, scale, torch.round(iscale[:, None] * values))
    for step in [s for s in range(-4, 5) if s]:
        trial_iscale = _div(_f32(np.float32(0.1) * np.float32(step) + np.float32(nmax)), peak)
        error = _qp_error(values, weights, _div(1.0, trial_iscale), _levels(trial_iscale, values, None, nmax))
        better = error < best
        best, iscale = torch.where(better, error, best), torch.where(better, trial_iscale, iscale)
    levels = _levels(iscale, values, None, nmax)
    sum_lx, sum_l2 = _ordered_sum(weights * values * levels), _ordered_sum(weights * levels * levels)
    levels, sum_lx, sum_l2 = _refine_levels(values, weights, levels, sum_lx, sum_l2, None, nmax, scale_codes=True)
    zero = peak < _GROUP_MAX_EPS
    d = torch.where(sum_l2 > 0, _div(sum_lx, sum_l2), 0.0)
    # Codes below 0 need negative scales, which the searches above never return.
    return torch.where(zero, 0.0, d), torch.where(zero[:, None], 0.0, levels).clamp(min=0)


def _qp_error(values, weights, scale, levels) -> torch.Tensor:
    diff = values - scale[:, None] * levels
    return _ordered_sum(weights * diff * diff)


# ---- super-block scale codes


def _max_scale_codes(values: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference quantizers' codes of non-negative scales [B, n]: round(top * v / max), d = max / top (fp16).
    ggml stores the rounding in a uint8 before its MIN(top, .): the remainder mod 256 keeps that."""
    peak = values.amax(1)
    peak = torch.where(peak > 0, peak, 0.0)  # ggml's running max starts at +0 and passes over -0
    inverse = torch.where(peak > 0, _div(float(top), peak), 0.0)
    codes = torch.remainder(torch.round(inverse[:, None] * values), 256).clamp(max=top)
    return codes, _div(peak, float(top)).half()


def _signed_max_scale_codes(values: torch.Tensor, top: int, high: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q3_K's and Q6_K's codes of signed scales [B, n]: the scale of largest magnitude maps to -top, d = 1 / (-top /
    it) (fp16), codes clamped to [-top, high]. Also returns that scale (0 for a zero block)."""
    peak = _first_absmax(values)
    iscale = _div(float(-top), peak)
    codes = _clamp(_levels(iscale, values, None, None), -top, high)
    return codes, _div(1.0, iscale).half(), peak


# ---- one search per type


def _search(weight: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor | None) -> tuple[KQParams, torch.Tensor]:
    """The grid and the codes of ggml's sub-block search (which it keeps where a step is 0)."""
    x, importance = _check(weight, qtype, importance)
    rows = x.shape[0]
    if qtype is Q.Q6_K:
        scales, d, mins, dmin, codes = _search_q6_k(x, importance)
    elif qtype is Q.Q3_K:
        scales, d, mins, dmin, codes = _search_q3_k(x, importance)
    else:
        scales, d, mins, dmin, codes = _search_with_mins(x, importance, qtype)
    shape = lambda t, n: None if t is None else t.reshape(rows, -1).to(n)  # noqa: E731
    qparams = KQParams(qtype, shape(scales, torch.int8), shape(d, torch.float16), shape(mins, torch.int8), shape(dmin, torch.float16))
    return qparams, shape(codes, torch.int8)


def _check(weight: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor | None):
    if qtype not in K_QTYPES:
        raise ValueError(f"{getattr(qtype, 'name', qtype)} is not a K-quant; k_grids quantizes {', '.join(q.name for q in K_QTYPES)}")
    if weight.ndim != 2 or weight.shape[1] % SUPER_BLOCK:
        raise ValueError(f"{qtype.name} quantizes [rows, cols] weights with cols a multiple of {SUPER_BLOCK}, got shape {list(weight.shape)}")
    x = weight.detach().float()
    if importance is None:
        return x, None
    if importance.shape != (weight.shape[1],):
        raise ValueError(f"importance must be one value per input column, shape [{weight.shape[1]}], got {list(importance.shape)}")
    return x, importance.detach().float().to(x.device)[None, :].expand_as(x)


def _variance_weights(x: torch.Tensor, importance: torch.Tensor, sub: int, factor: float) -> torch.Tensor:
    """The _impl quantizers' weight of each element, importance * sqrt(sigma2 + x^2) with sigma2 = factor * the
    super-block's mean square, as rows [B, sub]."""
    blocks = x.reshape(-1, SUPER_BLOCK)
    sigma2 = _div(factor * _ordered_sum(blocks * blocks), float(SUPER_BLOCK))
    weights = importance.reshape(-1, SUPER_BLOCK) * _sqrt(sigma2[:, None] + blocks * blocks)
    return weights.reshape(-1, sub)


_REF_FITS = {  # nmax, rmin, rdelta, nstep, use_mad, scale code top: quantize_row_qN_K_ref's make_qkx2_quants
    Q.Q2_K: (3, -0.5, 0.1, 15, True, 15),
    Q.Q4_K: (15, -1.0, 0.1, 20, False, 63),
    Q.Q5_K: (31, -0.5, 0.1, 15, False, 63),
}


def _search_with_mins(x: torch.Tensor, importance: torch.Tensor | None, qtype: GGMLQuantizationType):
    """Q2_K, Q4_K, Q5_K: a scale and a min per sub-block (make_qkx2_quants; make_qkx3_quants weighted by the
    importance), their codes by the largest (make_qp_quants given an importance)."""
    fmt = FORMATS[qtype]
    nmax, rmin, rdelta, nstep, use_mad, top = _REF_FITS[qtype]
    sub = x.reshape(-1, fmt.sub_block)
    per_super = SUPER_BLOCK // fmt.sub_block
    if importance is None:
        if qtype is Q.Q2_K:
            weights = sub.abs()
        else:
            mean_square = _div(_ordered_sum(sub * sub), float(fmt.sub_block))
            weights = _sqrt(mean_square)[:, None] + sub.abs()
        scales, mins, codes = _fit_scale_and_min(sub, weights, nmax, rmin, rdelta, nstep, use_mad)
        scale_codes, d = _max_scale_codes(scales.reshape(-1, per_super), top)
        min_codes, dmin = _max_scale_codes(mins.reshape(-1, per_super), top)
        return scale_codes, d, min_codes, dmin, codes
    weights = _variance_weights(x, importance, fmt.sub_block, 1.0 if qtype is Q.Q2_K else 2.0)
    scales, mins, codes = _fit_scale_and_min(sub, weights, nmax, -0.9, 0.05, 36, False)
    totals = _ordered_sum(weights).reshape(-1, per_super)
    d, scale_codes = _fit_scale_codes(scales.reshape(-1, per_super), top, totals)
    dmin, min_codes = _fit_scale_codes(mins.reshape(-1, per_super), top, totals)
    return scale_codes, d.half(), min_codes, dmin.half(), codes


def _search_q3_k(x: torch.Tensor, importance: torch.Tensor | None):
    """Q3_K: a signed scale per sub-block of 16 (make_q3_quants; make_qx_quants weighted by the importance), its
    6-bit code by the largest magnitude (make_qx_quants over the scales given an importance)."""
    sub = x.reshape(-1, 16)
    if importance is None:
        scales, codes = _fit_q3(sub)
        scale_codes, d, peak = _signed_max_scale_codes(scales.reshape(-1, 16), 32, 31)
        nonzero = (peak != 0)[:, None]
        return torch.where(nonzero, scale_codes, -32.0), torch.where(nonzero[:, 0], d, 0), None, None, codes
    weights = _variance_weights(x, importance, 16, 2.0)
    scales, codes = _fit_signed_scale(sub, 4, weights)
    d, scale_codes = _fit_signed_scale(scales.reshape(-1, 16), 32, _ordered_sum(weights).reshape(-1, 16))
    return scale_codes, d.half(), None, None, codes


def _search_q6_k(x: torch.Tensor, importance: torch.Tensor | None):
    """Q6_K: a signed scale per sub-block of 16 (make_qx_quants, weighted by the importance itself when given),
    8-bit codes by the largest magnitude; a block whose scales are all 0 is stored as zero bytes."""
    sub = x.reshape(-1, 16)
    scales, codes = _fit_signed_scale(sub, 32, None if importance is None else importance.reshape(-1, 16))
    scale_codes, d, peak = _signed_max_scale_codes(scales.reshape(-1, 16), 128, 127)
    zero = peak.abs() < _GROUP_MAX_EPS
    codes = torch.where(zero.repeat_interleave(16)[:, None], -32.0, codes)
    return torch.where(zero[:, None], 0.0, scale_codes), torch.where(zero, 0, d), None, None, codes
