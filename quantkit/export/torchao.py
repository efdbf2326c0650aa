"""torchao output: tensor subclasses saved as safetensors through transformers' TorchAo integration.

The recipe's scheme maps to the torchao config of the same grid; transformers quantizes each Linear with it
while loading, on the current device. So this format's quantization is its load: `load_quantized` (the one
exporter function beyond the `Exporter` protocol) gives the converted model, and `finalize` skips its own
round-to-nearest. Tests check that torchao's dequantized weights equal the scheme's.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from quantkit import models
from quantkit.plan import ModulePlan
from quantkit.quantized_model import QuantizedModel
from quantkit.registry import Recipe
from quantkit.schemes import Granularity, QDtype, QuantScheme, ScaleDtype, WeightObserver


def unsupported(recipe: Recipe) -> str | None:
    if recipe.kv_cache is not None:
        return "torchao artifacts carry no KV cache scales (--kv-cache); they are compressed-tensors' kv_cache_scheme"
    if recipe.needs_calibration:
        return "the torchao format takes round-to-nearest recipes with dynamic activations (it quantizes while loading)"
    if recipe.scheme.weights.observer is not WeightObserver.MINMAX:
        return "torchao's configs choose min/max qparams; the mse weight observer needs compressed-tensors"
    try:
        torchao_config(recipe.scheme)
    except ValueError as exc:
        return str(exc)
    return None


def torchao_config(scheme: QuantScheme):
    """The torchao config whose grid is the scheme's, or ValueError."""
    import torch
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8DynamicActivationIntxWeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
        MappingType,
        PerAxis,
        PerGroup,
        PerRow,
    )

    w, a = scheme.weights, scheme.activations
    per_channel = w.granularity is Granularity.CHANNEL
    granularity = PerAxis(0) if per_channel else PerGroup(w.group_size)
    mapping = MappingType.SYMMETRIC if w.symmetric else MappingType.ASYMMETRIC
    float32_scale = w.scale_dtype is ScaleDtype.FLOAT32
    if w.dtype is QDtype.FLOAT4 or w.scale_dtype in (ScaleDtype.FLOAT8, ScaleDtype.E8M0) or w.granularity is Granularity.BLOCK:
        raise ValueError("quantkit writes NVFP4, MX and FP8-block weights as compressed-tensors only")
    if a is not None and a.granularity is Granularity.GROUP:
        raise ValueError("quantkit writes per-group activations as compressed-tensors only")
    if w.dtype is QDtype.FLOAT8:
        if a is not None and a.dtype is QDtype.FLOAT8:
            return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
        raise ValueError("torchao has float8 weights only with float8 dynamic activations")
    if a is not None and a.dtype is QDtype.FLOAT8:
        raise ValueError("torchao has no integer-weight, float8-activation config")
    if w.dtype is QDtype.INT8 and per_channel and w.symmetric and float32_scale:
        if a is None:
            return Int8WeightOnlyConfig(granularity=PerRow())
        if a.symmetric:
            return Int8DynamicActivationInt8WeightConfig(granularity=PerRow())
    if float32_scale:
        raise ValueError("torchao's int configs keep scales in the model's dtype here; use scale_dtype: model")
    dtype = getattr(torch, w.dtype.value)  # torch.int2 ... torch.int8
    if a is None:
        return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity, mapping_type=mapping)
    if a.symmetric:
        raise ValueError("torchao's int8-activation, intx-weight config quantizes activations asymmetrically")
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=granularity, weight_mapping_type=mapping)


def transformers_config(plan: list[ModulePlan]):
    from torchao.quantization import FqnToConfig
    from transformers import TorchAoConfig

    fqn_to_config = {entry.name: torchao_config(entry.scheme) for entry in plan if entry.quantized}
    skipped = [entry.name for entry in plan if not entry.quantized]
    return TorchAoConfig(FqnToConfig(fqn_to_config), modules_to_not_convert=skipped or None)


def load_quantized(src: Path, plan: list[ModulePlan], dtype: str = "auto", trust_remote_code: bool = False) -> nn.Module:
    """The model at `src`, each planned Linear converted by its torchao config while transformers loads it."""
    return models.load_model(src, dtype, trust_remote_code, quantization_config=transformers_config(plan))


def as_loaded(quantized: QuantizedModel) -> nn.Module:
    return quantized.model  # converted while loading: it already computes as the artifact will


def weight_bytes(entry: ModulePlan, element_size: int) -> int:
    """torchao's CPU tensors keep one byte per element (int2, int3 and int4 unpacked into int8, int8, float8), scales in the
    model's dtype (float32 for per-row int8), int8 zero points for asymmetric grids."""
    rows, cols = entry.out_features, entry.in_features
    return rows * cols + entry.scheme.weights.qparam_bytes(rows, cols, element_size)


def write(quantized: QuantizedModel, out_dir: Path, max_shard_size: int | None = None) -> None:
    quantized.model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
