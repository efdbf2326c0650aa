"""SmoothQuant on one decoder layer: observe the normed activations (max over all ranks), fold the scales into
each norm and the Linears it feeds (`algorithms.smoothquant`)."""

from __future__ import annotations

import time

from quantkit import distributed
from quantkit.algorithms import Algorithm
from quantkit.algorithms.arguments import SmoothQuantArgs
from quantkit.algorithms.smoothquant import fold_scales, smoothing_scales
from quantkit.architectures import norm_weight_offset
from quantkit.calibration.hooks import observe
from quantkit.calibration.layer import Layer
from quantkit.calibration.steps import register
from quantkit.observers import ChannelAbsMax


@register(Algorithm.SMOOTHQUANT)
def smoothquant_step(layer: Layer, args: SmoothQuantArgs) -> None:
    started = time.perf_counter()
    part = layer.module.get_submodule
    groups = {}
    for norm, linears in layer.traced_wiring.smoothing:
        if norm is None:
            layer.skip("smoothquant", linears, "no norm feeds them: their input is the residual stream")
        else:
            groups[norm] = [part(name) for name in linears]
    observers = observe({norm: linears[0] for norm, linears in groups.items()}, ChannelAbsMax, layer.module, layer.inputs)
    for observer in observers.values():
        distributed.all_reduce_observer(observer, layer.ctx)
    for norm, linears in groups.items():
        scales = smoothing_scales(observers[norm].state["absmax"], [m.weight for m in linears], args)
        module = part(norm)
        fold_scales(module.weight, [m.weight for m in linears], scales, norm_weight_offset(module), getattr(module, "bias", None))
    layer.result.seconds["transforms"] += time.perf_counter() - started
