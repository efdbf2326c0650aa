"""Round-to-nearest: each weight to its nearest grid point, with the scheme's observer's qparams."""

import torch

from quantkit.grids import quantize_weight
from quantkit.grids.qparams import QuantizedWeight
from quantkit.grids.schemes import WeightSpec


def rtn_quantize(weight: torch.Tensor, spec: WeightSpec, global_scale: torch.Tensor | None = None) -> QuantizedWeight:
    """NVFP4: `global_scale` is the one shared with the weights a kernel fuses with this one (its own when None)."""
    return quantize_weight(weight, spec, global_scale)
