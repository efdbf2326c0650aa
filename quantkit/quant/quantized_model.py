"""`QuantizedModel`: what quantization (round-to-nearest or calibration) produces and every exporter writes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.quant.plan import ModulePlan
from quantkit.grids.qparams import QParams
from quantkit.quant.registry import Recipe


@dataclass
class QuantizedModel:
    """A model whose planned Linear weights hold their dequantized grid values, with each one's qparams and,
    for static activation schemes, its input scale; with a quantized KV cache, each attention's key and value
    scales. The grid integers are not kept: they follow from the weight
    and its qparams (so a quantized model costs no more memory than the float one). A format that converts
    while loading (torchao) gives the converted model and no qparams."""

    model: nn.Module
    plan: list[ModulePlan]
    recipe: Recipe
    qparams: dict[str, QParams] = field(default_factory=dict)
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # "<attention>.k_scale" / ".v_scale"
