"""Each algorithm's recipe arguments: `algorithm: {name: gptq, block_size: 64}` in a recipe file.

One frozen dataclass per algorithm, and it is the algorithm's signature: the pure function takes it as
`args`, so its defaults are written once. `parse_arguments` checks a recipe's values against the dataclass'
signature and field types, then builds it so that `__post_init__` checks the ranges. No torch here.
"""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import dataclass
from typing import Any

from quantkit.algorithms import Algorithm
from quantkit.quant.schemes import SchemeError


@dataclass(frozen=True)
class RTNArgs:
    """Round-to-nearest takes no arguments: the scheme's observer chooses the qparams."""


@dataclass(frozen=True)
class GPTQArgs:
    block_size: int = 128  # columns updated lazily together (rounded up to a multiple of the group size)
    dampening_frac: float = 0.01  # H += dampening_frac * mean(diag H) * I
    actorder: bool = False  # round columns in order of decreasing H_ii (static groups)
    static_groups: bool = False  # group qparams chosen up front from the weight, not as GPTQ reaches each group

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise SchemeError("block_size", f"{self.block_size} is not allowed; use a positive number of columns")
        if self.dampening_frac <= 0:
            raise SchemeError("dampening_frac", f"{self.dampening_frac} is not allowed; use a positive fraction such as 0.01")


@dataclass(frozen=True)
class AWQArgs:
    grid: int = 20  # ratios k / grid, k = 0 .. grid - 1, tried for each block
    # calibration tokens (all ranks) each candidate is scored on, taken as the first rows of every batch; the
    # statistics use every token. None: every token. 128 x 2048: llm-compressor's AWQ at its usual size, and a
    # quarter of the grid's work at 512 x 2048, where it is most of AWQ's time (an 8B layer: 23 s of 25 on an H200)
    grid_tokens: int | None = 128 * 2048

    def __post_init__(self) -> None:
        if self.grid < 1:
            raise SchemeError("grid", f"{self.grid} is not allowed; use at least 1 (1 is plain RTN)")
        if self.grid_tokens is not None and self.grid_tokens < 1:
            raise SchemeError("grid_tokens", f"{self.grid_tokens} is not allowed; use a positive count, or null for every token")


@dataclass(frozen=True)
class SmoothQuantArgs:
    alpha: float = 0.5  # migration strength: 0 leaves activations alone, 1 moves all of their range into weights

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise SchemeError("alpha", f"{self.alpha} is not allowed; use a value in [0, 1]")


@dataclass(frozen=True)
class AutoRoundArgs:
    """Intel auto-round's defaults (`SignRoundConfig`, llm-compressor's `AutoRoundModifier`)."""

    iters: int = 200  # SignSGD steps per decoder layer
    lr: float | None = None  # the rounding offsets' step size, decayed linearly to 0; None: 1 / iters
    minmax_lr: float | None = None  # the clipping factors' step size; None: lr
    batch_size: int = 8  # calibration samples per step
    samples_per_pass: int = 4  # a step's samples to one forward and backward pass (equal-length samples; else 1).
    # The ranks share a step's passes, so at most batch_size / samples_per_pass ranks tune at once; the artifact
    # depends on it, not on the number of ranks
    minmax_tuning: bool = True  # tune each group's min/max clipping factors (else only the rounding)
    seed: int = 42  # the order samples are drawn in (with the layer's index)
    amp: bool = True  # tune in bfloat16 autocast where the device multiplies bf16 natively (auto-round's `amp`)
    full_range: bool = True  # symmetric grids: auto-round's scales (the larger side of a group's range on qmin);
    # false: the recipe's min-max grid (round-to-nearest's, max|w| / ((qmax - qmin) / 2))

    def __post_init__(self) -> None:
        if self.iters < 1:
            raise SchemeError("iters", f"{self.iters} is not allowed; use at least 1 (e.g. 200), or algorithm rtn for none")
        for name in ("batch_size", "samples_per_pass"):
            if getattr(self, name) < 1:
                raise SchemeError(name, f"{getattr(self, name)} is not allowed; use a positive number of samples")
        for name in ("lr", "minmax_lr"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SchemeError(name, f"{value} is not allowed; use a positive step size, or leave it out for 1 / iters")

    @property
    def rounding_lr(self) -> float:
        return self.lr if self.lr is not None else 1.0 / self.iters

    @property
    def clipping_lr(self) -> float:
        return self.minmax_lr if self.minmax_lr is not None else self.rounding_lr


ARGUMENTS: dict[Algorithm, type] = {
    Algorithm.RTN: RTNArgs,
    Algorithm.GPTQ: GPTQArgs,
    Algorithm.AWQ: AWQArgs,
    Algorithm.SMOOTHQUANT: SmoothQuantArgs,
    Algorithm.AUTOROUND: AutoRoundArgs,
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


def _typed(key: str, value: Any, kind: Any) -> Any:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `float | None`: null, or the type
        if value is None:
            return None
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if isinstance(value, bool) and kind is not bool:
        raise SchemeError(key, f"{value!r} is not allowed; expected {kind.__name__}")
    if kind is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, kind):
        raise SchemeError(key, f"{value!r} is not allowed; expected {kind.__name__}")
    return value

