"""compressed-tensors output (vLLM's native format), produced on any device, CPU included.

The weights are quantized by quantkit's algorithms on the recipe's grid; compressed-tensors receives the
resulting qparams and packs them: int4/int8 weight-only as pack-quantized, int8 W8A8 as int-quantized, float8
as float-quantized. The in-memory model runs compressed-tensors' own forward (dequantized weights, activations
quantized per token at run time), so it computes exactly what the reloaded artifact computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
)
from torch import nn

from quantkit import models
from quantkit.algorithms import get_algorithm
from quantkit.plan import ModulePlan
from quantkit.qparams import QuantizedWeight
from quantkit.registry import Recipe
from quantkit.schemes import ActivationSpec, Granularity, QuantScheme, WeightSpec


def unsupported(scheme: QuantScheme) -> str | None:
    if scheme.weights.is_asymmetric and compression_format(scheme) == "pack-quantized":
        return "asymmetric pack-quantized weights do not load in transformers (packed zero-point shape mismatch)"
    return None


def compression_format(scheme: QuantScheme) -> str:
    if scheme.weights.dtype.is_float:
        return "float-quantized"
    return "int-quantized" if scheme.activations else "pack-quantized"


def _weight_args(spec: WeightSpec) -> QuantizationArgs:
    group = spec.granularity is Granularity.GROUP
    return QuantizationArgs(
        num_bits=spec.dtype.bits, type="float" if spec.dtype.is_float else "int", symmetric=spec.symmetric,
        strategy="group" if group else "channel", group_size=spec.group_size if group else None,
    )


def _activation_args(spec: ActivationSpec | None) -> QuantizationArgs | None:
    if spec is None:
        return None
    return QuantizationArgs(
        num_bits=8, type="float" if spec.dtype.is_float else "int", symmetric=spec.symmetric,
        strategy="token", dynamic=True,
    )


def quantization_config(plan: list[ModulePlan], recipe: Recipe) -> QuantizationConfig:
    """The recipe's scheme targets every Linear; modules with a fallback group size are named exactly
    (an exact name wins over a class in compressed-tensors and vLLM); modules left out are ignored by name."""
    groups: dict[QuantScheme, list[str]] = {}
    for entry in plan:
        if entry.quantized and entry.scheme != recipe.scheme:
            groups.setdefault(entry.scheme, []).append(entry.name)
    if any(entry.scheme == recipe.scheme for entry in plan):
        groups[recipe.scheme] = ["Linear"]
    config_groups = {
        f"group_{i}": QuantizationScheme(
            targets=targets, weights=_weight_args(scheme.weights), input_activations=_activation_args(scheme.activations)
        )
        for i, (scheme, targets) in enumerate(groups.items())
    }
    ignore = [entry.name for entry in plan if not entry.quantized]
    return QuantizationConfig(config_groups=config_groups, ignore=ignore)


def install(model: nn.Module, plan: list[ModulePlan], recipe: Recipe) -> None:
    """Attach compressed-tensors' quantization (schemes, qparam slots, quantized forward) to `model`."""
    apply_quantization_config(model, quantization_config(plan, recipe), show_progress=False)


def set_qparams(module: nn.Module, qweight: QuantizedWeight) -> None:
    """Give an installed module its qparams (from any algorithm); its weight becomes the dequantized grid point,
    which compressed-tensors re-quantizes to exactly `qweight.qdata` when it packs."""
    module.weight.data.copy_(qweight.dequantize(module.weight.dtype))
    module.weight_scale = nn.Parameter(qweight.scale.reshape(module.weight_scale.shape), requires_grad=False)
    if qweight.zero_point is not None:
        zero = qweight.zero_point.reshape(module.weight_zero_point.shape)
        module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)


def freeze(model: nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "quantization_scheme"):
            module.quantization_status = QuantizationStatus.FROZEN


def quantize(
    src: Path, plan: list[ModulePlan], recipe: Recipe, dtype: str = "auto", trust_remote_code: bool = False,
    on_module: Callable[[str], None] | None = None,
) -> nn.Module:
    """Load, then quantize module by module (each module's qparams are installed at once: no second copy)."""
    model = models.load_model(src, dtype, trust_remote_code)
    algorithm = get_algorithm(recipe.algorithm)
    install(model, plan, recipe)
    with torch.no_grad():
        for entry in plan:
            if entry.quantized:
                module = model.get_submodule(entry.name)
                set_qparams(module, algorithm(module.weight.data, entry.scheme.weights))
                if on_module:
                    on_module(entry.name)
    freeze(model)
    return model


def save(model: nn.Module, out_dir: Path) -> None:
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
