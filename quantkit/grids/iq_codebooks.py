"""llama.cpp's codebook i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: each type's grid and its
block bytes, laid out as ggml-common.h's block_iq* structs.

A super-block is 256 weights of a row under one fp16 d; each `scale_block` of them has a sub-scale code ls, and
the step is `d * (offset + mult * ls) * post` in float32, in that order (ggml's and the gguf package's). The
weights come in vectors of `width` (8, or 4 for IQ3), each one point of the type's grid (iq2xxs_grid[256] ...,
the tables of ggml-common.h, read from the gguf package: `grid`), whose entries are `levels` (8, 25, 43 for IQ2;
eight for IQ3; -1, 0, 1 for IQ1). IQ2 and IQ3 store the signs apart: IQ2_XXS, IQ2_XS and IQ3_XXS 7 bits per 8
weights, the eighth making the count of negatives even (ksigns); IQ2_S and IQ3_S a bit per weight. IQ1 has no
signs: a vector's values are its levels plus a shift of +-1/8 (IQ1S_DELTA), one per 32 weights (IQ1_S) or per 8
(IQ1_M).

quantkit holds a weight's code per weight (int8): for IQ2 / IQ3 +-(level index + 1), the sign the weight's; for
IQ1 the level index (0, 1, 2). `pack` finds each vector's grid index from its codes (`grid_index`) and refuses
codes that are off the grid or whose signs the type cannot store.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

Q = GGMLQuantizationType
SUPER_BLOCK = 256
UNIT = 8  # weights rounded together: a vector of 8, two of 4 (IQ3), and a group of signs
IQ1_DELTA = 0.125  # IQ1S_DELTA = IQ1M_DELTA (ggml-common.h)


@dataclass(frozen=True)
class CodebookFormat:
    qtype: GGMLQuantizationType
    width: int  # weights per grid point
    scale_block: int  # weights per sub-scale code
    scale_bits: int
    signs: str  # "parity" (7 bits per 8 weights, an even count of negatives), "free" (a bit per weight), "shift" (IQ1)
    step: tuple[float, float, float]  # (offset, mult, post): step = d * (offset + mult * ls) * post
    shift_block: int | None = None  # IQ1: weights sharing one shift's sign

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def type_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def signed(self) -> bool:
        return self.signs != "shift"

    @property
    def max_scale(self) -> int:
        return (1 << self.scale_bits) - 1

    @property
    def code_range(self) -> tuple[int, int]:
        n = len(levels(self.qtype))
        return (-n, n) if self.signed else (0, n - 1)


FORMATS: dict[GGMLQuantizationType, CodebookFormat] = {f.qtype: f for f in (
    CodebookFormat(Q.IQ2_XXS, 8, 32, 4, "parity", (0.5, 1.0, 0.25)),
    CodebookFormat(Q.IQ2_XS, 8, 16, 4, "parity", (0.5, 1.0, 0.25)),
    CodebookFormat(Q.IQ2_S, 8, 16, 4, "free", (0.5, 1.0, 0.25)),
    CodebookFormat(Q.IQ3_XXS, 4, 32, 4, "parity", (0.5, 1.0, 0.5)),
    CodebookFormat(Q.IQ3_S, 4, 32, 4, "free", (1.0, 2.0, 1.0)),
    CodebookFormat(Q.IQ1_S, 8, 32, 3, "shift", (1.0, 2.0, 1.0), shift_block=32),
    CodebookFormat(Q.IQ1_M, 8, 16, 3, "shift", (1.0, 2.0, 1.0), shift_block=8),
)}
QTYPES = tuple(FORMATS)


def _traits(qtype: GGMLQuantizationType):
    return getattr(gguf_quants, qtype.name)


@lru_cache(maxsize=None)
def levels(qtype: GGMLQuantizationType) -> np.ndarray:
    """float32: the values a grid entry takes (the gguf package's grid_map: ggml-common.h's bytes), ascending."""
    return np.array(_traits(qtype).grid_map, dtype=np.float32)


@lru_cache(maxsize=None)
def grid(qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [points, width]: the type's grid (iq2xxs_grid ...), as the gguf package unpacks it from ggml's tables."""
    traits = _traits(qtype)
    traits.init_grid()
    return np.ascontiguousarray(traits.grid.reshape(traits.grid_shape), dtype=np.float32)


@lru_cache(maxsize=None)
def grid_levels(qtype: GGMLQuantizationType) -> np.ndarray:
    """int64 [points, width]: each grid entry's level index."""
    return np.searchsorted(levels(qtype), grid(qtype)).astype(np.int64)


@lru_cache(maxsize=None)
def _index_table(qtype: GGMLQuantizationType) -> np.ndarray:
    """int64 [levels ** width]: the grid index of each vector of level indices (its key: `_keys`), -1 off the grid."""
    base, width = len(levels(qtype)), FORMATS[qtype].width
    table = np.full(base ** width, -1, dtype=np.int64)
    table[_keys(grid_levels(qtype), base)] = np.arange(grid(qtype).shape[0])
    return table


def _keys(level_vectors: np.ndarray, base: int) -> np.ndarray:
    return (level_vectors * base ** np.arange(level_vectors.shape[-1], dtype=np.int64)).sum(-1)


def grid_index(qtype: GGMLQuantizationType, level_vectors: np.ndarray) -> np.ndarray:
    """The grid index of each vector [..., width] of level indices; ValueError if one is not on the grid."""
    index = _index_table(qtype)[_keys(level_vectors.astype(np.int64), len(levels(qtype)))]
    if (index < 0).any():
        raise ValueError(f"{qtype.name} codes off the type's grid: {(index < 0).sum()} vectors are no grid point")
    return index


# ---- bytes


def pack(qtype: GGMLQuantizationType, codes: np.ndarray, scales: np.ndarray, d: np.ndarray,
         shifts: np.ndarray | None = None) -> np.ndarray:
    """GGML's blocks of `codes` [rows, cols] (int8, see the module docstring) with sub-scale codes `scales`
    [rows, cols // scale_block], fp16 `d` [rows, cols // 256] and (IQ1) the shifts' signs [rows, cols //
    shift_block] (1: -1/8): uint8 [rows, cols // 256 * type_bytes]."""
    fmt = FORMATS[qtype]
    codes, scales = np.asarray(codes), np.asarray(scales)
    _check(fmt, codes, scales, np.asarray(d), shifts)
    rows, cols = codes.shape
    blocks = codes.reshape(-1, SUPER_BLOCK).astype(np.int64)
    level_index = (np.abs(blocks) - 1) if fmt.signed else blocks
    index = grid_index(qtype, level_index.reshape(blocks.shape[0], -1, fmt.width))  # [B, vectors]
    negative = (blocks < 0).astype(np.uint8)
    ls = scales.reshape(blocks.shape[0], -1).astype(np.uint32)
    half = np.ascontiguousarray(np.asarray(d, dtype=np.float16).reshape(-1, 1)).view(np.uint8)
    shift = None if shifts is None else np.asarray(shifts).reshape(blocks.shape[0], -1).astype(np.uint32)
    parts = _LAYOUTS[qtype](index.astype(np.uint32), negative, ls, half, shift)
    out = np.concatenate(parts, axis=1)
    assert out.shape[1] == fmt.type_bytes
    return out.reshape(rows, cols // SUPER_BLOCK * fmt.type_bytes)


def _check(fmt: CodebookFormat, codes: np.ndarray, scales: np.ndarray, d: np.ndarray, shifts) -> None:
    name = fmt.name
    if codes.ndim != 2 or codes.shape[1] % SUPER_BLOCK:
        raise ValueError(f"{name} packs [rows, cols] codes with cols a multiple of {SUPER_BLOCK}, got shape {list(codes.shape)}")
    low, high = fmt.code_range
    if not np.issubdtype(codes.dtype, np.integer) or (codes.size and (codes.min() < low or codes.max() > high)):
        raise ValueError(f"{name} codes must be integers in [{low}, {high}]")
    if fmt.signed and codes.size and (codes == 0).any():
        raise ValueError(f"{name} codes are +-(level index + 1): 0 is none")
    rows, cols = codes.shape
    if scales.shape != (rows, cols // fmt.scale_block) or (scales.size and (scales.min() < 0 or scales.max() > fmt.max_scale)):
        raise ValueError(f"{name} sub-scale codes must be [{rows}, {cols // fmt.scale_block}] in [0, {fmt.max_scale}]")
    if d.dtype != np.float16 or d.shape != (rows, cols // SUPER_BLOCK):
        raise ValueError(f"{name} d must be float16 [{rows}, {cols // SUPER_BLOCK}], got {d.dtype} {list(d.shape)}")
    if (shifts is None) != (fmt.shift_block is None):
        raise ValueError(f"{name} {'needs' if shifts is None else 'has no'} shifts")
    if shifts is not None and np.shape(shifts) != (rows, cols // fmt.shift_block):
        raise ValueError(f"{name} shifts must be [{rows}, {cols // fmt.shift_block}]")
    if fmt.signs == "parity" and codes.size and ((codes < 0).reshape(-1, UNIT).sum(1) % 2).any():
        raise ValueError(f"{name} stores 7 signs per 8 weights: each 8's count of negatives must be even")


def _sign_bytes(negative: np.ndarray) -> np.ndarray:
    """[B, 256] -> [B, 32]: bit i of byte k is weight 8k + i's sign."""
    groups = negative.reshape(negative.shape[0], -1, UNIT).astype(np.uint32)
    return (groups << np.arange(UNIT, dtype=np.uint32)).sum(-1)


def _u8(values: np.ndarray) -> np.ndarray:
    return values.astype(np.uint8)


def _u16(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values.astype("<u2")).view(np.uint8).reshape(values.shape[0], -1)


def _u32(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values.astype("<u4")).view(np.uint8).reshape(values.shape[0], -1)


def _nibbles(ls: np.ndarray) -> np.ndarray:
    return _u8(ls[:, 0::2] | (ls[:, 1::2] << 4))


def _parity_words(negative: np.ndarray, ls: np.ndarray) -> np.ndarray:
    """IQ2_XXS / IQ3_XXS: per 32 weights, the four 7-bit sign codes in bits 7k and ls in bits 28-31."""
    signs = (_sign_bytes(negative) & 127).reshape(negative.shape[0], -1, 4)
    return (signs << (7 * np.arange(4, dtype=np.uint32))).sum(-1) | (ls << 28)


def _iq2_xxs(index, negative, ls, half, shift):  # {fp16 d; uint32 {4 grid bytes, signs and ls} per 32 weights}
    words = np.stack([(index.reshape(index.shape[0], -1, 4) << (8 * np.arange(4, dtype=np.uint32))).sum(-1),
                      _parity_words(negative, ls)], axis=-1)
    return [half, _u32(words.reshape(index.shape[0], -1))]


def _iq2_xs(index, negative, ls, half, shift):  # {fp16 d; uint16 qs[32] = index | signs << 9; scales[8]}
    return [half, _u16(index | ((_sign_bytes(negative) & 127) << 9)), _nibbles(ls)]


def _iq2_s(index, negative, ls, half, shift):  # {fp16 d; qs[32]; signs[32]; qh[8]: index bits 8-9; scales[8]}
    high = (index >> 8).reshape(index.shape[0], -1, 4)
    qh = (high << (2 * np.arange(4, dtype=np.uint32))).sum(-1)
    return [half, _u8(index & 255), _u8(_sign_bytes(negative)), _u8(qh), _nibbles(ls)]


def _iq3_xxs(index, negative, ls, half, shift):  # {fp16 d; qs[64] grid bytes; uint32 signs and ls per 32}
    return [half, _u8(index), _u32(_parity_words(negative, ls))]


def _iq3_s(index, negative, ls, half, shift):  # {fp16 d; qs[64]; qh[8]: index bit 8; signs[32]; scales[4]}
    high = (index >> 8).reshape(index.shape[0], -1, 8)
    qh = (high << np.arange(8, dtype=np.uint32)).sum(-1)
    return [half, _u8(index & 255), _u8(qh), _u8(_sign_bytes(negative)), _nibbles(ls)]


def _iq1_s(index, negative, ls, half, shift):  # {fp16 d; qs[32]; uint16 qh[8]: index bits 8-10, ls, shift sign}
    high = (index >> 8).reshape(index.shape[0], -1, 4)
    qh = (high << (3 * np.arange(4, dtype=np.uint32))).sum(-1) | (ls << 12) | (shift << 15)
    return [half, _u8(index & 255), _u16(qh)]


def _iq1_m(index, negative, ls, half, shift):  # {qs[32]; qh[16]: per vector a nibble; uint16 scales[4] with d's bits}
    nibble = ((index >> 8) | (shift << 3)).reshape(index.shape[0], -1, 2)
    qh = nibble[..., 0] | (nibble[..., 1] << 4)
    bits = half.copy().view("<u2").astype(np.uint32)  # [B, 1]
    d_parts = (bits >> (4 * np.arange(4, dtype=np.uint32))) & 0xF
    words = (ls.reshape(ls.shape[0], 4, 4) << (3 * np.arange(4, dtype=np.uint32))).sum(-1) | (d_parts << 12)
    return [_u8(index & 255), _u8(qh), _u16(words)]


_LAYOUTS = {Q.IQ2_XXS: _iq2_xxs, Q.IQ2_XS: _iq2_xs, Q.IQ2_S: _iq2_s, Q.IQ3_XXS: _iq3_xxs, Q.IQ3_S: _iq3_s,
            Q.IQ1_S: _iq1_s, Q.IQ1_M: _iq1_m}
