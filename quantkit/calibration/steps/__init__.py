"""Calibration layer steps: one module per algorithm, each registered with `@register(Algorithm.X)`.

A step is a function `step(layer, args) -> list[Tensor] | None`: it transforms or quantizes one decoder layer
(`calibration.layer.Layer`); `args` is the algorithm's argument dataclass (`algorithms.arguments`). For each
layer the pipeline runs the recipe's transforms (AWQ, SmoothQuant), then `static_scales` when the scheme has
static activations, then the quantizer (RTN, GPTQ, AutoRound). A quantizer that computed the layer's outputs on
the way (GPTQ's staged pass, AutoRound's loss after tuning) returns them; otherwise None, and the pipeline runs
the quantized layer.

A new algorithm is a new module here (its step) plus its pure math under `quantkit.algorithms`.
"""

from __future__ import annotations

from typing import Callable

from quantkit.runtime.registration import Registry

STEPS: Registry[Callable] = Registry("calibration step")
register = STEPS.register

from quantkit.calibration.steps import autoround, awq, gptq, rtn, smoothquant  # noqa: E402,F401  (each registers its step)
