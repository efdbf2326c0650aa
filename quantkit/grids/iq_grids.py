"""llama.cpp's non-linear 4-bit types IQ4_NL and IQ4_XS, ported from ggml-quants.c.

A weight is `step * KVALUES_IQ4NL[code]`, code in [0, 15], one step per block of 32 weights of a row. IQ4_NL
stores the step as a fp16 d per block (block_iq4_nl: 18 bytes per 32 weights); IQ4_XS as a fp16 d per super-block
of 256 times a 6-bit sub-scale code ls per block, step = d * (ls - 32) (block_iq4_xs: 136 bytes per 256).

`quantize_iq4` is llama.cpp's own quantizer: quantize_iq4_nl / quantize_iq4_xs, which llama-quantize calls with or
without an imatrix (quantize_row_iq4_nl_impl with ntry = 7; ggml's quantize_row_iq4_nl_ref, ntry = -1, is not
ported). It is ported as k_grids ports the K-quants: float32 in ggml's order of operations, rounding half to even,
fp16 by rounding to nearest, never dividing by a Python number (see k_grids' docstring), so its codes and bytes
are llama.cpp's. The scale search runs on all blocks of a chunk at once, held as columns; the Python loops run over
the 32 weights of a block and the selection among its 16 trial grids. On a CPU the search without an importance
matrix and the rounding onto a fixed grid run as compiled loops of the same arithmetic instead (`cpu_kernels`, bit
for bit).

GPTQ takes the two halves apart, as k_grids' `choose_k_qparams` / `round_k`: `choose_iq4_params` fixes the grid of
some whole blocks of columns, `round_iq4` rounds columns onto it as they are updated. llama.cpp rounds the codes
with its search's float32 d, before the fp16 rounding that the block stores and decodes with (`IQ4Params.d_search`);
`round_iq4` does the same, so choosing then rounding an unchanged weight gives `quantize_iq4`'s codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from quantkit.grids.ggml_blocks import BlockFormat, row_blocks
from quantkit.grids.family import GridFamily
from quantkit.grids.cpu_dispatch import compiled as _compiled, kernels as cpu_kernels, map_chunks as _map_chunks
from quantkit.grids.k_grids import _columns, _div, _first_absmax, _sqrt
from quantkit.grids.qparams import QuantizedWeight
from quantkit.grids.schemes import WeightSpec

Q = GGMLQuantizationType
IQ4_QTYPES = (Q.IQ4_NL, Q.IQ4_XS)
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml-common.h
BLOCK = 32  # weights per step: an IQ4_NL block, an IQ4_XS sub-block

IQ4_FORMATS: dict[GGMLQuantizationType, BlockFormat] = {f.qtype: f for f in (
    BlockFormat(Q.IQ4_NL, BLOCK, BLOCK, (0, 15), None, False),
    BlockFormat(Q.IQ4_XS, BLOCK, 256, (0, 15), (0, 63), False),  # scale codes: ls, the sub-scale being ls - 32
)}

IQ4_PARTS = ("scales", "d", "d_search")  # an IQ4 grid's tensors, in IQ4Params' constructor order

_GROUP_MAX_EPS = float(np.float32(1e-15))
_NTRY = 7  # the search's trial grids: 1 / d = (itry - 127) / max, itry = -7 .. 7

# ggml's best_index_int8 picks, of neighbours a < b, `x - a < b - x ? a : b` in float32, which for every float32 x
# is x >= (a + b) / 2 (the tests check it against a literal port); the midpoints are halves of integers. So the code
# of x is the number of doubled midpoints <= floor(2x) (2x is exact), read from a table at floor(2x). The table
# spans floor(2x) in [-272, 272]: the search's |x| stays below 135 (x = (itry - 127) / max * a weight of that block);
# rounding clamps floor(2x) into it (its ends are codes 0 and 15).
_DOUBLED_MIDPOINTS = tuple(a + b for a, b in zip(KVALUES_IQ4NL, KVALUES_IQ4NL[1:]))
_TABLE_LOW, _TABLE_HIGH = -272, 272
_TABLE_CODES = tuple(sum(i >= m for m in _DOUBLED_MIDPOINTS) for i in range(_TABLE_LOW, _TABLE_HIGH + 1))


@dataclass
class IQ4Params:
    """An IQ4 grid without its codes. d: float16 [rows, cols // super_block], the d a block stores. scales: IQ4_XS's
    sub-scale codes ls, int8 [rows, cols // 32] in [0, 63] (the sub-scale is ls - 32); None for IQ4_NL. d_search:
    float32, d's shape: the search's d before its fp16 rounding, which llama.cpp rounds the codes with (None:
    float(d), as for a grid read back from bytes). The constructor's first three mirror `KQParams`; an IQ4 grid has
    no mins (`mins` and `dmin` are None)."""

    qtype: GGMLQuantizationType
    scales: torch.Tensor | None
    d: torch.Tensor
    d_search: torch.Tensor | None = None

    mins = None
    dmin = None

    @classmethod
    def from_parts(cls, qtype: GGMLQuantizationType, parts: dict[str, torch.Tensor]) -> IQ4Params:
        """The grid of `parts()` (a resume file's tensors)."""
        return cls(qtype, parts.get("scales"), parts["d"], parts.get("d_search"))

    @property
    def format(self) -> BlockFormat:
        return IQ4_FORMATS[self.qtype]

    @property
    def code_range(self) -> tuple[int, int]:
        """The codes' range: indices into KVALUES_IQ4NL, not levels."""
        return self.format.code_range

    def parts(self) -> dict[str, torch.Tensor]:
        """Its tensors by name (`IQ4_PARTS`, those it has)."""
        return {name: t for name in IQ4_PARTS if (t := getattr(self, name)) is not None}

    def round(self, values: torch.Tensor, first_column: int = 0) -> torch.Tensor:
        """`round_iq4`'s codes on this grid, without their values."""
        return _round(values, self, first_column, decode=False)[0]

    def codes_on_grid(self, values: torch.Tensor, rtol: float, atol: float) -> torch.Tensor | None:
        """The codes of `values`, which hold this grid's values (in their dtype), rounded back onto it (`round`), or
        None if one of them decodes farther than atol + rtol * |value| from its value: it was not on the grid."""
        codes, _, on_grid = _round(values, self, 0, decode=False, tolerance=(rtol, atol))
        return codes if on_grid else None

    def sub_block_scales(self) -> torch.Tensor:
        """float32 [rows, cols // 32]: each block's step as ggml decodes it, float(d) or float(d) * (ls - 32)."""
        return self._steps(self.d.float())

    def column_scales(self, first_column: int, count: int) -> tuple[torch.Tensor, None]:
        """`sub_block_scales` for columns first_column .. first_column + count - 1, float32 [rows, count], and no
        offset (as `KQParams.column_scales`): a weight is its column's step * KVALUES_IQ4NL[code]."""
        return _per_column(self.sub_block_scales(), first_column, count), None

    def inverse_steps(self, first_column: int, count: int) -> torch.Tensor:
        """float32 [rows, count]: what llama.cpp multiplies a weight by before choosing its code (`nearest_code`),
        1 / d_search (IQ4_NL) or 1 / (d_search * (ls - 32)) (IQ4_XS); 0 where that step is 0."""
        return _per_column(self.block_inverses(), first_column, count)

    def block_inverses(self) -> torch.Tensor:
        """float32 [rows, cols // 32]: `inverse_steps` of each block."""
        steps = self._steps(self.d.float() if self.d_search is None else self.d_search)
        return torch.where(steps != 0, _div(1.0, steps), 0.0)

    def dequantize(self, codes: torch.Tensor, first_column: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values of `codes` (the columns from `first_column` on), exactly as ggml decodes them (in float32),
        in `dtype`, a block of rows at a time (`row_blocks`)."""
        out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
        for rows in row_blocks(*codes.shape):
            grid, part = self.rows(rows), codes[rows]
            values = _lookup(_kvalues(codes.device), part.int())
            if first_column % BLOCK or part.shape[1] % BLOCK:
                out[rows] = grid.column_scales(first_column, part.shape[1])[0] * values
                continue
            # whole blocks: each one's step broadcast over its weights, the same products
            step = grid.sub_block_scales()[:, first_column // BLOCK:(first_column + part.shape[1]) // BLOCK, None]
            out[rows] = values.reshape(part.shape[0], -1, BLOCK).mul_(step).reshape(part.shape)
        return out

    def rows(self, rows: slice) -> IQ4Params:
        """The grid of some rows."""
        return self.map(lambda t: t[rows])

    def result(self, codes: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
        """The quantized weight of `codes` on this grid: each block's step as the scale."""
        return QuantizedWeight(codes, self.sub_block_scales(), None, spec, k=self)

    def pack(self, codes: torch.Tensor) -> np.ndarray:
        """GGML's blocks of `codes` on this grid (`pack_iq4`)."""
        return pack_iq4(codes, self)

    def map(self, fn) -> IQ4Params:
        """The same grid with `fn` applied to each of its tensors (moved, cut into rows, reordered)."""
        return IQ4Params(self.qtype, *(None if t is None else fn(t) for t in (self.scales, self.d, self.d_search)))

    def _steps(self, d: torch.Tensor) -> torch.Tensor:
        """Each block's step from a d per super-block: d itself (IQ4_NL), d * (ls - 32) (IQ4_XS), in float32."""
        if self.scales is None:
            return d
        return d.repeat_interleave(self.format.super_block // BLOCK, dim=1) * (self.scales.float() - 32)


@dataclass
class IQ4Result:
    """codes: int8 [rows, cols] in [0, 15], indices into KVALUES_IQ4NL, on the grid `qparams`."""

    codes: torch.Tensor
    qparams: IQ4Params

    @property
    def qtype(self) -> GGMLQuantizationType:
        return self.qparams.qtype

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.qparams.dequantize(self.codes, dtype=dtype)

    def ggml_blocks(self) -> np.ndarray:
        """The GGUF tensor data: uint8 [rows, cols // super_block * type_bytes]."""
        return pack_iq4(self.codes, self.qparams)


def quantize_iq4(weight: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor | None = None) -> IQ4Result:
    """llama.cpp's quantization of a [rows, cols] weight to IQ4_NL (cols a multiple of 32) or IQ4_XS (of 256):
    its codes, d and sub-scale codes exactly. `importance`: float [cols], the imatrix (llama-quantize --imatrix);
    without one, llama.cpp weights each value by its square."""
    params = choose_iq4_params(weight, qtype, importance)
    return IQ4Result(params.round(weight), params)


def choose_iq4_params(columns: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor | None = None) -> IQ4Params:
    """The grid llama.cpp chooses for `columns` [rows, n] (whole super-blocks of a weight's columns; `importance`
    [n], theirs): each block's scale searched over 16 trial grids, then (IQ4_XS) the super-block's d and the
    blocks' 6-bit sub-scale codes under it. A non-finite weight counts as 0 in the search (llama.cpp differs)."""
    x, importance = _check(columns, qtype, importance)
    super_block = IQ4_FORMATS[qtype].super_block
    blocks = x.reshape(-1, super_block)

    def search_chunk(first: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        chunk = blocks[first:first + size].float()
        if importance is None and _compiled(chunk):
            return _compiled_search(chunk, qtype)
        return _search(chunk, _chunk_importance(importance, first, chunk.shape[0], super_block), qtype)

    size = max(1, _chunk_weights(x.device) // super_block)
    found = _map_chunks(search_chunk, range(0, blocks.shape[0], size), x.device)
    d_search = torch.cat([d for _, d in found]).reshape(x.shape[0], -1)
    scales = None if qtype is Q.IQ4_NL else torch.cat([s for s, _ in found]).reshape(x.shape[0], -1)
    return IQ4Params(qtype, scales, d_search.half(), d_search)


def round_iq4(values: torch.Tensor, params: IQ4Params, first_column: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (int8) of `values`' columns (the grid's columns from `first_column` on) on the fixed grid
    `params`, as llama.cpp's last pass chooses them (`nearest_code` of the value times `inverse_steps`), and their
    values (float32, as ggml decodes them). A block of rows at a time (`row_blocks`)."""
    return _round(values, params, first_column, decode=True)[:2]


def nearest_code(scaled: torch.Tensor) -> torch.Tensor:
    """ggml's best_index_int8 over KVALUES_IQ4NL, elementwise on float32 `scaled` (a weight over its step): the
    index (int8) of the nearest value, ties to the larger; NaN gets 15, as in ggml."""
    index = _table_index(torch.mul(scaled, 2.0), torch.empty(scaled.shape, dtype=torch.int32, device=scaled.device))
    return _lookup(_table(_TABLE_CODES, torch.int8, scaled.device), index)


def _round(values: torch.Tensor, params: IQ4Params, first_column: int, decode: bool,
           tolerance: tuple[float, float] | None = None):
    """`round_iq4`'s codes, (`decode`) their values, else None, and whether every code decodes to its value within
    `tolerance` (rtol, atol; True without one). On a CPU, without `decode`, each block of rows is one compiled pass
    (`cpu_kernels.round_iq4`), the blocks in threads; elsewhere torch ops."""
    codes = torch.empty(values.shape, dtype=torch.int8, device=values.device)
    decoded = torch.empty(values.shape, dtype=torch.float32, device=values.device) if decode else None
    code_table, value_table = _table(_TABLE_CODES, torch.int8, values.device), _table_values(values.device)
    rtol, atol = tolerance if tolerance is not None else (-1.0, 0.0)

    def round_rows(rows: slice) -> bool:
        grid, x = params.rows(rows), values[rows].float()
        if not decode and _compiled(x):
            spanned = slice(first_column // BLOCK, first_column // BLOCK + _blocks_spanned(first_column, x.shape[1]))
            inverse, steps = grid.block_inverses()[:, spanned], grid.sub_block_scales()[:, spanned]
            off = cpu_kernels().round_iq4(x.numpy(), inverse.contiguous().numpy(), steps.contiguous().numpy(),
                                          first_column % BLOCK, np.array(_TABLE_CODES, np.int8),
                                          np.array(KVALUES_IQ4NL, np.float32), _TABLE_LOW, _TABLE_HIGH,
                                          np.float32(rtol), np.float32(atol), codes[rows].numpy())
            return off == 0
        doubled = torch.mul(grid.inverse_steps(first_column, values.shape[1]), values[rows]).mul_(2.0)
        index = _table_index(doubled, torch.empty(doubled.shape, dtype=torch.int32, device=values.device))
        codes[rows] = _lookup(code_table, index)
        if decode:
            decoded[rows] = grid.column_scales(first_column, values.shape[1])[0] * _lookup(value_table, index)
        if tolerance is None:
            return True
        found = grid.dequantize(codes[rows], first_column, dtype=values.dtype)
        return torch.allclose(found.float(), x, rtol=rtol, atol=atol)

    on_grid = all(_map_chunks(round_rows, row_blocks(*values.shape), values.device))
    return codes, decoded, on_grid


def _blocks_spanned(first_column: int, count: int) -> int:
    """How many blocks of 32 columns first_column .. first_column + count - 1 touch."""
    return (first_column + count - 1) // BLOCK - first_column // BLOCK + 1


# ---- bytes


def pack_iq4(codes: torch.Tensor | np.ndarray, params: IQ4Params) -> np.ndarray:
    """GGML's blocks of `codes` [rows, cols] on `params`: uint8 [rows, cols // super_block * type_bytes].
    block_iq4_nl {fp16 d; qs[16]}; block_iq4_xs {fp16 d; uint16 scales_h; scales_l[4]; qs[128]}. qs byte 16i + j
    holds codes 32i + j (low nibble) and 32i + 16 + j (high); ls of block b: its low nibble in scales_l[b / 2] (the
    low nibble for even b), its two high bits in bits 2b of scales_h."""
    codes = np.asarray(codes.cpu() if isinstance(codes, torch.Tensor) else codes)
    _check_packed(codes, params)
    fmt = params.format
    rows, cols = codes.shape
    out = np.empty((rows, cols // fmt.super_block * fmt.type_bytes), np.uint8)
    d = params.d.cpu().numpy()
    scales = None if params.scales is None else params.scales.cpu().numpy()
    for part in row_blocks(rows, cols):
        fields = [np.ascontiguousarray(d[part].reshape(-1, 1)).view(np.uint8)]
        if scales is not None:
            fields += _xs_scale_bytes(scales[part])
        fields.append(_nibbles(codes[part], fmt.super_block))
        out[part] = np.concatenate(fields, axis=1).reshape(out[part].shape)
    return out


def unpack_iq4(data: np.ndarray, qtype: GGMLQuantizationType) -> IQ4Result:
    """The inverse of `pack_iq4` on GGUF tensor data uint8 [rows, bytes] (d_search None)."""
    fmt = IQ4_FORMATS[qtype]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, fmt.type_bytes)
    d = blocks[:, :2].copy().view(np.float16).reshape(rows, -1)
    quants = blocks[:, -fmt.super_block // 2:].reshape(-1, fmt.super_block // BLOCK, 1, 16)
    codes = np.concatenate([quants & 0xF, quants >> 4], axis=2).reshape(rows, -1)
    scales = None
    if qtype is Q.IQ4_XS:
        high, low, b = blocks[:, 2:4].copy().view("<u2"), blocks[:, 4:8], np.arange(8)
        ls = ((low[:, b // 2] >> (4 * (b % 2))) & 0xF) | (((high >> (2 * b)) & 3) << 4)
        scales = torch.from_numpy(ls.astype(np.int8).reshape(rows, -1))
    return IQ4Result(torch.from_numpy(codes.astype(np.int8)), IQ4Params(qtype, scales, torch.from_numpy(d)))


def _check_packed(codes: np.ndarray, params: IQ4Params) -> None:
    fmt, name = params.format, params.qtype.name
    if codes.ndim != 2 or codes.shape[1] % fmt.super_block:
        raise ValueError(f"{name} packs [rows, cols] codes with cols a multiple of {fmt.super_block}, got shape {list(codes.shape)}")
    if not np.issubdtype(codes.dtype, np.integer) or (codes.size and (codes.min() < 0 or codes.max() > 15)):
        raise ValueError(f"{name} codes must be integers in [0, 15]")
    if params.d.dtype != torch.float16 or tuple(params.d.shape) != (codes.shape[0], codes.shape[1] // fmt.super_block):
        raise ValueError(f"{name} d must be float16 [{codes.shape[0]}, {codes.shape[1] // fmt.super_block}], got "
                         f"{params.d.dtype} {list(params.d.shape)}")
    if (params.scales is None) != (fmt.scale_range is None):
        raise ValueError(f"{name} grids {'need' if params.scales is None else 'have no'} sub-scale codes")
    if params.scales is not None:
        if tuple(params.scales.shape) != (codes.shape[0], codes.shape[1] // BLOCK):
            raise ValueError(f"{name} scales must have shape [{codes.shape[0]}, {codes.shape[1] // BLOCK}], "
                             f"got {list(params.scales.shape)}")
        if params.scales.numel() and (params.scales.min() < 0 or params.scales.max() > 63):
            raise ValueError(f"{name} sub-scale codes must lie in [0, 63]")


def _xs_scale_bytes(scales: np.ndarray) -> list[np.ndarray]:
    """scales_h (uint16, little-endian) and scales_l[4] of each super-block, from its 8 codes ls."""
    ls = scales.reshape(-1, 8).astype(np.uint16)
    high = np.bitwise_or.reduce((ls >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1)
    low = (ls & 0xF).astype(np.uint8)
    return [np.ascontiguousarray(high.astype("<u2")[:, None]).view(np.uint8), low[:, 0::2] | (low[:, 1::2] << 4)]


def _nibbles(codes: np.ndarray, super_block: int) -> np.ndarray:
    halves = codes.reshape(-1, super_block // BLOCK, 2, 16).astype(np.uint8)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(-1, super_block // 2)


# ---- the search, on a chunk of super-blocks [S, super_block]

# Weights per chunk: on a CPU, a chunk's trial tensors [16, 2048] stay in L2 (k_grids' reasoning); on a GPU, launches are the cost.
# Blocks are independent: chunking changes no result.
_CHUNK_WEIGHTS = 1 << 16
_DEVICE_CHUNK_WEIGHTS = 1 << 24


def _chunk_weights(device: torch.device) -> int:
    return _CHUNK_WEIGHTS if device.type == "cpu" else _DEVICE_CHUNK_WEIGHTS


def _search(blocks: torch.Tensor, importance: torch.Tensor | None, qtype: GGMLQuantizationType):
    """quantize_row_iq4_nl_impl on super-blocks [S, super_block]: the sub-scale codes [S, 8] (IQ4_XS; None for
    IQ4_NL) and the search's float32 d, [S, 1]."""
    weights = _element_weights(blocks, importance)
    scales = _fit_block_scales(torch.nan_to_num(_columns(blocks, BLOCK), 0.0, 0.0, 0.0), weights)
    scales = scales.reshape(blocks.shape[0], -1)
    if qtype is Q.IQ4_NL:
        return None, scales
    d = _div(-_largest_magnitude(scales), 32.0)
    inverse = torch.where(d != 0, _div(1.0, d), 0.0)
    levels = _nearest_int(inverse[:, None] * scales).clamp_(-32, 31)
    return (levels + 32).to(torch.int8), d[:, None]


def _compiled_search(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`_search` without importance as one compiled loop (`cpu_kernels.search_iq4`), bit for bit."""
    count = blocks.shape[0]
    d = np.empty(count, np.float32)
    scales = np.empty((count, blocks.shape[1] // BLOCK), np.int8)
    trials = np.array([0.0] + [float(t + KVALUES_IQ4NL[0]) for t in range(-_NTRY, _NTRY + 1)], np.float32)
    cpu_kernels().search_iq4(blocks.numpy(), trials, _table_values(blocks.device).numpy(), _TABLE_LOW,
                             np.float32(_GROUP_MAX_EPS), qtype is Q.IQ4_XS, scales, d)
    return (None if qtype is Q.IQ4_NL else torch.from_numpy(scales)), torch.from_numpy(d)[:, None]


def _element_weights(blocks: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """Each weight's weight in the fit, as columns [32, B]: x^2, or given the imatrix qw, qw * sqrt(sigma2 + x^2)
    with sigma2 the super-block's sum of squares (in order) times 2 / super_block."""
    squares = blocks * blocks
    if importance is None:
        return _columns(squares, BLOCK)
    sigma2 = torch.zeros_like(blocks[:, 0])
    for column in squares.t():
        sigma2 += column
    sigma2 *= torch.tensor(2.0 / blocks.shape[1], device=blocks.device)  # a power of two: exact either way
    return _columns(importance * _sqrt(sigma2[:, None] + squares), BLOCK)


def _fit_block_scales(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The scale search of quantize_row_iq4_nl_impl (ntry = 7) on each column of x [32, B]: the first grid's
    d = max / 127, then 1 / d = (itry - 127) / max for itry = -7 .. 7; each grid's codes give the least-squares
    d = sum w q x / sum w q^2, kept where it fits better. Returns float32 [B]; 0 for a block whose largest magnitude
    is below 1e-15."""
    peak = _first_absmax(x)
    zero = peak.abs() < _GROUP_MAX_EPS
    trials = torch.tensor([float(t + KVALUES_IQ4NL[0]) for t in range(-_NTRY, _NTRY + 1)], device=x.device)
    iscales = torch.cat([_div(1.0, _div(peak, -float(KVALUES_IQ4NL[0])))[None], _div(trials[:, None], peak)])
    sum_qx, sum_q2 = _trial_sums(iscales.masked_fill_(zero, 0.0), x, weights)
    scale = torch.where(sum_q2[0] > 0, _div(sum_qx[0], sum_q2[0]), 0.0)
    best = scale * sum_qx[0]
    for qx, q2 in zip(sum_qx[1:], sum_q2[1:]):
        take = (q2 > 0) & (qx * qx > best * q2)
        scale = torch.where(take, _div(qx, q2), scale)
        best = torch.where(take, scale * qx, best)
    return torch.where(zero, 0.0, scale)


def _trial_sums(iscales: torch.Tensor, x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ordered sums of w * q * x and w * q * q [T, B] for T trial grids at once, q = KVALUES_IQ4NL of the codes
    of x [32, B] under iscales [T, B]; a block's 32 weights in turn, so each step works on [T, B]. Every |iscale * x|
    is below 135 (see _TABLE_LOW), so the table index needs no clamp."""
    doubled = iscales * 2  # (2 * id) * x is 2 * (id * x) exactly: a power of two scales alike before and after rounding
    sums = iscales.new_zeros(2, *iscales.shape)
    scaled, q, terms = torch.empty_like(iscales), torch.empty_like(iscales), iscales.new_empty(2, *iscales.shape)
    index = torch.empty(iscales.shape, dtype=torch.int32, device=iscales.device)
    values = _table_values(iscales.device)
    for xi, wi in zip(x, weights):
        index.copy_(torch.mul(doubled, xi, out=scaled).floor_().sub_(_TABLE_LOW))
        torch.index_select(values, 0, index.view(-1), out=q.view(-1))
        wq = torch.mul(q, wi, out=scaled)
        torch.mul(wq, xi, out=terms[0])
        torch.mul(wq, q, out=terms[1])
        sums += terms
    return sums[0], sums[1]


def _largest_magnitude(values: torch.Tensor) -> torch.Tensor:
    """Each row's value of largest magnitude [S] of [S, n], the first of ties, +0 if none exceeds 0 (ggml's scan
    from max = 0: an all-zero super-block's d is -0, which its bytes keep)."""
    peak, largest = values.new_zeros(values.shape[0]), values.new_zeros(values.shape[0])
    for column in values.t():
        larger = column.abs() > largest
        peak, largest = torch.where(larger, column, peak), torch.where(larger, column.abs(), largest)
    return peak


def _nearest_int(values: torch.Tensor) -> torch.Tensor:
    """ggml's nearest_int, the low bits of value + 12582912 as an int: half to even; off the finite values, what
    those bits say on x86 (an infinity: -4194304; NaN, the default NaN of an invalid operation: 0). A super-block
    whose sums overflowed (weights past 1e19) has such sub-scales."""
    levels = torch.where(values.isinf(), -4194304.0, torch.round(values))
    return torch.where(values.isnan(), 0.0, levels)


# ---- small helpers


def _table_index(doubled: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """int32 `out`: the code tables' index of each of `doubled` (twice a weight over its step; overwritten)."""
    doubled.floor_().clamp_(_TABLE_LOW, _TABLE_HIGH).sub_(_TABLE_LOW).nan_to_num_(_TABLE_HIGH - _TABLE_LOW)
    return out.copy_(doubled)


def _per_column(per_block: torch.Tensor, first_column: int, count: int) -> torch.Tensor:
    """[rows, count]: the entry of [rows, n_blocks] of each column first_column .. first_column + count - 1."""
    first, last = first_column // BLOCK, (first_column + count - 1) // BLOCK + 1
    columns = per_block[:, first:last, None].expand(-1, -1, BLOCK).reshape(per_block.shape[0], -1)
    return columns[:, first_column - first * BLOCK:first_column - first * BLOCK + count]


def _lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.index_select(table, 0, index.reshape(-1)).reshape(index.shape)


def _table(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _kvalues(device: torch.device) -> torch.Tensor:
    return _table(KVALUES_IQ4NL, torch.float32, device)


def _table_values(device: torch.device) -> torch.Tensor:
    """float32 KVALUES_IQ4NL of each code table entry."""
    return _table([KVALUES_IQ4NL[c] for c in _TABLE_CODES], torch.float32, device)


def _check(weight: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor | None):
    if qtype not in IQ4_QTYPES:
        raise ValueError(f"{getattr(qtype, 'name', qtype)} is not an IQ4 type; iq_grids quantizes {', '.join(q.name for q in IQ4_QTYPES)}")
    super_block = IQ4_FORMATS[qtype].super_block
    if weight.ndim != 2 or weight.shape[1] % super_block:
        raise ValueError(f"{qtype.name} quantizes [rows, cols] weights with cols a multiple of {super_block}, "
                         f"got shape {list(weight.shape)}")
    x = weight.detach()  # in its dtype: the search takes a chunk to float32 at a time
    if importance is None:
        return x, None
    if importance.shape != (weight.shape[1],):
        raise ValueError(f"importance must be one value per input column, shape [{weight.shape[1]}], got {list(importance.shape)}")
    return x, importance.detach().float().to(x.device)


def _chunk_importance(importance: torch.Tensor | None, first: int, count: int, super_block: int) -> torch.Tensor | None:
    """[count, super_block]: the importance of super-blocks first .. first + count - 1 of the row-major weight."""
    if importance is None:
        return None
    per_row = importance.reshape(-1, super_block)
    return per_row[torch.arange(first, first + count, device=importance.device) % per_row.shape[0]]


# ---- the grid family


@dataclass
class IQColumns:
    """An i-quant grid in GPTQ's column loop (`grids.family.ColumnGrid`): each block's scale (IQ4_XS: each super-block's
    d and sub-scales) chosen by llama.cpp's search on the columns as GPTQ has updated them when it reaches the
    super-block's first column (with actorder: all up front, on the original weights), then every column rounded to
    the nearest table value on its fixed step as `round_iq4` rounds (each column's inverse step and step kept as
    contiguous rows), so what GPTQ minimises is what llama.cpp decodes."""

    spec: WeightSpec
    params: IQ4Params  # the whole weight's, blocks overwritten as they are chosen
    dynamic: bool
    steps: torch.Tensor  # float32 [in, out]: each column's step as ggml decodes it
    inverse: torch.Tensor  # float32 [in, out]: what llama.cpp multiplies a weight by before choosing its code
    importance: torch.Tensor | None = None
    code_dtype = torch.int8
    graphs = False

    @classmethod
    def up_front(cls, weight: torch.Tensor, spec: WeightSpec, dynamic: bool, importance: torch.Tensor | None = None) -> IQColumns:
        qtype = Q[spec.codebook_type]
        rows, cols = weight.shape
        if dynamic:
            super_block = IQ4_FORMATS[qtype].super_block
            empty = lambda n, dtype: torch.zeros(rows, n, dtype=dtype, device=weight.device)  # noqa: E731
            scales = empty(cols // BLOCK, torch.int8) if qtype is Q.IQ4_XS else None
            params = IQ4Params(qtype, scales, empty(cols // super_block, torch.float16), empty(cols // super_block, torch.float32))
        else:
            params = choose_iq4_params(weight.float(), qtype, importance)
        buffer = lambda: torch.zeros(cols, rows, dtype=torch.float32, device=weight.device)  # noqa: E731
        grid = cls(spec, params, dynamic, buffer(), buffer(), importance)
        if not dynamic:
            grid._columns(0, cols)
        return grid

    @property
    def choose_every(self) -> int | None:
        return self.params.format.super_block if self.dynamic else None

    def group_of(self, column: int) -> int:
        return column  # rounding needs the column's own block

    def choose(self, first: int, columns: torch.Tensor) -> None:
        importance = None if self.importance is None else self.importance[first:first + columns.shape[1]]
        part = choose_iq4_params(columns.float(), self.params.qtype, importance)
        super_block = self.params.format.super_block
        block = first // super_block
        self.params.d[:, block:block + 1] = part.d
        self.params.d_search[:, block:block + 1] = part.d_search
        if part.scales is not None:
            self.params.scales[:, first // BLOCK:(first + super_block) // BLOCK] = part.scales
        self._columns(first, columns.shape[1])

    def _columns(self, first: int, count: int) -> None:
        self.steps[first:first + count] = self.params.column_scales(first, count)[0].T
        self.inverse[first:first + count] = self.params.inverse_steps(first, count).T

    def round(self, column: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = _table_index(torch.mul(self.inverse[group], column).mul_(2.0),
                             torch.empty(column.shape, dtype=torch.int32, device=column.device))
        codes = _lookup(_table(_TABLE_CODES, torch.int8, column.device), index)
        return codes.float(), self.steps[group] * _lookup(_table_values(column.device), index)

    def result(self, qdata: torch.Tensor) -> QuantizedWeight:
        return self.params.result(qdata, self.spec)


class IQGrid(GridFamily):
    """llama.cpp's non-linear i-quants IQ4_NL (a 16-value table times an fp16 scale per block of 32) and IQ4_XS
    (the same table, 6-bit sub-scales under an fp16 scale per 256), chosen by llama.cpp's own search."""

    name = "i-quant"

    def owns(self, spec: WeightSpec) -> bool:
        return spec.codebook_type in ("IQ4_NL", "IQ4_XS")

    def fake_quant(self, spec: WeightSpec) -> str:
        return "block_grid"

    def quantize(self, weight, spec, global_scale=None, importance=None) -> QuantizedWeight:
        found = quantize_iq4(weight, Q[spec.codebook_type], importance)
        return found.qparams.result(found.codes, spec)

    def empty(self, weight, spec) -> QuantizedWeight:
        qtype, (rows, cols) = Q[spec.codebook_type], weight.shape
        empty = lambda n, dtype: torch.empty(rows, n, dtype=dtype, device=weight.device)  # noqa: E731
        supers = cols // IQ4_FORMATS[qtype].super_block
        params = IQ4Params(qtype, empty(cols // BLOCK, torch.int8) if qtype is Q.IQ4_XS else None,
                           empty(supers, torch.float16), empty(supers, torch.float32))
        return QuantizedWeight(empty(cols, torch.int8), empty(cols // BLOCK, torch.float32), None, spec, k=params)

    def columns(self, weight, dtype, spec, actorder=False, static_groups=False, global_scale=None,
                importance=None) -> IQColumns:
        return IQColumns.up_front(weight, spec, dynamic=not actorder, importance=importance)

    def searched(self, weight, spec) -> IQ4Params:
        return choose_iq4_params(weight, Q[spec.codebook_type])

    def block_params(self, spec, parts) -> IQ4Params:
        return IQ4Params.from_parts(Q[spec.codebook_type], parts)


IQ_GRID = IQGrid()
