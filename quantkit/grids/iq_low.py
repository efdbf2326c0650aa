"""llama.cpp's codebook i-quants below 4 bits (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) as one grid
family: the grid of a weight (`CodebookParams`), quantkit's quantizer onto it, and GPTQ's rounding onto it. The
types' tables and bytes are `iq_codebooks`.

The quantizer (`quantize_codebook`) is llama.cpp's search made exact where llama.cpp approximates, not a port of
its bytes. As in quantize_row_iq2_xxs_impl and its siblings, each weight counts by its importance qw (an imatrix:
H's diagonal) times sqrt(sigma2 + x^2), sigma2 the super-block's mean square (times 2 but for IQ2_XXS / IQ2_XS).
Without one (a token embedding, which no matrix product calibrates, or round to nearest without data) every weight
counts alike, where llama.cpp weights by x^2: once the search is exact, x^2 buys the largest weights' error with the
small ones' (on the trained benchmark Llama, IQ3_S's token embedding had 32% less x^2-weighted error than ggml's and
twice its plain error, and +33% KL divergence from F16 in llama.cpp; unweighted, -23%); IQ2 / IQ3 round the magnitudes and keep each weight's sign, and where a type stores 7 signs per
8 weights and 8 has an odd count of negatives, the weight of least w x^2 is flipped first. Where llama.cpp rounds
each weight to a level and searches a few grid points near that, quantkit takes the nearest grid point of the
whole grid under the weights (one matrix product per trial: sum w (s g - x)^2 = s^2 sum w g^2 - 2 s sum w g x +
const); IQ1's shift is chosen with the points (per 8 for IQ1_M, for all 32 at once for IQ1_S). Each sub-block's
scale is searched over 13 trial steps around its largest magnitude and refitted by least squares; then, where
llama.cpp sets d = largest scale / top sub-scale and rounds each sub-block's scale to the nearest code without
rounding again, quantkit tries seven d around that and, for each, the two sub-scale codes around each
sub-block's scale, each rounded anew to the nearest points at its exact fp16 step, and keeps what has the least
weighted error per super-block (`tests/unit/grids/test_iq_low.py` checks it against the plain rule). On grids of
more than 512 points (IQ2_S, IQ1 with its two shifts) the trials search a shortlist, each vector's nearest points
at 5 steps across the trials' range, and the final rounding the whole grid: 3-7x faster, the error within 0.2%.

GPTQ (`CodebookColumns`): the grid's d and sub-scales (and IQ1_S's shifts) are chosen up front by the search
above on the weight and H's diagonal; the loop then rounds each 8 columns jointly, when it reaches the first of
them, to the nearest grid points (the signs and IQ1_M's shift with them) of the 8 columns as GPTQ has updated
them, each weighted by H's diagonal, and pushes each column's error on as it passes it (GPTVQ's order). On the
tests' correlated inputs its H-weighted error is below round to nearest's with the same importance. actorder is
refused: its columns come out of order, and a grid point spans 8 of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from quantkit.grids.family import GridFamily
from quantkit.grids.ggml_blocks import row_blocks
from quantkit.grids.iq_codebooks import FORMATS, IQ1_DELTA, QTYPES, SUPER_BLOCK, UNIT, CodebookFormat, grid, grid_levels, levels, pack
from quantkit.grids.qparams import QuantizedWeight
from quantkit.grids.schemes import SchemeError, WeightSpec

Q = GGMLQuantizationType
NAMES = tuple(q.name for q in QTYPES)
PARTS = ("scales", "d", "shifts")  # a codebook grid's tensors, in CodebookParams' constructor order
SCALE_TRIALS = tuple(0.7 + 0.05 * i for i in range(13))  # a sub-block's trial steps: its largest magnitude times these, over the top level
D_TRIALS = (0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1)  # d: the largest sub-block scale over the top sub-scale times these
SHORTLIST_ABOVE = 512  # grid points (times IQ1's two shifts) above which the trials search a shortlist
SHORTLIST_AT = (0.6, 0.8, 1.0, 1.2, 1.4)  # a large grid's shortlist: the nearest points at these steps (times the typical)
_CHUNK = 1 << 21  # elements of a chunk's [vectors, shifts, grid points] scores


@dataclass
class CodebookParams:
    """A codebook grid without its codes. scales: int8 [rows, cols // scale_block], the sub-scale codes ls. d:
    float16 [rows, cols // 256]. shifts: IQ1's int8 [rows, cols // shift_block], 1 where the shift is -1/8; None
    for IQ2 / IQ3. The constructor's first two mirror `KQParams`; there are no mins."""

    qtype: GGMLQuantizationType
    scales: torch.Tensor
    d: torch.Tensor
    shifts: torch.Tensor | None = None

    mins = None
    dmin = None

    @classmethod
    def from_parts(cls, qtype: GGMLQuantizationType, parts: dict[str, torch.Tensor]) -> CodebookParams:
        return cls(qtype, parts["scales"], parts["d"], parts.get("shifts"))

    @property
    def format(self) -> CodebookFormat:
        return FORMATS[self.qtype]

    @property
    def code_range(self) -> tuple[int, int]:
        return self.format.code_range

    def parts(self) -> dict[str, torch.Tensor]:
        return {name: t for name in PARTS if (t := getattr(self, name)) is not None}

    def sub_block_scales(self) -> torch.Tensor:
        """float32 [rows, cols // scale_block]: each sub-block's step as ggml decodes it."""
        per = SUPER_BLOCK // self.format.scale_block
        return decode_steps(self.d.float().repeat_interleave(per, dim=1), self.scales, self.format)

    def column_scales(self, first_column: int, count: int) -> tuple[torch.Tensor, None]:
        return _per_column(self.sub_block_scales(), self.format.scale_block, first_column, count), None

    def column_shifts(self, first_column: int, count: int) -> torch.Tensor | None:
        """float32 [rows, count]: IQ1's shift of each column (+-1/8), or None."""
        if self.shifts is None:
            return None
        shift = torch.where(self.shifts != 0, -IQ1_DELTA, IQ1_DELTA).float()
        return _per_column(shift, self.format.shift_block, first_column, count)

    def dequantize(self, codes: torch.Tensor, first_column: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values of `codes` (the columns from `first_column` on), as ggml decodes them (float32), in `dtype`."""
        out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
        for rows in row_blocks(*codes.shape):
            grid_ = self.rows(rows)
            step, _ = grid_.column_scales(first_column, codes.shape[1])
            out[rows] = decode(codes[rows], step, grid_.column_shifts(first_column, codes.shape[1]), self.format)
        return out

    def round(self, values: torch.Tensor, first_column: int = 0) -> torch.Tensor:
        """The codes of values that lie on this grid (a quantized weight, in its dtype): each weight's nearest level
        and its sign; a sub-block whose step is 0 gets grid point 0's levels."""
        fmt, codes = self.format, torch.empty(values.shape, dtype=torch.int8, device=values.device)
        table = torch.from_numpy(levels(self.qtype)).to(values.device)
        fallback = torch.from_numpy(grid_levels(self.qtype)[0]).to(values.device)
        position = (torch.arange(values.shape[1], device=values.device) + first_column) % fmt.width
        for rows in row_blocks(*values.shape):
            grid_ = self.rows(rows)
            step, _ = grid_.column_scales(first_column, values.shape[1])
            x = values[rows].float()
            shift = grid_.column_shifts(first_column, values.shape[1])
            target = (x.abs() if fmt.signed else x) / torch.where(step > 0, step, 1.0) - (0 if shift is None else shift)
            level = (target[..., None] - table).abs().argmin(-1)
            level = torch.where(step > 0, level, fallback[position])
            codes[rows] = torch.where(x < 0, -(level + 1), level + 1) if fmt.signed else level
        return codes

    def rows(self, rows: slice) -> CodebookParams:
        return self.map(lambda t: t[rows])

    def map(self, fn) -> CodebookParams:
        return CodebookParams(self.qtype, *(None if t is None else fn(t) for t in (self.scales, self.d, self.shifts)))

    def result(self, codes: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
        return QuantizedWeight(codes, self.sub_block_scales(), None, spec, k=self)

    def pack(self, codes: torch.Tensor) -> np.ndarray:
        """GGML's blocks of `codes` on this grid (`iq_codebooks.pack`)."""
        shifts = None if self.shifts is None else self.shifts.cpu().numpy()
        return pack(self.qtype, codes.cpu().numpy(), self.scales.cpu().numpy(), self.d.cpu().numpy(), shifts)


def decode_steps(d: torch.Tensor, scales: torch.Tensor, fmt: CodebookFormat) -> torch.Tensor:
    """float32 steps d * (offset + mult * ls) * post, in ggml's order (`d` float32, one per entry of `scales`)."""
    offset, mult, post = fmt.step
    return d * (scales.float() * mult + offset) * post


def decode(codes: torch.Tensor, step: torch.Tensor, shift: torch.Tensor | None, fmt: CodebookFormat) -> torch.Tensor:
    """float32 values of per-weight `codes` on per-weight steps (and IQ1 shifts), as the gguf package computes them:
    (step * level) * sign; step * (level + shift)."""
    table = torch.from_numpy(levels(fmt.qtype)).to(codes.device)
    codes = codes.long()
    if fmt.signed:
        return step * table[codes.abs() - 1] * torch.where(codes < 0, -1.0, 1.0)
    return step * (table[codes] + shift)


def _per_column(per_block: torch.Tensor, block: int, first_column: int, count: int) -> torch.Tensor:
    first, last = first_column // block, (first_column + count - 1) // block + 1
    columns = per_block[:, first:last].repeat_interleave(block, dim=1)
    return columns[:, first_column - first * block:first_column - first * block + count]


# ---- the search


class _Tables:
    """A type's grid on a device: unit values [shifts, points, width] (IQ1: the points plus +1/8 and -1/8) and
    their squares, and the points' level indices."""

    def __init__(self, fmt: CodebookFormat, device: torch.device):
        points = torch.from_numpy(grid(fmt.qtype)).to(device)
        self.values = (torch.stack([points + IQ1_DELTA, points - IQ1_DELTA]) if not fmt.signed else points[None])
        # [2 width, shifts x points]: a vector's scores at step s are [s^2 w, -2 s w x] @ this (`_Units.nearest`)
        self.scoring = torch.cat([self.values * self.values, self.values], -1).reshape(-1, 2 * fmt.width).T.contiguous()
        self.levels = torch.from_numpy(grid_levels(fmt.qtype)).to(device)
        self.top = float(self.values.abs().amax())


@dataclass
class _Units:
    """Weights of some units of 8 [N, 8] ready for the nearest-point search: the values the grid rounds (IQ2 / IQ3:
    the magnitudes, one flipped where the signs must be even), the weights' signs, and the per-vector sums."""

    xval: torch.Tensor
    negative: torch.Tensor
    weights: torch.Tensor
    tables: _Tables
    const: torch.Tensor  # sum w x^2 [N, vectors]

    @classmethod
    def of(cls, x: torch.Tensor, w: torch.Tensor, fmt: CodebookFormat, tables: _Tables) -> _Units:
        xval, negative = _signs(x, w, fmt)
        v, wv = xval.reshape(x.shape[0], -1, fmt.width), w.reshape(x.shape[0], -1, fmt.width)
        return cls(xval, negative, w, tables, (wv * v * v).sum(-1))

    def nearest(self, steps: torch.Tensor, fmt: CodebookFormat, shift: torch.Tensor | None = None):
        """Each vector's nearest grid point at its step [N, vectors]: (point, shift index, weighted squared error),
        the shift chosen per shift block unless given ([N, vectors]). The scores s^2 sum w g^2 - 2 s sum w x g of
        every point come out of one matrix product."""
        best, index = self.scores(steps, fmt).min(-1)  # [N, vectors, shifts]
        return _pick_shift(best, index, self.const, fmt, shift)

    def scores(self, steps: torch.Tensor, fmt: CodebookFormat) -> torch.Tensor:
        """[N, vectors, shifts, points]: every point's weighted squared error at the step, less sum w x^2."""
        n, vectors = steps.shape
        s = steps[..., None]
        wv = self.weights.reshape(n, vectors, fmt.width)
        lhs = torch.cat([s * s * wv, -2 * s * wv * self.xval.reshape(n, vectors, fmt.width)], -1).reshape(-1, 2 * fmt.width)
        return (lhs @ self.tables.scoring).reshape(n, vectors, self.tables.values.shape[0], -1)

    def codes(self, index: torch.Tensor, fmt: CodebookFormat, tables: _Tables) -> torch.Tensor:
        level = tables.levels[index].reshape(self.xval.shape)
        if not fmt.signed:
            return level.to(torch.int8)
        return torch.where(self.negative, -(level + 1), level + 1).to(torch.int8)

    def refit(self, index: torch.Tensor, shift: torch.Tensor, tables: _Tables, per: int) -> torch.Tensor:
        """Least-squares step of each `per` vectors [N, vectors // per] for the points chosen (0 where none fits)."""
        q = tables.values[shift, index]  # [N, vectors, width]
        v, wv = self.xval.reshape(q.shape), self.weights.reshape(q.shape)
        num = (wv * v * q).sum(-1).reshape(q.shape[0], -1, per).sum(-1)
        den = (wv * q * q).sum(-1).reshape(q.shape[0], -1, per).sum(-1)
        return torch.where((den > 0) & (num > 0), num / torch.where(den > 0, den, 1.0), 0.0)


class _Shortlist:
    """The nearest-point search among each vector's nearest points (per shift) at some steps across the trials'
    range: the trials of a grid of more than 512 points (IQ2_S, IQ1) search these, the final rounding the whole
    grid at the steps chosen. (The nearest point moves with the step in few jumps; torch's topk over the grid, the
    other way to a shortlist, costs more than the trials it saves.)"""

    def __init__(self, units: _Units, trial_steps: list[torch.Tensor], fmt: CodebookFormat):
        self.units = units
        self.candidates = torch.stack([units.scores(steps, fmt).min(-1).indices for steps in trial_steps], -1)  # [N, vectors, shifts, m]
        shifts = torch.arange(self.candidates.shape[2], device=self.candidates.device)[:, None]
        values = units.tables.values[shifts, self.candidates]  # [N, vectors, shifts, m, width]
        n, vectors = self.candidates.shape[:2]
        wv = units.weights.reshape(n, vectors, 1, 1, fmt.width)
        self.cross = (wv * units.xval.reshape(n, vectors, 1, 1, fmt.width) * values).sum(-1)
        self.norm = (wv * values * values).sum(-1)

    def nearest(self, steps: torch.Tensor, fmt: CodebookFormat, shift: torch.Tensor | None = None):
        s = steps[..., None, None]
        best, position = (s * s * self.norm - 2 * s * self.cross).min(-1)
        index = self.candidates.gather(-1, position[..., None])[..., 0]
        return _pick_shift(best, index, self.units.const, fmt, shift)

    def refit(self, index: torch.Tensor, shift: torch.Tensor, tables: _Tables, per: int) -> torch.Tensor:
        return self.units.refit(index, shift, tables, per)


def _pick_shift(best: torch.Tensor, index: torch.Tensor, const: torch.Tensor, fmt: CodebookFormat,
                shift: torch.Tensor | None):
    """(point, shift index, error) of each vector from its best point per shift [N, vectors, shifts]: IQ1's shift
    the better per shift block (the sum of its vectors' errors), unless given."""
    if best.shape[-1] == 1:
        return index[..., 0], torch.zeros_like(index[..., 0]), best[..., 0] + const
    if shift is None:
        per = fmt.shift_block // fmt.width
        totals = best.reshape(best.shape[0], -1, per, 2).sum(2)
        shift = totals.argmin(-1).repeat_interleave(per, dim=1)
    pick = shift[..., None]
    return index.gather(-1, pick)[..., 0], shift, best.gather(-1, pick)[..., 0] + const


def _signs(x: torch.Tensor, w: torch.Tensor, fmt: CodebookFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(the values to round, the signs kept): IQ1 rounds x itself; IQ2 / IQ3 its magnitudes, and where 8 weights have
    an odd count of negatives and the type stores 7 signs, the one of least w x^2 is flipped (llama.cpp's rule)."""
    if not fmt.signed:
        return x, torch.zeros_like(x, dtype=torch.bool)
    negative = x < 0
    xval = x.abs()
    if fmt.signs == "parity":
        groups = negative.reshape(-1, UNIT)
        odd = groups.sum(1) % 2 == 1
        flip = torch.zeros_like(groups)
        flip[torch.arange(groups.shape[0], device=x.device), (w * x * x).reshape(-1, UNIT).argmin(1)] = True
        flip &= odd[:, None]
        negative = negative ^ flip.reshape(x.shape)
        xval = torch.where(flip.reshape(x.shape), -xval, xval)
    return xval, negative


def element_weights(x: torch.Tensor, importance: torch.Tensor | None, fmt: CodebookFormat) -> torch.Tensor:
    """Each weight's weight in the search [S, 256] (super-blocks): qw * sqrt(sigma2 + x^2), or 1 without qw (the
    module docstring says why not llama.cpp's x^2)."""
    if importance is None:
        return torch.ones_like(x)
    sigma2 = (x * x).mean(1, keepdim=True) * (1.0 if fmt.qtype in (Q.IQ2_XXS, Q.IQ2_XS) else 2.0)
    return importance * torch.sqrt(sigma2 + x * x)


def quantize_codebook(weight: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, CodebookParams]:
    """(codes int8 [rows, cols], the grid) of a [rows, cols] weight (cols a multiple of 256) on type `qtype`, by the
    search of the module docstring. `importance`: float [cols], the imatrix (H's diagonal)."""
    fmt = _check(weight, qtype, importance)
    rows, cols = weight.shape
    blocks = torch.nan_to_num(weight.detach().float(), 0.0, 0.0, 0.0).reshape(-1, SUPER_BLOCK)
    per_row = None if importance is None else importance.detach().float().to(weight.device).reshape(-1, SUPER_BLOCK)
    tables = _Tables(fmt, weight.device)
    size = max(1, _CHUNK // (SUPER_BLOCK // fmt.width * tables.values.shape[0] * tables.values.shape[1]))
    found = []
    for first in range(0, blocks.shape[0], size):
        chunk = blocks[first:first + size]
        qw = None if per_row is None else per_row[torch.arange(first, first + chunk.shape[0], device=weight.device) % per_row.shape[0]]
        found.append(_search(chunk, element_weights(chunk, qw, fmt), fmt, tables))
    codes, scales, d, shifts = (torch.cat(parts) for parts in zip(*found))
    params = CodebookParams(qtype, scales.reshape(rows, -1), d.reshape(rows, -1),
                            shifts.reshape(rows, -1) if fmt.shift_block else None)
    return codes.reshape(rows, cols), params


def _search(x: torch.Tensor, w: torch.Tensor, fmt: CodebookFormat, tables: _Tables):
    """Super-blocks [S, 256]: (codes [S, 256], sub-scale codes, fp16 d [S], shift signs)."""
    S, per = x.shape[0], fmt.scale_block // fmt.width
    units = searched = _Units.of(x, w, fmt, tables)
    if tables.values.shape[0] * tables.values.shape[1] > SHORTLIST_ABOVE:
        typical = x.abs().reshape(S, -1, fmt.scale_block).amax(-1).repeat_interleave(per, dim=1) / tables.top
        searched = _Shortlist(units, [typical * c for c in SHORTLIST_AT], fmt)
    scale = _sub_block_scales(searched, x, fmt, tables)
    best = None
    top = float(decode_steps(torch.ones(1), torch.tensor([fmt.max_scale]), fmt))
    largest = scale.amax(1)
    for m in D_TRIALS:
        d = (largest * m / top).clamp(max=65504.0).half()
        found = _with_d(searched, scale, d, fmt, per)
        if best is None:
            best = found
            continue
        take = found[0] < best[0]
        best = tuple(torch.where(take.reshape(S, *[1] * (new.dim() - 1)), new, old) for new, old in zip(found, best))
    _, ls, index, shift, d = best
    if searched is not units:  # the final rounding on the whole grid, at the steps chosen
        index, shift, _ = units.nearest(decode_steps(d.float()[:, None], ls, fmt).repeat_interleave(per, dim=1), fmt)
    codes = units.codes(index, fmt, tables)
    shifts = shift[:, ::fmt.shift_block // fmt.width].to(torch.int8) if fmt.shift_block else torch.empty(S, 0, dtype=torch.int8)
    return codes, ls.to(torch.int8), d, shifts


def _sub_block_scales(units: _Units | _Shortlist, x: torch.Tensor, fmt: CodebookFormat, tables: _Tables) -> torch.Tensor:
    """Each sub-block's float step [S, sub-blocks]: the refit of the best of the trial steps."""
    per = fmt.scale_block // fmt.width
    largest = x.abs().reshape(x.shape[0], -1, fmt.scale_block).amax(-1)
    best_err = torch.full_like(largest, float("inf"))
    best = torch.zeros_like(largest)
    for c in SCALE_TRIALS:
        trial = largest * c / tables.top
        index, shift, err = units.nearest(trial.repeat_interleave(per, dim=1), fmt)
        err = err.reshape(err.shape[0], -1, per).sum(-1)
        fitted = units.refit(index, shift, tables, per)
        take = err < best_err
        best = torch.where(take, torch.where(fitted > 0, fitted, trial), best)
        best_err = torch.where(take, err, best_err)
    return best


def _with_d(units: _Units | _Shortlist, scale: torch.Tensor, d: torch.Tensor, fmt: CodebookFormat, per: int):
    """Given fp16 d [S]: each sub-block's best of the two sub-scale codes around its scale, at its exact step.
    Returns (the super-blocks' errors [S], ls, points, shifts, d)."""
    offset, mult, post = fmt.step
    df = d.float()[:, None]
    level = torch.where(df > 0, (scale / torch.where(df > 0, df, 1.0) / post - offset) / mult, 0.0)
    low = level.floor().clamp(0, fmt.max_scale)
    best = None
    for ls in (low, (low + 1).clamp(max=fmt.max_scale)):
        index, shift, err = units.nearest(decode_steps(df, ls, fmt).repeat_interleave(per, dim=1), fmt)
        err_sub = err.reshape(err.shape[0], -1, per).sum(-1)
        if best is None:
            best = [err_sub, ls, index, shift]
            continue
        take = err_sub < best[0]
        vec = take.repeat_interleave(per, dim=1)
        best = [torch.where(take, err_sub, best[0]), torch.where(take, ls, best[1]),
                torch.where(vec, index, best[2]), torch.where(vec, shift, best[3])]
    err_sub, ls, index, shift = best
    if fmt.shift_block and fmt.shift_block > fmt.scale_block:  # never: IQ1_S's shift block is its scale block
        raise AssertionError("a shift spanning sub-blocks")
    return err_sub.sum(1), ls, index, shift, d


def _check(weight: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor | None) -> CodebookFormat:
    if qtype not in FORMATS:
        raise ValueError(f"{getattr(qtype, 'name', qtype)} is not a codebook i-quant; iq_low quantizes {', '.join(NAMES)}")
    if weight.ndim != 2 or weight.shape[1] % SUPER_BLOCK:
        raise ValueError(f"{qtype.name} quantizes [rows, cols] weights with cols a multiple of {SUPER_BLOCK}, "
                         f"got shape {list(weight.shape)}")
    if importance is not None and importance.shape != (weight.shape[1],):
        raise ValueError(f"importance must be one value per input column, shape [{weight.shape[1]}], got {list(importance.shape)}")
    return FORMATS[qtype]


# ---- GPTQ


@dataclass
class CodebookColumns:
    """A codebook grid in GPTQ's column loop (`grids.family.ColumnGrid`; see the module docstring): every 8 columns
    rounded jointly when the loop reaches the first of them, onto the grid chosen up front."""

    spec: WeightSpec
    params: CodebookParams
    importance: torch.Tensor | None
    code_dtype = torch.int8
    graphs = False
    choose_every = UNIT

    def __post_init__(self):
        self.fmt = self.params.format
        self.tables = _Tables(self.fmt, self.params.d.device)
        self.steps = self.params.sub_block_scales()  # [rows, sub-blocks]
        self.first, self.codes, self.values = 0, None, None

    def group_of(self, column: int) -> int:
        return column

    def choose(self, first: int, columns: torch.Tensor) -> None:
        """Round columns first .. first + 7 ([rows, 8], as GPTQ has updated them) jointly."""
        fmt, x = self.fmt, columns.float()
        step = self.steps[:, first // fmt.scale_block]
        w = torch.ones_like(x) if self.importance is None else self.importance[first:first + UNIT].float().expand_as(x)
        codes = torch.empty(x.shape, dtype=torch.int8, device=x.device)
        vectors = UNIT // fmt.width
        size = max(1, _CHUNK // (vectors * self.tables.values.shape[0] * self.tables.values.shape[1]))
        for rows in (slice(r, r + size) for r in range(0, x.shape[0], size)):  # the scores [rows, vectors, shifts, points]
            units = _Units.of(x[rows], w[rows], fmt, self.tables)
            fixed = None
            if fmt.shift_block and fmt.shift_block > UNIT:
                fixed = self.params.shifts[rows, first // fmt.shift_block].long()[:, None].expand(-1, vectors)
            index, shift, _ = units.nearest(step[rows, None].expand(-1, vectors), fmt, fixed)
            codes[rows] = units.codes(index, fmt, self.tables)
            if fmt.shift_block == UNIT:
                self.params.shifts[rows, first // UNIT] = shift[:, 0].to(torch.int8)
        shifts = self.params.column_shifts(first, UNIT)
        self.first, self.codes = first, codes.T.contiguous()
        self.values = decode(codes, step[:, None].expand_as(x), shifts, fmt).T.contiguous()

    def round(self, column: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = group - self.first
        return self.codes[j].float(), self.values[j]

    def result(self, qdata: torch.Tensor) -> QuantizedWeight:
        return self.params.result(qdata, self.spec)


class CodebookGrid(GridFamily):
    """llama.cpp's codebook i-quants below 4 bits: grid points of 8 (or 4) weights from a type's table, under
    sub-scales and an fp16 scale per 256 weights."""

    name = "codebook i-quant"

    def owns(self, spec: WeightSpec) -> bool:
        return spec.codebook_type in NAMES

    def quantize(self, weight, spec, global_scale=None, importance=None) -> QuantizedWeight:
        codes, params = quantize_codebook(weight, Q[spec.codebook_type], importance)
        return params.result(codes, spec)

    def empty(self, weight, spec) -> QuantizedWeight:
        fmt, (rows, cols) = FORMATS[Q[spec.codebook_type]], weight.shape
        empty = lambda n, dtype: torch.empty(rows, n, dtype=dtype, device=weight.device)  # noqa: E731
        shifts = empty(cols // fmt.shift_block, torch.int8) if fmt.shift_block else None
        params = CodebookParams(fmt.qtype, empty(cols // fmt.scale_block, torch.int8), empty(cols // SUPER_BLOCK, torch.float16), shifts)
        return QuantizedWeight(empty(cols, torch.int8), empty(cols // fmt.scale_block, torch.float32), None, spec, k=params)

    def columns(self, weight, dtype, spec, actorder=False, static_groups=False, global_scale=None,
                importance=None) -> CodebookColumns:
        if actorder:
            raise SchemeError("actorder", f"{spec.codebook_type} rounds 8 columns at once onto a grid point, and actorder "
                                          "takes columns out of order: set actorder: false")
        _, params = quantize_codebook(weight.float(), Q[spec.codebook_type], importance)
        return CodebookColumns(spec, params, importance)

    def block_params(self, spec, parts) -> CodebookParams:
        return CodebookParams.from_parts(Q[spec.codebook_type], parts)


CODEBOOK_GRID = CodebookGrid()
