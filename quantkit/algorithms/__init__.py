"""Quantization algorithms: pure functions over tensors, registered by name.

`Algorithm` names them (recipes say `algorithm: {name: gptq}`); `arguments.py` holds each one's recipe
arguments as a dataclass that validates itself. Both import no torch, so recipes are checked without it.
The implementations register themselves with `@register(Algorithm.X)` in their own modules, which
`get_algorithm` imports on first use (one list, `_IMPLEMENTATIONS`):

- `rtn.rtn_quantize(weight, spec)`: round to nearest.
- `gptq.gptq_quantize(weight, hessian, spec, args)`: Hessian-aware rounding.
- `awq.search_scales(act_mean, error_of, args)`: activation-aware weight scales (a transform before a quantizer).
- `smoothquant.smoothing_scales(act_absmax, weights, args)`: activation outliers into weights (a transform).
- `autoround.tune(weights, specs, sample_loss, ...)`: learned rounding and clipping (SignSGD) for one decoder layer.

How a decoder layer feeds them data is `quantkit.calibration.steps`' business, not theirs.
"""

from __future__ import annotations

import importlib
from enum import Enum
from typing import Callable

from quantkit.runtime.registration import Registry


class Algorithm(str, Enum):
    RTN = "rtn"  # round-to-nearest: no calibration data
    GPTQ = "gptq"  # Hessian-aware rounding: calibration data
    SMOOTHQUANT = "smoothquant"  # a transform before the quantizer: migrates activation outliers into weights
    AWQ = "awq"  # a transform before the quantizer: activation-aware weight scales, searched per block
    AUTOROUND = "autoround"  # learned rounding and clipping per decoder layer (SignSGD): calibration data

    @property
    def is_quantizer(self) -> bool:
        """A quantizer rounds the weights (the last step of a recipe); the others transform before it."""
        return self in (Algorithm.RTN, Algorithm.GPTQ, Algorithm.AUTOROUND)


ALGORITHMS: Registry[Callable] = Registry("algorithm")
register = ALGORITHMS.register

_IMPLEMENTATIONS = ("rtn", "gptq", "awq", "smoothquant", "autoround")


def get_algorithm(name: Algorithm) -> Callable:
    """The registered pure function for `name` (importing the implementations, and torch, on first use)."""
    for module in _IMPLEMENTATIONS:
        importlib.import_module(f"quantkit.algorithms.{module}")
    return ALGORITHMS.get(name)
