"""SmoothQuant: a transform before the quantizer that migrates activation outliers into the weights."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.algorithms.base import Algorithm, register
from quantkit.grids.schemes import SchemeError


@dataclass(frozen=True)
class SmoothQuantArgs:
    alpha: float = 0.5  # migration strength: 0 leaves activations alone, 1 moves all of their range into weights

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise SchemeError("alpha", f"{self.alpha} is not allowed; use a value in [0, 1]")


@register
class SmoothQuant(Algorithm):
    name = "smoothquant"
    Arguments = SmoothQuantArgs
    quantizer = False
    step = "smoothquant"
