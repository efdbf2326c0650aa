"""Quantization schemes: what a quantized weight and activation look like.

A scheme is the one definition of a recipe's grid. The quantizer (`algorithms.rtn`), the QAT fake quantizer
and every exporter follow it. This module holds plain data and validation only; it imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum


class QDtype(str, Enum):
    INT2 = "int2"
    INT3 = "int3"
    INT4 = "int4"
    INT8 = "int8"
    FLOAT8 = "float8_e4m3fn"

    @property
    def is_float(self) -> bool:
        return self is QDtype.FLOAT8

    @property
    def bits(self) -> int:
        return {QDtype.INT2: 2, QDtype.INT3: 3, QDtype.INT4: 4}.get(self, 8)

    @property
    def qrange(self) -> tuple[float, float]:
        """The representable range: the full two's-complement range for ints, +-448 for float8 e4m3."""
        if self.is_float:
            return (-448.0, 448.0)
        return (-(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1)


class Granularity(str, Enum):
    GROUP = "group"  # weights: one scale per `group_size` input columns of each output row
    CHANNEL = "channel"  # weights: one scale per output row
    TOKEN = "token"  # dynamic activations: one scale per token, computed at run time
    TENSOR = "tensor"  # static activations: one scale per tensor, from calibration


class ScaleDtype(str, Enum):
    FLOAT32 = "float32"
    MODEL = "model"  # the dtype of the model's weights (bf16 for a bf16 model)


class WeightObserver(str, Enum):
    MINMAX = "minmax"  # the range of each group / channel
    MSE = "mse"  # the clipped range (grid search on a shrink factor) with the least quantization error


class SchemeError(ValueError):
    """A scheme field has a value that is not allowed; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class WeightSpec:
    """How weights are stored. Asymmetric grids use an integer zero point in the quantized dtype's range."""

    dtype: QDtype
    granularity: Granularity
    group_size: int | None = None
    symmetric: bool = True
    scale_dtype: ScaleDtype = ScaleDtype.MODEL
    observer: WeightObserver = WeightObserver.MINMAX  # memoryless: computed from the weight itself

    def __post_init__(self) -> None:
        if self.observer is WeightObserver.MSE and self.dtype.is_float:
            raise SchemeError("weights.observer", "mse searches integer grids; float8 weights use minmax")
        if self.granularity in (Granularity.TOKEN, Granularity.TENSOR):
            raise SchemeError("weights.granularity", "weights are quantized per 'group' or per 'channel'")
        if self.granularity is Granularity.GROUP:
            if not isinstance(self.group_size, int) or self.group_size < 2:
                raise SchemeError("weights.group_size", "granularity 'group' needs an integer group_size >= 2 (e.g. 128)")
        elif self.group_size is not None:
            raise SchemeError("weights.group_size", "only granularity 'group' takes a group_size; remove it or use granularity: group")
        if self.dtype.is_float and (not self.symmetric or self.granularity is not Granularity.CHANNEL):
            raise SchemeError("weights", "float8 weights are symmetric and per 'channel'")

    @property
    def is_asymmetric(self) -> bool:
        return not self.symmetric

    def qparam_bytes(self, rows: int, cols: int, element_size: int) -> int:
        """Bytes of the scales (float32, or the model's `element_size`) and int8 zero points of a [rows, cols] weight."""
        groups = rows * (cols // self.group_size if self.granularity is Granularity.GROUP else 1)
        scale = 4 if self.scale_dtype is ScaleDtype.FLOAT32 else element_size
        return groups * (scale + (0 if self.symmetric else 1))

    def describe(self) -> str:
        grain = f"g{self.group_size}" if self.granularity is Granularity.GROUP else "channel"
        mse = " mse" if self.observer is WeightObserver.MSE else ""
        return f"{_short(self.dtype)} {grain}{'' if self.symmetric else ' asym'}{mse}"


@dataclass(frozen=True)
class ActivationSpec:
    """How activations are quantized: dynamic (a scale per token, computed at run time), or static (one
    symmetric scale per tensor, measured on calibration data; `granularity: tensor`)."""

    dtype: QDtype
    granularity: Granularity = Granularity.TOKEN
    symmetric: bool = True
    dynamic: bool = True
    observer: str = "static_minmax"  # static scales: static_minmax (min/max over all data) or minmax (mean of batch ranges)

    def __post_init__(self) -> None:
        if self.observer not in ("static_minmax", "minmax"):
            raise SchemeError("activations.observer", f"'{self.observer}' is not allowed; allowed: static_minmax, minmax")
        if self.dtype.bits < 8:
            raise SchemeError("activations.dtype", "activations are int8 or float8_e4m3fn")
        expected = Granularity.TOKEN if self.dynamic else Granularity.TENSOR
        if self.granularity is not expected:
            raise SchemeError("activations.granularity", f"{'dynamic' if self.dynamic else 'static'} activations are quantized per '{expected.value}'")
        if not self.dynamic and not self.symmetric:
            raise SchemeError("activations.symmetric", "static activation scales are symmetric (per tensor)")
        if self.dtype.is_float and not self.symmetric:
            raise SchemeError("activations.symmetric", "float8 activations are symmetric")

    def describe(self) -> str:
        return f"{_short(self.dtype)} {self.granularity.value}{'' if self.symmetric else ' asym'}"


@dataclass(frozen=True)
class QuantScheme:
    weights: WeightSpec
    activations: ActivationSpec | None = None

    def with_group_size(self, group_size: int) -> QuantScheme:
        return replace(self, weights=replace(self.weights, group_size=group_size))

    def describe(self) -> str:
        kind = "dynamic" if self.activations and self.activations.dynamic else "static"
        acts = f"{kind} {self.activations.describe()}" if self.activations else "16-bit"
        return f"weights {self.weights.describe()}, activations {acts}"


def _short(dtype: QDtype) -> str:
    return "fp8" if dtype is QDtype.FLOAT8 else dtype.value
