"""Each algorithm's recipe arguments: `algorithm: {name: gptq, block_size: 64}` in a recipe file.

One frozen dataclass per algorithm, and it is the algorithm's signature: the pure function takes it as
`args`, so its defaults are written once. `parse_arguments` checks a recipe's values against the dataclass'
signature and field types, then builds it so that `__post_init__` checks the ranges. No torch here.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from typing import Any

from quantkit.algorithms import Algorithm
from quantkit.schemes import SchemeError


@dataclass(frozen=True)
class RTNArgs:
    """Round-to-nearest takes no arguments: the scheme's observer chooses the qparams."""


@dataclass(frozen=True)
class GPTQArgs:
    block_size: int = 128  # columns updated lazily together (rounded up to a multiple of the group size)
    dampening_frac: float = 0.01  # H += dampening_frac * mean(diag H) * I
    actorder: bool = False  # round columns in order of decreasing H_ii (static groups)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise SchemeError("block_size", f"{self.block_size} is not allowed; use a positive number of columns")
        if self.dampening_frac <= 0:
            raise SchemeError("dampening_frac", f"{self.dampening_frac} is not allowed; use a positive fraction such as 0.01")


@dataclass(frozen=True)
class AWQArgs:
    grid: int = 20  # ratios k / grid, k = 0 .. grid - 1, tried for each block

    def __post_init__(self) -> None:
        if self.grid < 1:
            raise SchemeError("grid", f"{self.grid} is not allowed; use at least 1 (1 is plain RTN)")


@dataclass(frozen=True)
class SmoothQuantArgs:
    alpha: float = 0.5  # migration strength: 0 leaves activations alone, 1 moves all of their range into weights

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise SchemeError("alpha", f"{self.alpha} is not allowed; use a value in [0, 1]")


ARGUMENTS: dict[Algorithm, type] = {
    Algorithm.RTN: RTNArgs,
    Algorithm.GPTQ: GPTQArgs,
    Algorithm.AWQ: AWQArgs,
    Algorithm.SMOOTHQUANT: SmoothQuantArgs,
}


def parse_arguments(name: Algorithm, values: dict[str, Any]) -> dict[str, Any]:
    """`values` checked against `name`'s arguments (floats given as ints become floats); SchemeError names
    the argument at fault."""
    cls = ARGUMENTS[name]
    allowed = inspect.signature(cls).parameters
    types = typing.get_type_hints(cls)
    checked = {}
    for key, value in values.items():
        if key not in allowed:
            choices = ", ".join(sorted(allowed)) or "none"
            raise SchemeError(key, f"unknown argument for {name.value}; allowed: {choices}")
        checked[key] = _typed(key, value, types[key])
    cls(**checked)  # __post_init__ checks the ranges
    return checked


def _typed(key: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) and kind is not bool:
        raise SchemeError(key, f"{value!r} is not allowed; expected {kind.__name__}")
    if kind is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, kind):
        raise SchemeError(key, f"{value!r} is not allowed; expected {kind.__name__}")
    return value

