"""Compiled CPU loops (numba) of ggml's searches and roundings, for the grids that hold them as torch ops.

`k_grids` and `iq_grids` port llama.cpp's quantizers as torch ops over a chunk of sub-blocks held as columns: a
few dozen passes through memory per trial grid, which is what a GPU wants and a CPU pays for (the K search cost
~0.4 s per million weights, llama.cpp's own loop ~0.05 s). Here the same loops run over one sub-block at a time in
registers, as ggml runs them. Each kernel is its torch twin's arithmetic operation for operation: float32
throughout (every constant a float32, never a Python float, which would widen the expression to float64), ggml's
order of operations, sums from the first term to the last, rounding half to even (`np.rint`), IEEE division
(`error_model="numpy"`: a zero divisor gives inf or NaN as in C, not an exception), no fast-math (no fused
multiply-adds). Constants that the twins compute in numpy come in as float32 arrays made by the twins' own
expressions. So every code, scale code and d is the torch twin's, bit for bit (tests/unit/grids/test_cpu_kernels.py
checks each pair on weights that take every branch), and the torch versions stay the reference and the device path.

The kernels take finite float32 weights (the callers fall back to torch otherwise) and release the GIL: the
callers run chunks of super-blocks (`cpu_dispatch.map_chunks`) or blocks of rows in threads. Compiled on first use and
cached on disk (numba's cache: beside this file, or under the user's cache directory when that is read-only).
"""

from __future__ import annotations

import numpy as np
from numba import njit

F32 = np.float32
_JIT = dict(nogil=True, cache=True, error_model="numpy")


# ---- K-quants: the reference quantizers (no importance)

# Q6_K's search runs LANES sub-blocks side by side, element i of every lane before element i + 1: a sub-block's sums
# are chains of dependent additions too short to keep a core busy, and the lanes' independent chains overlap (1.7x
# here); each lane's arithmetic is still its own sub-block's, in ggml's order. Lanes past the last sub-block hold
# zeros, whose results are dropped. (Q2_K/Q4_K/Q5_K's search, whose trial grids each take three passes, ran 1.5x
# slower so: it runs one sub-block at a time.)
LANES = 16


@njit(**_JIT)
def search_with_mins(blocks, sub, nmax, numerators, use_mad, abs_weights, top, eps,
                     scale_codes, d, min_codes, dmin, codes):
    """k_grids._search_with_mins without importance, on super-blocks [S, 256]: per sub-block make_qkx2_quants
    (weights |x|, or sqrt(mean x^2) + |x|; `numerators[k]`: trial grid k's rmin + rdelta * k + nmax), then each
    super-block's scales and mins as codes under their largest (`_max_scale_codes`). Writes scale_codes, min_codes
    [S, 256 // sub] (float32 codes), d, dmin [S] (float32, before the fp16 rounding) and codes [S, 256] (int8, the
    search's levels)."""
    n_sub = 256 // sub
    fnmax, zero, one = F32(nmax), F32(0.0), F32(1.0)
    w = np.empty(sub, np.float32)
    levels = np.empty(sub, np.float32)
    scales = np.empty(n_sub, np.float32)
    mins = np.empty(n_sub, np.float32)
    for s in range(blocks.shape[0]):
        for j in range(n_sub):
            x = blocks[s, j * sub:(j + 1) * sub]
            _mins_weights(x, abs_weights, F32(sub), w)
            scale, low, flat = _fit_scale_and_min(x, w, fnmax, numerators, use_mad, levels)
            if flat:
                scales[j], mins[j] = zero, -low
                for i in range(sub):
                    codes[s, j * sub + i] = 0
            else:
                scales[j], mins[j] = scale, -low
                for i in range(sub):
                    codes[s, j * sub + i] = np.int8(levels[i])
        d[s] = _max_scale_codes(scales, F32(top), scale_codes[s])
        dmin[s] = _max_scale_codes(mins, F32(top), min_codes[s])
    return one


@njit(**_JIT)
def _mins_weights(x, abs_weights, n, w):
    """The reference quantizers' weights: |x| (Q2_K), else sqrt(sum x^2 / n) + |x| (correctly rounded sqrtf)."""
    if abs_weights:
        for i in range(x.shape[0]):
            w[i] = abs(x[i])
        return
    total = x[0] * x[0]
    for i in range(1, x.shape[0]):
        total += x[i] * x[i]
    root = np.sqrt(total / n)
    for i in range(x.shape[0]):
        w[i] = root + abs(x[i])


@njit(**_JIT)
def _fit_scale_and_min(x, w, nmax, numerators, use_mad, levels):
    """make_qkx2_quants on one sub-block, as k_grids._fit_scale_and_min: returns (scale, the best min (<= 0), flat)
    and leaves the best levels in `levels`."""
    n = x.shape[0]
    zero, one = F32(0.0), F32(1.0)
    low, high = x[0], x[0]
    for i in range(1, n):
        if x[i] < low:
            low = x[i]
        if x[i] > high:
            high = x[i]
    if low > zero:
        low = zero
    if high == low:
        return zero, low, True
    sum_w, sum_x = w[0], w[0] * x[0]
    for i in range(1, n):
        sum_w += w[i]
        sum_x += w[i] * x[i]
    iscale = nmax / (high - low)
    scale, offset = one / iscale, low
    _min_levels(x, iscale, offset, nmax, levels)
    best = _min_error(x, w, levels, scale, offset, use_mad)
    best_iscale, best_shift = iscale, offset
    for k in range(numerators.shape[0]):
        trial_iscale = numerators[k] / (high - offset)
        _min_levels(x, trial_iscale, offset, nmax, levels)
        wl = w[0] * levels[0]
        sum_l, sum_l2, sum_xl = wl, wl * levels[0], wl * x[0]
        for i in range(1, n):
            wl = w[i] * levels[i]
            sum_l += wl
            sum_l2 += wl * levels[i]
            sum_xl += wl * x[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        if this_min > zero:
            this_min = zero
            this_scale = sum_xl / sum_l2
        error = _min_error(x, w, levels, this_scale, this_min, use_mad)
        if det > zero and error < best:
            best_iscale, best_shift = trial_iscale, offset
            best, scale, offset = error, this_scale, this_min
    _min_levels(x, best_iscale, best_shift, nmax, levels)
    return scale, offset, False


@njit(**_JIT)
def _min_levels(x, iscale, shift, nmax, out):
    """clamp(rint(iscale * (x - shift)), 0, nmax); NaN stays NaN, as torch's clamp keeps it."""
    zero = F32(0.0)
    for i in range(x.shape[0]):
        level = np.rint((x[i] - shift) * iscale)
        if level < zero:
            level = zero
        elif level > nmax:
            level = nmax
        out[i] = level


@njit(**_JIT)
def _min_error(x, w, levels, scale, offset, use_mad):
    """The ordered sum of w * |L * scale + offset - x| (use_mad), else of w * (L * scale + offset - x)^2."""
    total = F32(0.0)
    for i in range(x.shape[0]):
        diff = levels[i] * scale + offset - x[i]
        term = (abs(diff) if use_mad else diff * diff) * w[i]
        total = term if i == 0 else total + term
    return total


@njit(**_JIT)
def _max_scale_codes(values, top, out):
    """k_grids._max_scale_codes of one super-block's non-negative scales: codes round(top * v / max) (its uint8
    remainder, then at most top) into `out`; returns max / top."""
    zero = F32(0.0)
    peak = values[0]
    for i in range(1, values.shape[0]):
        if values[i] > peak:
            peak = values[i]
    if not peak > zero:
        peak = zero
    inverse = top / peak if peak > zero else zero
    for i in range(values.shape[0]):
        code = np.fmod(np.rint(inverse * values[i]), F32(256.0))
        if code != zero and code < zero:
            code += F32(256.0)
        out[i] = code if not code > top else top
    return peak / top


@njit(**_JIT)
def search_q6_k(blocks, numerators, eps, scale_codes, d, codes):
    """k_grids._search_q6_k without importance, on super-blocks [S, 256]: per sub-block of 16 make_qx_quants
    (rmse_type 1, weights x^2, `numerators`: its 19 trial grids' -(nmax + 0.1 * is)), then the scales' codes under
    the one of largest magnitude; a super-block whose scales' largest magnitude is below `eps` is all zeros (levels
    -32). Writes scale_codes [S, 16] (float32), d [S] (float32, before fp16) and codes [S, 256] (int8)."""
    zero, one = F32(0.0), F32(1.0)
    flat = blocks.reshape(-1)
    count = flat.shape[0] // 16
    scales = np.empty(count, np.float32)
    x = np.zeros((16, LANES), np.float32)
    levels = np.empty((16, LANES), np.float32)
    lane_scale = np.empty(LANES, np.float32)
    for first in range(0, count, LANES):
        lanes = min(LANES, count - first)
        for t in range(lanes):
            for i in range(16):
                x[i, t] = flat[(first + t) * 16 + i]
        if lanes < LANES:
            x[:, lanes:] = zero
        _fit_signed_scale(x, F32(-32.0), F32(31.0), numerators, eps, levels, lane_scale)
        for t in range(lanes):
            scales[first + t] = lane_scale[t]
            for i in range(16):
                codes.reshape(-1)[(first + t) * 16 + i] = np.int8(levels[i, t])
    for s in range(blocks.shape[0]):
        own = scales[s * 16:(s + 1) * 16]
        peak = _first_absmax(own)  # the first of ties, as torch's argmax of |v|
        if abs(peak) < eps:
            d[s] = zero
            scale_codes[s, :] = zero
            codes[s, :] = -32
            continue
        iscale = F32(-128.0) / peak
        for j in range(16):
            scale_codes[s, j] = _clamp(np.rint(iscale * own[j]), F32(-128.0), F32(127.0))
        d[s] = one / iscale
    return 0


@njit(**_JIT)
def _fit_signed_scale(x, low, high, numerators, eps, levels, scale_out):
    """make_qx_quants (rmse_type 1, weights x^2) on lanes x [n, LANES], as k_grids._fit_signed_scale: each lane's
    scale into scale_out and its levels into `levels` (a lane whose largest magnitude is below eps: 0 and `low`)."""
    n = x.shape[0]
    zero = F32(0.0)
    peak, largest = x[0].copy(), np.abs(x[0])
    for i in range(1, n):
        for t in range(LANES):
            magnitude = abs(x[i, t])
            if magnitude > largest[t]:
                peak[t], largest[t] = x[i, t], magnitude
    w = x * x
    wx = w * x
    sum_lx, sum_l2 = np.empty(LANES, np.float32), np.empty(LANES, np.float32)
    scale, best, best_iscale = np.empty(LANES, np.float32), np.empty(LANES, np.float32), np.empty(LANES, np.float32)
    for k in range(numerators.shape[0]):
        iscale = numerators[k] / peak
        for t in range(LANES):
            level = _clamp(np.rint(x[0, t] * iscale[t]), low, high)
            sum_lx[t], sum_l2[t] = level * wx[0, t], level * w[0, t] * level
        for i in range(1, n):
            for t in range(LANES):
                level = _clamp(np.rint(x[i, t] * iscale[t]), low, high)
                sum_lx[t] += level * wx[i, t]
                sum_l2[t] += level * w[i, t] * level
        for t in range(LANES):
            if k == 0:
                scale[t] = sum_lx[t] / sum_l2[t] if sum_l2[t] != zero else zero
                best[t], best_iscale[t] = scale[t] * sum_lx[t], iscale[t]
            elif sum_l2[t] > zero and sum_lx[t] * sum_lx[t] > best[t] * sum_l2[t]:
                scale[t] = sum_lx[t] / sum_l2[t]
                best[t], best_iscale[t] = scale[t] * sum_lx[t], iscale[t]
    for i in range(n):
        for t in range(LANES):
            levels[i, t] = _clamp(np.rint(x[i, t] * best_iscale[t]), low, high)
    for t in range(LANES):
        if abs(peak[t]) < eps:
            scale[t] = zero
            for i in range(n):
                levels[i, t] = low
        scale_out[t] = scale[t]


# ---- rounding on a fixed K grid


@njit(**_JIT)
def round_k(x, d, scales, dmin, mins, sub, first_column, low, high, fallback, rtol, atol, out):
    """k_grids.round_k on rows x [R, C] (float32; the grid's columns from `first_column` on): code =
    clamp(rint((x + dmin * mn) / (d * sc)), low, high) per sub-block (no offset where `mins` has no columns), and
    `fallback`'s code where the step d * sc is 0. d, dmin: float32 [R, cols // 256] (the stored fp16); scales,
    mins: float32 codes [R, cols // sub]. Writes int8 `out` [R, C]; returns how many codes decode (d * sc * code -
    dmin * mn) farther than atol + rtol * |x| from x (0 when rtol < 0: no check)."""
    zero = F32(0.0)
    has_mins, check = mins.shape[1] > 0, rtol >= zero
    off = 0
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            column = first_column + c
            j, s = column // sub, column // 256
            step = d[r, s] * scales[r, j]
            offset = dmin[r, s] * mins[r, j] if has_mins else zero
            if step == zero:
                code = F32(fallback[r, c])
            else:
                code = _clamp(np.rint((x[r, c] + offset if has_mins else x[r, c]) / step), low, high)
            out[r, c] = np.int8(code)
            if check and not abs(step * code - offset - x[r, c]) <= atol + rtol * abs(x[r, c]):
                off += 1
    return off


# ---- IQ4_NL / IQ4_XS: the scale search without importance, and rounding on a fixed grid


@njit(**_JIT)
def search_iq4(blocks, trials, table_values, table_low, eps, xs, scale_codes, d):
    """iq_grids._search without importance on super-blocks [S, super_block] (blocks of 32): each block's scale by
    quantize_row_iq4_nl_impl's search (weights x^2; `trials`: the 16 trial grids' numerators, the first 1 / (max /
    127) given as 0 and computed here), then for IQ4_XS (`xs`) each super-block's d = -largest / 32 and the blocks'
    sub-scale codes ls in [0, 63]. `table_values[floor(2 * x * iscale) - table_low]` is the table value of a scaled
    weight. Writes d [S] (float32: the search's d, the block's scale for IQ4_NL) and (xs) scale_codes [S, n] int8."""
    zero, one, two = F32(0.0), F32(1.0), F32(2.0)
    n_blocks = blocks.shape[1] // 32
    scales = np.empty(n_blocks, np.float32)
    w = np.empty(32, np.float32)
    iscales = np.empty(trials.shape[0], np.float32)
    for s in range(blocks.shape[0]):
        for b in range(n_blocks):
            x = blocks[s, b * 32:(b + 1) * 32]
            for i in range(32):
                w[i] = x[i] * x[i]
            scales[b] = _fit_iq4_scale(x, w, trials, table_values, table_low, eps, iscales, two)
        if not xs:
            d[s] = scales[0]
            continue
        peak, largest = zero, zero
        for b in range(n_blocks):
            if abs(scales[b]) > largest:
                peak, largest = scales[b], abs(scales[b])
        d_s = -peak / F32(32.0)
        inverse = one / d_s if d_s != zero else zero
        for b in range(n_blocks):
            scale_codes[s, b] = np.int8(_clamp(np.rint(inverse * scales[b]), F32(-32.0), F32(31.0)) + F32(32.0))
        d[s] = d_s
    return one


@njit(**_JIT)
def _fit_iq4_scale(x, w, trials, table_values, table_low, eps, iscales, two):
    """iq_grids._fit_block_scales on one block of 32."""
    zero, one = F32(0.0), F32(1.0)
    peak = _first_absmax(x)
    if abs(peak) < eps:
        return zero
    iscales[0] = one / (peak / F32(127.0))
    for t in range(1, trials.shape[0]):
        iscales[t] = trials[t] / peak
    scale, best = zero, zero
    for t in range(trials.shape[0]):
        doubled = iscales[t] * two
        sum_qx, sum_q2 = zero, zero
        for i in range(32):
            q = table_values[np.int64(np.floor(doubled * x[i])) - table_low]
            wq = q * w[i]
            sum_qx += wq * x[i]
            sum_q2 += wq * q
        if t == 0:
            scale = sum_qx / sum_q2 if sum_q2 > zero else zero
            best = scale * sum_qx
        elif sum_q2 > zero and sum_qx * sum_qx > best * sum_q2:
            scale = sum_qx / sum_q2
            best = scale * sum_qx
    return scale


@njit(**_JIT)
def round_iq4(x, inverse, steps, first_column, table_codes, kvalues, table_low, table_high, rtol, atol, out):
    """iq_grids' rounding on rows x [R, C] (float32; the grid's columns from `first_column` on): the code of
    floor(2 * x * inverse) clamped to the table, `inverse` [R, cols // 32] float32 each block's 1 / step (0 where
    the step is 0). Writes int8 `out` [R, C]; returns how many codes decode (`steps`, each block's stored step, times
    the table value) farther than atol + rtol * |x| from x (0 when rtol < 0: no check)."""
    two, check = F32(2.0), rtol >= F32(0.0)
    off = 0
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            block = (first_column + c) // 32
            doubled = np.floor(inverse[r, block] * x[r, c] * two)
            code = table_codes[np.int64(_clamp(doubled, F32(table_low), F32(table_high))) - table_low]
            out[r, c] = code
            if check and not abs(steps[r, block] * kvalues[code] - x[r, c]) <= atol + rtol * abs(x[r, c]):
                off += 1
    return off


# ---- integer grids (Q8_0, Q4_0, Q4_1, Q5_x blocks): the codes of weights that hold the grid's values


@njit(**_JIT)
def integer_codes(x, scale, zero, group, low, high, out):
    """export.gguf.codes' nearest codes on rows x [R, C] (float32): clamp(rint(x / scale (+ zero)), low, high) per
    group of `group` columns, scale (and zero, where it has columns) float32 [R, C // group]. Writes int8 `out`;
    returns how many lie a quarter of a step or more from their code (where bfloat16's rounding may have made
    two codes one value: the caller decides those as before)."""
    quarter = F32(0.25)
    has_zero = zero.shape[1] > 0
    far = 0
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            g = c // group
            exact = x[r, c] / scale[r, g]
            if has_zero:
                exact = exact + zero[r, g]
            code = _clamp(np.rint(exact), low, high)
            out[r, c] = np.int8(code)
            if not abs(exact - code) < quarter:
                far += 1
    return far


@njit(**_JIT)
def signed_largest(x, out):
    """qparams._largest on groups x [R, G, n] (float32): each group's value of largest magnitude, the first of ties
    (torch's argmax of |x|). Writes float32 `out` [R, G]."""
    for r in range(x.shape[0]):
        for g in range(x.shape[1]):
            out[r, g] = _first_absmax(x[r, g])
    return 0


@njit(**_JIT)
def all_finite(x):
    """Whether every value of the 2-D array x is finite."""
    for r in range(x.shape[0]):
        for c in range(x.shape[1]):
            if not np.isfinite(x[r, c]):
                return False
    return True


# ---- small helpers


@njit(**_JIT)
def _clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value


@njit(**_JIT)
def _first_absmax(x):
    """The value of largest magnitude, the first of ties (ggml's `if (ax > amax)` scan)."""
    peak, largest = x[0], abs(x[0])
    for i in range(1, x.shape[0]):
        if abs(x[i]) > largest:
            peak, largest = x[i], abs(x[i])
    return peak


# ---- MLX's affine grid (mlx_grids, export.mlx): a weight's values as their bits, float32 computed in registers
#
# numba has no bfloat16 or float16: the weights come in as their bits (uint16; float32 as uint32) and each group is
# widened into a float32 buffer; a float32 result is rounded to the model's dtype (to nearest even, as torch's casts
# round) on its bits. `kind`: FLOAT32, BFLOAT16 or FLOAT16; `lut` [65536] uint32: each float16's float32 bits. The
# helpers are inlined into the loops (`_INLINE`): called, they cost the loops half their speed.

FLOAT32, BFLOAT16, FLOAT16 = 0, 1, 2
_INLINE = dict(_JIT, inline="always")


@njit(**_JIT)
def mlx_quantize(w, kind, lut, group, n_bins, eps, codes, scales, biases):
    """mlx_grids.quantize_mlx on rows `w` [R, C] (bits): each group's scale and bias chosen as `choose`, stored in
    the model's dtype, the codes rounded onto them. Writes uint8 `codes` [R, C], float32 `scales`, `biases`
    [R, C // group] (the stored values). Returns 0, or 1 where a weight is not finite or a stored step is 0 (the
    torch ops decide those)."""
    x, xbits = _group_buffer(group)
    pair, pair_bits = _group_buffer(2)
    lanes = np.empty((2, LANES), np.float32)
    top = F32(n_bins)
    for r in range(w.shape[0]):
        for g in range(w.shape[1] // group):
            first = g * group
            if not _widen(w, r, first, kind, lut, xbits):
                return 1
            pair[0], pair[1] = _mlx_choose(x, top, eps, lanes)
            _narrow(pair_bits, kind, lut)
            step, bias = pair[0], pair[1]
            if step == F32(0.0):
                return 1
            scales[r, g], biases[r, g] = step, bias
            for i in range(group):
                codes[r, first + i] = np.uint8(_mlx_code(x[i], step, bias, top))
    return 0


@njit(**_JIT)
def mlx_dequantize(codes, scales, biases, group, kind, lut, out):
    """AffineParams.dequantize on rows: scale * code + bias in float32, rounded to the model's dtype. Writes `out`
    [R, C] (the dtype's bits: uint16, or uint32 for float32); returns 0, or 1 where a value is NaN (a grid that is
    not finite: the torch ops decide)."""
    x, xbits = _group_buffer(group)
    for r in range(codes.shape[0]):
        for g in range(codes.shape[1] // group):
            first, step, bias = g * group, scales[r, g], biases[r, g]
            nan = False
            for i in range(group):
                x[i] = F32(codes[r, first + i]) * step + bias
                nan |= x[i] != x[i]
            if nan:
                return 1
            for i in range(group):
                out[r, first + i] = _dtype_bits(np.int64(xbits[i]), kind)
    return 0


@njit(**_JIT)
def mlx_pack(w, kind, lut, scales, biases, group, bits, packed):
    """export.mlx's writer on rows `w` [R, C] (bits) that hold their grid's values: each code rounded back onto the
    stored grid (float32 `scales`, `biases` [R, C // group]), decoded in the model's dtype and checked to be the
    weight, and packed as `export.mlx.pack` packs (each row one little-endian bit stream of `bits`-bit codes).
    Writes uint32 `packed` [R, C * bits // 32]. Returns 0, or 1 where a weight is not finite or a code does not
    decode to its weight (the torch ops decide those)."""
    x, xbits = _group_buffer(group)
    decoded, decoded_bits = _group_buffer(group)
    codes = np.empty(group, np.int64)
    top = F32((1 << bits) - 1)
    for r in range(w.shape[0]):
        for g in range(w.shape[1] // group):
            if not _widen(w, r, g * group, kind, lut, xbits):
                return 1
            if not _codes_decoding_to(x, scales[r, g], biases[r, g], top, kind, lut, codes, decoded, decoded_bits):
                return 1
            _pack_group(codes, bits, packed, r, g * group * bits // 32)
    return 0


@njit(**_JIT)
def mlx_quantize_pack(w, kind, lut, group, bits, eps, scales, biases, packed):
    """`mlx_quantize`, its values decoded in the model's dtype (`mlx_dequantize`) and those written (`mlx_pack`)
    in one pass, nothing of the weight's size in between (export.mlx's token embedding). Writes float32 `scales`,
    `biases` and uint32 `packed`; returns 0, or 1 where either would have (the torch ops decide those)."""
    x, xbits = _group_buffer(group)
    pair, pair_bits = _group_buffer(2)
    decoded, decoded_bits = _group_buffer(group)
    codes = np.empty(group, np.int64)
    lanes = np.empty((2, LANES), np.float32)
    top = F32((1 << bits) - 1)
    for r in range(w.shape[0]):
        for g in range(w.shape[1] // group):
            # mlx_quantize's first lines, written out again: as one inlined helper they measured 20-25% slower
            if not _widen(w, r, g * group, kind, lut, xbits):
                return 1
            pair[0], pair[1] = _mlx_choose(x, top, eps, lanes)
            _narrow(pair_bits, kind, lut)
            step, bias = pair[0], pair[1]
            if step == F32(0.0):
                return 1
            scales[r, g], biases[r, g] = step, bias
            for i in range(group):
                x[i] = _mlx_code(x[i], step, bias, top) * step + bias
            _narrow(xbits, kind, lut)  # the quantized weight, as the model holds it
            if not _codes_decoding_to(x, step, bias, top, kind, lut, codes, decoded, decoded_bits):
                return 1
            _pack_group(codes, bits, packed, r, g * group * bits // 32)
    return 0


@njit(**_INLINE)
def _mlx_choose(x, n_bins, eps, lanes):
    """mlx_grids.choose on one group (its size a multiple of LANES): (scale, bias) in float32. The group's least
    and largest values in LANES independent chains (`lanes` [2, LANES]: room for them)."""
    for j in range(LANES):
        lanes[0, j] = lanes[1, j] = x[j]
    for k in range(LANES, x.shape[0], LANES):
        for j in range(LANES):
            v = x[k + j]
            lanes[0, j] = v if v < lanes[0, j] else lanes[0, j]
            lanes[1, j] = v if v > lanes[1, j] else lanes[1, j]
    low, high = lanes[0, 0], lanes[1, 0]
    for j in range(1, LANES):
        low = lanes[0, j] if lanes[0, j] < low else low
        high = lanes[1, j] if lanes[1, j] > high else high
    scale = (high - low) / n_bins
    if scale < eps:
        scale = eps
    edge = low
    if not abs(low) > abs(high):
        scale, edge = -scale, high
    q0 = np.rint(edge / scale)
    if q0 != F32(0.0):
        return edge / q0, edge
    return scale, F32(0.0)


@njit(**_INLINE)
def _mlx_code(x, step, bias, n_bins):
    """AffineParams.round of one value: clamp(rint((x - bias) / step), 0, n_bins), a float32."""
    q = np.rint((x - bias) / step)
    q = F32(0.0) if q < F32(0.0) else q
    return n_bins if q > n_bins else q


@njit(**_INLINE)
def _codes_decoding_to(x, step, bias, n_bins, kind, lut, codes, decoded, decoded_bits):
    """A group's codes on the grid (into int64 `codes`), and whether each decodes in the model's dtype to its value."""
    for i in range(x.shape[0]):
        q = _mlx_code(x[i], step, bias, n_bins)
        codes[i] = np.int64(q)
        decoded[i] = q * step + bias
    _narrow(decoded_bits, kind, lut)
    off = False
    for i in range(x.shape[0]):
        off |= decoded[i] != x[i]
    return not off


@njit(**_INLINE)
def _pack_group(codes, bits, packed, r, first_word):
    """A group's codes into row r's words from `first_word` on: a little-endian bit stream."""
    if 32 % bits == 0:  # 2, 4, 8 bits: whole codes to a word
        per_word = 32 // bits
        for k in range(codes.shape[0] // per_word):
            word = np.int64(0)
            for j in range(per_word):
                word |= codes[k * per_word + j] << (j * bits)
            packed[r, first_word + k] = np.uint32(word)
        return
    acc, filled, word = np.int64(0), 0, first_word
    for i in range(codes.shape[0]):
        acc |= codes[i] << filled
        filled += bits
        if filled >= 32:
            packed[r, word] = np.uint32(acc & 0xFFFFFFFF)
            acc >>= 32
            filled -= 32
            word += 1


@njit(**_INLINE)
def _group_buffer(n):
    """A float32 buffer of n values and its uint32 bits (one memory)."""
    bits = np.empty(n, np.uint32)
    return bits.view(np.float32), bits


@njit(**_INLINE)
def _widen(w, r, first, kind, lut, xbits):
    """Row r's values from column `first` on (bits of `kind`) into `xbits` (float32 bits); whether all are finite."""
    n = xbits.shape[0]
    if kind == BFLOAT16:
        for i in range(n):
            xbits[i] = np.uint32(w[r, first + i]) << np.uint32(16)
    elif kind == FLOAT16:
        for i in range(n):
            xbits[i] = lut[w[r, first + i]]
    else:
        for i in range(n):
            xbits[i] = np.uint32(w[r, first + i])
    exponent = np.uint32(0x7F800000)
    lowest = exponent
    for i in range(n):
        lowest = min(lowest, ~xbits[i] & exponent)  # 0 where the exponent's bits are all ones: inf or NaN
    return lowest != np.uint32(0)


@njit(**_INLINE)
def _narrow(xbits, kind, lut):
    """Round finite float32 values (their bits, in place) to `kind`, and back to float32 bits."""
    if kind == FLOAT32:
        return
    for i in range(xbits.shape[0]):
        h = _dtype_bits(np.int64(xbits[i]), kind)
        xbits[i] = np.uint32(h << 16) if kind == BFLOAT16 else lut[h]


@njit(**_INLINE)
def _dtype_bits(f, kind):
    """`kind`'s bits of the finite float32 of bits f, rounded to nearest even (torch's casts)."""
    if kind == BFLOAT16:
        return (f + 0x7FFF + ((f >> 16) & 1)) >> 16
    if kind == FLOAT16:
        return _float16_bits(f)
    return f


@njit(**_JIT)
def _float16_bits(f):
    """float16's bits of the finite float32 of bits f, rounded to nearest even (beyond float16's range: inf)."""
    sign, exponent, mantissa = (f >> 16) & 0x8000, (f >> 23) & 0xFF, f & 0x7FFFFF
    if exponent >= 143:  # |x| >= 2^16
        return sign | 0x7C00
    if exponent <= 112:  # below 2^-14: a subnormal float16 (or 0), in units of 2^-24
        if exponent < 102:
            return sign
        m, shift = mantissa | 0x800000, 126 - exponent
        q, rest, half = m >> shift, m & ((1 << shift) - 1), 1 << (shift - 1)
        if rest > half or (rest == half and (q & 1) == 1):
            q += 1
        return sign | q
    q, rest = mantissa >> 13, mantissa & 0x1FFF
    if rest > 0x1000 or (rest == 0x1000 and (q & 1) == 1):
        q += 1
    return sign | (((exponent - 112) << 10) + q)  # a carry out of the mantissa raises the exponent (to inf past 65504)
