"""Round-to-nearest on llama.cpp's K-quant grids (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), ported from ggml-quants.c.

A super-block of 256 weights of a row holds sub-blocks of 16 or 32, each with an integer scale code (and min
code) under the super-block's fp16 d (and dmin): weight = d * sc * q (- dmin * mn). `quantize_k` is llama.cpp's
own quantizer: `quantize_row_qN_K_ref`, or `quantize_row_qN_K_impl` given an importance per input column (an
imatrix). It is ported step by step in float32 and ggml's order of operations (sums left to right, rounding
half to even, fp16 by rounding to nearest), so its codes and bytes are llama.cpp's. Every step is vectorised
over the sub-blocks of a chunk of super-blocks (see `_chunk_super_blocks`), held as columns; the Python loops run
over the search grids and the 16 or 32 weights of a sub-block. On a CPU the reference searches (no importance) and
the rounding onto a fixed grid run instead as compiled loops of the same arithmetic (`cpu_kernels`, bit for bit),
which is what a CPU wants; these torch ops stay the reference, the device path and the importance-weighted search. Never divide by a Python number here: torch divides a tensor by a scalar as a multiplication by the
scalar's reciprocal on CUDA, and a scalar by a tensor so everywhere, which is not IEEE division.

GPTQ takes the two halves apart: `choose_k_qparams` on a super-block's columns fixes the grid (what llama.cpp
computes for them), then `round_k` rounds columns onto it as they are updated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from quantkit.grids.ggml_blocks import FORMATS, BlockFormat, pack, row_blocks
from quantkit.grids.family import GridFamily
from quantkit.grids.cpu_dispatch import compiled as _compiled, kernels as cpu_kernels, map_chunks as _map_chunks
from quantkit.grids.qparams import QuantizedWeight
from quantkit.grids.schemes import WeightSpec

Q = GGMLQuantizationType
K_QTYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
SUPER_BLOCK = 256
_GROUP_MAX_EPS = float(np.float32(1e-15))


K_PARTS = ("scales", "d", "mins", "dmin")  # a K grid's tensors, in KQParams' constructor order


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

    def dequantize(self, codes: torch.Tensor, first_column: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values of `codes` (the columns from `first_column` on), exactly as ggml decodes them (in float32),
        in `dtype`. A block of rows at a time (`row_blocks`): a 128k-token embedding holds no float32 copies."""
        out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
        sub = self.format.sub_block
        for rows in row_blocks(*codes.shape):
            grid, part = self.rows(rows), codes[rows]
            if first_column % sub or part.shape[1] % sub:
                step, offset = grid.column_scales(first_column, part.shape[1])
                values = step * part.float()
                out[rows] = values if offset is None else values - offset
                continue
            # whole sub-blocks: each one's step (and offset) broadcast over its weights, the same products
            subs = slice(first_column // sub, (first_column + part.shape[1]) // sub)
            step, offset = (None if t is None else t[:, subs, None] for t in grid.sub_block_scales())
            values = part.reshape(part.shape[0], -1, sub).float().mul_(step)
            out[rows] = (values if offset is None else values.sub_(offset)).reshape(part.shape)
        return out

    def rows(self, rows: slice) -> KQParams:
        """The grid of some rows."""
        return self.map(lambda t: t[rows])

    @property
    def code_range(self) -> tuple[int, int]:
        return self.format.code_range

    def parts(self) -> dict[str, torch.Tensor]:
        """Its tensors by name (a resume file's; `K_GRID.block_params` reads them back)."""
        return {name: t for name in K_PARTS if (t := getattr(self, name)) is not None}

    def round(self, weight: torch.Tensor, first_column: int = 0) -> torch.Tensor:
        """`round_k` on this grid."""
        return round_k(weight, self, first_column)

    def codes_on_grid(self, values: torch.Tensor, rtol: float, atol: float) -> torch.Tensor | None:
        """The codes of `values`, which hold this grid's values (in their dtype), rounded back onto it (`round`), or
        None if one of them decodes farther than atol + rtol * |value| from its value: it was not on the grid."""
        codes, on_grid = _round_k(values, self, 0, None, (rtol, atol))
        return codes if on_grid else None

    def pack(self, codes: torch.Tensor) -> np.ndarray:
        """GGML's blocks of `codes` on this grid: uint8 [rows, cols // 256 * type_bytes]."""
        return KQuantizedWeight(codes, self).ggml_blocks()

    def result(self, codes: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
        """The quantized weight of `codes` on this grid: each sub-block's step as the scale."""
        return QuantizedWeight(codes, self.sub_block_scales()[0], None, spec, k=self)

    def map(self, fn) -> KQParams:
        """The same grid with `fn` applied to each of its tensors (moved, cut into rows, reordered)."""
        return KQParams(self.qtype, *(None if t is None else fn(t) for t in (self.scales, self.d, self.mins, self.dmin)))


@dataclass
class KQuantizedWeight:
    """codes: int8 [rows, cols] (in [0, 2^bits - 1] for the types with mins, centred on 0 for Q3_K and Q6_K) on
    the grid `qparams`."""

    codes: torch.Tensor
    qparams: KQParams

    @property
    def qtype(self) -> GGMLQuantizationType:
        return self.qparams.qtype

    def dequantize(self) -> torch.Tensor:
        return self.qparams.dequantize(self.codes)

    def ggml_blocks(self) -> np.ndarray:
        """The GGUF tensor data: uint8 [rows, cols // 256 * type_bytes]."""
        k = self.qparams
        fields = {"scales": k.scales, "d": k.d, "mins": k.mins, "dmin": k.dmin}
        arrays = {name: v.cpu().numpy() for name, v in fields.items() if v is not None}
        return pack(k.qtype, self.codes.cpu().numpy(), **arrays)


def quantize_k(weight: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor | None = None) -> KQuantizedWeight:
    """llama.cpp's quantization of a [rows, cols] weight to `qtype` (cols a multiple of 256): its codes, scale
    codes and d exactly. `importance`: float [cols], the imatrix (llama-quantize --imatrix); None is ggml's
    reference quantizer (llama-quantize without one)."""
    qparams, codes = _search(weight, qtype, importance, final_codes=True)
    return KQuantizedWeight(codes, qparams)


def choose_k_qparams(weight: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor | None = None) -> KQParams:
    """The grid llama.cpp chooses for `weight` [rows, cols] (one or more whole super-blocks of columns): sub-block
    scales and mins searched, then quantized to their codes under fp16 d and dmin."""
    return _search(weight, qtype, importance, final_codes=False)[0]


def round_k(weight: torch.Tensor, qparams: KQParams, first_column: int = 0) -> torch.Tensor:
    """int8 codes of `weight`'s columns (the grid's columns from `first_column` on) rounded to nearest on the
    fixed grid `qparams`, as ggml's final pass does. Columns whose step is 0 get code 0 (any code decodes alike).
    A block of rows at a time (`row_blocks`)."""
    return _round_k(weight, qparams, first_column, None)[0]


def _round_k(weight: torch.Tensor, qparams: KQParams, first_column: int, fallback: torch.Tensor | None,
             tolerance: tuple[float, float] | None = None) -> tuple[torch.Tensor, bool]:
    """`round_k`, with `fallback`'s codes (int8, the weight's shape) where a step is 0 (None: 0), and whether every
    code decodes to its weight within `tolerance` (rtol, atol: atol + rtol * |weight|; True without one). On a CPU
    each block of rows is one compiled pass (`cpu_kernels.round_k`), the blocks in threads; elsewhere torch ops."""
    low, high = qparams.format.code_range
    codes = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    rtol, atol = tolerance if tolerance is not None else (-1.0, 0.0)

    def round_rows(rows: slice) -> bool:
        x, grid = weight[rows].float(), qparams.rows(rows)
        substitute = fallback[rows] if fallback is not None else torch.zeros(x.shape, dtype=torch.int8, device=x.device)
        if _compiled(x):
            parts = [_f32_array(t) for t in (grid.d, grid.scales)]
            parts += [_f32_array(t) for t in (grid.dmin, grid.mins)] if grid.mins is not None else [_no_columns(x.shape[0])] * 2
            off = cpu_kernels().round_k(x.numpy(), *parts, qparams.format.sub_block, first_column, np.float32(low),
                                        np.float32(high), substitute.contiguous().numpy(), np.float32(rtol),
                                        np.float32(atol), codes[rows].numpy())
            return off == 0
        step, offset = grid.column_scales(first_column, weight.shape[1])
        scaled = _div(x if offset is None else x + offset, step)
        codes[rows] = torch.where(step == 0, substitute, _clamp(torch.round(scaled), low, high).to(torch.int8))
        if tolerance is None:
            return True
        decoded = grid.dequantize(codes[rows], first_column, dtype=weight.dtype)
        return torch.allclose(decoded.float(), x, rtol=rtol, atol=atol)

    return codes, all(_map_chunks(round_rows, row_blocks(*weight.shape), weight.device))


def _f32_array(t: torch.Tensor) -> np.ndarray:
    return t.float().contiguous().numpy()


def _no_columns(rows: int) -> np.ndarray:
    return np.empty((rows, 0), np.float32)



@dataclass
class KColumns:
    """A llama.cpp K-quant grid (`k_grids`) in the GPTQ loop: each super-block's sub-block scales and mins are chosen
    by llama.cpp's search on the columns as GPTQ has updated them when it reaches the super-block's first column
    (with actorder: all up front, on the original weights), then every column is rounded onto that fixed grid as
    `k_grids.round_k` rounds (its arithmetic inlined on each column's step and offset, kept as contiguous columns:
    a call per column costs more than the rounding), so what GPTQ minimises is what llama.cpp decodes."""

    spec: WeightSpec
    k: KQParams  # the whole weight's, super-blocks overwritten as they are chosen
    dynamic: bool
    steps: torch.Tensor  # float32 [in, out]: each column's step d * sc (and offset dmin * mn), as contiguous rows
    offsets: torch.Tensor | None
    importance: torch.Tensor | None = None  # float32 [in]: H's diagonal, which weights llama.cpp's search (its imatrix)
    code_dtype = torch.int8
    graphs = False

    @classmethod
    def up_front(cls, weight: torch.Tensor, spec: WeightSpec, dynamic: bool,
                 importance: torch.Tensor | None = None) -> KColumns:
        """The grid chosen on the whole weight now, or (dynamic) its buffers, each super-block chosen in the loop.
        `importance` (H's diagonal: each input's mean squared activation, what llama-imatrix measures) weights the
        search as llama-quantize --imatrix does (`k_grids`' _impl path)."""
        qtype = GGMLQuantizationType[spec.k_quant_type]
        rows, cols, fmt = weight.shape[0], weight.shape[1], FORMATS[qtype]
        if dynamic:
            codes = lambda: torch.zeros(rows, cols // fmt.sub_block, dtype=torch.int8, device=weight.device)  # noqa: E731
            supers = lambda: torch.zeros(rows, cols // SUPER_BLOCK, dtype=torch.float16, device=weight.device)  # noqa: E731
            k = KQParams(qtype, codes(), supers(), codes() if fmt.has_mins else None, supers() if fmt.has_mins else None)
        else:
            k = choose_k_qparams(weight.float(), qtype, importance)
        steps = torch.zeros(cols, rows, dtype=torch.float32, device=weight.device)
        grid = cls(spec, k, dynamic, steps, torch.zeros_like(steps) if fmt.has_mins else None, importance)
        if not dynamic:
            grid._columns(0, cols)
        return grid

    @property
    def choose_every(self) -> int | None:
        return SUPER_BLOCK if self.dynamic else None

    def group_of(self, column: int) -> int:
        return column  # rounding needs the column's own sub-block

    def choose(self, first: int, columns: torch.Tensor) -> None:
        importance = None if self.importance is None else self.importance[first:first + columns.shape[1]]
        part = choose_k_qparams(columns.float(), self.k.qtype, importance)
        per_super = SUPER_BLOCK // self.k.format.sub_block
        block, sub = first // SUPER_BLOCK, first // self.k.format.sub_block
        for name in ("scales", "mins"):
            if getattr(self.k, name) is not None:
                getattr(self.k, name)[:, sub:sub + per_super] = getattr(part, name)
        for name in ("d", "dmin"):
            if getattr(self.k, name) is not None:
                getattr(self.k, name)[:, block:block + 1] = getattr(part, name)
        self._columns(first, columns.shape[1])

    def _columns(self, first: int, count: int) -> None:
        step, offset = self.k.column_scales(first, count)
        self.steps[first:first + count] = step.T
        if offset is not None:
            self.offsets[first:first + count] = offset.T

    def result(self, qdata: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight(qdata=qdata, scale=self.k.sub_block_scales()[0], zero_point=None, spec=self.spec, k=self.k)

    def round(self, column: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.steps[group]
        offset = self.offsets[group] if self.offsets is not None else None
        scaled = torch.div(column if offset is None else column + offset, step)
        q = torch.round(scaled).clamp_(*self.k.format.code_range)
        q = torch.where(step == 0, 0.0, q)
        value = step * q
        return q, value if offset is None else value - offset


class KGrid(GridFamily):
    """llama.cpp's K-quants (Q2_K .. Q6_K): integer scale (and min) codes per sub-block under fp16 super-block scales,
    chosen by llama.cpp's own search (`quantize_k`)."""

    name = "k-quant"

    def fake_quant(self, spec: WeightSpec) -> str:
        return "block_grid"

    def owns(self, spec: WeightSpec) -> bool:
        return spec.k_quant_type is not None

    def qtype(self, spec: WeightSpec) -> GGMLQuantizationType:
        return GGMLQuantizationType[spec.k_quant_type]

    def quantize(self, weight, spec, global_scale=None, importance=None) -> QuantizedWeight:
        """llama.cpp's own quantizer (the weight's columns must be whole super-blocks of 256)."""
        found = quantize_k(weight, self.qtype(spec), importance)
        return found.qparams.result(found.codes, spec)

    def empty(self, weight, spec) -> QuantizedWeight:
        """int8 codes, each sub-block's float32 step, and the grid's int8 scale (and min) codes under fp16
        super-block scales."""
        rows, cols = weight.shape
        empty = lambda n, dtype: torch.empty(rows, n, dtype=dtype, device=weight.device)  # noqa: E731
        sub, supers = cols // spec.group_size, cols // SUPER_BLOCK
        grid = KQParams(self.qtype(spec), empty(sub, torch.int8), empty(supers, torch.float16),
                        *((empty(sub, torch.int8), empty(supers, torch.float16)) if spec.is_asymmetric else (None, None)))
        return QuantizedWeight(empty(cols, torch.int8), empty(sub, torch.float32), None, spec, k=grid)

    def columns(self, weight, dtype, spec, actorder=False, static_groups=False, global_scale=None,
                importance=None) -> KColumns:
        """Each super-block chosen as the loop reaches it, unless actorder (static groups do not apply: a block's
        search needs its columns as updated)."""
        return KColumns.up_front(weight, spec, dynamic=not actorder, importance=importance)

    def searched(self, weight, spec) -> KQParams:
        """The grid llama.cpp's search chooses for `weight`, as round to nearest does."""
        return choose_k_qparams(weight, self.qtype(spec))

    def block_params(self, spec, parts) -> KQParams:
        return KQParams(self.qtype(spec), *(parts.get(name) for name in K_PARTS))


K_GRID = KGrid()


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


def _levels(iscale: torch.Tensor, x: torch.Tensor, low: float | None, high: float | None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """ggml's nearest_int(iscale * x) (round half to even), clamped; iscale broadcasts against x."""
    levels = torch.mul(x, iscale, out=out).round_()
    return levels if low is None and high is None else levels.clamp_(min=low, max=high)


def _columns(values: torch.Tensor, n: int) -> torch.Tensor:
    """[n, B], contiguous: element i of each of the B runs of n consecutive values (sub-blocks, or one super-block's
    scales). The searches hold their groups as columns, so that ggml's loops over a group step through rows."""
    return values.reshape(-1, n).t().contiguous()


def _ordered_sum(terms: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 from first to last, as ggml's loops add (torch.sum's order differs)."""
    total = terms[0].clone()
    for term in terms[1:]:
        total += term
    return total


def _first_absmax(x: torch.Tensor) -> torch.Tensor:
    """Each column's value of largest magnitude, the first of ties (ggml's `if (ax > amax)` scan)."""
    peak, largest = x[0], x[0].abs()
    for xi in x[1:]:
        magnitude = xi.abs()
        larger = magnitude > largest
        peak, largest = torch.where(larger, xi, peak), torch.where(larger, magnitude, largest)
    return peak


# ---- ggml's sub-block searches, on columns x [n, B] (element i of B sub-blocks in row i)


class _MinFit:
    """The inner loops of make_qkx2_quants / make_qkx3_quants on columns x, weights [n, B], writing into buffers
    that the trial grids reuse."""

    def __init__(self, x: torch.Tensor, weights: torch.Tensor, nmax: int, use_mad: bool):
        self.x, self.weights, self.nmax, self.use_mad = x, weights, nmax, use_mad
        self.trial, self.diff = torch.empty_like(x), torch.empty_like(x)
        self.products = x.new_empty(x.shape[0], 3, x.shape[1])

    def levels(self, iscale: torch.Tensor, shift: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """L = clamp(round(iscale * (x - shift)), 0, nmax), in the trial buffer unless `out` is given."""
        shifted = torch.sub(self.x, shift, out=self.trial if out is None else out)
        return _levels(iscale, shifted, 0, self.nmax, out=shifted)

    def sums(self, levels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The ordered sums of w * L, w * L * L and w * L * x."""
        wl, wl2, wlx = self.products.unbind(1)
        torch.mul(self.weights, levels, out=wl)
        torch.mul(wl, levels, out=wl2)
        torch.mul(wl, self.x, out=wlx)
        return _ordered_sum(self.products).unbind(0)

    def error(self, scale: torch.Tensor, offset: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """The ordered sum of w * |scale * L + offset - x| (use_mad), else of w * (scale * L + offset - x)^2."""
        diff = torch.mul(levels, scale, out=self.diff).add_(offset).sub_(self.x)
        diff = diff.abs_() if self.use_mad else diff.mul_(diff)
        return _ordered_sum(diff.mul_(self.weights))


def _fit_scale_and_min(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                       use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants / make_qkx3_quants on each column of x [n, B]: x ~ scale * L - min, L in [0, nmax], by
    weighted least squares on the rounding of nstep + 1 trial grids. Returns scale, min (>= 0) and L, float32."""
    low, high = x.amin(0), x.amax(0)
    low = torch.where(low > 0, 0.0, low)
    sum_w, sum_x = _ordered_sum(weights), _ordered_sum(weights * x)
    fit = _MinFit(x, weights, nmax, use_mad)
    iscale = _div(float(nmax), high - low)
    scale, offset = _div(1.0, iscale), low
    best = fit.error(scale, offset, fit.levels(iscale, offset))
    best_grid = iscale, offset  # the best L is kept as what rounds it, and rounded again at the end
    for step in range(nstep + 1):
        # ggml's trial grids start from the best min so far, not from the data's
        numerator = _f32(np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax))
        trial_iscale = _div(numerator, high - offset)
        trial = fit.levels(trial_iscale, offset)
        this_scale, this_min, det = _least_squares(*fit.sums(trial), sum_w, sum_x)
        error = fit.error(this_scale, this_min, trial)
        better = (det > 0) & (error < best)
        best_grid = tuple(torch.where(better, new, old) for new, old in zip((trial_iscale, offset), best_grid))
        best, scale = torch.where(better, error, best), torch.where(better, this_scale, scale)
        offset = torch.where(better, this_min, offset)
    flat = high == low
    offset = torch.where(flat, low, offset)
    levels = fit.levels(*best_grid, out=torch.empty_like(x))
    return torch.where(flat, 0.0, scale), -offset, levels.masked_fill_(flat, 0.0)


def _least_squares(sum_l, sum_l2, sum_xl, sum_w, sum_x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants' scale and min (clipped to <= 0) for one trial grid, and the determinant."""
    det = sum_w * sum_l2 - sum_l * sum_l
    this_scale = _div(sum_w * sum_xl - sum_x * sum_l, det)
    this_min = _div(sum_l2 * sum_x - sum_l * sum_xl, det)
    clipped = this_min > 0
    this_min = torch.where(clipped, 0.0, this_min)
    this_scale = torch.where(clipped, _div(sum_xl, sum_l2), this_scale)
    return this_scale, this_min, det


def _trial_sums(iscales: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """The ordered sums of w * x * l and w * l * l [2, T, B] for all of a search's independent trial grids at once,
    l = the levels of x [n, B] under iscales [T, B]. The loop runs over a sub-block's n weights, so that each call
    works on [T, B] and the T grids' levels are never all held."""
    sums, trial, terms = None, torch.empty_like(iscales), iscales.new_empty(2, *iscales.shape)
    for xi, wi, wxi in zip(x, weights, weights * x):
        _levels(iscales, xi, low, high, out=trial)
        torch.mul(trial, wxi, out=terms[0])
        torch.mul(trial, wi, out=terms[1]).mul_(trial)
        sums = terms.clone() if sums is None else sums.add_(terms)
    return sums


def _fit_signed_scale(x: torch.Tensor, nmax: int, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants (rmse_type 1) on each column of x [n, B]: x ~ scale * l, l in [-nmax, nmax - 1], the scale of
    least weighted error (weights x^2 by default) over 19 trial grids around -nmax / the signed absmax. Returns
    scale and l, float32; an all-zero column gets scale 0 and l = -nmax."""
    peak = _first_absmax(x)
    weights = x * x if weights is None else weights
    numerators = [float(-nmax)] + [-_f32(np.float32(nmax) + np.float32(0.1) * np.float32(s)) for s in range(-9, 10) if s]
    iscales = _div(torch.tensor(numerators, device=x.device)[:, None], peak)
    sum_lx, sum_l2 = _trial_sums(iscales, x, weights, -nmax, nmax - 1)
    scale = torch.where(sum_l2[0] != 0, _div(sum_lx[0], sum_l2[0]), 0.0)
    best, iscale = scale * sum_lx[0], iscales[0]
    for k in range(1, len(numerators)):
        take = (sum_l2[k] > 0) & (sum_lx[k] * sum_lx[k] > best * sum_l2[k])
        scale = torch.where(take, _div(sum_lx[k], sum_l2[k]), scale)
        best, iscale = torch.where(take, scale * sum_lx[k], best), torch.where(take, iscales[k], iscale)
    levels = _levels(iscale, x, -nmax, nmax - 1)
    zero = peak.abs() < _GROUP_MAX_EPS
    return torch.where(zero, 0.0, scale), levels.masked_fill_(zero, float(-nmax))


def _fit_q3(x: torch.Tensor, nmax: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants (do_rmse): the absmax grid, then up to five passes that move single levels while the
    x^2-weighted fit improves. Returns scale and l in [-nmax, nmax - 1]; an all-zero column: 0 and -nmax."""
    peak = _first_absmax(x)
    weights = x * x
    levels = _levels(_div(float(-nmax), peak), x, -nmax, nmax - 1)
    levels, sum_lx, sum_l2 = _refine_levels(x, weights, levels, -nmax, nmax - 1, scale_codes=False)
    zero = peak.abs() < _GROUP_MAX_EPS
    scale = torch.where(sum_l2 > 0, _div(sum_lx, sum_l2), 0.0)
    return torch.where(zero, 0.0, scale), levels.masked_fill_(zero, float(-nmax))


def _refine_levels(x, weights, levels, low, high, scale_codes: bool, passes: int = 5):
    """The coordinate passes of make_q3_quants and (`scale_codes`) make_qp_quants, from the sums of w x l and w l^2:
    each level in turn moves to the rounding of x under the scale fitted without it, kept if the fit
    sum_lx^2 / sum_l2 grows. A pass that changes nothing leaves the next alike (ggml stops there)."""
    wx = weights * x
    sum_lx, sum_l2 = _ordered_sum(wx * levels), _ordered_sum(weights * levels * levels)
    for _ in range(passes):
        moved = torch.zeros_like(sum_lx, dtype=torch.bool)
        for xi, wi, wxi, li in zip(x, weights, wx, levels):
            slx, sl2 = sum_lx - wxi * li, sum_l2 - wi * li * li
            new = torch.round(_div(xi * sl2, slx)).clamp_(min=low, max=high)
            new_lx, new_l2 = slx + wxi * new, sl2 + wi * new * new
            positive = sl2 > 0 if scale_codes else new_l2 > 0  # make_qp_quants asks before the move, make_q3_quants after
            accept = (slx > 0) & positive & (new != li) & (new_lx * new_lx * sum_l2 > sum_lx * sum_lx * new_l2)
            li.copy_(torch.where(accept, new, li))
            sum_lx, sum_l2 = torch.where(accept, new_lx, sum_lx), torch.where(accept, new_l2, sum_l2)
            moved |= accept
        if not moved.any():
            break
    return levels, sum_lx, sum_l2


def _fit_scale_codes(values: torch.Tensor, nmax: int, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qp_quants on columns [n, B] of non-negative sub-block scales (or mins): one float scale d and codes in
    [0, nmax] with values ~ d * code, weighted by the sub-blocks' total importance. Returns d and the codes."""
    peak = values.amax(0).clamp(min=0)
    numerators = [float(nmax)] + [_f32(np.float32(0.1) * np.float32(s) + np.float32(nmax)) for s in range(-4, 5) if s]
    iscales = _div(torch.tensor(numerators, device=values.device)[:, None], peak)
    trials = _levels(iscales, values[:, None], None, None)
    trials[:, 1:].clamp_(max=nmax)  # ggml clamps the trial grids' levels, not its first grid's
    diff = values[:, None] - _div(1.0, iscales) * trials
    errors = _ordered_sum(weights[:, None] * diff * diff)
    best, iscale = errors[0], iscales[0]
    for error, trial_iscale in zip(errors[1:], iscales[1:]):
        better = error < best
        best, iscale = torch.where(better, error, best), torch.where(better, trial_iscale, iscale)
    levels = _levels(iscale, values, None, nmax)
    levels, sum_lx, sum_l2 = _refine_levels(values, weights, levels, None, nmax, scale_codes=True)
    zero = peak < _GROUP_MAX_EPS
    d = torch.where(sum_l2 > 0, _div(sum_lx, sum_l2), 0.0)
    # Codes below 0 need negative scales, which the searches above never return.
    return torch.where(zero, 0.0, d), levels.masked_fill_(zero, 0.0).clamp_(min=0)


# ---- super-block scale codes, on rows [B, n] of one super-block's sub-block scales


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
    peak = values.gather(1, values.abs().argmax(1, keepdim=True))[:, 0]
    iscale = _div(float(-top), peak)
    codes = _levels(iscale[:, None], values, -top, high)
    return codes, _div(1.0, iscale).half(), peak


# ---- one search per type, on a chunk of super-blocks [S, 256]

# Super-blocks per chunk. The searches run ggml's per-weight loops as a few dozen passes over all of their
# sub-blocks per trial grid; over a whole weight those passes stream hundreds of MiB through memory each. A chunk's
# working set (~1 MiB per float32 copy of the weights) stays in cache, and is still large enough that each torch
# call amortises its overhead. Super-blocks are independent, so chunking changes no result. On a GPU a kernel
# launch, not the cache, is the cost: chunks of 64 Ki super-blocks (16 M weights, every Linear of an 8B layer in a
# few chunks, each float32 copy 64 MiB) cut the launches 64-fold.
_CHUNK_SUPER_BLOCKS = 1024
_DEVICE_CHUNK_SUPER_BLOCKS = 65536


def _chunk_super_blocks(device: torch.device) -> int:
    return _CHUNK_SUPER_BLOCKS if device.type == "cpu" else _DEVICE_CHUNK_SUPER_BLOCKS


def _search(weight: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor | None,
            final_codes: bool) -> tuple[KQParams, torch.Tensor | None]:
    """ggml's grid for `weight`, and (`final_codes`) its codes, a chunk of super-blocks at a time."""
    x, importance = _check(weight, qtype, importance)
    rows = x.shape[0]
    search = {Q.Q6_K: _search_q6_k, Q.Q3_K: _search_q3_k}.get(qtype, _search_with_mins)
    blocks = x.reshape(-1, SUPER_BLOCK)
    dtypes = (torch.int8, torch.float16, torch.int8, torch.float16, torch.int8)

    def search_chunk(first: int) -> tuple[KQParams, torch.Tensor | None]:
        chunk = blocks[first:first + size].float()
        found = _compiled_search(chunk, importance, qtype)
        if found is None:
            found = search(chunk, _chunk_importance(importance, first, chunk.shape[0]), qtype)
        *grid, codes = (None if t is None else t.to(dtype).reshape(chunk.shape[0], -1) for t, dtype in zip(found, dtypes))
        grid = KQParams(qtype, *grid)
        return grid, _final_codes(chunk, grid, codes) if final_codes else None

    size = _chunk_super_blocks(x.device)
    grids, codes = zip(*_map_chunks(search_chunk, range(0, blocks.shape[0], size), x.device))
    joined = lambda parts: None if parts[0] is None else torch.cat(parts).reshape(rows, -1)  # noqa: E731
    fields = (joined([getattr(grid, name) for grid in grids]) for name in ("scales", "d", "mins", "dmin"))
    return KQParams(qtype, *fields), joined(codes)


def _final_codes(blocks: torch.Tensor, grid: KQParams, search_codes: torch.Tensor) -> torch.Tensor:
    """ggml's last pass over super-blocks [S, 256]: the codes rounded on their grid, except where a sub-block's step
    is 0 (every code decodes alike there), where llama.cpp leaves its search's."""
    return _round_k(blocks, grid, 0, search_codes)[0]


def _check(weight: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor | None):
    if qtype not in K_QTYPES:
        raise ValueError(f"{getattr(qtype, 'name', qtype)} is not a K-quant; k_grids quantizes {', '.join(q.name for q in K_QTYPES)}")
    if weight.ndim != 2 or weight.shape[1] % SUPER_BLOCK:
        raise ValueError(f"{qtype.name} quantizes [rows, cols] weights with cols a multiple of {SUPER_BLOCK}, got shape {list(weight.shape)}")
    x = weight.detach()  # in its dtype: the search takes a chunk of super-blocks to float32 at a time
    if importance is None:
        return x, None
    if importance.shape != (weight.shape[1],):
        raise ValueError(f"importance must be one value per input column, shape [{weight.shape[1]}], got {list(importance.shape)}")
    return x, importance.detach().float().to(x.device)


def _chunk_importance(importance: torch.Tensor | None, first: int, count: int) -> torch.Tensor | None:
    """[count, 256]: the importance of super-blocks first .. first + count - 1 of the row-major weight."""
    if importance is None:
        return None
    per_row = importance.reshape(-1, SUPER_BLOCK)
    return per_row[torch.arange(first, first + count, device=importance.device) % per_row.shape[0]]


def _variance_weights(blocks: torch.Tensor, importance: torch.Tensor, sub: int, factor: float) -> torch.Tensor:
    """The _impl quantizers' weight of each element of super-blocks [S, 256], importance * sqrt(sigma2 + x^2) with
    sigma2 = factor * the super-block's mean square, as columns [sub, S * 256 / sub]."""
    columns = _columns(blocks, SUPER_BLOCK)
    sigma2 = _div(factor * _ordered_sum(columns * columns), float(SUPER_BLOCK))
    return _columns(importance * _sqrt(sigma2[:, None] + blocks * blocks), sub)


_REF_FITS = {  # nmax, rmin, rdelta, nstep, use_mad, scale code top: quantize_row_qN_K_ref's make_qkx2_quants
    Q.Q2_K: (3, -0.5, 0.1, 15, True, 15),
    Q.Q4_K: (15, -1.0, 0.1, 20, False, 63),
    Q.Q5_K: (31, -0.5, 0.1, 15, False, 63),
}


def _search_with_mins(blocks: torch.Tensor, importance: torch.Tensor | None, qtype: GGMLQuantizationType):
    """Q2_K, Q4_K, Q5_K: a scale and a min per sub-block (make_qkx2_quants; make_qkx3_quants weighted by the
    importance), their codes by the largest (make_qp_quants given an importance)."""
    sub = FORMATS[qtype].sub_block
    nmax, rmin, rdelta, nstep, use_mad, top = _REF_FITS[qtype]
    per_super = SUPER_BLOCK // sub
    x = _columns(blocks, sub)
    if importance is None:
        weights = x.abs() if qtype is Q.Q2_K else _sqrt(_div(_ordered_sum(x * x), float(sub))) + x.abs()
        scales, mins, codes = _fit_scale_and_min(x, weights, nmax, rmin, rdelta, nstep, use_mad)
        scale_codes, d = _max_scale_codes(scales.reshape(-1, per_super), top)
        min_codes, dmin = _max_scale_codes(mins.reshape(-1, per_super), top)
        return scale_codes, d, min_codes, dmin, codes.t()
    weights = _variance_weights(blocks, importance, sub, 1.0 if qtype is Q.Q2_K else 2.0)
    scales, mins, codes = _fit_scale_and_min(x, weights, nmax, -0.9, 0.05, 36, False)
    totals = _columns(_ordered_sum(weights), per_super)
    d, scale_codes = _fit_scale_codes(_columns(scales, per_super), top, totals)
    dmin, min_codes = _fit_scale_codes(_columns(mins, per_super), top, totals)
    return scale_codes.t(), d, min_codes.t(), dmin, codes.t()


def _search_q3_k(blocks: torch.Tensor, importance: torch.Tensor | None, qtype: GGMLQuantizationType = Q.Q3_K):
    """Q3_K: a signed scale per sub-block of 16 (make_q3_quants; make_qx_quants weighted by the importance), its
    6-bit code by the largest magnitude (make_qx_quants over the scales given an importance)."""
    x = _columns(blocks, 16)
    if importance is None:
        scales, codes = _fit_q3(x)
        scale_codes, d, peak = _signed_max_scale_codes(scales.reshape(-1, 16), 32, 31)
        nonzero = (peak != 0)[:, None]
        return torch.where(nonzero, scale_codes, -32.0), torch.where(nonzero[:, 0], d, 0), None, None, codes.t()
    weights = _variance_weights(blocks, importance, 16, 2.0)
    scales, codes = _fit_signed_scale(x, 4, weights)
    d, scale_codes = _fit_signed_scale(_columns(scales, 16), 32, _columns(_ordered_sum(weights), 16))
    return scale_codes.t(), d, None, None, codes.t()


def _compiled_search(blocks: torch.Tensor, importance: torch.Tensor | None, qtype: GGMLQuantizationType):
    """The reference search (no importance) of Q2_K, Q4_K, Q5_K or Q6_K on super-blocks [S, 256] as one compiled
    loop (`cpu_kernels`), returning what `_search_with_mins` / `_search_q6_k` return, bit for bit; None where it
    does not apply (an importance, Q3_K, a device, a non-finite weight)."""
    if importance is not None or qtype not in (Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K) or not _compiled(blocks):
        return None
    x, count = np.ascontiguousarray(blocks.numpy()), blocks.shape[0]
    codes, d = np.empty((count, SUPER_BLOCK), np.int8), np.empty(count, np.float32)
    if qtype is Q.Q6_K:
        scale_codes = np.empty((count, 16), np.float32)
        cpu_kernels().search_q6_k(x, _Q6_NUMERATORS, np.float32(_GROUP_MAX_EPS), scale_codes, d, codes)
        return torch.from_numpy(scale_codes), torch.from_numpy(d).half(), None, None, torch.from_numpy(codes)
    sub = FORMATS[qtype].sub_block
    nmax, rmin, rdelta, nstep, use_mad, top = _REF_FITS[qtype]
    numerators = np.array([_f32(np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax))
                           for step in range(nstep + 1)], np.float32)  # as _fit_scale_and_min computes them
    scale_codes, min_codes = np.empty((count, SUPER_BLOCK // sub), np.float32), np.empty((count, SUPER_BLOCK // sub), np.float32)
    dmin = np.empty(count, np.float32)
    cpu_kernels().search_with_mins(x, sub, nmax, numerators, use_mad, qtype is Q.Q2_K, top, np.float32(_GROUP_MAX_EPS),
                                   scale_codes, d, min_codes, dmin, codes)
    return (torch.from_numpy(scale_codes), torch.from_numpy(d).half(), torch.from_numpy(min_codes),
            torch.from_numpy(dmin).half(), torch.from_numpy(codes))


# make_qx_quants' trial grids for Q6_K (nmax 32), as _fit_signed_scale computes them
_Q6_NUMERATORS = np.array([-32.0] + [-_f32(np.float32(32) + np.float32(0.1) * np.float32(s)) for s in range(-9, 10) if s],
                          np.float32)


def _search_q6_k(blocks: torch.Tensor, importance: torch.Tensor | None, qtype: GGMLQuantizationType = Q.Q6_K):
    """Q6_K: a signed scale per sub-block of 16 (make_qx_quants, weighted by the importance itself when given),
    8-bit codes by the largest magnitude; a block whose scales are all 0 is stored as zero bytes."""
    scales, codes = _fit_signed_scale(_columns(blocks, 16), 32, None if importance is None else _columns(importance, 16))
    scale_codes, d, peak = _signed_max_scale_codes(scales.reshape(-1, 16), 128, 127)
    zero = peak.abs() < _GROUP_MAX_EPS
    codes = torch.where(zero.repeat_interleave(16)[:, None], -32.0, codes.t())
    return torch.where(zero[:, None], 0.0, scale_codes), torch.where(zero, 0, d), None, None, codes
