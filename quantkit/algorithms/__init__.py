"""Quantization algorithms: each one object (`base.Algorithm`, one module each under `methods/`, torch-free) and
its pure math over tensors beside it:

- `rtn.rtn_quantize(weight, spec)`: round to nearest.
- `hqq.hqq_quantize(weight, spec, args)`: half-quadratic scales and zero points, no data.
- `gptq.gptq_quantize(weight, hessian, spec, args)`: Hessian-aware rounding.
- `awq.search_scales(act_mean, error_of, args)`: activation-aware weight scales (a transform before a quantizer).
- `smoothquant.smoothing_scales(act_absmax, weights, args)`: activation outliers into weights (a transform).
- `autoround.tune(weights, specs, sample_loss, ...)`: learned rounding and clipping (SignSGD) for one decoder layer.

Recipes say `algorithm: {name: gptq, ...}`; `get(name)` is the object, which everything else asks (whether it
needs data, what it refuses, its preflight terms, its summary). How a decoder layer feeds them data is
`quantkit.calibration.steps`' business, not theirs. Adding an algorithm: its math module, its `methods/` module,
its name in METHODS below (and a calibration step where it needs data).
"""

from __future__ import annotations

import difflib
from importlib import import_module

from quantkit.algorithms.base import ALGORITHMS, Algorithm

METHODS = ("rtn", "gptq", "smoothquant", "awq", "autoround", "hqq")  # the registration: modules under methods/
DEFAULT = "rtn"  # a recipe without `algorithm:` rounds to nearest


def _load() -> None:
    for module in METHODS:
        import_module(f"quantkit.algorithms.methods.{module}")


def get(name: str) -> Algorithm:
    """The algorithm object registered as `name` (LookupError, with close matches, for an unknown one)."""
    _load()
    if name not in ALGORITHMS.keys():
        close = difflib.get_close_matches(str(name), names(), n=2, cutoff=0.5)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise LookupError(f"'{name}' is not an algorithm{hint} (allowed: {', '.join(names())})")
    return ALGORITHMS.get(name)


def names(quantizer: bool | None = None) -> list[str]:
    """The registered algorithms' names (only the quantizers, or only the transforms, if asked)."""
    _load()
    return [name for name in ALGORITHMS.keys() if quantizer is None or ALGORITHMS.get(name).quantizer is quantizer]


__all__ = ["Algorithm", "DEFAULT", "METHODS", "get", "names"]
