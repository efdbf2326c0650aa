"""GGUF: one file for llama.cpp and the tools built on it (llama-cli, llama-server, Ollama, LM Studio).

Written with the `gguf` package (llama.cpp's own writer, constants and tensor-name maps); quantkit packs its own
integers and scales into GGML blocks (`ggml_blocks`), so the grid an algorithm chose reaches llama.cpp unchanged.
A weight's GGML type follows from its scheme (`ggml_type`): a scheme no type holds exactly is refused before any
work, never approximated.

The file is written in two steps, so that a streamed finalize holds one decoder layer at a time: each tensor's
bytes are appended to a spill file as its layer finishes (`StreamWriter.add`); `finish` writes the header (the
architecture's metadata, the tokenizer, quantkit's record) and then the tensors, read back from the spill file
through a memory map, into `model.gguf` (FILENAME), which the atomic write moves to DST.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from quantkit.errors import ExportError, FormatError
from quantkit.models import moe
from quantkit.runtime import placement
from quantkit.export import FORMATS, gguf_archs, gguf_vocab
from quantkit.quant.plan import ModulePlan
from quantkit.grids.qparams import QParams, QuantizedWeight, has_fp16_minimum
from quantkit.quant.quantized_model import QuantizedModel
from quantkit.quant.registry import AlgorithmStep, Format, Recipe
from quantkit.grids.schemes import Granularity, QDtype, QuantScheme, ScaleDtype, WeightSpec

FILENAME = FORMATS[Format.GGUF].single_file  # the artifact inside the temporary directory; `atomic` moves it to DST
SPILL = "tensors.spill"

# Hugging Face model_type -> llama.cpp's architecture. Mistral's dense models are llama's graph in llama.cpp;
# Gemma2, Gemma3 and Phi-3 need more of their own (`gguf_archs`).
ARCHITECTURES = {"llama": "LLAMA", "mistral": "LLAMA", "mixtral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3",
                 "qwen3_moe": "QWEN3MOE", **gguf_archs.ARCHITECTURES}
# llama.cpp's llama graph applies RoPE to interleaved pairs; Hugging Face's Llama rotates halves. Its converter
# reorders the rows of q_proj and k_proj (`LlamaModel.permute`), and so does quantkit: a row order, so a quantized
# weight's blocks move whole. Qwen2/Qwen3 use the halves layout (NEOX) in llama.cpp too.
PERMUTED_ROPE = {"llama", "mistral", "mixtral"}
BLOCK = 32  # the smallest GGML block: Q4_0 and Q8_0 hold groups that are a multiple of it
K_SUPER_BLOCK = 256  # a K-quant row is whole super-blocks of 256 weights


def _gguf():
    import gguf
    return gguf


# ---------------------------------------------------------------- which GGML type holds a scheme


def ggml_type(spec: WeightSpec):
    """The GGML type whose grid holds `spec`'s exactly, or None. Symmetric int8 / int5 / int4 with fp16 scales per
    group (a multiple of 32) or per row are Q8_0 / Q5_0 / Q4_0 blocks of 32 sharing the group's scale; asymmetric
    int5 / int4 with fp16 scales are Q5_1 / Q4_1 (`qparams.fp16_minimum_grid`); a K or i-quant grid is its type;
    FP4 in groups of 32 with E8M0 scales (quantkit's MXFP4 grid) is MXFP4."""
    from quantkit.quant import gguf_types

    t = _gguf().GGMLQuantizationType
    if spec.block_type:
        return t[spec.block_type]
    if spec == gguf_types.MXFP4:
        return t.MXFP4
    if spec.dtype.is_float or spec.scale_dtype is not ScaleDtype.FLOAT16:
        return None
    if spec.granularity is Granularity.GROUP and spec.group_size % BLOCK:
        return None
    if not spec.symmetric:
        return {QDtype.INT5: t.Q5_1, QDtype.INT4: t.Q4_1}.get(spec.dtype)
    return {QDtype.INT8: t.Q8_0, QDtype.INT5: t.Q5_0, QDtype.INT4: t.Q4_0}.get(spec.dtype)


def _nearest(spec: WeightSpec) -> str:
    if spec.dtype.is_float:
        return "Q8_0 (recipe gguf-q8-0)" if spec.dtype is QDtype.FLOAT8 else "MXFP4 (recipe gguf-mxfp4)"
    if not spec.symmetric:
        return "Q4_1 (asymmetric int4 in groups of a multiple of 32: recipe gguf-q4-1)"
    return "Q4_0 or Q8_0 (symmetric int4 / int8 in groups of a multiple of 32: recipes gguf-q4-0, gguf-q8-0)"


def for_format(recipe: Recipe) -> Recipe:
    """The recipe as it quantizes for a GGUF file: an integer grid's scales chosen on fp16, the dtype GGUF stores
    them in, so the grid the algorithm rounds onto is the one in the file (bf16 scales are not all fp16 values)."""
    from dataclasses import replace

    weights = recipe.scheme.weights
    if weights.dtype.is_float or weights.scale_dtype not in (ScaleDtype.MODEL, ScaleDtype.FLOAT32):
        return recipe
    scheme = QuantScheme(replace(weights, scale_dtype=ScaleDtype.FLOAT16), recipe.scheme.activations)
    return replace(recipe, scheme=scheme)


def unsupported(recipe: Recipe) -> str | None:
    """Why GGUF cannot hold the recipe, or None. The weights' grid must be one a GGML type holds exactly (after
    `for_format`); activations and the KV cache are llama.cpp's own business; online rotations it does not apply."""
    spec = for_format(recipe).scheme.weights
    if recipe.scheme.activations is not None:
        return ("GGUF holds weight-only schemes (llama.cpp quantizes activations its own way); "
                f"for these weights use {_nearest(spec)}")
    if recipe.kv_cache is not None:
        return "a quantized KV cache is llama.cpp's run-time option (llama-cli --cache-type-k), not the file's: drop --kv-cache"
    if recipe.online_rotations:
        return "llama.cpp does not apply online rotations (R4); use the fused ones only (R1, R2)"
    if ggml_type(spec) is None:
        return f"no GGUF type holds {spec.describe()} exactly; the nearest is {_nearest(spec)}"
    learner = next((step.name for step in recipe.steps if step.algorithm.learns_ranges), None)
    if has_fp16_minimum(spec) and learner is not None:
        return (f"{learner} learns scales and minimums that {ggml_type(spec).name}'s fp16 minimum does not hold "
                f"exactly: use gptq, awq or rtn for it, or {learner} on Q4_0 ({learner}-w4a16 --format gguf)")
    return None


def check_architecture(config) -> None:
    """Refuse, before any weight is read, an architecture quantkit cannot describe to llama.cpp, and a config of a
    known one that llama.cpp's graph would compute differently (`gguf_archs.refusal`)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise FormatError(f"quantkit writes GGUF for {', '.join(sorted(ARCHITECTURES))} models, not '{model_type}'; "
                          "use --format compressed-tensors")
    why = gguf_archs.refusal(config)
    if why:
        raise FormatError(f"llama.cpp cannot compute this {model_type} model as Hugging Face does ({why}); "
                          "use --format compressed-tensors")


def check_model(src: Path, config, skeleton: nn.Module) -> None:
    """The architecture (`check_architecture`) and the tokenizer (`gguf_vocab.check_tokenizer`) llama.cpp is told
    about, refused before any weight is read where quantkit cannot describe them right."""
    check_architecture(config)
    gguf_vocab.check_tokenizer(src, config.vocab_size)


def qat_recipe(recipe: Recipe) -> Recipe:
    """A recipe on K grids calibrated by one quantizer alone that only rounds onto the grid (GPTQ: gguf-q4-k-m, ...)
    trains and converts with its data-free substitute (`Algorithm.qat_substitute`: rounding to nearest on the same
    grids, llama.cpp's own quantizer, a function of the weights), so what training sees is what the file holds;
    GPTQ would move the trained weights off the grid they learned (and want calibration data)."""
    from dataclasses import replace

    substitute = recipe.quantizer.algorithm.qat_substitute
    if recipe.scheme.weights.k_quant_type and len(recipe.steps) == 1 and substitute is not None:
        return replace(recipe, steps=(AlgorithmStep(substitute),))
    return recipe


# llama.cpp's types for a row that is not whole K super-blocks (`tensor_type_fallback`, llama-quant.cpp): blocks of
# 32, symmetric, fp16 scales. Q5_K's fallback, Q5_1, has a float minimum quantkit's grids do not hold: F16 instead.
# llama.cpp's tensor_type_fallback: (dtype, symmetric) of Q4_0, Q5_0, Q5_1 and Q8_0 blocks of 32
K_FALLBACKS = {"Q2_K": (QDtype.INT4, True), "Q3_K": (QDtype.INT4, True), "Q4_K": (QDtype.INT5, True),
               "Q5_K": (QDtype.INT5, False), "Q6_K": (QDtype.INT8, True), "IQ4_XS": (QDtype.IQ4_NL, True),
               **{name: (QDtype.IQ4_NL, True) for name in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")}}


def _fallback_spec(kind: str) -> WeightSpec | None:
    """The grid of blocks of 32 a K or i-quant type `kind` falls back to (K_FALLBACKS), or None."""
    fallback = K_FALLBACKS.get(kind.upper())
    if fallback is None:
        return None
    return WeightSpec(fallback[0], Granularity.GROUP, BLOCK, symmetric=fallback[1], scale_dtype=ScaleDtype.FLOAT16)


def fallback_type(kind: str) -> str | None:
    """The GGML type name a K or i-quant type `kind` falls back to on rows that are not whole super-blocks
    (K_FALLBACKS, as `adapt_plan` writes it: Q2_K -> Q4_0, Q4_K -> Q5_0, Q6_K -> Q8_0, ...), or None."""
    spec = _fallback_spec(kind)
    found = ggml_type(spec) if spec is not None else None
    return found.name if found is not None else None


def adapt_plan(plan: list[ModulePlan], recipe: Recipe, config) -> list[ModulePlan]:
    """The plan as GGUF holds it: a llama.cpp mixture's per-tensor types (`gguf_mixtures`) on the Linears it names,
    then the recipe's per-tensor overrides (`tensor_types`: on any Linear but an MoE router, `ignore`d ones too;
    `float` leaves one in full precision); a K type on a Linear whose input size is not whole 256-weight super-blocks falls back as llama.cpp's does
    (Q4_0, Q5_0, Q5_1 or Q8_0 blocks of 32: K_FALLBACKS); a Linear no block fits (its input size not a multiple of 32)
    stays in full precision, reported, as llama.cpp's quantizer leaves such tensors."""
    from dataclasses import replace

    from quantkit.quant import gguf_mixtures, gguf_types
    from quantkit.quant.plan import with_tensor_type

    def mixed(entry: ModulePlan) -> ModulePlan:
        role, layer = gguf_mixtures.role_of(entry.name)
        if recipe.mixture is None or not entry.quantized or role is None:
            return entry
        kind = gguf_mixtures.tensor_type(recipe.mixture, role, layer, config.num_hidden_layers, _gqa(config),
                                         _experts(config), recipe.needs_calibration_without_kv)
        return replace(entry, scheme=QuantScheme(gguf_types.spec(kind), entry.scheme.activations))

    def fitted(entry: ModulePlan) -> ModulePlan:
        spec = entry.scheme.weights if entry.quantized else None
        if spec is None or not spec.super_block or entry.in_features % spec.super_block == 0:
            return entry
        weights = _fallback_spec(spec.block_type)
        if weights is None or entry.in_features % BLOCK:
            return replace(entry, scheme=None, note=f"{spec.block_type} takes rows of whole {K_SUPER_BLOCK}-weight "
                                                    f"super-blocks ({entry.in_features} inputs), and no fallback fits")
        note = f"{spec.block_type} -> {ggml_type(weights).name}: {entry.in_features} inputs are not whole {K_SUPER_BLOCK}-weight super-blocks"
        return replace(entry, scheme=QuantScheme(weights, entry.scheme.activations), note=note)

    def problem(entry: ModulePlan) -> str | None:
        spec = entry.scheme.weights
        if ggml_type(spec) is None:
            return f"no GGUF block holds groups of {spec.group_size} ({entry.in_features} inputs are not a multiple of {BLOCK})"
        return None

    plan = [fitted(with_tensor_type(mixed(entry), recipe)) for entry in plan]
    plan = [replace(entry, scheme=None, note=why) if entry.quantized and (why := problem(entry)) else entry
            for entry in plan]
    _check_stacked_experts(plan)
    return plan


def _check_stacked_experts(plan: list[ModulePlan]) -> None:
    """The experts of one MoE projection take one type (llama.cpp stacks them into one tensor): refused before any
    work where per-tensor types would split them."""
    from quantkit.models.architectures import expert_projection
    from quantkit.quant.tensor_types import gguf_name

    stacks: dict[str, set[str]] = {}
    for entry in plan:
        if expert_projection(entry.name) is not None:
            kind = ggml_type(entry.scheme.weights).name if entry.quantized else "float"
            stacks.setdefault(gguf_name(entry.name), set()).add(kind)
    for name, kinds in stacks.items():
        if len(kinds) > 1:
            raise FormatError(f"{name}: its experts would take different types ({', '.join(sorted(kinds))}), and llama.cpp "
                              "stacks them into one tensor of one type; give all experts of a projection one --tensor-type")


def _gqa(config) -> int:
    return config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


# what quantkit rounds a token embedding to: the K types (llama.cpp's own rounding), Q8_0 (MXFP4_MOE's) and the
# i-quant types the i-quant mixtures give it (their grid family's rounding)
EMBEDDING_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ3_S", "IQ4_XS")


def embedding_type(recipe: Recipe, config) -> str | None:
    """The GGML type of token_embd, or None: kept in the model's dtype. A mixture gives it its own (a tied one the
    output's: Q6_K, or MXFP4_MOE's Q8_0); a per-tensor override matching `model.embed_tokens` or `token_embd` wins.
    Rows that are not whole blocks stay float, as llama.cpp leaves them. Types other than EMBEDDING_TYPES are
    refused."""
    from quantkit.quant import gguf_mixtures, gguf_types, tensor_types

    kind = None
    if recipe.mixture is not None:
        role = "output" if getattr(config, "tie_word_embeddings", False) else "token_embd"
        kind = gguf_mixtures.tensor_type(recipe.mixture, role, None, config.num_hidden_layers, _gqa(config),
                                         _experts(config), recipe.needs_calibration_without_kv)
    kind = tensor_types.type_for(tensor_types.EMBEDDING_NAMES, recipe.tensor_types) or kind
    if kind is None or kind == gguf_types.FLOAT:
        return None
    if kind not in EMBEDDING_TYPES:
        raise FormatError(f"token_embd takes a K type (Q2_K ... Q6_K), {', '.join(EMBEDDING_TYPES[5:])} or float in "
                          f"quantkit's GGUF files; {kind} is not one: change the --tensor-type that matches it")
    return kind if gguf_types.fits(kind, config.hidden_size) else None


def embedding_weights(recipe: Recipe, config) -> WeightSpec | None:
    """The grid of the token embedding (`embedding_type`), which QAT trains it on, or None."""
    from quantkit.quant import gguf_types

    kind = embedding_type(recipe, config)
    return gguf_types.spec(kind) if kind else None


@dataclass
class QuantizedEmbedding:
    """The token embedding on its type's grid: a K type's (`k_grids.KQuantizedWeight`, llama.cpp's own rounding), or
    another's (`QuantizedWeight`: Q8_0's integer grid, an i-quant's block grid)."""

    quantized: object
    qtype: object

    def ggml_blocks(self) -> np.ndarray:
        found = self.quantized
        if isinstance(found, QuantizedWeight) and found.k is not None:
            return found.k.pack(found.qdata)
        if isinstance(found, QuantizedWeight):
            from quantkit.grids import ggml_blocks

            return ggml_blocks.pack(self.qtype, found.qdata.numpy(), d=found.scale.to(torch.float16).numpy())
        return found.ggml_blocks()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        found = self.quantized
        if isinstance(found, QuantizedWeight):
            return found.dequantize(dtype)
        return found.qparams.dequantize(found.codes, dtype=dtype)


def quantize_embedding(weight: torch.Tensor, recipe: Recipe, config) -> QuantizedEmbedding | None:
    """The token embedding on its type's grid (`embedding_type`), or None. It is not a Linear: no calibration reaches
    it, and llama-imatrix has no entry for it. A K type takes llama.cpp's own search: without calibration data its
    reference quantizer (llama-quantize without an imatrix, byte for byte); in a calibrated recipe its search under
    an importance matrix whose every column is 1 (each column of a looked-up row enters the residual stream alike),
    which weights a weight by sqrt(sigma2 + x^2) instead of the reference's |x|-like weights: 5-10% less KL divergence
    from F16 for the whole file on the benchmark Llama (Q2_K, Q3_K, Q4_K embeddings of gguf-q2-k, -q3-k-m, -q4-k-m).
    Other types take their grid's own quantizer (the i-quants': every weight alike without an importance matrix)."""
    kind = embedding_type(recipe, config)
    if kind is None:
        return None
    qtype = _gguf().GGMLQuantizationType[kind]
    if not kind.endswith("_K"):
        from quantkit.grids import quantize_weight
        from quantkit.quant import gguf_types

        return QuantizedEmbedding(quantize_weight(weight, gguf_types.spec(kind)), qtype)
    from quantkit.grids.k_grids import quantize_k

    unit = torch.ones(weight.shape[1], device=weight.device) if recipe.needs_calibration_without_kv else None
    return QuantizedEmbedding(quantize_k(weight, qtype, unit), qtype)


def quantized_tensors(skeleton: nn.Module, plan: list[ModulePlan], recipe: Recipe) -> dict[str, str]:
    """The parameters outside the plan that the file holds quantized, by name, with their GGML type (what
    `plan.coverage` counts as quantized by the format): the token embedding, as `StreamWriter` writes it: tied to a
    quantized lm_head, in lm_head's type; else in its mixture's type (`embedding_type`), if any. `skeleton` may be
    on the meta device."""
    embedding = skeleton.get_input_embeddings().weight
    name = next(name for name, param in skeleton.named_parameters() if param is embedding)
    tied = bool(getattr(skeleton.config, "tie_word_embeddings", False))
    lm_head = next((entry for entry in plan if entry.name == "lm_head" and entry.quantized), None)
    if tied and lm_head is not None:
        return {name: ggml_type(lm_head.scheme.weights).name}
    kind = embedding_type(recipe, skeleton.config)
    return {name: kind} if kind else {}


def weight_bytes(entry: ModulePlan, element_size: int) -> int:
    block, size = _gguf().GGML_QUANT_SIZES[ggml_type(entry.scheme.weights)]
    return entry.out_features * entry.in_features // block * size


def as_loaded(quantized: QuantizedModel) -> nn.Module:
    """The quantized model: its planned Linears hold the grid's values, which llama.cpp dequantizes the file's
    blocks to (it computes in its own precision, and quantizes activations for its dot products); a mixture's
    token embedding is put on its K grid too. A tied embedding is llama.cpp's output as well: where lm_head is
    quantized it already holds lm_head's grid (the file's token_embd); else it is put on the embedding's grid, which
    lm_head then reads, as llama.cpp's output does."""
    model = quantized.model
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in quantized.qparams:
        return model
    embedding = model.get_input_embeddings()
    found = quantize_embedding(embedding.weight.data, quantized.recipe, model.config)
    if found is not None:
        embedding.weight.data = found.dequantize(embedding.weight.dtype)
    return model


def write(quantized: QuantizedModel, out_dir: Path, max_shard_size: int | None = None) -> None:
    writer = StreamWriter(quantized.model, quantized.plan, quantized.recipe, out_dir)
    writer.add([quantized.model], quantized.qparams, quantized.input_scales)
    writer.finish()


# ---------------------------------------------------------------- tensors


def codes(weight: torch.Tensor, qparams: QParams) -> torch.Tensor:
    """The integers of a Linear's weight that holds its grid's values (`weight` = (code - zero point) x scale,
    rounded to the model's dtype), recovered: each is the nearest code, within a third of a step, or one that
    decodes (`QuantizedWeight.dequantize`, in the model's dtype) to the weight exactly. bfloat16 holds int8's
    largest values to half a step only (8 significant bits), so there the nearest code may be a tie, and the
    decode picks. A block of rows at a time: float32 intermediates stay small."""
    from quantkit.grids.ggml_blocks import row_blocks
    from quantkit.grids.cpu_dispatch import compiled as _compiled, kernels as cpu_kernels, map_chunks as _map_chunks

    group = weight.shape[1] // qparams.scale.shape[1]
    lo, hi = qparams.spec.dtype.qrange
    out = torch.empty(weight.shape, dtype=torch.int8)

    def nearest(rows: slice) -> bool:
        """The nearest codes of `rows` in one compiled pass (`cpu_kernels.integer_codes`); False where some lie far
        from their code (or a weight is not finite), left to the checks below."""
        x = weight[rows].float()
        if not _compiled(x):
            return False
        zero = (np.empty((x.shape[0], 0), np.float32) if qparams.zero_point is None
                else qparams.zero_point[rows].float().contiguous().numpy())
        far = cpu_kernels().integer_codes(x.numpy(), qparams.scale[rows].float().contiguous().numpy(), zero, group,
                                          np.float32(lo), np.float32(hi), out[rows].numpy())
        return far == 0

    blocks = row_blocks(*weight.shape)
    checked = _map_chunks(nearest, blocks, weight.device)
    for rows, done in zip(blocks, checked):
        if done:  # every code within a quarter of a step: no tie for the checks below to decide
            continue
        scale = qparams.scale[rows]
        zero = None if qparams.zero_point is None else qparams.zero_point[rows]
        exact = weight[rows].float() / scale.float().repeat_interleave(group, dim=1)
        if zero is not None:
            exact = exact + zero.float().repeat_interleave(group, dim=1)
        q = torch.round(exact).clamp(lo, hi)

        def off_grid(q: torch.Tensor) -> torch.Tensor:
            decoded = QuantizedWeight(q.to(torch.int8), scale, zero, qparams.spec).dequantize(weight.dtype)
            return ((exact - q).abs() >= 0.3) & (decoded != weight[rows])

        if (wrong := off_grid(q)).any():  # a tie: the other neighbour
            q = torch.where(wrong, (q + torch.sign(exact - q)).clamp(lo, hi), q)
            if off_grid(q).any():
                raise ExportError("a quantized weight is not on its grid (a quantkit bug: please report it)")
        out[rows] = q.to(torch.int8)
    return out


# how far a block grid's float32 value may lie from the weight holding it: 2^-7 of its magnitude, as the dequantized
# weight is compared (`block_codes`), plus bfloat16's rounding of the value (2^-9 of it, within 2^-8)
_ON_GRID_RTOL = 2 ** -7 + 2 ** -8


def block_codes(weight: torch.Tensor, qparams: QParams) -> torch.Tensor:
    """A block grid's codes (K-quants, i-quants) of the grid values `weight` holds: rounded back on the grid (its
    `round`), checked to decode to the weight (to the model dtype's rounding), a block of rows at a time."""
    from quantkit.grids.ggml_blocks import row_blocks

    k = qparams.k
    on_grid = getattr(k, "codes_on_grid", None)  # K and IQ4 grids: rounded and checked in one compiled pass
    if on_grid is not None:
        q = on_grid(weight, rtol=_ON_GRID_RTOL, atol=1e-6)
        if q is None:
            raise ExportError("a quantized weight is not on its block grid (a quantkit bug: please report it)")
        return q
    q = k.round(weight)
    for rows in row_blocks(*weight.shape):
        decoded = k.rows(rows).dequantize(q[rows], dtype=weight.dtype)
        if not torch.allclose(decoded.float(), weight[rows].float(), rtol=2 ** -7, atol=1e-6):
            raise ExportError("a quantized weight is not on its block grid (a quantkit bug: please report it)")
    return q


def mx_codes(weight: torch.Tensor, qparams: QParams) -> np.ndarray:
    """The E2M1 bit patterns (uint8) of an MXFP4 weight that holds its grid's values (FP4 value x its group's
    power-of-two scale, exact in the model's dtype), checked to decode to the weight exactly, a block of rows at a
    time."""
    from quantkit.grids import float_grids
    from quantkit.grids.ggml_blocks import row_blocks

    group = weight.shape[1] // qparams.scale.shape[1]
    out = torch.empty(weight.shape, dtype=torch.uint8)
    for rows in row_blocks(*weight.shape):
        scale = qparams.scale[rows].float().repeat_interleave(group, dim=1)
        q = float_grids.fp4_codes(weight[rows].float() / scale)
        if not torch.equal((float_grids.fp4_values(q) * scale).to(weight.dtype), weight[rows]):
            raise ExportError("a quantized weight is not on its MXFP4 grid (a quantkit bug: please report it)")
        out[rows] = q
    return out.numpy()


def pack(weight: torch.Tensor, qparams: QParams):
    """(GGML type, the weight's block bytes [rows, bytes per row])."""
    from quantkit.grids import float_grids, ggml_blocks

    qtype = ggml_type(qparams.spec)
    if qparams.k is not None:
        return qtype, qparams.k.pack(block_codes(weight, qparams))
    if qtype == _gguf().GGMLQuantizationType.MXFP4:
        return qtype, ggml_blocks.pack(qtype, mx_codes(weight, qparams), e=float_grids.mx_exponents(qparams.scale).numpy())
    q = codes(weight, qparams)
    blocks = weight.shape[1] // qparams.scale.shape[1] // BLOCK
    d = qparams.scale.to(torch.float16).repeat_interleave(blocks, dim=1)
    if qparams.zero_point is None:
        return qtype, ggml_blocks.pack(qtype, q.numpy(), d=d.numpy())
    qmin = qparams.spec.dtype.qrange[0]  # Q4_1 / Q5_1: codes from 0, x = d c + m
    offset = (qparams.zero_point.float() - qmin).repeat_interleave(blocks, dim=1)
    m = -offset * d.float()
    if not torch.equal(m.to(torch.float16).float(), m):
        raise ExportError("a quantized weight's minimum is not an fp16 value (a quantkit bug: please report it)")
    c = (q.float() - qmin).to(torch.uint8).numpy()
    return qtype, ggml_blocks.pack(qtype, c, d=d.numpy(), m=m.to(torch.float16).numpy())


def float_bytes(tensor: torch.Tensor, keep_float32: bool):
    """(GGML type, bytes [rows, bytes per row]) of an unquantized tensor: 1-D ones (norms, biases) in F32, as
    llama.cpp requires; matrices in the artifact's dtype (BF16, F16 or F32)."""
    t = _gguf().GGMLQuantizationType
    tensor = tensor.detach()
    if tensor.dim() == 1 or keep_float32 or tensor.dtype is torch.float32:
        qtype, data = t.F32, tensor.float()
    elif tensor.dtype is torch.bfloat16:
        qtype, data = t.BF16, tensor
    else:
        qtype, data = t.F16, tensor.to(torch.float16)
    rows = data.reshape(-1, data.shape[-1]) if data.dim() > 1 else data.reshape(1, -1)
    raw = rows.contiguous().view(torch.uint8).numpy()
    return qtype, raw.reshape(*data.shape[:-1], -1) if data.dim() > 1 else raw.reshape(-1)


def permute_rows(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row order for q_proj / k_proj (and their scales): within each head, the rows of the two
    halves interleaved (convert_hf_to_gguf's `LlamaModel.permute`)."""
    shape = tensor.shape
    return tensor.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _rows_permuted(qparams: QParams, heads: int) -> QParams:
    """`qparams` of a weight whose rows `permute_rows` reorders: every per-row tensor reordered alike."""
    k = qparams.k.map(lambda t: permute_rows(t, heads)) if qparams.k is not None else None
    zero = permute_rows(qparams.zero_point, heads) if qparams.zero_point is not None else None
    return QParams(permute_rows(qparams.scale, heads), zero, qparams.spec, None, k)


@dataclass
class _Spilled:
    name: str
    qtype: object
    offset: int
    shape: tuple[int, ...]  # in bytes: [rows, bytes per row] (or [bytes] for a vector)


class StreamWriter:
    """The GGUF file written layer by layer (see the module's docstring); `add` takes modules whose planned
    Linears hold their grid's values, with their qparams."""

    def __init__(self, model: nn.Module, plan: list[ModulePlan], recipe: Recipe, out_dir: Path,
                 max_shard_size: int | None = None, expected_bytes: int | None = None):
        gguf = _gguf()
        config = model.config
        self.model, self.recipe, self.out_dir = model, recipe, Path(out_dir)
        self.model_type = config.model_type
        self.arch = gguf.MODEL_ARCH[ARCHITECTURES[self.model_type]]
        self.names = gguf.get_tensor_name_map(self.arch, config.num_hidden_layers)
        self.planned = {entry.name: entry for entry in plan if entry.quantized}
        self.modules = {module: name for name, module in model.named_modules()}
        self.heads = (config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.stored_name = moe.checkpoint_renamer(model)  # checkpoint names (Mixtral's mlp: block_sparse_moe)
        self.experts = _experts(config)
        self.spill_path = self.out_dir / SPILL
        self.spill = open(self.spill_path, "wb")
        self.tensors: list[_Spilled] = []

    def add(self, modules: list[nn.Module], qparams: dict[str, QParams], input_scales: dict[str, torch.Tensor],
            kv_scales: dict[str, torch.Tensor] | None = None) -> None:
        placement.check_on_host("the GGUF writer", modules=modules, qparams=qparams)
        for module in modules:
            prefix = self.modules[module]
            state = module.state_dict(prefix=f"{prefix}." if prefix else "", keep_vars=True)
            stacks: dict[str, dict[int, tuple]] = {}  # an MoE block's projection -> its experts' blocks
            for key, value in state.items():
                self._add_tensor(key, value.detach(), qparams, stacks)
            for merged, experts in stacks.items():
                self._spill_experts(merged, experts)

    def _add_tensor(self, key: str, value: torch.Tensor, qparams: dict[str, QParams], stacks: dict) -> None:
        from quantkit.models.architectures import expert_projection

        module_name, _, leaf = key.rpartition(".")
        if key == "lm_head.weight" and self.tied:
            return  # llama.cpp reads a tied output from token_embd
        expert = expert_projection(module_name)
        stored = self.stored_name(key)
        name = None if expert else self.names.get_name(stored, try_suffixes=(".weight", ".bias"))
        if name == "token_embd.weight" and self.tied and "lm_head" in self.planned and "lm_head" in qparams:
            self._spill(name, *pack(value, qparams["lm_head"]))  # tied: lm_head's grid is llama.cpp's output
            return
        if name == "token_embd.weight" and (found := quantize_embedding(value, self.recipe, self.model.config)):
            self._spill(name, found.qtype, found.ggml_blocks())
            return
        if name is None and not expert:
            raise FormatError(f"{key}: llama.cpp's {self.arch.name.lower()} architecture has no tensor of that name; "
                              "this model cannot be written as GGUF (use --format compressed-tensors)")
        heads = self._permutation(module_name)
        if module_name in self.planned and leaf == "weight":
            found = qparams.get(module_name)
            if found is None:
                raise RuntimeError(f"{module_name} is planned for quantization but has no qparams")
            weight = value
            if heads:
                weight, found = permute_rows(weight, heads), _rows_permuted(found, heads)
            qtype, data = pack(weight, found)
        else:
            if heads:
                value = permute_rows(value, heads)
            value = gguf_archs.stored_value(self.model_type, key, value)
            qtype, data = float_bytes(value, keep_float32=name is not None and name.endswith("ffn_gate_inp.weight"))
        if expert:  # stacked with the block's other experts: blk.N.ffn_{gate,up,down}_exps
            block, _, projection, _ = stored.rsplit(".", 3)  # ...experts.7.w1.weight -> ...experts, w1
            stacks.setdefault(f"{block}.{projection}", {})[expert[1]] = (qtype, data)
            return
        self._spill(name, qtype, data)

    def _spill_experts(self, merged: str, experts: dict[int, tuple]) -> None:
        """One MoE projection of all experts as llama.cpp stacks it: [experts, rows, bytes], expert 0 first."""
        if sorted(experts) != list(range(self.experts)):
            raise ExportError(f"{merged}: {len(experts)} of {self.experts} experts reached the GGUF writer together")
        types = {qtype for qtype, _ in experts.values()}
        if len(types) > 1:
            raise FormatError(f"{merged}: its experts are quantized to different types ({sorted(t.name for t in types)}); "
                              "llama.cpp stacks them into one tensor of one type")
        name = self.names.get_name(f"{merged}.weight", try_suffixes=(".weight",))
        if name is None:
            raise FormatError(f"{merged}: llama.cpp's {self.arch.name.lower()} architecture has no stacked experts of that "
                              "name; this model cannot be written as GGUF (use --format compressed-tensors)")
        self._spill(name, types.pop(), np.stack([experts[i][1] for i in range(self.experts)]))

    def _permutation(self, module_name: str) -> int | None:
        """The head count whose rows `module_name`'s tensors are reordered by, or None."""
        from quantkit.models.architectures import rotary_projection

        if self.model_type not in PERMUTED_ROPE:
            return None
        return {"query": self.heads[0], "key": self.heads[1]}.get(rotary_projection(module_name))

    def _spill(self, name: str, qtype, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data)
        self.tensors.append(_Spilled(name, qtype, self.spill.tell(), tuple(data.shape)))
        self.spill.write(memoryview(data.reshape(-1).view(np.uint8)))  # no copy of the bytes (tobytes would make one)

    def finish(self) -> None:
        """Header, metadata, tokenizer and tensors into FILENAME; the spill file removed."""
        gguf = _gguf()
        self.spill.close()
        writer = gguf.GGUFWriter(self.out_dir / FILENAME, self.arch_name)
        describe_model(writer, self.model.config, self.model_type, self._file_type())
        gguf_vocab.describe_tokenizer(writer, self.out_dir, self.model.config.vocab_size)
        describe_origin(writer, self.out_dir)
        small = {}  # float32 tensors made here, written before the spilled ones
        rope_freqs = llama3_rope_freqs(self.model.config)
        if rope_freqs is not None:
            small[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"] = rope_freqs
        small.update(gguf_archs.extra_tensors(self.model.config))
        for name, tensor in small.items():
            writer.add_tensor_info(name, tensor.shape, tensor.dtype, tensor.nbytes)
        spilled = sorted(self.tensors, key=lambda t: _tensor_order(t.name))
        for t in spilled:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.uint8), int(np.prod(t.shape)), raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in small.values():
            writer.write_tensor_data(tensor)
        for t in spilled:  # one tensor's bytes mapped at a time (a map of the whole spill file would count its pages
            # as the process's); mapped, not read: the bytes go from the page cache to the file without a copy here
            tensor = np.memmap(self.spill_path, np.uint8, "r", offset=t.offset, shape=(int(np.prod(t.shape)),))
            writer.write_tensor_data(tensor.reshape(t.shape))
            del tensor
        writer.close()
        self.spill_path.unlink()

    @property
    def arch_name(self) -> str:
        return _gguf().MODEL_ARCH_NAMES[self.arch]

    def _file_type(self):
        """llama.cpp's file type: the type most of the quantized weights are in (its `general.file_type`)."""
        gguf = _gguf()
        if self.recipe.mixture is not None:
            return gguf.LlamaFileType[f"MOSTLY_{self.recipe.mixture}"]
        counts: dict[str, int] = {}
        for t in self.tensors:
            if t.name.startswith("blk."):
                counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
        common = max(counts, key=counts.get) if counts else "F32"
        if common == "F32":
            return gguf.LlamaFileType.ALL_F32
        known = gguf.LlamaFileType.__members__  # K types are named by mixture: a file all Q4_K is llama.cpp's Q4_K_S kind
        return next((known[n] for n in (f"MOSTLY_{common}", f"MOSTLY_{common}_S") if n in known), gguf.LlamaFileType.GUESSED)


def _experts(config) -> int:
    """The number of routed experts of an MoE model (0 for a dense one)."""
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0


def _tensor_order(name: str) -> tuple:
    """token_embd first, then the blocks in order, then the rest (as llama.cpp's converter writes them)."""
    parts = name.split(".")
    if parts[0] == "token_embd":
        return (0, 0, name)
    if parts[0] == "blk":
        return (1, int(parts[1]), name)
    return (2, 0, name)


# ---------------------------------------------------------------- metadata


def describe_model(writer, config, model_type: str, file_type) -> None:
    """The hyperparameters llama.cpp reads for these architectures, as its converter writes them."""
    gguf = _gguf()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(getattr(config, "_name_or_path", "") or model_type)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if _experts(config):
        writer.add_expert_count(_experts(config))
        writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if model_type in gguf_archs.ARCHITECTURES:
        gguf_archs.describe(writer, config)
    else:
        _describe_rope_and_heads(writer, config, model_type, head_dim)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _describe_rope_and_heads(writer, config, model_type: str, head_dim: int) -> None:
    """The Llama family's RoPE keys and head sizes."""
    gguf = _gguf()
    rope = gguf_archs.rope_parameters(config)
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(float(rope["rope_theta"]))
    kind = rope.get("rope_type") or rope.get("type")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind not in (None, "default", "llama3"):
        raise FormatError(f"RoPE scaling '{kind}' is not one quantkit describes to llama.cpp; use --format compressed-tensors")
    if model_type in PERMUTED_ROPE:
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    elif head_dim != config.hidden_size // config.num_attention_heads or model_type.startswith("qwen3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def llama3_rope_freqs(config) -> np.ndarray | None:
    """Llama 3.1's RoPE frequency factors (the `rope_freqs` tensor llama.cpp reads), as its converter computes them."""
    import math

    rope = gguf_archs.rope_parameters(config)
    if (rope.get("rope_type") or rope.get("type")) != "llama3":
        return None
    base = float(rope.get("rope_theta", 10000.0))
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def describe_origin(writer, out_dir: Path) -> None:
    """quantkit's record (quantkit.json: recipe, scheme, versions, source) as `quantkit.*` keys."""
    from quantkit.export import metadata

    info = metadata.read(out_dir)
    if info is None:
        return
    writer.add_string("general.quantized_by", f"quantkit {info['quantkit_version']}")
    writer.add_string("quantkit.recipe", info["recipe"]["name"])
    writer.add_string("quantkit.json", json.dumps(info))
