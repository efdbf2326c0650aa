"""MLX's affine grid (`mx.quantize(w, group_size, bits, mode="affine")`): per group of a row, a scale and a float
bias, both stored in the model's dtype, and codes in [0, 2^bits - 1]: value = scale * code + bias.

Not an integer zero point: the bias is any value of the model's dtype. Round to nearest chooses scale and bias as
`mx.quantize` does (mlx's `fast::Quantize` on the CPU, ported in float32: the group's end of larger magnitude is the
bias, and lies on the grid exactly; the step may be negative), then stores them in the model's dtype and rounds the
codes onto the grid as stored. mlx itself rounds the codes onto its float32 scale and bias and casts those afterwards,
so for a bfloat16 or float16 model a few codes differ from `mx.quantize`'s; here the file holds exactly the grid the
codes were chosen on (for a float32 model the two agree bit for bit). A value is computed in float32 (scale * code,
then + bias) and rounded once to the model's dtype: what mx.dequantize computes from the same tensors in float32.

On the CPU, for float32, bfloat16 and float16 weights, quantizing and dequantizing are compiled loops
(`cpu_kernels.mlx_quantize`, `mlx_dequantize`: one pass, a group at a time in registers); the torch ops below are
their twins, bit for bit (tests/unit/grids/test_mlx_kernels.py), and run on GPUs and for non-finite weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from quantkit.grids.family import GridFamily
from quantkit.grids.qparams import QuantizedWeight
from quantkit.grids.schemes import Granularity, ScaleDtype, WeightSpec

MLX_EPS = 1e-7  # mx.quantize's smallest step
PARTS = ("scales", "biases")  # the grid's tensors, in AffineParams' constructor order


def _blocks(x: torch.Tensor) -> list[slice]:
    from quantkit.grids.ggml_blocks import row_blocks

    return row_blocks(*x.shape)


# ---------------------------------------------------------------- the compiled loops' side (cpu_kernels)

_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu_kernels.FLOAT32, BFLOAT16, FLOAT16


def compiled_kind(device: torch.device, dtype: torch.dtype) -> int | None:
    """cpu_kernels' kind of `dtype` where the compiled loops take it (on the CPU; float32, bfloat16, float16), or
    None."""
    return _KINDS.get(dtype) if device.type == "cpu" else None


def bits_of(x: torch.Tensor) -> np.ndarray:
    """x's values as their bits (uint16; uint32 for float32), sharing its memory (contiguous x)."""
    wide = x.element_size() == 4
    return x.view(torch.int32 if wide else torch.int16).numpy().view(np.uint32 if wide else np.uint16)


@cache
def float16_bits() -> np.ndarray:
    """uint32 [65536]: each float16's float32 bits (`cpu_kernels`' `lut`)."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return every.float().view(torch.int32).numpy().view(np.uint32)


def in_row_blocks(fn, x: torch.Tensor) -> bool:
    """fn(rows) on each block of x's rows (`row_blocks`, in threads: `cpu_dispatch.map_chunks`); whether every
    block's kernel returned 0 (1: a block the torch ops must decide)."""
    from quantkit.grids.cpu_dispatch import map_chunks

    return not any(map_chunks(fn, _blocks(x), x.device))


def levels(spec: WeightSpec) -> int:
    """The largest code, 2^bits - 1 (mx.quantize's n_bins)."""
    return (1 << spec.dtype.bits) - 1


def choose(groups: torch.Tensor, n_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (scale, bias) [rows, groups] of `groups` [rows, groups, group_size], as mx.quantize chooses them: the
    step spans the group's range; the end of larger magnitude (`edge`) is the bias, the step then made to put zero on
    the grid (edge / its code), unless the edge rounds to code 0."""
    w_min, w_max = (t.float() for t in torch.aminmax(groups, dim=-1))
    mask = w_min.abs() > w_max.abs()
    scale = torch.clamp((w_max - w_min) / n_bins, min=MLX_EPS)
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    q0 = torch.round(edge / scale)
    nonzero = q0 != 0
    scale = torch.where(nonzero, edge / torch.where(nonzero, q0, 1.0), scale)
    bias = torch.where(nonzero, edge, torch.zeros_like(edge))
    return scale, bias


@dataclass
class AffineParams:
    """MLX's affine grid of a weight without its codes: scales and biases [rows, cols // group_size] in the model's
    dtype (`QParams.k`, as the block grids carry theirs)."""

    scales: torch.Tensor
    biases: torch.Tensor
    bits: int
    group_size: int

    @property
    def code_range(self) -> tuple[int, int]:
        return (0, (1 << self.bits) - 1)

    def column_scales(self, first_column: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (step, offset) [rows, count] of columns first_column .. + count - 1: value = step * code - offset."""
        index = torch.arange(first_column, first_column + count, device=self.scales.device) // self.group_size
        return self.scales.float()[:, index], -self.biases.float()[:, index]

    def _grouped(self, x: torch.Tensor, first_column: int):
        """(x as [rows, groups, group_size], its groups' float32 scale and bias [rows, groups, 1]) where x's columns are
        whole groups from `first_column` on, else None: broadcast, not gathered per column."""
        g = self.group_size
        if first_column % g or x.shape[1] % g:
            return None
        groups = slice(first_column // g, first_column // g + x.shape[1] // g)
        return (x.reshape(x.shape[0], -1, g), self.scales[:, groups].float().unsqueeze(-1),
                self.biases[:, groups].float().unsqueeze(-1))

    def dequantize(self, codes: torch.Tensor, first_column: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """scale * code + bias in float32 (the product, then the sum, as mx.dequantize computes them in float32), in
        `dtype`; a block of rows at a time."""
        out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
        if self._dequantize_compiled(codes, first_column, out):
            return out
        for rows in _blocks(codes):
            grouped = self.rows(rows)._grouped(codes[rows], first_column)
            if grouped is None:
                step, offset = self.rows(rows).column_scales(first_column, codes.shape[1])
                out[rows] = step * codes[rows].float() - offset
                continue
            part, step, bias = grouped
            out[rows] = part.float().mul_(step).add_(bias).reshape(part.shape[0], -1)
        return out

    def _dequantize_compiled(self, codes: torch.Tensor, first_column: int, out: torch.Tensor) -> bool:
        """`dequantize` into `out` by `cpu_kernels.mlx_dequantize`, where it takes the codes (whole groups from
        column 0, on the CPU, uint8, `out` float32 / bfloat16 / float16); whether it did."""
        kind = compiled_kind(codes.device, out.dtype)
        if kind is None or first_column or codes.dtype != torch.uint8 or codes.shape[1] != self.scales.shape[1] * self.group_size:
            return False
        from quantkit.grids.cpu_dispatch import kernels

        codes, out_bits = codes.contiguous().numpy(), bits_of(out)
        scales, biases = (t.float().contiguous().numpy() for t in (self.scales, self.biases))
        return in_row_blocks(lambda rows: kernels().mlx_dequantize(
            codes[rows], scales[rows], biases[rows], self.group_size, kind, float16_bits(), out_bits[rows]), out)

    def round(self, weight: torch.Tensor, first_column: int = 0) -> torch.Tensor:
        """The nearest codes (uint8) of `weight`'s columns from `first_column` on: rint((w - bias) / scale), clamped,
        in float32 (mx.quantize's arithmetic); a block of rows at a time."""
        out = torch.empty(weight.shape, dtype=torch.uint8, device=weight.device)
        for rows in _blocks(weight):
            grouped = self.rows(rows)._grouped(weight[rows], first_column)
            if grouped is None:
                step, offset = self.rows(rows).column_scales(first_column, weight.shape[1])
                out[rows] = torch.round((weight[rows].float() + offset) / step).clamp_(*self.code_range)
                continue
            part, step, bias = grouped
            codes = part.to(torch.float32, copy=True).sub_(bias).div_(step).round_().clamp_(*self.code_range)
            out[rows] = codes.reshape(part.shape[0], -1)
        return out

    def rows(self, rows: slice) -> AffineParams:
        return self.map(lambda t: t[rows])

    def parts(self) -> dict[str, torch.Tensor]:
        """Its tensors by name (a resume file's; `MLX_GRID.block_params` reads them back)."""
        return {"scales": self.scales, "biases": self.biases}

    def result(self, codes: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
        """The quantized weight of `codes` on this grid: each group's step, as float32, its scale (a copy: a resume
        file holds the two apart)."""
        return QuantizedWeight(codes, self.scales.to(torch.float32, copy=True), None, spec, k=self)

    def map(self, fn) -> AffineParams:
        return AffineParams(fn(self.scales), fn(self.biases), self.bits, self.group_size)


def quantize_mlx(weight: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
    """Round to nearest on MLX's affine grid: scale and bias chosen as mx.quantize does, stored in the weight's dtype,
    the codes the nearest on the grid as stored."""
    rows, cols = weight.shape
    if cols % spec.group_size:
        raise ValueError(f"group size {spec.group_size} does not divide input size {cols}")
    compiled = _quantize_compiled(weight, spec)
    if compiled is not None:
        return compiled
    scale, bias = choose(weight.reshape(rows, cols // spec.group_size, spec.group_size), levels(spec))
    grid = AffineParams(scale.to(weight.dtype), bias.to(weight.dtype), spec.dtype.bits, spec.group_size)
    return grid.result(grid.round(weight), spec)


def _quantize_compiled(weight: torch.Tensor, spec: WeightSpec) -> QuantizedWeight | None:
    """`quantize_mlx` by `cpu_kernels.mlx_quantize` (choose, store in the weight's dtype, round: one pass), where
    it takes the weight; None where it does not (a GPU, another dtype, a weight that is not finite)."""
    from quantkit.grids.cpu_dispatch import kernels

    kind = compiled_kind(weight.device, weight.dtype)
    if kind is None or spec.group_size % kernels().LANES:
        return None

    weight = weight.contiguous()
    groups = (weight.shape[0], weight.shape[1] // spec.group_size)
    codes = torch.empty(weight.shape, dtype=torch.uint8)
    scales, biases = torch.empty(groups, dtype=torch.float32), torch.empty(groups, dtype=torch.float32)
    w, out = bits_of(weight), [t.numpy() for t in (codes, scales, biases)]
    if not in_row_blocks(lambda rows: kernels().mlx_quantize(w[rows], kind, float16_bits(), spec.group_size, levels(spec),
                                                             np.float32(MLX_EPS), *(t[rows] for t in out)), weight):
        return None
    grid = AffineParams(scales.to(weight.dtype), biases.to(weight.dtype), spec.dtype.bits, spec.group_size)
    return grid.result(codes, spec)


@dataclass
class AffineColumns:
    """MLX's affine grid in GPTQ's column loop (`grids.family.ColumnGrid`): each group's scale and bias chosen as
    round to nearest chooses them, from the group's columns when the loop reaches it (or all up front), and columns
    rounded onto the stored grid exactly as `AffineParams.round` rounds."""

    spec: WeightSpec
    dtype: torch.dtype
    grid: AffineParams
    dynamic: bool
    code_dtype = torch.uint8
    graphs = False  # `algorithms.gptq_graphs` runs the integer grids' arithmetic; this grid's runs eagerly

    @classmethod
    def up_front(cls, weight: torch.Tensor, dtype: torch.dtype, spec: WeightSpec, dynamic: bool) -> AffineColumns:
        rows, cols = weight.shape
        scale, bias = choose(weight.to(dtype).reshape(rows, cols // spec.group_size, spec.group_size), levels(spec))
        return cls(spec, dtype, AffineParams(scale.to(dtype), bias.to(dtype), spec.dtype.bits, spec.group_size), dynamic)

    @property
    def choose_every(self) -> int | None:
        return self.spec.group_size if self.dynamic else None

    def group_of(self, column: int) -> int:
        return column // self.spec.group_size

    def choose(self, group: int, columns: torch.Tensor) -> None:
        scale, bias = choose(columns.to(self.dtype).reshape(columns.shape[0], 1, -1), levels(self.spec))
        self.grid.scales[:, group:group + 1] = scale.to(self.dtype)
        self.grid.biases[:, group:group + 1] = bias.to(self.dtype)

    def round(self, column: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the code as a float, its float32 value) of one column [out], the weight's dtype first, as RTN sees it."""
        step, bias = self.grid.scales[:, group].float(), self.grid.biases[:, group].float()
        code = torch.round((column.to(self.dtype).float() - bias) / step).clamp_(*self.grid.code_range)
        return code, step * code + bias

    def result(self, qdata: torch.Tensor) -> QuantizedWeight:
        return self.grid.result(qdata, self.spec)


class MLXGrid(GridFamily):
    """MLX's affine grids (`ScaleDtype.MLX_AFFINE`): round to nearest as mx.quantize chooses the grid, GPTQ's
    column rounding on it. AutoRound and HQQ fit an integer zero point, which this grid has not (they refuse it)."""

    name = "mlx affine"

    def owns(self, spec: WeightSpec) -> bool:
        return spec.scale_dtype is ScaleDtype.MLX_AFFINE

    def quantize(self, weight, spec, global_scale=None, importance=None) -> QuantizedWeight:
        return quantize_mlx(weight, spec)

    def empty(self, weight, spec) -> QuantizedWeight:
        shape = (weight.shape[0], weight.shape[1] // spec.group_size)
        grid = AffineParams(torch.empty(shape, dtype=weight.dtype, device=weight.device),
                            torch.empty(shape, dtype=weight.dtype, device=weight.device), spec.dtype.bits, spec.group_size)
        return grid.result(torch.empty(weight.shape, dtype=torch.uint8, device=weight.device), spec)

    def columns(self, weight, dtype, spec, actorder=False, static_groups=False, global_scale=None,
                importance=None) -> AffineColumns:
        dynamic = spec.granularity is Granularity.GROUP and not (actorder or static_groups)
        return AffineColumns.up_front(weight, dtype, spec, dynamic)

    def block_params(self, spec: WeightSpec, parts: dict[str, torch.Tensor]) -> AffineParams:
        return AffineParams(parts["scales"], parts["biases"], spec.dtype.bits, spec.group_size)


MLX_GRID = MLXGrid()
