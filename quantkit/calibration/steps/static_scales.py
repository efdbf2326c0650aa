"""Static activation scales: per-tensor input ranges of every quantized Linear, observed on calibration data
(NVFP4: the activations' global scale, 448 * 6 / absmax).

Not an algorithm of the recipe's list but a property of its scheme (`activations: {dynamic: false}`): the
pipeline runs this step before the quantizer whenever the scheme asks for static scales.
"""

from __future__ import annotations

import time

import torch

from quantkit.calibration.hooks import observe, observer_groups
from quantkit.calibration.layer import Layer
from quantkit.grids import float_grids
from quantkit.grids.observers import activation_observer
from quantkit.runtime import distributed
from quantkit.runtime.precision import model_dtype


def static_scales_step(layer: Layer) -> None:
    """Observe each Linear's input range on the (transformed, not yet quantized) layer, merged over all ranks
    with the observer's reduce ops; scale = absmax / qmax."""
    started = time.perf_counter()
    spec = layer.recipe.scheme.activations
    observers = observe(layer.linears, activation_observer(spec.observer), layer.module, layer.inputs)
    # modules fed one tensor share one observer: reduce it once
    distributed.all_reduce_observers([observers[names[0]] for names in observer_groups(observers)], layer.ctx)
    qmax = spec.dtype.qrange[1]
    for name, observer in observers.items():
        if spec.global_scale:  # NVFP4: the per-tensor scale above the dynamic FP8 group scales, computed in the
            # activations' dtype as compressed-tensors does (the float32 absmax of bf16 values is a bf16 value)
            layer.result.input_scales[name] = float_grids.global_scale(observer.absmax().to(model_dtype(layer.module)))
        else:
            layer.result.input_scales[name] = (observer.absmax() / qmax).clamp(min=torch.finfo(torch.float32).eps)
    layer.result.seconds["observe"] += time.perf_counter() - started
