"""A data-free quantizer (round to nearest, HQQ) as the quantizer of a calibrated recipe (after AWQ, or with static
activation scales): each quantized Linear of the layer through the algorithm's weight function
(`Algorithm.quantize_weight`). Every rank computes the same from the same weights."""

from __future__ import annotations

import time

from quantkit.algorithms import Algorithm
from quantkit.calibration.layer import Layer, relative_error


def data_free_step(layer: Layer, algorithm: Algorithm, args) -> None:
    started = time.perf_counter()
    global_scales = layer.global_scales()
    for name, module in layer.linears.items():
        weight = module.weight.data
        qweight = algorithm.quantize_weight(weight, layer.plan[name].scheme.weights, args, global_scales.get(name))
        layer.record(name, qweight, relative_error(weight, qweight, None))
    layer.result.seconds["quantize"] += time.perf_counter() - started
