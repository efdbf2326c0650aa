"""Quantization parameters on a scheme's grid, computed with torchao's primitives.

`quantize_weight` is round-to-nearest on the grid a `WeightSpec` defines; every algorithm, the QAT fake
quantizer and every exporter produce or consume the `QuantizedWeight` it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

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

from quantkit.schemes import Granularity, ScaleDtype, WeightObserver, WeightSpec

_EPS = torch.finfo(torch.float32).eps


@dataclass
class QParams:
    """A weight's grid without its integers (scale/zero_point: [out, in // group]): what an exporter needs beside
    the weight itself once that holds the dequantized grid values (the integers follow from the two)."""

    scale: torch.Tensor
    zero_point: torch.Tensor | None
    spec: WeightSpec


@dataclass
class QuantizedWeight:
    """qdata: int8 holding the grid's integers, or float8_e4m3fn. scale/zero_point: [out, in // group]."""

    qdata: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    spec: WeightSpec

    @property
    def qparams(self) -> QParams:
        return QParams(self.scale, self.zero_point, self.spec)

    @property
    def group_size(self) -> int:
        return self.qdata.shape[1] // self.scale.shape[1]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.scale.dtype
        if self.spec.dtype.is_float:
            return _dequantize_affine_float8(self.qdata, self.scale, output_dtype=dtype)
        qmin, qmax = self.spec.dtype.qrange
        zero = self.zero_point if self.zero_point is not None else torch.zeros_like(self.scale, dtype=torch.int8)
        block = (1, self.group_size)
        return dequantize_affine(self.qdata, block, self.scale, zero, torch.int8, qmin, qmax, output_dtype=dtype)


def block_size(weight: torch.Tensor, spec: WeightSpec) -> tuple[int, int]:
    if spec.granularity is Granularity.GROUP:
        if weight.shape[1] % spec.group_size:
            raise ValueError(f"group size {spec.group_size} does not divide input size {weight.shape[1]}")
        return (1, spec.group_size)
    return (1, weight.shape[1])


def scale_dtype(weight: torch.Tensor, spec: WeightSpec) -> torch.dtype:
    return torch.float32 if spec.scale_dtype is ScaleDtype.FLOAT32 else weight.dtype


def choose_qparams(weight: torch.Tensor, spec: WeightSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales (and integer zero points for asymmetric grids) for a 2-D weight, by the spec's weight observer."""
    if spec.observer is WeightObserver.MSE:
        return choose_qparams_mse(weight, spec)
    return choose_qparams_minmax(weight, spec)


def choose_qparams_minmax(weight: torch.Tensor, spec: WeightSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min/max scales: each group's (or channel's) full range."""
    block = block_size(weight, spec)
    shape = (weight.shape[0], weight.shape[1] // block[1])
    if spec.dtype.is_float:
        scale = _choose_scale_float8(weight, block_size=list(block), float8_dtype=torch.float8_e4m3fn)
        return scale.to(scale_dtype(weight, spec)).reshape(shape), None
    qmin, qmax = spec.dtype.qrange
    mapping = MappingType.SYMMETRIC if spec.symmetric else MappingType.ASYMMETRIC
    scale, zero = choose_qparams_affine(
        weight, mapping, block, torch.int8, qmin, qmax, eps=_EPS,
        scale_dtype=scale_dtype(weight, spec), zero_point_dtype=torch.int8,
    )
    return scale.reshape(shape), (None if spec.symmetric else zero.reshape(shape))


def choose_qparams_mse(
    weight: torch.Tensor, spec: WeightSpec, grid: int = 100, max_shrink: float = 0.2, norm: float = 2.4
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The memoryless MSE observer: per group, shrink the min/max range by p in (1 - max_shrink, 1] and keep
    the qparams whose rounding error sum |w - q|^norm is least. p = 1 gives exactly the min/max qparams."""
    block = block_size(weight, spec)
    qmin, qmax = spec.dtype.qrange
    mapping = MappingType.SYMMETRIC if spec.symmetric else MappingType.ASYMMETRIC
    groups = weight.reshape(weight.shape[0], -1, block[1])
    low, high = groups.amin(-1), groups.amax(-1)
    best = None
    for step in range(int(max_shrink * grid) + 1):
        shrink = 1 - step / grid
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


def quantize_with(weight: torch.Tensor, spec: WeightSpec, scale: torch.Tensor, zero: torch.Tensor | None) -> QuantizedWeight:
    """Round `weight` to the grid given by precomputed qparams (GPTQ and friends reuse this)."""
    block = block_size(weight, spec)
    if spec.dtype.is_float:
        qdata = _quantize_affine_float8(weight, scale, torch.float8_e4m3fn)
    else:
        qmin, qmax = spec.dtype.qrange
        z = zero if zero is not None else torch.zeros_like(scale, dtype=torch.int8)
        qdata = quantize_affine(weight, block, scale, z, torch.int8, qmin, qmax)
    return QuantizedWeight(qdata=qdata, scale=scale, zero_point=zero, spec=spec)


def empty_quantized(weight: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
    """Buffers shaped and typed like `quantize_weight(weight, spec)`'s result (to receive a broadcast)."""
    shape = (weight.shape[0], weight.shape[1] // block_size(weight, spec)[1])
    qdtype = torch.float8_e4m3fn if spec.dtype.is_float else torch.int8
    zero = None if spec.symmetric else torch.empty(shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(shape, dtype=scale_dtype(weight, spec), device=weight.device)
    return QuantizedWeight(torch.empty_like(weight, dtype=qdtype), scale, zero, spec)


def quantize_weight(weight: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
    """Round-to-nearest quantization of a 2-D weight [out, in] on the spec's grid."""
    with torch.no_grad():
        scale, zero = choose_qparams(weight, spec)
        return quantize_with(weight, spec, scale, zero)


def fake_quantize_weight(weight: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """The weight as the quantized model sees it: quantize, then dequantize to the weight's dtype."""
    return quantize_weight(weight, spec).dequantize(weight.dtype)
