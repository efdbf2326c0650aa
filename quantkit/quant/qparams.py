"""Quantization parameters on a scheme's grid, computed with torchao's primitives.

`quantize_weight` is round-to-nearest on the grid a `WeightSpec` defines; every algorithm, the QAT fake
quantizer and every exporter produce or consume the `QuantizedWeight` it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torchao.quantization.quant_primitives import (
    MappingType,
    _choose_scale_float8,
    _dequantize_affine_float8,
    _quantize_affine_float8,
    choose_qparams_affine,
    choose_qparams_affine_with_min_max,
    dequantize_affine,
    quantize_affine,
)

from quantkit.quant import float_grids
from quantkit.quant.schemes import Granularity, QDtype, ScaleDtype, WeightObserver, WeightSpec

if TYPE_CHECKING:
    from quantkit.quant.k_grids import KQParams

_EPS = torch.finfo(torch.float32).eps


@dataclass
class QParams:
    """A weight's grid without its integers (scale/zero_point: [out, in // group]): what an exporter needs beside
    the weight itself once that holds the dequantized grid values (the integers follow from the two)."""

    scale: torch.Tensor
    zero_point: torch.Tensor | None
    spec: WeightSpec
    global_scale: torch.Tensor | None = None  # float32 [1], NVFP4
    k: KQParams | None = None  # llama.cpp's K grid: the scale codes and fp16 super-block scales (scale: their product)


@dataclass
class QuantizedWeight:
    """qdata: int8 holding the grid's integers, or float8_e4m3fn holding FP8 or FP4 values (FP4's are exact in
    FP8). scale/zero_point: [out, in // group], or [tile rows, tile columns] for block scales. global_scale:
    NVFP4's float32 [1], by which the group scales are divided."""

    qdata: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    spec: WeightSpec
    global_scale: torch.Tensor | None = None
    k: KQParams | None = None  # K-quants: qdata holds llama.cpp's codes, scale each sub-block's float32 step

    @property
    def qparams(self) -> QParams:
        return QParams(self.scale, self.zero_point, self.spec, self.global_scale, self.k)

    @property
    def group_size(self) -> int:
        return self.qdata.shape[1] // self.scale.shape[1]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.scale.dtype
        if self.k is not None:
            return self.k.dequantize(self.qdata, dtype=dtype)
        if is_float_grid(self.spec):
            return (self.qdata.float() * element_scales(self.scale, self.spec, self.qdata.shape, self.global_scale)).to(dtype)
        if self.spec.dtype.is_float:
            return _dequantize_affine_float8(self.qdata, self.scale, output_dtype=dtype)
        qmin, qmax = self.spec.dtype.qrange
        zero = self.zero_point if self.zero_point is not None else torch.zeros_like(self.scale, dtype=torch.int8)
        block = (1, self.group_size)
        return dequantize_affine(self.qdata, block, self.scale, zero, torch.int8, qmin, qmax, output_dtype=dtype)


def is_float_grid(spec: WeightSpec) -> bool:
    """FP4, MX and FP8 block grids (`float_grids`): everything float but FP8 per channel."""
    return spec.dtype.is_float and spec.granularity is not Granularity.CHANNEL


def element_scales(scale: torch.Tensor, spec: WeightSpec, shape: torch.Size, global_scale: torch.Tensor | None) -> torch.Tensor:
    """A float grid's scale for every element of a weight of `shape`, float32, divided by the global scale."""
    if spec.granularity is Granularity.BLOCK:
        full = float_grids.expand_blocks(scale.float(), shape, spec.block_shape)
    else:
        full = scale.float().repeat_interleave(shape[1] // scale.shape[1], dim=1)
    return full / global_scale if global_scale is not None else full


def weight_global_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """NVFP4's per-tensor scale shared by `weights` (one weight, or the q/k/v or gate/up a kernel fuses)."""
    return float_grids.global_scale(torch.stack([w.abs().amax() for w in weights]).amax())


def fused_global_scales(weights: dict[str, torch.Tensor], groups: list[list[str]]) -> dict[str, torch.Tensor]:
    """Each named weight's NVFP4 global scale, one per group of `groups` (`architectures.kernel_fused_groups`)."""
    scales = {}
    for group in groups:
        members = [name for name in group if name in weights]
        if members:
            shared = weight_global_scale([weights[name] for name in members])
            scales.update({name: shared for name in members})
    return scales


def block_size(weight: torch.Tensor, spec: WeightSpec) -> tuple[int, int]:
    if spec.granularity is Granularity.GROUP:
        if weight.shape[1] % spec.group_size:
            raise ValueError(f"group size {spec.group_size} does not divide input size {weight.shape[1]}")
        return (1, spec.group_size)
    return (1, weight.shape[1])


def scale_dtype(weight: torch.Tensor, spec: WeightSpec) -> torch.dtype:
    return {ScaleDtype.FLOAT32: torch.float32, ScaleDtype.FLOAT16: torch.float16}.get(spec.scale_dtype, weight.dtype)


def choose_qparams(weight: torch.Tensor, spec: WeightSpec, global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales (and integer zero points for asymmetric grids) for a 2-D weight, by the spec's weight observer.
    NVFP4's group scales lie under `global_scale` (`weight_global_scale`), which it needs."""
    if spec.k_quant_type:
        raise ValueError(f"{spec.k_quant_type} grids are chosen per super-block by k_grids (round to nearest only)")
    if is_float_grid(spec):
        return choose_float_scales(weight, spec, global_scale), None
    if spec.observer is WeightObserver.MSE:
        return choose_qparams_mse(weight, spec)
    return choose_qparams_minmax(weight, spec)


def choose_float_scales(weight: torch.Tensor, spec: WeightSpec, global_scale: torch.Tensor | None) -> torch.Tensor:
    """Scales of a float grid, in the weight's dtype (their values are exact there): FP8 per block, NVFP4's FP8
    group scales, MX's powers of two."""
    if spec.granularity is Granularity.BLOCK:
        return float_grids.fp8_block_scales(float_grids.block_absmax(weight, spec.block_shape))
    absmax = weight.reshape(weight.shape[0], -1, spec.group_size).abs().amax(-1)
    if spec.scale_dtype is ScaleDtype.E8M0:
        return float_grids.mx_group_scales(absmax, spec.dtype.bits).to(weight.dtype)
    if global_scale is None:
        raise ValueError("NVFP4 group scales need the tensor's global scale (qparams.weight_global_scale)")
    return float_grids.nvfp4_group_scales(absmax, global_scale).to(weight.dtype)


def choose_qparams_minmax(weight: torch.Tensor, spec: WeightSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min/max scales: each group's (or channel's) full range."""
    block = block_size(weight, spec)
    shape = (weight.shape[0], weight.shape[1] // block[1])
    if spec.dtype.is_float:
        scale = _choose_scale_float8(weight, block_size=list(block), float8_dtype=torch.float8_e4m3fn)
        return scale.to(scale_dtype(weight, spec)).reshape(shape), None
    qmin, qmax = spec.dtype.qrange
    if has_fp16_minimum(spec):
        groups = weight.reshape(shape[0], shape[1], block[1])
        return fp16_minimum_grid(groups.amin(-1), groups.amax(-1), spec)
    if has_signed_step(spec):
        return signed_step_grid(_largest(weight.reshape(shape[0], shape[1], block[1])), qmin), None
    mapping = MappingType.SYMMETRIC if spec.symmetric else MappingType.ASYMMETRIC
    scale, zero = choose_qparams_affine(
        weight, mapping, block, torch.int8, qmin, qmax, eps=_EPS,
        scale_dtype=scale_dtype(weight, spec), zero_point_dtype=torch.int8,
    )
    return scale.reshape(shape), (None if spec.symmetric else zero.reshape(shape))


def has_fp16_minimum(spec: WeightSpec) -> bool:
    """An asymmetric integer grid with fp16 scales: GGUF's Q4_1 / Q5_1, which store each block's step d and minimum m
    (x = d c + m, c from 0) in fp16."""
    return spec.scale_dtype is ScaleDtype.FLOAT16 and not spec.symmetric and not spec.dtype.is_float


def has_signed_step(spec: WeightSpec) -> bool:
    """A symmetric integer grid with fp16 scales: GGUF's Q4_0 / Q5_0 / Q8_0, whose step d may be negative (value =
    d q, q in [qmin, qmax]): llama.cpp's own rule for them (`signed_step_grid`) is then a grid too."""
    return spec.scale_dtype is ScaleDtype.FLOAT16 and spec.symmetric and not spec.dtype.is_float


def _largest(groups: torch.Tensor) -> torch.Tensor:
    """Each group's value of largest magnitude, with its sign [rows, groups]."""
    return groups.gather(-1, groups.abs().argmax(-1, keepdim=True)).squeeze(-1).float()


def signed_step_grid(largest: torch.Tensor, end: int) -> torch.Tensor:
    """The fp16 step that puts each group's value of largest magnitude `largest` on the grid's code `end`. With
    end = qmin it is llama.cpp's rule for its symmetric blocks (quantize_row_q4_0_ref: d = m / -8): m lands on the
    far end of [qmin, qmax] exactly, whatever its sign (a negative step turns the grid round), and the other end
    covers qmax / -qmin of its magnitude on the other side. Where max|w| / ((qmax - qmin) / 2) rounds both ends,
    that is 18% less weight error on trained weights (Q4_0). An all-zero group takes the smallest positive step, as
    torchao's eps does."""
    step = (largest / end).to(torch.float16)
    return torch.where(step.abs() < _EPS, torch.full_like(step, _EPS), step)


def fp16_minimum_grid(low: torch.Tensor, high: torch.Tensor, spec: WeightSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (fp16) and integer zero point of an asymmetric grid whose minimum is an fp16 value too (Q4_1 / Q5_1).
    A value is (q - z) s = c s + m with c = q - qmin and m = -(z - qmin) s; m is exact in fp16 when s has no more
    significant bits than fp16's 11 less those of (z - qmin), so s is the min/max scale rounded up to 7 (int4) or
    6 (int5) significant bits, at least fp16's smallest normal; the zero point then follows as torchao computes it.
    The scale's rounding costs at most 2^-7 of a step, at the grid's far end."""
    qmin, qmax = spec.dtype.qrange
    low, high = torch.clamp(low.float(), max=0), torch.clamp(high.float(), min=0)
    bits = 11 - int(qmax - qmin).bit_length()
    mantissa, exponent = torch.frexp(((high - low) / (qmax - qmin)).clamp(min=2.0 ** -14))
    scale = torch.ldexp(torch.ceil(mantissa * 2 ** bits) / 2 ** bits, exponent)
    zero = (qmin - torch.round(low / scale)).clamp(qmin, qmax)
    return scale.to(torch.float16), zero.to(torch.int8)


def choose_qparams_mse(
    weight: torch.Tensor, spec: WeightSpec, grid: int = 100, max_shrink: float = 0.2, norm: float = 2.4
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The memoryless MSE observer: per group, shrink the min/max range by p in (1 - max_shrink, 1] and keep
    the qparams whose rounding error sum |w - q|^norm is least. p = 1 gives exactly the min/max qparams. A grid
    with a signed step (`has_signed_step`: GGUF's Q4_0 / Q5_0 / Q8_0) puts the shrunk largest value on either end
    of the grid, so p = 1 gives llama.cpp's step or a better one."""
    block = block_size(weight, spec)
    qmin, qmax = spec.dtype.qrange
    mapping = MappingType.SYMMETRIC if spec.symmetric else MappingType.ASYMMETRIC
    groups = weight.reshape(weight.shape[0], -1, block[1])
    low, high = groups.amin(-1), groups.amax(-1)
    largest = _largest(groups) if has_signed_step(spec) else None
    best = None
    for step in range(int(max_shrink * grid) + 1):
        shrink = 1 - step / grid
        if largest is not None:  # the largest value on either end of the grid, a signed step (llama.cpp's: qmin)
            for end in (qmin, qmax):
                scale = signed_step_grid(largest * shrink, end)
                error = _group_error(weight, quantize_with(weight, spec, scale, None), block[1], norm)
                best = _keep_better(best, (error, scale, None))
            continue
        if has_fp16_minimum(spec):
            scale, zero = fp16_minimum_grid(low * shrink, high * shrink, spec)
        else:
            scale, zero = choose_qparams_affine_with_min_max(
                low * shrink, high * shrink, mapping, block, torch.int8, qmin, qmax, eps=_EPS,
                scale_dtype=scale_dtype(weight, spec), zero_point_dtype=torch.int8,
            )
        zero = None if spec.symmetric else zero
        error = _group_error(weight, quantize_with(weight, spec, scale, zero), block[1], norm)
        best = _keep_better(best, (error, scale, zero))
    return best[1], best[2]


def _group_error(weight: torch.Tensor, qweight: QuantizedWeight, group: int, norm: float) -> torch.Tensor:
    delta = (weight.float() - qweight.dequantize(torch.float32)).abs().pow(norm)
    return delta.reshape(weight.shape[0], -1, group).sum(-1)


def _keep_better(best, candidate):
    if best is None:
        return candidate
    better = candidate[0] < best[0]
    pick = lambda new, old: None if new is None else torch.where(better, new, old)  # noqa: E731
    return torch.minimum(candidate[0], best[0]), pick(candidate[1], best[1]), pick(candidate[2], best[2])


def quantize_with(weight: torch.Tensor, spec: WeightSpec, scale: torch.Tensor, zero: torch.Tensor | None,
                  global_scale: torch.Tensor | None = None) -> QuantizedWeight:
    """Round `weight` to the grid given by precomputed qparams (GPTQ and friends reuse this)."""
    if is_float_grid(spec):
        return QuantizedWeight(round_float_grid(weight, spec, scale, global_scale), scale, None, spec, global_scale)
    block = block_size(weight, spec)
    if spec.dtype.is_float:
        qdata = _quantize_affine_float8(weight, scale, torch.float8_e4m3fn)
    else:
        qmin, qmax = spec.dtype.qrange
        z = zero if zero is not None else torch.zeros_like(scale, dtype=torch.int8)
        qdata = quantize_affine(weight, block, scale, z, torch.int8, qmin, qmax)
    return QuantizedWeight(qdata=qdata, scale=scale, zero_point=zero, spec=spec)


def round_float_grid(weight: torch.Tensor, spec: WeightSpec, scale: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """The grid values (float8_e4m3fn) of `weight` divided by its scales, as compressed-tensors divides: in float32
    under a global scale, else in the scales' dtype."""
    if global_scale is not None:
        scaled = weight / element_scales(scale, spec, weight.shape, global_scale)
    elif spec.granularity is Granularity.BLOCK:
        scaled = weight / float_grids.expand_blocks(scale, weight.shape, spec.block_shape)
    else:
        scaled = weight / scale.repeat_interleave(spec.group_size, dim=1)
    if spec.dtype is QDtype.FLOAT4:
        return float_grids.round_to_fp4(scaled).to(torch.float8_e4m3fn)
    return float_grids.round_to_fp8(scaled)


def empty_quantized(weight: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
    """Buffers shaped and typed like `quantize_weight(weight, spec)`'s result (to receive a broadcast)."""
    if spec.k_quant_type:
        return _empty_k_quantized(weight, spec)
    if spec.granularity is Granularity.BLOCK:
        shape = tuple(-(-n // b) for n, b in zip(weight.shape, spec.block_shape))
    else:
        shape = (weight.shape[0], weight.shape[1] // block_size(weight, spec)[1])
    qdtype = torch.float8_e4m3fn if spec.dtype.is_float else torch.int8
    zero = None if spec.symmetric else torch.empty(shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(shape, dtype=scale_dtype(weight, spec), device=weight.device)
    global_scale = torch.empty(1, dtype=torch.float32, device=weight.device) if spec.global_scale else None
    return QuantizedWeight(torch.empty_like(weight, dtype=qdtype), scale, zero, spec, global_scale)


def _empty_k_quantized(weight: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
    """A K grid's buffers: int8 codes, each sub-block's float32 step, and the grid's int8 scale (and min) codes
    under fp16 super-block scales."""
    from gguf import GGMLQuantizationType

    from quantkit.quant.k_grids import SUPER_BLOCK, KQParams

    rows, cols = weight.shape
    empty = lambda n, dtype: torch.empty(rows, n, dtype=dtype, device=weight.device)  # noqa: E731
    sub, supers = cols // spec.group_size, cols // SUPER_BLOCK
    grid = KQParams(GGMLQuantizationType[spec.k_quant_type], empty(sub, torch.int8), empty(supers, torch.float16),
                    *((empty(sub, torch.int8), empty(supers, torch.float16)) if spec.is_asymmetric else (None, None)))
    return QuantizedWeight(empty(cols, torch.int8), empty(sub, torch.float32), None, spec, k=grid)


def quantize_weight(weight: torch.Tensor, spec: WeightSpec, global_scale: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of a 2-D weight [out, in] on the spec's grid. NVFP4: the global scale
    shared with the weights a kernel fuses with this one, or this weight's own when None."""
    with torch.no_grad():
        if spec.k_quant_type:
            return quantize_k_grid(weight, spec)
        if spec.global_scale and global_scale is None:
            global_scale = weight_global_scale([weight])
        scale, zero = choose_qparams(weight, spec, global_scale)
        return quantize_with(weight, spec, scale, zero, global_scale if spec.global_scale else None)


def quantize_k_grid(weight: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
    """llama.cpp's own quantizer on a K grid (`k_grids.quantize_k`): its codes, and each sub-block's step as the
    scale (the weight's columns must be whole super-blocks of 256)."""
    from gguf import GGMLQuantizationType

    from quantkit.quant.k_grids import quantize_k

    found = quantize_k(weight, GGMLQuantizationType[spec.k_quant_type])
    step, _ = found.qparams.sub_block_scales()
    return QuantizedWeight(found.codes, step, None, spec, k=found.qparams)


def fake_quantize_weight(weight: torch.Tensor, spec: WeightSpec, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as the quantized model sees it: quantize, then dequantize to the weight's dtype."""
    return quantize_weight(weight, spec, global_scale).dequantize(weight.dtype)
