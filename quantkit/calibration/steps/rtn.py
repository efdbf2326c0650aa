"""Round-to-nearest as the quantizer of a calibrated recipe (after AWQ, or with static activation scales)."""

from __future__ import annotations

import time

from quantkit.algorithms import Algorithm
from quantkit.algorithms.arguments import RTNArgs
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.calibration.layer import Layer, relative_error
from quantkit.calibration.steps import register


@register(Algorithm.RTN)
def rtn_step(layer: Layer, args: RTNArgs) -> None:
    """Round each quantized Linear of the layer on its grid; every rank computes the same from the same weights."""
    started = time.perf_counter()
    global_scales = layer.global_scales()
    for name, module in layer.linears.items():
        weight = module.weight.data
        qweight = rtn_quantize(weight, layer.plan[name].scheme.weights, global_scales.get(name))
        layer.record(name, qweight, relative_error(weight, qweight, None))
    layer.result.seconds["quantize"] += time.perf_counter() - started
