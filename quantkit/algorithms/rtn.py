"""Round-to-nearest: each weight to its nearest grid point, with min/max scales."""

import torch

from quantkit.algorithms import register
from quantkit.qparams import QuantizedWeight, quantize_weight
from quantkit.registry import Algorithm
from quantkit.schemes import WeightSpec


@register(Algorithm.RTN)
def rtn_quantize(weight: torch.Tensor, spec: WeightSpec) -> QuantizedWeight:
    return quantize_weight(weight, spec)
