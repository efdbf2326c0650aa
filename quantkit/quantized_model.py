"""`QuantizedModel`: what quantization (round-to-nearest or calibration) produces and every exporter writes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.plan import ModulePlan
from quantkit.qparams import QuantizedWeight
from quantkit.registry import Recipe


@dataclass
class QuantizedModel:
    """A model whose planned Linear weights hold their dequantized grid values, with each one's qparams and,
    for static activation schemes, its input scale. A format that converts while loading (torchao) gives the
    converted model and no qweights."""

    model: nn.Module
    plan: list[ModulePlan]
    recipe: Recipe
    qweights: dict[str, QuantizedWeight] = field(default_factory=dict)
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)
