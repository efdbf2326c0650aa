"""The grid layer: what a quantized weight looks like (`schemes`: torch-free specs), how it rounds (`qparams`, the
families below), llama.cpp's block layouts (`ggml_blocks`). Imports only `quantkit.errors` and `quantkit.runtime`.

Grid families: what a weight's grid is, as one object each. Everything above the grid layer asks the family of a
spec (`family_of`) instead of asking what kind of grid it is.

A family owns, for the specs it holds:
- `quantize(weight, spec, global_scale, importance)`: round to nearest on the grid, its parameters chosen by the
  family's own observer or search (a `QuantizedWeight`);
- `empty(weight, spec)`: buffers shaped like `quantize`'s result (to receive a broadcast);
- `columns(weight, dtype, spec, dynamic, global_scale, importance)`: the grid as GPTQ rounds onto it, one column at
  a time (`ColumnGrid`);
- `searched(weight, spec)`: a grid whose parameters the family's search fixes, with each column's step and offset
  (`SearchedGrid`: what AutoRound tunes the rounding on), or None where the algorithm chooses the parameters;
- `block_params(spec, parts)`: a block grid's parameters rebuilt from their tensors (a resume file);
- `fake_quant`: the kind of QAT fake quantizer that reproduces it (`quant.fake_quant.WEIGHT_CONFIGS`).

Members, in the order they are asked: llama.cpp's K-quants (`k_grids`), llama.cpp's non-linear i-quants
(`iq_grids`), llama.cpp's codebook i-quants below 4 bits (`iq_low`), MLX's affine grids (`mlx_grids`: a scale and a float bias per group), the float grids (FP8 blocks, NVFP4, MX: `qparams.FLOAT_GRID`), the integer and FP8-per-channel grids
(`qparams.INTEGER_GRID`). A new family is a module in this layer defining one object, and its place in `families()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantkit.grids.family import GridFamily
from quantkit.grids.schemes import WeightSpec

if TYPE_CHECKING:
    import torch

    from quantkit.grids.qparams import QuantizedWeight


def families() -> list[GridFamily]:
    from quantkit.grids.iq_grids import IQ_GRID
    from quantkit.grids.iq_low import CODEBOOK_GRID
    from quantkit.grids.k_grids import K_GRID
    from quantkit.grids.mlx_grids import MLX_GRID
    from quantkit.grids.qparams import FLOAT_GRID, INTEGER_GRID

    return [K_GRID, IQ_GRID, CODEBOOK_GRID, MLX_GRID, FLOAT_GRID, INTEGER_GRID]


def family_of(spec: WeightSpec) -> GridFamily:
    """The family that holds `spec`'s grid."""
    return next(family for family in families() if family.owns(spec))


def quantize_weight(weight: torch.Tensor, spec: WeightSpec, global_scale: torch.Tensor | None = None,
                    importance: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest of a 2-D weight [out, in] on the spec's grid (its family's). NVFP4: the global scale shared
    with the weights a kernel fuses with this one, or this weight's own when None. `importance`: a weight per input
    column (an imatrix: H's diagonal) where the family's search takes one."""
    import torch

    with torch.no_grad():
        return family_of(spec).quantize(weight, spec, global_scale, importance)


def fake_quantize_weight(weight: torch.Tensor, spec: WeightSpec, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as the quantized model sees it: quantize, then dequantize to the weight's dtype."""
    return quantize_weight(weight, spec, global_scale).dequantize(weight.dtype)


def empty_quantized(weight: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
    """Buffers shaped and typed like `quantize_weight(weight, spec)`'s result (to receive a broadcast)."""
    return family_of(spec).empty(weight, spec)
