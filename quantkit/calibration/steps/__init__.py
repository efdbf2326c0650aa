"""Calibration layer steps: one module per algorithm that reads data, each registered with `@register(name)`.

A step is a function `step(layer, args) -> list[Tensor] | None`: it transforms or quantizes one decoder layer
(`calibration.layer.Layer`); `args` is the algorithm's argument dataclass. For each layer the pipeline runs the
recipe's transforms (AWQ, SmoothQuant), then `static_scales` when the scheme has static activations, then the
quantizer, then the KV cache scales. A quantizer that computed the layer's outputs on the way (GPTQ's staged pass,
AutoRound's loss after tuning) returns them; otherwise None, and the pipeline runs the quantized layer. A
data-free quantizer (round to nearest, HQQ) has no step module: `data_free.data_free_step` runs its weight function.

The algorithm object names its step's module (`Algorithm.step`); `step_of` imports it on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Callable

from quantkit.algorithms import Algorithm
from quantkit.runtime.registration import Registry

STEPS: Registry[Callable] = Registry("calibration step")
register = STEPS.register


def step_of(algorithm: Algorithm) -> Callable:
    """`step(layer, args)` for the algorithm: its own step, or the data-free quantizers' one."""
    if algorithm.step is None:
        from quantkit.calibration.steps.data_free import data_free_step

        return lambda layer, args: data_free_step(layer, algorithm, args)
    import_module(f"quantkit.calibration.steps.{algorithm.step}")
    return STEPS.get(algorithm.name)
