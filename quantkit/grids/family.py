"""What a grid family is (`GridFamily`) and what it hands to the algorithms (`ColumnGrid`, `SearchedGrid`); the
families and the lookup are `quantkit.grids`. This module imports nothing of quantkit's but the schemes, so every
family's module can build on it."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

from quantkit.grids.schemes import WeightSpec

if TYPE_CHECKING:
    import torch


class ColumnGrid(Protocol):
    """A weight's grid as GPTQ's column loop uses it (`algorithms.gptq._quantize_columns`)."""

    spec: WeightSpec
    code_dtype: torch.dtype  # what the grid values are held in (int8 codes, float8_e4m3fn FP4 / FP8 values)
    graphs: bool  # affine integer columns that `algorithms.gptq_graphs` can run as CUDA graphs

    @property
    def choose_every(self) -> int | None:
        """Columns between two choices of parameters in the loop, or None: chosen up front."""

    def group_of(self, column: int) -> int: ...

    def choose(self, group: int, columns: torch.Tensor) -> None:
        """Choose the parameters of `group` (or of the block starting at column `group`) from `columns`."""

    def round(self, column: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the grid value as held, its float32 value) of one column [out]."""

    def result(self, qdata: torch.Tensor) -> QuantizedWeight:
        """The quantized weight of the finished codes."""


class SearchedGrid(Protocol):
    """Parameters a family's search fixes for a weight, affine per column: value = step * code - offset."""

    code_range: tuple[int, int]

    def column_scales(self, first_column: int, count: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def result(self, codes: torch.Tensor, spec: WeightSpec) -> QuantizedWeight: ...


class GridFamily:
    name: ClassVar[str]

    def owns(self, spec: WeightSpec) -> bool:
        raise NotImplementedError

    def fake_quant(self, spec: WeightSpec) -> str:
        """The QAT fake quantizer that reproduces the grid bit for bit (`quant.fake_quant.WEIGHT_CONFIGS`): torchao's
        where it does, else quantkit's own (`grid`: round to nearest through this family; `block_grid`: the family's
        search, kept for some training calls, and rounding onto it)."""
        return "grid"

    def quantize(self, weight: torch.Tensor, spec: WeightSpec, global_scale: torch.Tensor | None = None,
                 importance: torch.Tensor | None = None) -> QuantizedWeight:
        raise NotImplementedError

    def empty(self, weight: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
        raise NotImplementedError

    def columns(self, weight: torch.Tensor, dtype: torch.dtype, spec: WeightSpec, actorder: bool = False,
                static_groups: bool = False, global_scale: torch.Tensor | None = None,
                importance: torch.Tensor | None = None) -> ColumnGrid:
        """`weight` [out, in] (float32); its parameters chosen up front or as the loop reaches each group or block
        (`actorder`: the columns come out of order, so up front; `static_groups`: a scaled grid's groups up front);
        `importance`: each input column's weight in a block search (H's diagonal)."""
        raise NotImplementedError(f"{self.name} grids cannot be rounded one column at a time")

    def searched(self, weight: torch.Tensor, spec: WeightSpec) -> SearchedGrid | None:
        return None

    def block_params(self, spec: WeightSpec, parts: dict[str, torch.Tensor]):
        """A block grid's parameters from the tensors `parts` (name -> tensor, as `params.parts()` gave them)."""
        return None
