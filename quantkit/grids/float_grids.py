"""Float element grids with their scale grids: FP8 per block, FP4 (e2m1) with FP8 group scales under a per-tensor
global scale (NVFP4), and OCP microscaling (MXFP4, MXFP8: power-of-two E8M0 group scales); and MLX's nvfp4 mode (FP8
group scales alone, chosen and rounded as mx.quantize does: `mlx_nvfp4_scales`, `mlx_fp4_codes`).

Pure tensor functions with compressed-tensors' arithmetic (the library that writes these formats for vLLM, and
that LLM Compressor calls), step for step, so the scales of an artifact are the ones LLM Compressor writes:
tests/unit/test_float_grids.py holds them equal to compressed-tensors' own `calculate_qparams` / `quantize`,
atol 0. Rounding onto the FP4 grid is torchao's (round half to even).

Scales come back in float32 holding values of their grid (FP8 e4m3, or powers of two); the caller keeps them in
the model's dtype, where those values are exact.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

FP4_MAX = 6.0
FP8_MAX = 448.0
FP8_SCALE_EPS = 0.125  # compressed-tensors' stand-in for a zero FP8 group scale
_MX_OFFSET = {4: 2, 8: 8}  # floor(log2(largest element)): 6 for FP4, 448 for FP8 e4m3
_FP4_MANTISSA = 1  # compressed-tensors rounds MX scales with FP4's mantissa width for FP4 and FP8 elements


def round_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """The nearest FP4 e2m1 value (0, +-0.5, +-1, +-1.5, +-2, +-3, +-4, +-6; ties to even), clamped to +-6, in float32."""
    return f4_unpacked_to_f32(f32_to_f4_unpacked(x.float().clamp(-FP4_MAX, FP4_MAX)))


def fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """The E2M1 bit patterns (uint8 0-15, the sign in bit 3) of the nearest FP4 values, as `round_to_fp4` rounds:
    the nibbles MX formats store (ggml's block_mxfp4 among them)."""
    return f32_to_f4_unpacked(x.float().clamp(-FP4_MAX, FP4_MAX))


def fp4_values(codes: torch.Tensor) -> torch.Tensor:
    """The float32 values of E2M1 bit patterns (`fp4_codes`)."""
    return f4_unpacked_to_f32(codes)


_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive FP4 magnitudes 0, 0.5, ..., 4, 6


def mlx_fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """E2M1 bit patterns (uint8) as mx.quantize picks them in its nvfp4 mode (mlx's `fp_quantize`: the first entry of
    its FP4 table nearest to x): the nearest FP4 value, a tie going to the smaller magnitude (0.75 to 0.5, where
    `fp4_codes` rounds to even), every value that rounds to zero as +0 (code 0), and code 0 for a non-finite x (a
    zero scale's quotient)."""
    midpoints = torch.tensor(_FP4_MIDPOINTS, device=x.device)
    magnitude = torch.bucketize(x.abs().float(), midpoints, out_int32=True)  # midpoints below |x|: a tie stays below
    magnitude = torch.where(torch.isfinite(x), magnitude, 0).to(torch.uint8)
    return magnitude | (((x < 0) & (magnitude > 0)).to(torch.uint8) << 3)


def round_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """The nearest FP8 e4m3 value, clamped to +-448, as a float8_e4m3fn tensor."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def global_scale(absmax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor float32 scale [1] for a tensor whose largest magnitude is `absmax`: 448 * 6 / absmax,
    computed in absmax's dtype (as compressed-tensors does), so that the largest group scale uses FP8's whole
    range (1.0 for an all-zero or non-finite tensor)."""
    absmax = absmax.reshape(1).clamp(min=torch.finfo(absmax.dtype).tiny)
    return torch.nan_to_num(FP8_MAX * FP4_MAX / absmax, nan=1.0, posinf=1.0, neginf=1.0).float()


def nvfp4_group_scales(absmax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 group scales (float32 values) from per-group absmax in the weight's dtype: the local scale
    absmax / 6, computed in that dtype, times the global scale, rounded to FP8 (0 becomes 0.125)."""
    local = absmax / torch.tensor(FP4_MAX, dtype=absmax.dtype)
    scales = round_to_fp8(global_scale * local).float()
    return torch.where(scales == 0, torch.tensor(FP8_SCALE_EPS), scales)


def mlx_nvfp4_scales(absmax: torch.Tensor) -> torch.Tensor:
    """MLX's nvfp4 group scales (float32 values of FP8 e4m3) from per-group absmax in the weight's dtype, as
    mx.quantize chooses them with no global scale: absmax / 6 in that dtype, rounded to FP8 (saturating at 448); a
    zero scale stays zero (its group stores code 0 throughout)."""
    return round_to_fp8(absmax / torch.tensor(FP4_MAX, dtype=absmax.dtype)).float()


def mx_group_scales(absmax: torch.Tensor, bits: int) -> torch.Tensor:
    """E8M0 group scales (float32 powers of two) for MXFP4 (`bits` 4) or MXFP8 (8): absmax rounded to a power of
    two (up when its mantissa is at least 1.5), divided by 2^floor(log2(largest element)), within E8M0's range."""
    exponent = torch.floor(torch.log2(_round_to_power_of_2(absmax))) - _MX_OFFSET[bits]
    biased = torch.round((exponent + 127).clamp(0, 255))
    return torch.exp2(biased.float() - 127)


def mx_exponents(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales as stored: the biased exponent of each power of two, uint8."""
    return (torch.log2(scale.float()) + 127).round().to(torch.uint8)


def _round_to_power_of_2(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' `round_to_power_2`: keep the sign and exponent bits after adding half of FP4's mantissa
    step, in `x`'s own float format."""
    formats = {torch.bfloat16: (torch.uint16, 7, 8), torch.float16: (torch.uint16, 10, 5), torch.float32: (torch.uint32, 23, 8)}
    if x.dtype not in formats:
        raise TypeError(f"MX scales are computed from bfloat16, float16 or float32 weights, not {x.dtype}")
    uint, mantissa, exponent = formats[x.dtype]
    keep = ((1 << (exponent + 1)) - 1) << mantissa
    rounded = (x.view(uint).to(torch.int64) + (1 << (mantissa - _FP4_MANTISSA - 1))) & keep
    return rounded.to(uint).view(x.dtype)


def block_absmax(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Largest magnitude per [rows, cols] tile, zero-padding the last row of tiles (compressed-tensors pads too)."""
    rows, cols = weight.shape
    padded = F.pad(weight, (0, -cols % block[1], 0, -rows % block[0]))
    tiles = padded.reshape(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    return tiles.abs().amax(dim=(1, 3))


def expand_blocks(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """Per-tile values [tile rows, tile cols] repeated over a weight of `shape` (the last row of tiles cut short)."""
    return scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def fp8_block_scales(absmax: torch.Tensor) -> torch.Tensor:
    """absmax / 448 in the weight's dtype; a zero scale becomes that dtype's eps."""
    scale = absmax / torch.tensor(FP8_MAX, dtype=absmax.dtype)
    return torch.where(scale == 0, torch.tensor(torch.finfo(scale.dtype).eps, dtype=scale.dtype), scale)


def fake_quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 activations, dequantized, as compressed-tensors' runtime computes them under `global_scale`: per group
    of 16 along the last dimension, FP8 group scales (absmax / 6 in x's dtype, times the global scale), FP4 values
    of x divided by scale / global_scale in float32, the product cast back to x's dtype."""
    groups = x.unflatten(-1, (-1, 16))
    divisor = nvfp4_group_scales(groups.abs().amax(-1, keepdim=True), global_scale) / global_scale
    return (round_to_fp4(groups / divisor) * divisor).flatten(-2).to(x.dtype)


def fake_quantize_groups(x: torch.Tensor, bits: int, group_size: int, mx: bool) -> torch.Tensor:
    """Dynamic per-group quantization of activations along the last dimension, dequantized, as compressed-tensors'
    runtime computes it: FP8 (`bits` 8) with scale absmax / 448 in x's dtype, or MX (FP4 / FP8 elements, E8M0
    scales)."""
    groups = x.reshape(*x.shape[:-1], -1, group_size)
    absmax = groups.abs().amax(-1, keepdim=True)
    if mx:
        scale = mx_group_scales(absmax, bits).to(x.dtype)
    else:
        scale = fp8_block_scales(absmax)
    scaled = groups / scale
    q = round_to_fp4(scaled).to(x.dtype) if bits == 4 else round_to_fp8(scaled).to(x.dtype)
    return (q * scale).reshape(x.shape)
