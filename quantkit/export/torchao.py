"""torchao output: tensor subclasses saved as safetensors through transformers' TorchAo integration.

The recipe's scheme maps to the torchao config of the same grid; transformers quantizes each Linear with it
while loading, on the current device. So this format's quantization is its load: `load_quantized` (a hook of
`export.Hooks`) gives the converted model, and `finalize` skips its own round-to-nearest; the model is loaded
whole (no `StreamWriter`). Tests check that torchao's dequantized weights equal the scheme's.

Float grids: torchao's NVFP4 and FP8-block arithmetic (group / block maxima, the global scale, the division by
the scales) runs in float32, compressed-tensors' (which the scheme follows) in the model's dtype. On float32
models both give the same grid values and scales; on bfloat16 models about 1.5% of NVFP4's values and a few of
FP8-block's land one step apart. MX scales are the same in both (torchao's EVEN mode for FP4 elements, RCEIL for
FP8).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from quantkit.quant.plan import ModulePlan
from quantkit.quant.quantized_model import QuantizedModel
from quantkit.quant.registry import Recipe
from quantkit.grids.schemes import Granularity, QDtype, QuantScheme, ScaleDtype, WeightObserver

if TYPE_CHECKING:
    from torch import nn


WHOLE_MODEL = "transformers converts to torchao while it loads"
LOAD_AND_WRITE_COPIES = 1.75  # the preflight's RAM estimate, in copies of the model's bytes


def unsupported(recipe: Recipe) -> str | None:
    if recipe.kv_cache is not None:
        return "torchao artifacts carry no KV cache scales (--kv-cache); they are compressed-tensors' kv_cache_scheme"
    if recipe.needs_calibration or not all(step.algorithm.rounds_to_nearest for step in recipe.steps):
        return "the torchao format takes round-to-nearest recipes with dynamic activations (it quantizes while loading)"
    if recipe.transforms:
        return ("the recipe rotates the model before quantizing it, and transformers converts the unrotated checkpoint "
                "to torchao while it loads")
    if recipe.scheme.weights.scale_dtype in (ScaleDtype.FLOAT16, ScaleDtype.K_QUANT):
        return "fp16 and k_quant scales are GGUF's grids (torchao's tensors keep scales in the model's dtype)"
    if recipe.scheme.weights.scale_dtype is ScaleDtype.MLX_AFFINE:
        return "mlx_affine is MLX's grid (a float bias per group, not an integer zero point)"
    if recipe.mixture:
        return (f"{recipe.mixture} is llama.cpp's mixture of GGML types, which GGUF holds; per-tensor types here are "
                "recipes' schemes (--tensor-type REGEX=RECIPE)")
    if recipe.scheme.weights.observer is not WeightObserver.MINMAX:
        return "torchao's configs choose min/max qparams; the mse weight observer needs compressed-tensors"
    try:
        torchao_config(recipe.scheme)
    except ValueError as exc:
        return str(exc)
    return None


def check_model(src: Path, config, skeleton: nn.Module) -> None:
    from quantkit.errors import FormatError
    from quantkit.models import moe

    if moe.experts_modules(skeleton):
        raise FormatError(f"{src} is a mixture-of-experts model; quantkit writes MoE experts as compressed-tensors only: "
                          "use --format compressed-tensors")


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
        return _float_grid_config(scheme)
    if a is not None and a.granularity is Granularity.GROUP:
        raise ValueError("quantkit writes per-group activations as compressed-tensors only")
    if w.dtype is QDtype.FLOAT8:
        if a is not None and a.dtype is QDtype.FLOAT8:
            return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
        raise ValueError("torchao has float8 weights only with float8 dynamic activations")
    if a is not None and a.dtype is QDtype.FLOAT8:
        raise ValueError("torchao's int4-weight, float8-activation config (Float8DynamicActivationInt4WeightConfig) "
                         "quantizes through mslk's CUDA kernels on a grid quantkit cannot check against the scheme")
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


def _float_grid_config(scheme: QuantScheme):
    """NVFP4 weight-only, MXFP4 / MXFP8 with dynamic activations, FP8 128x128 blocks with per-token-group
    activations: torchao's configs of the same grid, or ValueError."""
    import torch
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.inference_workflow import MXDynamicActivationMXWeightConfig, NVFP4WeightOnlyConfig
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerBlock

    w, a = scheme.weights, scheme.activations
    if w.global_scale:  # NVFP4
        if a is not None:
            raise ValueError("torchao's NVFP4 W4A4 computes the activations' global scale at run time; "
                             "the scheme's is calibrated")
        return NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=True)
    if w.scale_dtype is ScaleDtype.E8M0:  # MX
        if a is None or a.dtype is not w.dtype or a.group_size != w.group_size:
            raise ValueError("torchao's MX config quantizes weights and activations alike (MX weight-only has no torchao config)")
        element = torch.float4_e2m1fn_x2 if w.dtype is QDtype.FLOAT4 else torch.float8_e4m3fn
        mode = ScaleCalculationMode.EVEN if w.dtype is QDtype.FLOAT4 else ScaleCalculationMode.RCEIL
        return MXDynamicActivationMXWeightConfig(activation_dtype=element, weight_dtype=element, block_size=w.group_size,
                                                 scaling_mode=mode)
    if w.granularity is Granularity.BLOCK and w.dtype is QDtype.FLOAT8:
        blocks_128 = tuple(w.block_shape) == (128, 128)
        token_groups_128 = (a is not None and a.dtype is QDtype.FLOAT8 and a.granularity is Granularity.GROUP
                            and a.group_size == 128)
        if not (blocks_128 and token_groups_128):
            raise ValueError("torchao's FP8 block config takes 128x128 weight blocks with FP8 activations per token-group of 128")
        return Float8DynamicActivationFloat8WeightConfig(granularity=[PerBlock([1, 128]), PerBlock([128, 128])])
    raise ValueError("torchao has no config for this float grid")


def qat_mismatch(scheme: QuantScheme) -> str | None:
    """Why torchao's conversion would not give back the weights a QAT run trained on this scheme's grid, or None.
    QAT follows the scheme (compressed-tensors' arithmetic, NVFP4's global scale shared by q/k/v and gate/up)."""
    w = scheme.weights
    if w.global_scale:
        return "torchao's NVFP4 gives each Linear its own global scale and divides in float32"
    if w.granularity is Granularity.BLOCK:
        return "torchao's FP8 blocks divide in float32"
    return None


def required_dtype(recipe: Recipe) -> tuple[str, str] | None:
    """torchao's FP8 tensors (per row, per block) and its FP4 / MX tensors take bfloat16 weights alone."""
    if recipe.scheme.weights.dtype is QDtype.FLOAT8:
        return "bfloat16", "torchao's FP8 tensors take bfloat16 weights"
    if recipe.scheme.weights.sixteen_bit:
        return "bfloat16", "torchao's FP4 / MX tensors take bfloat16 weights"
    return None


def cuda_capability(scheme: QuantScheme) -> str | None:
    """The CUDA compute capability torchao's kernels need to convert (and run) the scheme's config, or None where it
    converts and runs on CPU too: FP8 compute 8.9 (Ada), MX compute 10.0 (Blackwell); NVFP4 weight-only runs
    anywhere (torchao dequantizes it for a 16-bit product)."""
    w, a = scheme.weights, scheme.activations
    if w.scale_dtype is ScaleDtype.E8M0:
        return "10.0"
    if w.dtype is QDtype.FLOAT8 and a is not None and a.dtype is QDtype.FLOAT8:
        return "8.9"
    return None


def transformers_config(plan: list[ModulePlan]):
    from torchao.quantization import FqnToConfig
    from transformers import TorchAoConfig

    fqn_to_config = {entry.name: torchao_config(entry.scheme) for entry in plan if entry.quantized}
    skipped = [entry.name for entry in plan if not entry.quantized]
    return TorchAoConfig(FqnToConfig(fqn_to_config), modules_to_not_convert=skipped or None)


def load_quantized(src: Path, plan: list[ModulePlan], dtype: str = "auto", trust_remote_code: bool = False) -> nn.Module:
    """The model at `src`, each planned Linear converted by its torchao config while transformers loads it."""
    from quantkit.models import loading as models
    return models.load_model(src, dtype, trust_remote_code, quantization_config=transformers_config(plan))


def as_loaded(quantized: QuantizedModel) -> nn.Module:
    return quantized.model  # converted while loading: it already computes as the artifact will


def weight_bytes(entry: ModulePlan, element_size: int) -> int:
    """torchao's CPU tensors keep one byte per element (int2, int3 and int4 unpacked into int8, int8, float8; FP4 packs
    two elements a byte), scales in the model's dtype (float32 for per-row int8), int8 zero points for asymmetric
    grids."""
    rows, cols = entry.out_features, entry.in_features
    elements = rows * cols // 2 if entry.scheme.weights.dtype is QDtype.FLOAT4 else rows * cols
    return elements + entry.scheme.weights.qparam_bytes(rows, cols, element_size)


def write(quantized: QuantizedModel, out_dir: Path, max_shard_size: int | None = None) -> None:
    quantized.model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
