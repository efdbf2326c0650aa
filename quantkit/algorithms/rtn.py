"""Round-to-nearest: each weight to its nearest grid point, with the scheme's observer's qparams."""

import torch

from quantkit.algorithms import Algorithm, register
from quantkit.qparams import QuantizedWeight, quantize_weight
from quantkit.schemes import WeightSpec


@register(Algorithm.RTN)
def rtn_quantize(weight: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
    return quantize_weight(weight, spec)
