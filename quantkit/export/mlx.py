"""MLX: a directory mlx-lm loads (`mlx_lm.load`, `mlx_lm.generate`, LM Studio's MLX engine), in MLX's affine mode.

Each quantized Linear is three tensors, as `nn.QuantizedLinear` holds it: `weight`, the codes packed into uint32
words (each row's codes one little-endian bit stream, the first code in the lowest bits, so 3, 5 and 6 bits span
words), `scales` and `biases` per group in the model's dtype: value = scales * code + biases, code in [0, 2^bits - 1]
(`mx.dequantize`). config.json carries `quantization` (and the same as `quantization_config`, as mlx-lm writes it):
{group_size, bits, mode} and an entry for each layer quantized otherwise. The token embedding is quantized as
mlx-lm's `convert -q` quantizes it (on the recipe's grid, round to nearest) unless the recipe's `ignore` names it; a
tied lm_head is the embedding (mlx-lm's `as_linear`).

Two grids are held exactly. MLX's own affine grid (`scale_dtype: mlx_affine`, `grids.mlx_grids`: a float bias per
group) as it is. A symmetric integer grid (scale per group in the model's dtype, q in [qmin, qmax]) as code q - qmin
and bias qmin * scale, a power of two times the scale and so exact in any float dtype: every value is the recipe's.
An asymmetric integer grid's bias, (qmin - zero point) * scale, is not a value of the model's dtype in general: it is
refused, naming MLX's own grid (never rounded a second time). mlx's float modes hold FP4 / FP8 codes and one uint8
scale per group, no biases: mxfp4 / mxfp8 (quantkit's MX grids as they are, E8M0 exponents) and nvfp4 (FP4 in groups
of 16 under FP8 e4m3 scales and no global scale, `global_scale: false`: chosen as mx.quantize chooses them).

On the CPU the writer's pass over an affine grid's weight is one compiled loop (`cpu_kernels.mlx_pack`: each code
rounded back, decoded and checked, packed), and the token embedding's quantization, decoding and packing another
(`cpu_kernels.mlx_quantize_pack`: nothing of the embedding's size in between); `grid_tensors` and `pack` are their
torch twins, and decide whatever the loops leave to them (a weight that is not finite, a code that does not decode).

Written layer by layer (`StreamWriter`) into safetensors shards (`export/shards.py`: `model.safetensors`, or
`model-0000x-of-0000y.safetensors` with `model.safetensors.index.json`), names as mlx-lm's models name them (the
Hugging Face names, for the architectures in ARCHITECTURES; Qwen3-MoE's experts stacked as mlx-lm's switch_mlp, and
what Gemma2, Gemma3 and Phi-3 need in config.json: `mlx_archs`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from quantkit.errors import ExportError, FormatError
from quantkit.export import mlx_archs
from quantkit.grids.ggml_blocks import row_blocks
from quantkit.grids import mlx_grids
from quantkit.grids.mlx_grids import AffineParams
from quantkit.grids.qparams import QParams
from quantkit.grids.schemes import (
    MLX_BITS,
    MLX_GROUP_SIZES,
    Granularity,
    QDtype,
    QuantScheme,
    ScaleDtype,
    WeightSpec,
)
from quantkit.quant import tensor_types
from quantkit.quant.plan import ModulePlan, is_ignored
from quantkit.quant.quantized_model import QuantizedModel
from quantkit.quant.registry import Recipe
from quantkit.runtime import placement

# Hugging Face model_type -> mlx-lm's model module; their tensors carry the Hugging Face names there (Qwen3-MoE's
# experts: stacked, `mlx_archs.stacked`). Gemma 3's multimodal `gemma3` is not here: quantkit loads its text model
# (gemma3_text) only
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                 "gemma2": "gemma2", "gemma3_text": "gemma3_text", "phi3": "phi3"}
NEAREST = "recipe mlx-4bit-g64 (MLX's own affine grid: scale_dtype mlx_affine)"
NEAREST_NVFP4 = "recipe mlx-nvfp4 (FP4 in groups of 16 under FP8 scales alone, chosen as mx.quantize chooses them)"


# ---------------------------------------------------------------- which grids MLX holds


def for_format(recipe: Recipe) -> Recipe:
    """The recipe as it quantizes for MLX: a symmetric integer grid's float32 scales chosen in the model's dtype,
    the dtype MLX stores them in (so the grid the algorithm rounds onto is the file's)."""
    weights = recipe.scheme.weights
    if _for_mlx(weights) is weights:
        return recipe
    return replace(recipe, scheme=QuantScheme(_for_mlx(weights), recipe.scheme.activations))


def _for_mlx(spec: WeightSpec) -> WeightSpec:
    """A grid as MLX stores it: an integer grid's float32 scales in the model's dtype."""
    if spec.dtype.is_float or spec.scale_dtype is not ScaleDtype.FLOAT32:
        return spec
    return replace(spec, scale_dtype=ScaleDtype.MODEL)


def mode_of(spec: WeightSpec) -> str:
    """mlx's quantization mode of a grid it holds: affine (integer codes, scale and bias), mxfp4 / mxfp8 (FP4 / FP8
    values in groups of 32 under E8M0 scales: OCP microscaling, quantkit's MX grids as they are), nvfp4 (FP4 values
    in groups of 16 under FP8 e4m3 scales and no global scale: a Linear's nvfp4 in mlx holds none)."""
    if spec.scale_dtype is ScaleDtype.E8M0 and spec.group_size == 32:
        return {QDtype.FLOAT4: "mxfp4", QDtype.FLOAT8: "mxfp8"}.get(spec.dtype, "affine")
    if spec.scale_dtype is ScaleDtype.FLOAT8 and spec.dtype is QDtype.FLOAT4 and not spec.global_scale:
        return "nvfp4"
    return "affine"


def spec_refusal(spec: WeightSpec) -> str | None:
    """Why MLX cannot hold `spec`'s grid exactly (with the nearest it can), or None."""
    if spec.scale_dtype is ScaleDtype.MLX_AFFINE or mode_of(spec) != "affine":
        return None
    if spec.global_scale:
        return (f"mlx's nvfp4 mode holds FP8 group scales alone, not {spec.label()}'s under a per-tensor global scale; "
                f"the nearest is {NEAREST_NVFP4}")
    if spec.dtype.is_float or spec.dtype.is_codebook or spec.scale_dtype not in (ScaleDtype.MODEL, ScaleDtype.FLOAT32):
        return (f"MLX holds integer grids with scales in the model's dtype (affine), MX grids (mxfp4, mxfp8) and nvfp4 "
                f"without a global scale, not {spec.label()}; the nearest is {NEAREST}, or mxfp4-a16 / mlx-nvfp4 for FP4")
    if spec.dtype.bits not in MLX_BITS:
        return f"MLX takes {', '.join(map(str, MLX_BITS))}-bit codes, not {spec.dtype.bits}; the nearest is {NEAREST}"
    if spec.granularity is not Granularity.GROUP or spec.group_size not in MLX_GROUP_SIZES:
        return (f"MLX takes groups of {', '.join(map(str, MLX_GROUP_SIZES))}, not {spec.describe()}; the nearest is "
                f"{NEAREST}")
    if not spec.symmetric:
        return ("an integer zero point's bias ((qmin - zero point) x scale) is not a value of the model's dtype in "
                f"general, and MLX stores the bias in it; the nearest is {NEAREST}, whose float bias the algorithm chooses")
    return None


def unsupported(recipe: Recipe) -> str | None:
    """Why MLX cannot hold the recipe, or None: weight-only, no KV cache or online rotations, a grid it holds
    exactly (`spec_refusal`)."""
    if recipe.scheme.activations is not None:
        return f"MLX's files are weight-only (16-bit activations); the nearest is {NEAREST}, or mxfp4-a16 / mlx-nvfp4 for FP4"
    if recipe.kv_cache is not None:
        return "mlx-lm quantizes its KV cache at run time (--kv-bits), not in the file: drop --kv-cache"
    if recipe.online_rotations:
        return "mlx-lm does not apply online rotations (R4); use the fused ones only (R1, R2)"
    if recipe.mixture:
        return "llama.cpp's mixtures are GGUF's; give MLX per-tensor types as recipes' names (--tensor-type REGEX=mlx-8bit-g64)"
    return spec_refusal(for_format(recipe).scheme.weights)


def check_model(src: Path, config, skeleton: nn.Module) -> None:
    """Refuse, before any weight is read, an architecture whose tensors mlx-lm names otherwise than quantkit knows,
    or whose config mlx-lm's model would compute otherwise (`mlx_archs.refusal`)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise FormatError(f"quantkit writes MLX for {', '.join(sorted(ARCHITECTURES))} models, not '{model_type}'; "
                          "use --format gguf or compressed-tensors")
    if problem := mlx_archs.refusal(config):
        raise FormatError(f"mlx-lm's {model_type} would compute another model: {problem}; use --format gguf or "
                          "compressed-tensors")


def notes(skeleton: nn.Module, recipe: Recipe) -> list[str]:
    """The summary's caveats (`mlx_archs.notes`: where mlx-lm attends beyond a sliding window)."""
    return mlx_archs.notes(skeleton.config)


def adapt_plan(plan: list[ModulePlan], recipe: Recipe, config) -> list[ModulePlan]:
    """The plan with the recipe's per-tensor schemes (`tensor_types`: recipes' names, `plan.with_tensor_type`), each
    a per-layer entry of config.json's `quantization` (mlx-lm's mixed bits); a tensor type whose grid MLX does not
    hold exactly is refused before any work. A Linear whose group size MLX does not take (a smaller group chosen for
    it: `on_indivisible`) stays in full precision, as mlx-lm's `convert -q` leaves a layer its group does not divide."""
    from quantkit.quant.plan import with_tensor_type

    def typed(entry: ModulePlan) -> ModulePlan:
        if not recipe.tensor_types:
            return entry
        adapted = with_tensor_type(entry, recipe)
        if adapted.scheme is None or adapted.scheme == entry.scheme:
            return adapted
        spec = _for_mlx(adapted.scheme.weights)
        kind = tensor_types.type_for(tensor_types.names_of(entry.name), recipe.tensor_types)
        if problem := spec_refusal(spec):
            raise FormatError(f"{entry.name}: tensor type {kind}: {problem}")
        if entry.in_features % spec.group_size:
            raise FormatError(f"{entry.name}: tensor type {kind}'s groups of {spec.group_size} do not divide its "
                              f"{entry.in_features} inputs; give it a type with another group size")
        return replace(adapted, scheme=QuantScheme(spec, adapted.scheme.activations))

    def fitted(entry: ModulePlan) -> ModulePlan:
        spec = entry.scheme.weights if entry.quantized else None
        if spec is None or (mode_of(spec) != "affine" or spec.group_size in MLX_GROUP_SIZES) and (
                entry.in_features % spec.group_size == 0):  # the float modes fix their groups (16, 32)
            return entry
        return replace(entry, scheme=None, note=f"MLX takes groups of {'/'.join(map(str, MLX_GROUP_SIZES))}; "
                                                f"{entry.in_features} inputs fit none of the recipe's")
    if recipe.tensor_types:
        embedding_weights(recipe, config)  # an embedding's tensor type MLX cannot hold: refused here, before any work
    adapted = [fitted(typed(entry)) for entry in plan]
    if problem := mlx_archs.mixed_experts(adapted):
        raise FormatError(problem)
    return adapted


# ---------------------------------------------------------------- the token embedding


def _embedding_name(model: nn.Module) -> str:
    embedding = model.get_input_embeddings()
    return next(name for name, module in model.named_modules() if module is embedding)


def embedding_weights(recipe: Recipe, config) -> WeightSpec | None:
    """The grid the token embedding is stored on (mlx-lm's `convert -q` quantizes it: QuantizedEmbedding), None where
    the recipe's `ignore` names it or the group does not divide the hidden size."""
    spec = for_format(recipe).scheme.weights
    names = ("model.embed_tokens", "embed_tokens", "token_embd")
    kind = tensor_types.type_for(tensor_types.EMBEDDING_NAMES, recipe.tensor_types)
    if kind is not None:  # a per-tensor type (`--tensor-type embed_tokens=mlx-8bit-g64`, or float) wins
        from quantkit.quant.registry import tensor_type_spec

        typed = tensor_type_spec(kind)
        spec = typed and _for_mlx(typed)
        if spec is None:
            return None
        if problem := spec_refusal(spec):
            raise FormatError(f"the token embedding: tensor type {kind}: {problem}")
        if config.hidden_size % spec.group_size:
            raise FormatError(f"the token embedding: tensor type {kind}'s groups of {spec.group_size} do not divide its "
                              f"{config.hidden_size} columns; give it a type with another group size")
        return spec
    if is_ignored("model.embed_tokens", recipe.ignore) or any(n in recipe.ignore for n in names):
        return None
    if spec_refusal(spec) is not None or config.hidden_size % spec.group_size:
        return None
    return spec


def _embedding_spec(model: nn.Module, recipe: Recipe, plan_names: set[str]) -> WeightSpec | None:
    """The embedding's grid, None where it is stored as lm_head's (tied, lm_head quantized) or left in full precision."""
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in plan_names:
        return None
    return embedding_weights(recipe, model.config)


def quantized_tensors(skeleton: nn.Module, plan: list[ModulePlan], recipe: Recipe) -> dict[str, str]:
    """The token embedding, when the file holds it quantized (`plan.coverage` counts it)."""
    name = f"{_embedding_name(skeleton)}.weight"
    planned = {entry.name for entry in plan if entry.quantized}
    if getattr(skeleton.config, "tie_word_embeddings", False) and "lm_head" in planned:
        return {name: next(e.scheme.weights.describe() for e in plan if e.name == "lm_head")}
    spec = _embedding_spec(skeleton, recipe, planned)
    return {name: spec.describe()} if spec else {}


def _quantize_embedding(weight: torch.Tensor, spec: WeightSpec):
    from quantkit.grids import quantize_weight

    return quantize_weight(weight, spec)


def as_loaded(quantized: QuantizedModel) -> nn.Module:
    """The quantized model: its planned Linears hold their grid's values, and the token embedding (unless ignored,
    or tied to a quantized lm_head, which already holds the grid the file stores for both) its grid's, as
    mlx-lm's QuantizedEmbedding dequantizes it."""
    model = quantized.model
    planned = {name for name in quantized.qparams}
    spec = _embedding_spec(model, quantized.recipe, planned)
    if spec is not None:
        embedding = model.get_input_embeddings()
        embedding.weight.data = _quantize_embedding(embedding.weight.data, spec).dequantize(embedding.weight.dtype)
    return model


def weight_bytes(entry: ModulePlan, element_size: int) -> int:
    spec = entry.scheme.weights
    per_group = 2 * element_size if mode_of(spec) == "affine" else 1  # scale and bias, or an E8M0 exponent
    return entry.out_features * entry.in_features * spec.dtype.bits // 8 + per_group * spec.scale_count(
        entry.out_features, entry.in_features)


# ---------------------------------------------------------------- tensors


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint32 [rows, cols * bits / 32] of codes [rows, cols] in [0, 2^bits - 1]: each row one bit stream, code k in
    bits [k * bits, (k + 1) * bits), little-endian words (`mx.quantize`'s layout). Eight codes at a time are one
    integer of `bits` bytes."""
    rows, cols = codes.shape
    if cols * bits % 32:
        raise ExportError(f"{cols} codes of {bits} bits do not fill whole 32-bit words")
    if 8 % bits == 0:  # 2, 4, 8 bits: whole codes to a byte, the first in the lowest bits
        per_byte = 8 // bits
        parts = codes.reshape(rows, -1, per_byte)
        out = parts[..., 0].clone()
        for k in range(1, per_byte):
            out |= parts[..., k] << (k * bits)
        return out.contiguous().view(torch.int32).view(torch.uint32)
    out = torch.empty((rows, cols * bits // 8), dtype=torch.uint8)
    shifts = torch.arange(8, dtype=torch.int64) * bits
    byte_shifts = torch.arange(bits, dtype=torch.int64) * 8
    for part in row_blocks(rows, cols):
        chunk = codes[part].to(torch.int64).reshape(-1, cols // 8, 8)
        joined = (chunk << shifts).sum(-1, keepdim=True)  # the 8 codes' bits do not overlap: a sum is an OR
        out[part] = ((joined >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1, cols * bits // 8)
    return out.view(torch.int32).view(torch.uint32)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes (uint8 [rows, cols]) of `pack`'s words."""
    data = packed.contiguous().view(torch.uint8)
    rows = data.shape[0]
    grouped = data.reshape(rows, -1, bits).to(torch.int64)
    joined = (grouped << (torch.arange(bits, dtype=torch.int64) * 8)).sum(-1, keepdim=True)
    codes = (joined >> (torch.arange(8, dtype=torch.int64) * bits)) & ((1 << bits) - 1)
    return codes.reshape(rows, -1).to(torch.uint8)


def grid_tensors(weight: torch.Tensor, qparams: QParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8, scales, biases) of a Linear's weight that holds its grid's values: MLX's affine grid's codes
    rounded back onto it, a symmetric integer grid's as code q - qmin with bias qmin * scale; each checked to decode
    (in the model's dtype) to the weight exactly."""
    grid = affine_grid(weight.dtype, qparams)
    codes = grid.round(weight)
    for rows in row_blocks(*weight.shape):
        decoded = grid.rows(rows).dequantize(codes[rows], dtype=weight.dtype)
        if not torch.equal(decoded, weight[rows]) and not _within_rounding(decoded, weight[rows], grid.rows(rows), codes[rows]):
            raise ExportError("a quantized weight is not on its MLX grid (a quantkit bug: please report it)")
    return codes, grid.scales.to(weight.dtype), grid.biases.to(weight.dtype)


def affine_grid(dtype: torch.dtype, qparams: QParams) -> AffineParams:
    """The affine grid a Linear's qparams stand for: MLX's own, or a symmetric integer grid's as code q - qmin with
    bias qmin * scale (in the model's dtype)."""
    if isinstance(qparams.k, AffineParams):
        return qparams.k
    spec = qparams.spec
    if spec_refusal(spec) is not None or qparams.zero_point is not None:
        raise ExportError(f"MLX cannot hold {spec.describe()} (a quantkit bug: the recipe should have been refused)")
    qmin = spec.dtype.qrange[0]
    return AffineParams(qparams.scale.to(dtype), (qparams.scale.float() * qmin).to(dtype), spec.dtype.bits,
                        spec.group_size)


def packed_tensors(weight: torch.Tensor, qparams: QParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed codes uint32, scales, biases) of a Linear's weight that holds its affine grid's values (`grid_tensors`,
    `pack`): on the CPU one compiled pass (`cpu_kernels.mlx_pack`), the torch ops where it leaves the weight to them."""
    grid = affine_grid(weight.dtype, qparams)
    kind = mlx_grids.compiled_kind(weight.device, weight.dtype)
    if kind is not None and weight.shape[1] == grid.scales.shape[1] * grid.group_size:
        from quantkit.grids.cpu_dispatch import kernels

        w, packed = mlx_grids.bits_of(weight.contiguous()), _words(weight.shape, grid.bits)
        scales, biases = (t.float().contiguous().numpy() for t in (grid.scales, grid.biases))
        out = mlx_grids.bits_of(packed)
        if mlx_grids.in_row_blocks(lambda rows: kernels().mlx_pack(
                w[rows], kind, mlx_grids.float16_bits(), scales[rows], biases[rows], grid.group_size, grid.bits,
                out[rows]), weight):
            return packed.view(torch.uint32), grid.scales.to(weight.dtype), grid.biases.to(weight.dtype)
    codes, scales, biases = grid_tensors(weight, qparams)
    return pack(codes, grid.bits), scales, biases


def quantized_packed(weight: torch.Tensor, spec: WeightSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`packed_tensors` of the weight quantized on MLX's affine grid `spec` (round to nearest, its values decoded
    in the weight's dtype) in one compiled pass (`cpu_kernels.mlx_quantize_pack`), or None where that loop does not
    take it."""
    from quantkit.grids.cpu_dispatch import kernels

    kind = mlx_grids.compiled_kind(weight.device, weight.dtype)
    if (kind is None or spec.scale_dtype is not ScaleDtype.MLX_AFFINE or weight.shape[1] % spec.group_size
            or spec.group_size % kernels().LANES):
        return None

    bits, groups = spec.dtype.bits, (weight.shape[0], weight.shape[1] // spec.group_size)
    w, packed = mlx_grids.bits_of(weight.contiguous()), _words(weight.shape, bits)
    scales, biases = torch.empty(groups, dtype=torch.float32), torch.empty(groups, dtype=torch.float32)
    out = [mlx_grids.bits_of(packed), scales.numpy(), biases.numpy()]
    if not mlx_grids.in_row_blocks(lambda rows: kernels().mlx_quantize_pack(
            w[rows], kind, mlx_grids.float16_bits(), spec.group_size, bits, np.float32(mlx_grids.MLX_EPS),
            out[1][rows], out[2][rows], out[0][rows]), weight):
        return None
    return packed.view(torch.uint32), scales.to(weight.dtype), biases.to(weight.dtype)


def _words(shape: torch.Size, bits: int) -> torch.Tensor:
    """int32 [rows, cols * bits / 32]: room for `pack`'s words."""
    rows, cols = shape
    if cols * bits % 32:
        raise ExportError(f"{cols} codes of {bits} bits do not fill whole 32-bit words")
    return torch.empty((rows, cols * bits // 32), dtype=torch.int32)


def _within_rounding(decoded: torch.Tensor, weight: torch.Tensor, grid: AffineParams, codes: torch.Tensor) -> bool:
    """float32 weights of a symmetric integer grid: torchao rounds scale x q once, mlx scale x code + bias twice
    (`rounding_bound`); the grid value is the same, its two float32 roundings within the bound."""
    if weight.dtype is not torch.float32:
        return False
    return bool(((decoded - weight).abs() <= rounding_bound(grid, codes)).all())


def rounding_bound(grid: AffineParams, codes: torch.Tensor) -> torch.Tensor:
    """How far float32's scale x code + bias (two roundings) may lie from the exact value: half a unit in the last
    place of the product and of the sum, each at most eps x (|scale x code| + |bias|)."""
    step, offset = grid.column_scales(0, codes.shape[1])
    return torch.finfo(torch.float32).eps * ((step * codes.float()).abs() + offset.abs())


def mx_tensors(weight: torch.Tensor, qparams: QParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, scales uint8) of a Linear's weight that holds an MX or nvfp4 grid's values: FP4 e2m1 nibbles
    (the sign in bit 3) or FP8 e4m3 bytes; each group's power-of-two scale as its biased exponent (MX) or its FP8
    e4m3 byte (nvfp4, the codes as mx.quantize writes them: a zero +0, a zero scale's group all 0); checked to decode
    to the weight exactly (an FP4 / FP8 value times a power of two, or FP4 times FP8, is exact in the model's dtype)."""
    from quantkit.grids import float_grids

    spec, group = qparams.spec, qparams.spec.group_size
    nvfp4 = mode_of(spec) == "nvfp4"
    codes = torch.empty(weight.shape, dtype=torch.uint8)
    for rows in row_blocks(*weight.shape):
        scale = qparams.scale[rows].float().repeat_interleave(group, dim=1)
        values = weight[rows].float() / scale
        if spec.dtype is QDtype.FLOAT4:
            codes[rows] = (float_grids.mlx_fp4_codes if nvfp4 else float_grids.fp4_codes)(values)
            decoded = float_grids.fp4_values(codes[rows]) * scale
        else:
            fp8 = values.to(torch.float8_e4m3fn)
            codes[rows] = fp8.view(torch.uint8)
            decoded = fp8.float() * scale
        if not torch.equal(decoded.to(weight.dtype), weight[rows]):
            raise ExportError("a quantized weight is not on its MX grid (a quantkit bug: please report it)")
    if nvfp4:
        return codes, qparams.scale.to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, float_grids.mx_exponents(qparams.scale)


def _linear_tensors(name: str, weight: torch.Tensor, qparams: QParams) -> dict[str, torch.Tensor]:
    bits = qparams.spec.dtype.bits
    if mode_of(qparams.spec) != "affine":
        codes, exponents = mx_tensors(weight, qparams)
        return {f"{name}.weight": pack(codes, bits), f"{name}.scales": exponents}
    packed, scales, biases = packed_tensors(weight, qparams)
    return {f"{name}.weight": packed, f"{name}.scales": scales, f"{name}.biases": biases}


class StreamWriter:
    """The MLX directory written layer by layer: `add` takes modules whose planned Linears hold their grid's
    values, with their qparams; `finish` writes the shards' headers, the index and config.json."""

    def __init__(self, model: nn.Module, plan: list[ModulePlan], recipe: Recipe, out_dir: Path,
                 max_shard_size: int | None = None, expected_bytes: int | None = None):
        from quantkit.export.shards import ShardWriter
        from quantkit.models import moe

        self.model, self.recipe, self.out_dir = model, recipe, Path(out_dir)
        self.planned = {entry.name: entry for entry in plan if entry.quantized}
        self.names = {module: name for name, module in model.named_modules()}
        self.stored_name = moe.checkpoint_renamer(model)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.embedding = f"{_embedding_name(model)}.weight"
        self.embedding_spec = _embedding_spec(model, recipe, set(self.planned))
        self.shards = ShardWriter(out_dir, max_shard_size, expected_bytes)

    def add(self, modules: list[nn.Module], qparams: dict[str, QParams], input_scales: dict[str, torch.Tensor],
            kv_scales: dict[str, torch.Tensor] | None = None) -> None:
        placement.check_on_host("the MLX writer", modules=modules, qparams=qparams)
        tensors: dict[str, torch.Tensor] = {}
        for module in modules:
            prefix = self.names[module]
            for key, value in module.state_dict(prefix=f"{prefix}." if prefix else "", keep_vars=True).items():
                tensors.update(self._tensors(key, value.detach(), qparams))
        self.shards.add(mlx_archs.stacked({self.stored_name(key): value for key, value in tensors.items()}))

    def _tensors(self, key: str, value: torch.Tensor, qparams: dict[str, QParams]) -> dict[str, torch.Tensor]:
        module_name, _, leaf = key.rpartition(".")
        if key == "lm_head.weight" and self.tied:
            return {}  # mlx-lm computes a tied lm_head from the embedding (`as_linear`)
        if key == self.embedding and self.tied and "lm_head" in self.planned:
            return _linear_tensors(module_name, value, self._qparams("lm_head", qparams))
        if key == self.embedding and self.embedding_spec is not None:
            if (packed := quantized_packed(value, self.embedding_spec)) is not None:
                return dict(zip((f"{module_name}.{part}" for part in ("weight", "scales", "biases")), packed))
            quantized = _quantize_embedding(value, self.embedding_spec)
            return _linear_tensors(module_name, quantized.dequantize(value.dtype), quantized.qparams)
        if module_name in self.planned and leaf == "weight":
            return _linear_tensors(module_name, value, self._qparams(module_name, qparams))
        return {key: value}

    @staticmethod
    def _qparams(name: str, qparams: dict[str, QParams]) -> QParams:
        if name not in qparams:
            raise RuntimeError(f"{name} is planned for quantization but has no qparams")
        return qparams[name]

    def finish(self) -> None:
        """The shards (and their index), config.json with `quantization` and `quantization_config`."""
        self.shards.finish()
        self.model.config.save_pretrained(self.out_dir)
        if getattr(self.model, "generation_config", None) is not None and self.model.can_generate():
            self.model.generation_config.save_pretrained(self.out_dir)
        config_file = self.out_dir / "config.json"
        config = json.loads(config_file.read_text())
        embedding = self.planned["lm_head"].scheme.weights if self.tied and "lm_head" in self.planned else self.embedding_spec
        config["quantization"] = config["quantization_config"] = quantization_config(
            for_format(self.recipe).scheme.weights, self.planned.values(),
            lambda name: mlx_archs.switch_name(self.stored_name(name)),
            {self.embedding.rpartition(".")[0]: embedding} if embedding is not None else {})
        config.update(rope_keys(config) | mlx_archs.config_keys(self.model.config))
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (self.out_dir / "README.md").write_text(model_card(self.recipe))


def quantization_config(spec: WeightSpec, planned, stored_name=lambda name: name,
                        others: dict[str, WeightSpec] | None = None) -> dict:
    """config.json's `quantization`: the recipe's {group_size, bits, mode}, and each layer quantized otherwise
    (per-tensor types, the token embedding: `others` by module name) by its module path, as mlx-lm's `load` reads
    per-layer entries (`class_predicate`: config["quantization"][path] passed to `to_quantized`)."""
    def params(own: WeightSpec) -> dict:
        return {"group_size": own.group_size, "bits": own.dtype.bits, "mode": mode_of(own)}

    config = params(spec)
    layers = {entry.name: entry.scheme.weights for entry in planned} | dict(others or {})
    for name, own in layers.items():
        if params(own) != params(spec):
            config[stored_name(name)] = params(own)
    return config


def model_card(recipe: Recipe) -> str:
    """README.md as mlx-lm writes one (`library_name: mlx`: the Hugging Face Hub and LM Studio list the model as MLX),
    saying how it was made and how to run it."""
    from quantkit.version import __version__

    return (f"---\nlibrary_name: mlx\npipeline_tag: text-generation\ntags:\n- mlx\n- quantkit\n---\n\n"
            f"Quantized by quantkit {__version__} with the recipe `{recipe.name}` ({recipe.scheme.weights.describe()}, "
            f"{recipe.describe_algorithm()}), in MLX's format; quantkit.json holds the recipe and the versions.\n\n"
            "```bash\npip install mlx-lm\nmlx_lm.generate --model PATH --prompt \"hello\"\n```\n")


def rope_keys(config: dict) -> dict:
    """`rope_theta` and `rope_scaling` at the top of config.json, where mlx-lm's Llama, Mistral and Qwen2 read them
    (transformers 5 writes them inside `rope_parameters`, which only mlx-lm's Qwen3 reads)."""
    rope = config.get("rope_parameters") or {}
    keys = {"rope_theta": rope["rope_theta"]} if "rope_theta" in rope and "rope_theta" not in config else {}
    kind = rope.get("rope_type") or rope.get("type")
    if kind not in (None, "default") and not config.get("rope_scaling"):
        keys["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return keys


def write(quantized: QuantizedModel, out_dir: Path, max_shard_size: int | None = None) -> None:
    writer = StreamWriter(quantized.model, quantized.plan, quantized.recipe, out_dir, max_shard_size)
    writer.add([quantized.model], quantized.qparams, quantized.input_scales)
    writer.finish()
