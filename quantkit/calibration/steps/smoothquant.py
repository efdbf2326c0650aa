"""SmoothQuant on one decoder layer: observe the normed activations (max over all ranks), fold the scales into
each norm and the Linears it feeds (`algorithms.smoothquant`)."""

from __future__ import annotations

import time

from quantkit.algorithms.methods.smoothquant import SmoothQuantArgs
from quantkit.algorithms.smoothquant import fold_scales, smoothing_scales
from quantkit.calibration.hooks import observe
from quantkit.calibration.layer import Layer
from quantkit.calibration.steps import register
from quantkit.models.architectures import norm_weight_offset
from quantkit.grids.observers import ChannelAbsMax
from quantkit.runtime import distributed


@register("smoothquant")
def smoothquant_step(layer: Layer, args: SmoothQuantArgs) -> None:
    started = time.perf_counter()
    part = layer.module.get_submodule
    groups = {}
    for norm, linears in layer.traced_wiring.smoothing:
        if norm is None:
            layer.skip("smoothquant", linears, "no norm feeds them: their input is the residual stream")
        else:
            groups[norm] = linears
    observers = observe({norm: part(linears[0]) for norm, linears in groups.items()}, ChannelAbsMax, layer.module, layer.inputs)
    distributed.all_reduce_observers(list(observers.values()), layer.ctx)
    for norm, linears in groups.items():
        # the scales balance the quantized weights; modules kept in full precision (an MoE router) take them too
        quantized = [part(n).weight for n in linears if _quantized(layer, n)] or [part(n).weight for n in linears]
        scales = smoothing_scales(observers[norm].state["absmax"], quantized, args)
        module = part(norm)
        fold_scales(module.weight, [part(n).weight for n in linears], scales, norm_weight_offset(module), getattr(module, "bias", None))
    layer.result.seconds["transforms"] += time.perf_counter() - started


def _quantized(layer: Layer, name: str) -> bool:
    entry = layer.plan.get(f"{layer.prefix}.{name}")
    return entry is not None and entry.quantized
