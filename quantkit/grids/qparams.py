"""Quantization parameters on a scheme's grid, computed with torchao's primitives.

The scaled grids (integer, FP8, FP4, MX: one scale, and zero point, per group, channel or block) as two grid
families, `INTEGER_GRID` and `FLOAT_GRID` (`quantkit.grids`), and the `QuantizedWeight` every family's quantizer
returns and every exporter consumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

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

from quantkit.grids import float_grids
from quantkit.grids.family import GridFamily
from quantkit.grids.schemes import Granularity, QDtype, ScaleDtype, SchemeError, WeightObserver, WeightSpec

_EPS = torch.finfo(torch.float32).eps


@dataclass
class QParams:
    """A weight's grid without its integers (scale/zero_point: [out, in // group]): what an exporter needs beside
    the weight itself once that holds the dequantized grid values (the integers follow from the two)."""

    scale: torch.Tensor
    zero_point: torch.Tensor | None
    spec: WeightSpec
    global_scale: torch.Tensor | None = None  # float32 [1], NVFP4
    k: "BlockParams | None" = None  # llama.cpp's block grids (K, i-quants): the block scale codes, fp16 super-block
    # scales (`grids.family.BlockParams`; scale: each sub-block's step)


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
    k: "BlockParams | None" = None  # llama.cpp's block grids: qdata holds its codes, scale each sub-block's float32 step

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
    if is_float_grid(spec):
        return choose_float_scales(weight, spec, global_scale), None
    if spec.observer is WeightObserver.MSE:
        return choose_qparams_mse(weight, spec)
    return choose_qparams_minmax(weight, spec)


def choose_float_scales(weight: torch.Tensor, spec: WeightSpec, global_scale: torch.Tensor | None) -> torch.Tensor:
    """Scales of a float grid, in the weight's dtype (their values are exact there): FP8 per block, NVFP4's FP8
    group scales (MLX's nvfp4: without a global scale), MX's powers of two."""
    if spec.granularity is Granularity.BLOCK:
        return float_grids.fp8_block_scales(float_grids.block_absmax(weight, spec.block_shape))
    absmax = weight.reshape(weight.shape[0], -1, spec.group_size).abs().amax(-1)
    if spec.scale_dtype is ScaleDtype.E8M0:
        return float_grids.mx_group_scales(absmax, spec.dtype.bits).to(weight.dtype)
    if not spec.global_scale:
        return float_grids.mlx_nvfp4_scales(absmax).to(weight.dtype)
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


def steps_may_be_negative(spec: WeightSpec) -> bool:
    """Whether the grid's step may be negative, turning it round (`has_signed_step`): an algorithm that fits a step
    keeps its sign there, and a positive one elsewhere."""
    return has_signed_step(spec)


def as_stored(scale: torch.Tensor, zero: torch.Tensor, spec: WeightSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A fitted (scale, zero point) as the grid stores them, both float32: the scale in its dtype `dtype`, and on
    an fp16-minimum grid (GGUF's Q4_1 / Q5_1) the range they span put through `fp16_minimum_grid`, so step * code +
    minimum is exact in fp16."""
    if has_fp16_minimum(spec):
        qmin, qmax = spec.dtype.qrange
        stored, stored_zero = fp16_minimum_grid((qmin - zero) * scale, (qmax - zero) * scale, spec)
        return stored.float(), stored_zero.float()
    return scale.to(dtype).float(), zero


def _largest(groups: torch.Tensor) -> torch.Tensor:
    """Each group's value of largest magnitude, with its sign [rows, groups] (float32), the first of ties; on a CPU
    one compiled pass (`cpu_kernels.signed_largest`), a block of rows at a time."""
    from quantkit.grids.cpu_dispatch import compiled as _compiled, kernels as cpu_kernels, map_chunks as _map_chunks

    out = torch.empty(groups.shape[:2], dtype=torch.float32, device=groups.device)
    per_block = max(1, (1 << 22) // max(1, groups.shape[1] * groups.shape[2]))

    def largest(first: int) -> None:
        part = groups[first:first + per_block]
        x = part.float()
        if _compiled(x.reshape(x.shape[0], -1)):
            cpu_kernels().signed_largest(x.contiguous().numpy(), out[first:first + per_block].numpy())
        else:
            out[first:first + per_block] = part.gather(-1, part.abs().argmax(-1, keepdim=True)).squeeze(-1).float()

    _map_chunks(largest, range(0, groups.shape[0], per_block), groups.device)
    return out


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
        return round_fp4(scaled, spec).to(torch.float8_e4m3fn)
    return float_grids.round_to_fp8(scaled)


def round_fp4(scaled: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """FP4 values (float32) of weights divided by their scales: round half to even (torchao's, as compressed-tensors
    rounds), or as mx.quantize rounds for MLX's nvfp4 grid (FP8 scales without a global scale: a tie to the smaller
    magnitude, a zero scale's group to zero)."""
    if spec.scale_dtype is ScaleDtype.FLOAT8 and not spec.global_scale:
        return float_grids.fp4_values(float_grids.mlx_fp4_codes(scaled))
    return float_grids.round_to_fp4(scaled)


def empty_scaled(weight: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
    """Buffers shaped and typed like `quantize_scaled(weight, spec)`'s result (to receive a broadcast)."""
    if spec.granularity is Granularity.BLOCK:
        shape = tuple(-(-n // b) for n, b in zip(weight.shape, spec.block_shape))
    else:
        shape = (weight.shape[0], weight.shape[1] // block_size(weight, spec)[1])
    qdtype = torch.float8_e4m3fn if spec.dtype.is_float else torch.int8
    zero = None if spec.symmetric else torch.empty(shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(shape, dtype=scale_dtype(weight, spec), device=weight.device)
    global_scale = torch.empty(1, dtype=torch.float32, device=weight.device) if spec.global_scale else None
    return QuantizedWeight(torch.empty_like(weight, dtype=qdtype), scale, zero, spec, global_scale)


def quantize_scaled(weight: torch.Tensor, spec: WeightSpec, global_scale: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest of a 2-D weight [out, in] on a scaled grid (integer or float: one scale, and zero point,
    per group, channel or block). NVFP4: the global scale shared with the weights a kernel fuses with this one, or
    this weight's own when None. `grids.quantize_weight` takes any grid."""
    with torch.no_grad():
        if spec.global_scale and global_scale is None:
            global_scale = weight_global_scale([weight])
        scale, zero = choose_qparams(weight, spec, global_scale)
        return quantize_with(weight, spec, scale, zero, global_scale if spec.global_scale else None)


@dataclass
class ScaledColumns:
    """A scaled grid in GPTQ's column loop (`grids.family.ColumnGrid`): the qparams of the result, and how one column
    is rounded onto them (exactly as `quantize_with` rounds)."""

    spec: WeightSpec
    dtype: torch.dtype  # the original weight dtype: qparams are chosen and columns rounded in it, like RTN
    scale: torch.Tensor  # [out, in // group]
    zero: torch.Tensor | None
    dynamic: bool  # group qparams chosen when each group's first column is reached
    global_scale: torch.Tensor | None = None  # NVFP4: fixed before any column moves
    _columns: dict = field(default_factory=dict)  # group -> its qparams as contiguous columns (what round uses)

    @classmethod
    def up_front(cls, weight: torch.Tensor, dtype: torch.dtype, spec: WeightSpec, dynamic: bool,
                 global_scale: torch.Tensor | None = None) -> ScaledColumns:
        scale, zero = choose_qparams(weight.to(dtype), spec, global_scale)  # dynamic groups overwrite theirs later
        return cls(spec, dtype, scale, zero, dynamic, global_scale)

    @property
    def float_grid(self) -> bool:
        return is_float_grid(self.spec)

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.float_grid else torch.int8

    @property
    def graphs(self) -> bool:
        """Integer columns run as CUDA graphs (`algorithms.gptq_graphs`) where the loop allows."""
        return not self.float_grid

    def result(self, qdata: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight(qdata=qdata, scale=self.scale, zero_point=self.zero, spec=self.spec, global_scale=self.global_scale)

    @property
    def choose_every(self) -> int | None:
        """Columns between two choices of qparams in the loop (a group's first column), or None: chosen up front."""
        return self.spec.group_size if self.dynamic else None

    def group_of(self, column: int) -> int:
        return column // self.spec.group_size if self.spec.granularity is Granularity.GROUP else 0

    def choose(self, group: int, columns: torch.Tensor) -> None:
        scale, zero = choose_qparams(columns.to(self.dtype), self.spec, self.global_scale)
        self.scale[:, group : group + 1] = scale
        if zero is not None:
            self.zero[:, group : group + 1] = zero
        self._columns.pop(group, None)

    def round(self, column: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the grid integer as a float, its float32 value) for one column [out] with its group's qparams.

        torchao's `quantize_affine` / `dequantize_affine` arithmetic, inlined for one column (a call per column
        costs more than the rounding): clamp(round(x * (1 / scale)) + zero), then (q - zero) * scale.
        tests/unit/algorithms/test_gptq.py holds it equal to RTN through `quantize_with`, bit for bit."""
        if self.float_grid:
            return self._round_float(column, group)
        scale, inverse, zero, zero_float = self.columns(group)
        q = torch.round(column.to(self.dtype) * inverse)
        if zero is None:
            q = q.clamp_(*self.spec.dtype.qrange).float()
            return q, (q * scale).float()
        q = (q + zero).clamp_(*self.spec.dtype.qrange).float()
        return q, ((q - zero_float) * scale).float()

    def columns_in_order(self, order: list[int]) -> Callable[[int, int], tuple]:
        """For qparams fixed up front (static groups) and columns in `order`: a function giving the qparams of
        positions [j1, j2) as `columns` gives one group's, a row per column ([j2 - j1, out]), bit for bit the same
        values; one gather a tensor."""
        groups = torch.tensor([self.group_of(c) for c in order], device=self.scale.device)
        scale = self.scale.T.contiguous()
        by_group = (scale, 1.0 / scale, *((self.zero.T.contiguous(), self.zero.T.float()) if self.zero is not None else (None, None)))
        return lambda j1, j2: tuple(t.index_select(0, groups[j1:j2]) if t is not None else None for t in by_group)

    def columns(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """An integer grid's (scale, 1 / scale, zero point, zero point as float32) of `group`, as contiguous columns."""
        if group not in self._columns:
            scale = self.scale[:, group].contiguous()
            zero = self.zero[:, group].contiguous() if self.zero is not None else None
            self._columns[group] = (scale, 1.0 / scale, zero, zero.float() if zero is not None else None)
        return self._columns[group]

    def _round_float(self, column: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FP4 grids (NVFP4, MXFP4) as `qparams.round_float_grid` rounds: divided by the float32 scale under a
        global scale, else by the scale in the weight's dtype."""
        if group not in self._columns:
            scale = self.scale[:, group].contiguous()
            divisor = scale.float() / self.global_scale if self.global_scale is not None else scale
            self._columns[group] = (divisor, divisor.float())
        divisor, divisor_float = self._columns[group]
        q = round_fp4(column.to(self.dtype) / divisor, self.spec)
        return q, q * divisor_float


class IntegerGrid(GridFamily):
    """Integer grids (int2 to int8, symmetric or with an integer zero point; float32, model-dtype or fp16 scales,
    GGUF's Q4_0 / Q4_1 / Q5_x / Q8_0 among them) and FP8 per channel: torchao's affine primitives."""

    name = "integer"

    def owns(self, spec: WeightSpec) -> bool:
        return not is_float_grid(spec)

    def fake_quant(self, spec: WeightSpec) -> str:
        """torchao's symmetric int weights and float32-scaled FP8 rows are this grid bit for bit; its asymmetric path
        (unsigned, a float zero point) and fp16 scales (GGUF's) are not."""
        if spec.dtype.is_float:
            return "torchao_float8" if spec.scale_dtype is ScaleDtype.FLOAT32 else "grid"
        return "grid" if not spec.symmetric or spec.scale_dtype is ScaleDtype.FLOAT16 else "torchao_intx"

    def quantize(self, weight, spec, global_scale=None, importance=None) -> QuantizedWeight:
        return quantize_scaled(weight, spec, global_scale)

    def empty(self, weight, spec) -> QuantizedWeight:
        return empty_scaled(weight, spec)

    def columns(self, weight, dtype, spec, actorder=False, static_groups=False, global_scale=None,
                importance=None) -> ScaledColumns:
        """Group qparams chosen as the loop reaches each group, or all up front (actorder, static groups)."""
        if spec.dtype is QDtype.FLOAT8:
            raise SchemeError("weights.dtype", FLOAT8_COLUMNS)
        dynamic = spec.granularity is Granularity.GROUP and not (actorder or static_groups)
        return ScaledColumns.up_front(weight, dtype, spec, dynamic=dynamic, global_scale=global_scale)


class FloatGrid(IntegerGrid):
    """Float grids with group or block scales: FP8 blocks, NVFP4 (FP8 scales under a global scale), MX (E8M0)."""

    name = "float"

    def fake_quant(self, spec: WeightSpec) -> str:
        """torchao's NVFP4 and MX numerics round differently from compressed-tensors, whose grid the artifact holds."""
        return "grid"

    def owns(self, spec: WeightSpec) -> bool:
        return is_float_grid(spec)



FLOAT8_COLUMNS = ("float8 grids are not rounded one column at a time (integer and FP4 grids are, by GPTQ); "
                  "use rtn for float8 weights")
INTEGER_GRID = IntegerGrid()
FLOAT_GRID = FloatGrid()
