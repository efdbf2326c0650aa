"""GGML block bytes from quantkit's integers: one packer per llama.cpp type, laid out as ggml-common.h's structs.

Every packer takes the integer codes of a [rows, cols] weight and its scale codes (numpy; a caller holding torch
tensors converts them) and returns uint8 [rows, cols // block_weights * type_bytes]: each row is its blocks, one
after the other, as a GGUF file stores them. Nothing here rounds a float: a value that is off the type's grid
is a caller's bug, refused with a ValueError. `FORMATS` is the one description of each type's grid that the
GGUF writer and the quantizers (`quant.k_grids`) share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType


@dataclass(frozen=True)
class BlockFormat:
    """One GGML type's grid. A weight of a super-block is `d * scale * code` (minus `dmin * min` where
    `has_mins`), with one scale code (and min code) per `sub_block` weights and one fp16 d (and dmin) per
    `super_block`; the legacy types (Q8_0, Q4_0, ...) have a fp16 d (and m) per block of 32 and no scale codes
    (`scale_range` None)."""

    qtype: GGMLQuantizationType
    sub_block: int
    super_block: int
    code_range: tuple[int, int]
    scale_range: tuple[int, int] | None
    has_mins: bool

    @property
    def type_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def bits(self) -> int:
        return (self.code_range[1] - self.code_range[0]).bit_length()


FORMATS: dict[GGMLQuantizationType, BlockFormat] = {f.qtype: f for f in (
    BlockFormat(Q.Q8_0, 32, 32, (-128, 127), None, False),
    BlockFormat(Q.Q4_0, 32, 32, (-8, 7), None, False),
    BlockFormat(Q.Q4_1, 32, 32, (0, 15), None, True),
    BlockFormat(Q.Q5_0, 32, 32, (-16, 15), None, False),
    BlockFormat(Q.Q5_1, 32, 32, (0, 31), None, True),
    BlockFormat(Q.Q2_K, 16, 256, (0, 3), (0, 15), True),
    BlockFormat(Q.Q3_K, 16, 256, (-4, 3), (-32, 31), False),
    BlockFormat(Q.Q4_K, 32, 256, (0, 15), (0, 63), True),
    BlockFormat(Q.Q5_K, 32, 256, (0, 31), (0, 63), True),
    BlockFormat(Q.Q6_K, 16, 256, (-32, 31), (-128, 127), False),
    BlockFormat(Q.MXFP4, 32, 32, (0, 15), (0, 255), False),  # codes: E2M1 bit patterns; scale codes: E8M0 exponents
)}


def block_format(qtype: GGMLQuantizationType) -> BlockFormat:
    if qtype not in FORMATS:
        names = ", ".join(q.name for q in FORMATS)
        raise ValueError(f"no block packer for GGML type {getattr(qtype, 'name', qtype)}; supported: {names}")
    return FORMATS[qtype]


# ---- checks


def _check_codes(codes: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    codes = np.asarray(codes)
    if codes.ndim != 2:
        raise ValueError(f"{fmt.qtype.name} codes must be 2-D [rows, cols], got shape {codes.shape}")
    if codes.shape[1] % fmt.super_block:
        raise ValueError(f"{fmt.qtype.name} packs rows of a multiple of {fmt.super_block} weights; "
                         f"{codes.shape[1]} columns is not one (keep this tensor in another type)")
    _check_range(codes, fmt.code_range, f"{fmt.qtype.name} codes")
    return codes.astype(np.int16)


def _check_range(values: np.ndarray, bounds: tuple[int, int], what: str) -> None:
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"{what} must be integers, got {values.dtype}")
    if values.size and (values.min() < bounds[0] or values.max() > bounds[1]):
        raise ValueError(f"{what} must lie in [{bounds[0]}, {bounds[1]}], got [{values.min()}, {values.max()}]")


def _check_scale_codes(values: np.ndarray, codes: np.ndarray, fmt: BlockFormat, bounds: tuple[int, int], what: str) -> np.ndarray:
    values = np.asarray(values)
    _check_shape(values, codes, fmt.sub_block, f"{fmt.qtype.name} {what}")
    _check_range(values, bounds, f"{fmt.qtype.name} {what}")
    return values.astype(np.int16)


def _check_fp16(values: np.ndarray, codes: np.ndarray, fmt: BlockFormat, what: str) -> np.ndarray:
    values = np.asarray(values)
    if values.dtype != np.float16:
        raise ValueError(f"{fmt.qtype.name} {what} must be float16 (the value stored), got {values.dtype}")
    _check_shape(values, codes, fmt.super_block, f"{fmt.qtype.name} {what}")
    return values


def _check_shape(values: np.ndarray, codes: np.ndarray, per: int, what: str) -> None:
    expected = (codes.shape[0], codes.shape[1] // per)
    if values.shape != expected:
        raise ValueError(f"{what} must have shape {list(expected)} (one per {per} weights), got {list(values.shape)}")


# ---- bit layouts


def _blocks(codes: np.ndarray, size: int) -> np.ndarray:
    return codes.reshape(-1, size).astype(np.uint8)


def _half_bytes(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values.reshape(-1, 1).astype(np.float16)).view(np.uint8)


def _nibbles(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return (low & 0xF) | ((high & 0xF) << 4)


def _crumbs(levels: np.ndarray) -> np.ndarray:
    """2-bit levels [blocks, 256] as ggml's Q2_K/Q3_K qs: byte 32c + l holds levels 128c + 32s + l in bits 2s."""
    parts = levels.reshape(-1, 2, 4, 32)
    packed = parts[:, :, 0] | (parts[:, :, 1] << 2) | (parts[:, :, 2] << 4) | (parts[:, :, 3] << 6)
    return packed.reshape(-1, 64)


def _bit_planes(bits: np.ndarray, stride: int) -> np.ndarray:
    """One bit per weight [blocks, n]: byte m holds the bits of weights m, m + stride, m + 2 stride, ... in bits 0..7."""
    planes = bits.reshape(bits.shape[0], -1, stride).astype(np.uint8)
    return np.bitwise_or.reduce(planes << np.arange(planes.shape[1], dtype=np.uint8)[None, :, None], axis=1)


def _k4_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [blocks, 8] in Q4_K/Q5_K's 12 bytes (the inverse of ggml's get_scale_min_k4)."""
    sc, mn = scales.astype(np.uint8), mins.astype(np.uint8)
    low = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    return np.concatenate([low, mid, _nibbles(sc[:, 4:], mn[:, 4:])], axis=1)


def _q3_scales(scales: np.ndarray) -> np.ndarray:
    """Sixteen 6-bit scales (stored + 32) [blocks, 16] in Q3_K's 12 bytes: low nibbles of 0-7 and 8-15 in bytes
    0-7, the two high bits of scale 4g + i in bits 2g of byte 8 + i."""
    stored = (scales + 32).astype(np.uint8)
    high = (stored >> 4).reshape(-1, 4, 4)
    tops = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
    return np.concatenate([_nibbles(stored[:, :8], stored[:, 8:]), tops], axis=1)


def _rows(parts: list[np.ndarray], rows: int, fmt: BlockFormat) -> np.ndarray:
    packed = np.concatenate(parts, axis=1)
    assert packed.shape[1] == fmt.type_bytes
    return packed.reshape(rows, -1)


# ---- packers, one per type


def pack_q8_0(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """block_q8_0 {fp16 d; int8 qs[32]}: value = d * q, q in [-128, 127]."""
    fmt = FORMATS[Q.Q8_0]
    q = _check_codes(codes, fmt)
    d = _check_fp16(d, q, fmt, "d")
    return _rows([_half_bytes(d), q.reshape(-1, 32).astype(np.int8).view(np.uint8)], q.shape[0], fmt)


def pack_q4_0(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """block_q4_0 {fp16 d; qs[16]}: value = d * q, q in [-8, 7] stored as the nibble q + 8; byte j holds weights
    j (low nibble) and j + 16 (high)."""
    fmt = FORMATS[Q.Q4_0]
    q = _check_codes(codes, fmt)
    d = _check_fp16(d, q, fmt, "d")
    levels = _blocks(q + 8, 32)
    return _rows([_half_bytes(d), _nibbles(levels[:, :16], levels[:, 16:])], q.shape[0], fmt)


def pack_q4_1(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """block_q4_1 {fp16 d, m; qs[16]}: value = d * q + m, q in [0, 15]."""
    fmt = FORMATS[Q.Q4_1]
    q = _check_codes(codes, fmt)
    d, m = _check_fp16(d, q, fmt, "d"), _check_fp16(m, q, fmt, "m")
    levels = _blocks(q, 32)
    return _rows([_half_bytes(d), _half_bytes(m), _nibbles(levels[:, :16], levels[:, 16:])], q.shape[0], fmt)


def pack_q5_0(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """block_q5_0 {fp16 d; qh[4]; qs[16]}: value = d * q, q in [-16, 15] stored as q + 16; bit j of the
    little-endian qh is weight j's fifth bit."""
    fmt = FORMATS[Q.Q5_0]
    q = _check_codes(codes, fmt)
    d = _check_fp16(d, q, fmt, "d")
    levels = _blocks(q + 16, 32)
    qh = np.packbits(levels >> 4, axis=1, bitorder="little")
    return _rows([_half_bytes(d), qh, _nibbles(levels[:, :16], levels[:, 16:])], q.shape[0], fmt)


def pack_q5_1(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """block_q5_1 {fp16 d, m; qh[4]; qs[16]}: value = d * q + m, q in [0, 31]."""
    fmt = FORMATS[Q.Q5_1]
    q = _check_codes(codes, fmt)
    d, m = _check_fp16(d, q, fmt, "d"), _check_fp16(m, q, fmt, "m")
    levels = _blocks(q, 32)
    qh = np.packbits(levels >> 4, axis=1, bitorder="little")
    return _rows([_half_bytes(d), _half_bytes(m), qh, _nibbles(levels[:, :16], levels[:, 16:])], q.shape[0], fmt)


def pack_q2_k(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    """block_q2_K {scales[16]; qs[64]; fp16 d, dmin}: value = d * sc * q - dmin * mn per sub-block of 16, q in
    [0, 3], sc and mn in [0, 15] (scale byte = sc | mn << 4)."""
    fmt = FORMATS[Q.Q2_K]
    q = _check_codes(codes, fmt)
    sc = _check_scale_codes(scales, q, fmt, fmt.scale_range, "scales").reshape(-1, 16)
    mn = _check_scale_codes(mins, q, fmt, fmt.scale_range, "mins").reshape(-1, 16)
    d, dmin = _check_fp16(d, q, fmt, "d"), _check_fp16(dmin, q, fmt, "dmin")
    scale_bytes = _nibbles(sc.astype(np.uint8), mn.astype(np.uint8))
    return _rows([scale_bytes, _crumbs(_blocks(q, 256)), _half_bytes(d), _half_bytes(dmin)], q.shape[0], fmt)


def pack_q3_k(codes: np.ndarray, scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """block_q3_K {hmask[32]; qs[64]; scales[12]; fp16 d}: value = d * sc * q per sub-block of 16, q in [-4, 3]
    stored as q + 4 (the third bit in hmask: byte m, bit b is weight 32b + m), sc in [-32, 31] stored as sc + 32."""
    fmt = FORMATS[Q.Q3_K]
    q = _check_codes(codes, fmt)
    sc = _check_scale_codes(scales, q, fmt, fmt.scale_range, "scales").reshape(-1, 16)
    d = _check_fp16(d, q, fmt, "d")
    levels = _blocks(q + 4, 256)
    parts = [_bit_planes(levels >> 2, 32), _crumbs(levels & 3), _q3_scales(sc), _half_bytes(d)]
    return _rows(parts, q.shape[0], fmt)


def pack_q4_k(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    """block_q4_K {fp16 d, dmin; scales[12]; qs[128]}: value = d * sc * q - dmin * mn per sub-block of 32, q in
    [0, 15], sc and mn in [0, 63]; qs byte 32c + l holds weights 64c + l (low nibble) and 64c + 32 + l."""
    fmt = FORMATS[Q.Q4_K]
    q = _check_codes(codes, fmt)
    sc = _check_scale_codes(scales, q, fmt, fmt.scale_range, "scales").reshape(-1, 8)
    mn = _check_scale_codes(mins, q, fmt, fmt.scale_range, "mins").reshape(-1, 8)
    d, dmin = _check_fp16(d, q, fmt, "d"), _check_fp16(dmin, q, fmt, "dmin")
    levels = _blocks(q, 256).reshape(-1, 4, 2, 32)
    qs = _nibbles(levels[:, :, 0], levels[:, :, 1]).reshape(-1, 128)
    return _rows([_half_bytes(d), _half_bytes(dmin), _k4_scales(sc, mn), qs], q.shape[0], fmt)


def pack_q5_k(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    """block_q5_K {fp16 d, dmin; scales[12]; qh[32]; qs[128]}: Q4_K with q in [0, 31], the fifth bit of weight
    32k + j in bit k of qh[j]."""
    fmt = FORMATS[Q.Q5_K]
    q = _check_codes(codes, fmt)
    sc = _check_scale_codes(scales, q, fmt, fmt.scale_range, "scales").reshape(-1, 8)
    mn = _check_scale_codes(mins, q, fmt, fmt.scale_range, "mins").reshape(-1, 8)
    d, dmin = _check_fp16(d, q, fmt, "d"), _check_fp16(dmin, q, fmt, "dmin")
    levels = _blocks(q, 256)
    halves = levels.reshape(-1, 4, 2, 32)
    qs = _nibbles(halves[:, :, 0], halves[:, :, 1]).reshape(-1, 128)
    return _rows([_half_bytes(d), _half_bytes(dmin), _k4_scales(sc, mn), _bit_planes(levels >> 4, 32), qs], q.shape[0], fmt)


def pack_q6_k(codes: np.ndarray, scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """block_q6_K {ql[128]; qh[64]; int8 scales[16]; fp16 d}: value = d * sc * q per sub-block of 16, q in
    [-32, 31] stored as q + 32. In each half of 128 weights (quarters a = 0..3 of 32), ql byte 32a' + l holds
    quarters a' and a' + 2 (a' = 0, 1) and qh byte l holds the two high bits of quarter a in bits 2a."""
    fmt = FORMATS[Q.Q6_K]
    q = _check_codes(codes, fmt)
    sc = _check_scale_codes(scales, q, fmt, fmt.scale_range, "scales").reshape(-1, 16)
    d = _check_fp16(d, q, fmt, "d")
    quarters = _blocks(q + 32, 256).reshape(-1, 2, 4, 32)
    ql = _nibbles(quarters[:, :, :2], quarters[:, :, 2:]).reshape(-1, 128)
    high = quarters >> 4
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    return _rows([ql, qh, sc.astype(np.int8).view(np.uint8), _half_bytes(d)], q.shape[0], fmt)


def pack_mxfp4(codes: np.ndarray, e: np.ndarray) -> np.ndarray:
    """block_mxfp4 {uint8 e; qs[16]}: value = kvalues_mxfp4[q] * 2^(e - 128) = e2m1(q) * 2^(e - 127), q the E2M1 bit
    pattern (sign in bit 3; kvalues_mxfp4 holds the e2m1 values doubled, GGML_E8M0_TO_FP32_HALF the scale halved);
    byte j holds weights j (low nibble) and j + 16 (high)."""
    fmt = FORMATS[Q.MXFP4]
    q = _check_codes(codes, fmt)
    e = _check_scale_codes(e, q, fmt, fmt.scale_range, "e")
    levels = _blocks(q, 32)
    return _rows([e.reshape(-1, 1).astype(np.uint8), _nibbles(levels[:, :16], levels[:, 16:])], q.shape[0], fmt)


PACKERS = {
    Q.Q8_0: pack_q8_0, Q.Q4_0: pack_q4_0, Q.Q4_1: pack_q4_1, Q.Q5_0: pack_q5_0, Q.Q5_1: pack_q5_1,
    Q.Q2_K: pack_q2_k, Q.Q3_K: pack_q3_k, Q.Q4_K: pack_q4_k, Q.Q5_K: pack_q5_k, Q.Q6_K: pack_q6_k,
    Q.MXFP4: pack_mxfp4,
}


def pack(qtype: GGMLQuantizationType, codes: np.ndarray, **scales: np.ndarray) -> np.ndarray:
    """The packer of `qtype`, called with the codes and its scale arguments by name (d; m; scales, mins, dmin; e), a
    block of rows at a time (`row_blocks`: the packers' integer intermediates stay small for a 128k-token
    embedding; every argument is per row)."""
    block_format(qtype)
    if np.ndim(codes) != 2 or len(blocks := row_blocks(*np.shape(codes))) == 1:
        return PACKERS[qtype](codes, **scales)  # which refuses codes that are not [rows, cols]
    out = np.empty((np.shape(codes)[0], np.shape(codes)[1] // FORMATS[qtype].super_block * FORMATS[qtype].type_bytes), np.uint8)
    for rows in blocks:
        out[rows] = PACKERS[qtype](codes[rows], **{name: values[rows] for name, values in scales.items()})
    return out


ROW_BLOCK_ELEMENTS = 1 << 22  # weights in a block of rows that the packers and the K-grid rounding take at once


def row_blocks(rows: int, cols: int) -> list[slice]:
    """Slices of a [rows, cols] weight's rows, each of about ROW_BLOCK_ELEMENTS weights (at least one row): work
    done a block at a time holds intermediates of that size whatever the tensor (an 8B model's 128k x 4096
    embedding is 2 GiB in float32)."""
    per_block = max(1, ROW_BLOCK_ELEMENTS // max(1, cols))
    return [slice(first, first + per_block) for first in range(0, rows, per_block)]
