"""Quantization schemes: what a quantized weight and activation look like.

A scheme is the one definition of a recipe's grid. The quantizer (`algorithms.rtn`), the QAT fake quantizer
and every exporter follow it. This module holds plain data and validation only; it imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum


class QDtype(str, Enum):
    INT2 = "int2"
    INT3 = "int3"
    INT4 = "int4"
    INT5 = "int5"
    INT6 = "int6"
    INT7 = "int7"
    INT8 = "int8"
    FLOAT8 = "float8_e4m3fn"
    FLOAT4 = "float4_e2m1fn"  # FP4 e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (NVFP4, MXFP4)
    IQ4_NL = "iq4_nl"  # llama.cpp's 16 non-linear values (kvalues_iq4nl, -127 .. 113) times a block's scale
    # llama.cpp's codebook i-quants: points of 8 (IQ3: 4) weights from the type's table (grids.iq_codebooks)
    IQ3_XXS = "iq3_xxs"
    IQ3_S = "iq3_s"
    IQ2_XXS = "iq2_xxs"
    IQ2_XS = "iq2_xs"
    IQ2_S = "iq2_s"
    IQ1_S = "iq1_s"
    IQ1_M = "iq1_m"

    @property
    def is_float(self) -> bool:
        return self in (QDtype.FLOAT8, QDtype.FLOAT4)

    @property
    def is_codebook(self) -> bool:
        """Values from a table (llama.cpp's i-quants), a code being an index into it, not a level."""
        return self.value.startswith("iq")

    @property
    def bits(self) -> int:
        if self.is_codebook:
            return int(self.value[2])  # the type's nominal bits (IQ2_XXS: 2.06 a weight in the file)
        return 4 if self is QDtype.FLOAT4 else 8 if self is QDtype.FLOAT8 else int(self.value[3:])

    @property
    def qrange(self) -> tuple[float, float]:
        """The representable range: the full two's-complement range for ints, +-448 for float8 e4m3, +-6 for fp4; a
        table's code indices for a codebook (IQ4), a signed level index (IQ2, IQ3: +-(index + 1)) or a level
        index (IQ1: -1, 0, 1 as 0, 1, 2)."""
        if self.is_codebook:
            return CODEBOOK_CODES.get(self, (0, 15))
        if self.is_float:
            return (-6.0, 6.0) if self is QDtype.FLOAT4 else (-448.0, 448.0)
        return (-(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1)


class Granularity(str, Enum):
    GROUP = "group"  # weights: one scale per `group_size` input columns of each output row; dynamic activations: per group of a token
    CHANNEL = "channel"  # weights: one scale per output row
    BLOCK = "block"  # weights: one scale per `block_shape` tile [rows, columns] (FP8 block-wise, DeepSeek-V3's layout)
    TOKEN = "token"  # dynamic activations: one scale per token, computed at run time
    TENSOR = "tensor"  # static activations: one scale per tensor, from calibration
    HEAD = "head"  # KV cache: one scale per key/value head, from calibration


class ScaleDtype(str, Enum):
    """The grid a scale lies on. Scales are held in the model's dtype for every grid but float32 (the values of
    float8_e4m3fn and float8_e8m0fnu grids are exact in bf16); the exporter stores them in their own dtype."""

    FLOAT32 = "float32"
    MODEL = "model"  # the dtype of the model's weights (bf16 for a bf16 model)
    FLOAT16 = "float16"  # integer grids whose scales GGUF stores as fp16 (Q4_0, Q8_0): the grid is exact in the file
    K_QUANT = "k_quant"  # llama.cpp's K-quants: integer scale (and min) codes per sub-block under fp16 ones per 256 weights
    FLOAT8 = "float8_e4m3fn"  # NVFP4's group scales: under a per-tensor float32 global scale (compressed-tensors), or
    # alone (`global_scale: false`: MLX's nvfp4 mode, chosen and rounded as mx.quantize does, `float_grids.mlx_nvfp4_scales`)
    E8M0 = "float8_e8m0fnu"  # OCP microscaling (MX): a power of two, stored as its biased exponent (uint8)
    MLX_AFFINE = "mlx_affine"  # MLX's affine grid: a scale and a float bias per group (not an integer zero point), both
    # in the model's dtype: value = scale * code + bias, code in [0, 2^bits - 1] (`grids.mlx_grids`)


# The K-quant types by their grid: (weight dtype, sub-block size, symmetric) -> llama.cpp's type name
K_QUANT_TYPES = {
    (QDtype.INT2, 16, False): "Q2_K", (QDtype.INT3, 16, True): "Q3_K", (QDtype.INT4, 32, False): "Q4_K",
    (QDtype.INT5, 32, False): "Q5_K", (QDtype.INT6, 16, True): "Q6_K",
}


# The i-quant types by their grid: (weight dtype, scale dtype) -> llama.cpp's type name, in groups of 32 (a sub-scale
# per 32 weights) but where CODEBOOK_GROUPS says 16; the codebook types below 4 bits have k_quant scales (4-bit,
# IQ1's 3-bit, sub-scales under an fp16 scale per 256)
CODEBOOK_TYPES = {(QDtype.IQ4_NL, ScaleDtype.FLOAT16): "IQ4_NL", (QDtype.IQ4_NL, ScaleDtype.K_QUANT): "IQ4_XS",
                  **{(d, ScaleDtype.K_QUANT): d.name for d in (QDtype.IQ3_XXS, QDtype.IQ3_S, QDtype.IQ2_XXS,
                                                             QDtype.IQ2_XS, QDtype.IQ2_S, QDtype.IQ1_S, QDtype.IQ1_M)}}
CODEBOOK_GROUPS = {"IQ2_XS": 16, "IQ2_S": 16, "IQ1_M": 16}
CODEBOOK_CODES = {QDtype.IQ3_XXS: (-8, 8), QDtype.IQ3_S: (-8, 8), QDtype.IQ2_XXS: (-3, 3), QDtype.IQ2_XS: (-3, 3),
                  QDtype.IQ2_S: (-3, 3), QDtype.IQ1_S: (0, 2), QDtype.IQ1_M: (0, 2)}
SUPER_BLOCK = 256  # weights under one fp16 scale of llama.cpp's K and IQ4_XS types

# MLX's affine grids (`mx.quantize`'s mode "affine"): the bits and group sizes its kernels take
MLX_BITS = (2, 3, 4, 5, 6, 8)
MLX_GROUP_SIZES = (32, 64, 128)


class WeightObserver(str, Enum):
    MINMAX = "minmax"  # the range of each group / channel
    MSE = "mse"  # the clipped range (grid search on a shrink factor) with the least quantization error


class SchemeError(ValueError):
    """A scheme field has a value that is not allowed; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class WeightSpec:
    """How weights are stored. Asymmetric grids use an integer zero point in the quantized dtype's range.

    Float grids: float8_e4m3fn per channel, per `block_shape` tile (FP8 block) or per group of 32 with E8M0 scales
    (MXFP8); float4_e2m1fn per group of 16 with FP8 scales under a per-tensor global scale (NVFP4) or per group of
    32 with E8M0 scales (MXFP4). These are the layouts compressed-tensors writes and vLLM serves. float4_e2m1fn per
    group of 16 with FP8 scales and no global scale is MLX's nvfp4 mode (mx.quantize's choice and rounding)."""

    dtype: QDtype
    granularity: Granularity
    group_size: int | None = None
    symmetric: bool = True
    scale_dtype: ScaleDtype = ScaleDtype.MODEL
    observer: WeightObserver = WeightObserver.MINMAX  # memoryless: computed from the weight itself
    block_shape: tuple[int, int] | None = None  # granularity 'block': [rows, columns] of one tile
    global_scale: bool = False  # a float32 scale per tensor above the group scales (NVFP4)

    def __post_init__(self) -> None:
        if self.observer is WeightObserver.MSE and self.dtype.is_float:
            raise SchemeError("weights.observer", "mse searches integer grids; float weights use minmax")
        if self.granularity in (Granularity.TOKEN, Granularity.TENSOR):
            raise SchemeError("weights.granularity", "weights are quantized per 'group', 'channel' or 'block'")
        if self.granularity is Granularity.GROUP:
            if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 2:
                raise SchemeError("weights.group_size", "granularity 'group' needs an integer group_size >= 2 (e.g. 128)")
        elif self.group_size is not None:
            raise SchemeError("weights.group_size", "only granularity 'group' takes a group_size; remove it or use granularity: group")
        if self.granularity is Granularity.BLOCK:
            shape = self.block_shape
            if not (isinstance(shape, tuple) and len(shape) == 2 and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)):
                raise SchemeError("weights.block_shape", "granularity 'block' needs block_shape: [rows, columns] (e.g. [128, 128])")
            if self.dtype is not QDtype.FLOAT8:
                raise SchemeError("weights.granularity", "block scales are for float8_e4m3fn weights (fp8-block)")
        elif self.block_shape is not None:
            raise SchemeError("weights.block_shape", "only granularity 'block' takes a block_shape")
        if self.dtype.is_float and not self.symmetric:
            raise SchemeError("weights.symmetric", "float weights are symmetric")
        self._check_scale_grid()

    def _check_scale_grid(self) -> None:
        if self.dtype.is_codebook:
            if self.codebook_type is None or self.granularity is not Granularity.GROUP or not self.symmetric:
                if self.dtype is QDtype.IQ4_NL:
                    raise SchemeError("weights.dtype", "iq4_nl values take groups of 32, symmetric, with scale_dtype float16 "
                                      "(IQ4_NL) or k_quant (IQ4_XS: 6-bit sub-scales under an fp16 scale per 256)")
                group = CODEBOOK_GROUPS.get(self.dtype.name, 32)
                raise SchemeError("weights.dtype", f"{self.dtype.value} values take granularity group, group_size {group}, "
                                  "symmetric, scale_dtype k_quant (llama.cpp's sub-scales under an fp16 scale per 256)")
            return
        nvfp4 = ("float4_e2m1fn weights take group_size 16 with scale_dtype float8_e4m3fn (NVFP4: global_scale: true as "
                 "compressed-tensors writes it, false as MLX's nvfp4 mode), or group_size 32 with scale_dtype "
                 "float8_e8m0fnu (MXFP4)")
        if self.scale_dtype is ScaleDtype.FLOAT8:
            if self.dtype is not QDtype.FLOAT4 or self.group_size != 16:
                raise SchemeError("weights.scale_dtype", f"float8_e4m3fn scales are NVFP4's: {nvfp4}")
        elif self.scale_dtype is ScaleDtype.E8M0:
            if not self.dtype.is_float or self.group_size != 32:
                raise SchemeError("weights.scale_dtype", "float8_e8m0fnu (MX) scales are for float4/float8 weights in groups of 32")
        elif self.dtype is QDtype.FLOAT4:
            raise SchemeError("weights.scale_dtype", nvfp4)
        elif self.scale_dtype is ScaleDtype.FLOAT16 and self.dtype.is_float:
            raise SchemeError("weights.scale_dtype", "float16 scales are for integer weights (GGUF's Q4_0 / Q8_0 grids)")
        elif self.scale_dtype is ScaleDtype.MLX_AFFINE:
            if (self.dtype.is_float or self.dtype.bits not in MLX_BITS or self.granularity is not Granularity.GROUP
                    or self.group_size not in MLX_GROUP_SIZES or self.symmetric):
                raise SchemeError("weights.scale_dtype", "mlx_affine scales are MLX's affine grid: int2, int3, int4, int5, "
                                  "int6 or int8 weights in groups of 32, 64 or 128, symmetric: false (a float bias per group)")
            if self.observer is not WeightObserver.MINMAX:
                raise SchemeError("weights.observer", "mlx_affine grids are chosen as mx.quantize chooses them (minmax)")
        elif self.scale_dtype is ScaleDtype.K_QUANT and self.k_quant_type is None:
            kinds = ", ".join(f"{name}: {d.value} group_size {g}{'' if sym else ' asymmetric'}"
                              for (d, g, sym), name in K_QUANT_TYPES.items())
            raise SchemeError("weights.scale_dtype", f"k_quant scales take one of llama.cpp's K grids ({kinds})")
        elif self.dtype is QDtype.FLOAT8 and self.granularity is Granularity.GROUP:
            raise SchemeError("weights.granularity", "float8_e4m3fn weights are per 'channel', per 'block', or in groups of 32 with float8_e8m0fnu scales (MXFP8)")
        if self.global_scale and self.scale_dtype is not ScaleDtype.FLOAT8:
            raise SchemeError("weights.global_scale", "a global scale goes with float8_e4m3fn group scales (NVFP4)")

    @property
    def k_quant_type(self) -> str | None:
        """llama.cpp's K-quant type name (Q4_K, ...) of a k_quant grid, or None."""
        if self.scale_dtype is not ScaleDtype.K_QUANT or self.granularity is not Granularity.GROUP:
            return None
        return K_QUANT_TYPES.get((self.dtype, self.group_size, self.symmetric))

    @property
    def rounding_copies(self) -> float:
        """float32 copies of a weight that rounding it to nearest holds at once, measured on a Llama-3.1-8B layer
        (down_proj, 14336 x 4096: the growth of VmHWM while round to nearest quantizes the layer): an integer grid
        1.5, FP8 3.7, NVFP4 (group and global scales) 11 (the preflight's streamed layer)."""
        return 11.0 if self.global_scale else 3.7 if self.dtype.is_float else 1.5

    @property
    def affine(self) -> bool:
        """Integer values on one scale (and integer zero point) per group or channel, the scale in float32, the
        model's dtype or fp16: a grid whose scale and zero an algorithm may choose (HQQ, AutoRound's clipping)."""
        return (not self.dtype.is_float and not self.dtype.is_codebook and self.granularity in (Granularity.GROUP, Granularity.CHANNEL)
                and self.scale_dtype in (ScaleDtype.FLOAT32, ScaleDtype.MODEL, ScaleDtype.FLOAT16))

    @property
    def learned_rounding(self) -> bool:
        """A grid whose rounding can be learned (AutoRound): an affine one, or a K grid (its steps fixed by llama.cpp's
        search, the rounding onto them tuned)."""
        return self.affine or self.k_quant_type is not None

    def label(self) -> str:
        """The grid in a table cell (`recipes list`): NVFP4 and MX grids by their names, any other as `describe`."""
        return _label(self, self.describe(), self.observer is WeightObserver.MSE)

    @property
    def codebook_type(self) -> str | None:
        """llama.cpp's i-quant type name (IQ4_NL, IQ4_XS, IQ2_XXS ...) of a codebook grid, or None."""
        name = CODEBOOK_TYPES.get((self.dtype, self.scale_dtype))
        if self.granularity is not Granularity.GROUP or self.group_size != CODEBOOK_GROUPS.get(name, 32):
            return None
        return name

    @property
    def block_type(self) -> str | None:
        """llama.cpp's type name of a grid only its block layouts hold (K-quants, i-quants), or None."""
        return self.k_quant_type or self.codebook_type

    @property
    def super_block(self) -> int | None:
        """Weights of a row under one super-block scale (256 for K types and IQ4_XS), or None."""
        return SUPER_BLOCK if self.scale_dtype is ScaleDtype.K_QUANT else None

    @property
    def is_asymmetric(self) -> bool:
        return not self.symmetric

    @property
    def group_size_adjustable(self) -> bool:
        """Whether a smaller group keeps the format (integer grids); NVFP4 and MX fix theirs at 16 and 32."""
        return (self.scale_dtype not in (ScaleDtype.FLOAT8, ScaleDtype.E8M0, ScaleDtype.K_QUANT, ScaleDtype.MLX_AFFINE)
                and not self.dtype.is_codebook)

    @property
    def sixteen_bit(self) -> bool:
        """FP4 and MX weights load and run in 16 bits: a float32 model's artifact is bfloat16
        (`finalize.artifact_dtype`), and QAT trains a float32 model on that bfloat16 grid."""
        return self.dtype is QDtype.FLOAT4 or self.scale_dtype is ScaleDtype.E8M0

    def scale_count(self, rows: int, cols: int) -> int:
        if self.granularity is Granularity.GROUP:
            return rows * (cols // self.group_size)
        if self.granularity is Granularity.BLOCK:
            return -(-rows // self.block_shape[0]) * -(-cols // self.block_shape[1])
        return rows

    def qparam_bytes(self, rows: int, cols: int, element_size: int) -> int:
        """Bytes of the scales as stored (float32, the model's `element_size`, or one byte for FP8 / E8M0 grids), the
        int8 zero points and the float32 global scale of a [rows, cols] weight; MLX's affine grid a scale and a bias
        in the model's dtype per group."""
        if self.scale_dtype is ScaleDtype.MLX_AFFINE:
            return self.scale_count(rows, cols) * 2 * element_size
        scale = {ScaleDtype.FLOAT32: 4, ScaleDtype.MODEL: element_size, ScaleDtype.FLOAT16: 2}.get(self.scale_dtype, 1)
        return self.scale_count(rows, cols) * (scale + (0 if self.symmetric else 1)) + (4 if self.global_scale else 0)

    def describe(self) -> str:
        if self.granularity is Granularity.GROUP:
            grain = f"g{self.group_size}"
        elif self.granularity is Granularity.BLOCK:
            grain = f"block {self.block_shape[0]}x{self.block_shape[1]}"
        else:
            grain = "channel"
        scales = {ScaleDtype.FLOAT8: " fp8 scales + global" if self.global_scale else " fp8 scales mlx",
                  ScaleDtype.E8M0: " e8m0 scales"}.get(self.scale_dtype, "")
        if self.k_quant_type:
            return f"{self.k_quant_type.lower()} k-quant"  # its grid is the type's (K_QUANT_TYPES)
        if self.codebook_type:
            return f"{self.codebook_type.lower()} i-quant"  # CODEBOOK_TYPES
        mse = " mse" if self.observer is WeightObserver.MSE else ""
        if self.scale_dtype is ScaleDtype.MLX_AFFINE:
            return f"{_short(self.dtype)} {grain} mlx{mse}"
        return f"{_short(self.dtype)} {grain}{scales}{'' if self.symmetric else ' asym'}{mse}"


@dataclass(frozen=True)
class ActivationSpec:
    """How activations are quantized: dynamic (scales computed at run time, per token or per group of a token's
    features), or static (one symmetric scale per tensor, measured on calibration data; `granularity: tensor`).
    NVFP4 activations are dynamic per group of 16 with FP8 scales under a static per-tensor global scale
    (`global_scale: true`, calibrated); MXFP4 activations are dynamic per group of 32 with E8M0 scales."""

    dtype: QDtype
    granularity: Granularity = Granularity.TOKEN
    symmetric: bool = True
    dynamic: bool = True
    observer: str = "static_minmax"  # static scales: static_minmax (min/max over all data) or minmax (mean of batch ranges)
    group_size: int | None = None  # granularity 'group'
    scale_dtype: ScaleDtype | None = None  # group scales' grid: None (the activation's dtype), float8_e4m3fn, float8_e8m0fnu
    global_scale: bool = False  # a static per-tensor global scale from calibration (NVFP4)

    def __post_init__(self) -> None:
        if self.observer not in ("static_minmax", "minmax"):
            raise SchemeError("activations.observer", f"'{self.observer}' is not allowed; allowed: static_minmax, minmax")
        if self.dtype not in (QDtype.INT8, QDtype.FLOAT8, QDtype.FLOAT4):
            raise SchemeError("activations.dtype", "activations are int8, float8_e4m3fn or float4_e2m1fn")
        allowed = (Granularity.TOKEN, Granularity.GROUP) if self.dynamic else (Granularity.TENSOR,)
        if self.granularity not in allowed:
            kinds = " or ".join(f"'{g.value}'" for g in allowed)
            raise SchemeError("activations.granularity", f"{'dynamic' if self.dynamic else 'static'} activations are quantized per {kinds}")
        if self.granularity is Granularity.GROUP:
            if not self.dtype.is_float:
                raise SchemeError("activations.granularity", "per-group activations are float8_e4m3fn or float4_e2m1fn")
            if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 2:
                raise SchemeError("activations.group_size", "granularity 'group' needs an integer group_size (e.g. 128)")
        elif self.group_size is not None:
            raise SchemeError("activations.group_size", "only granularity 'group' takes a group_size")
        if self.dtype is QDtype.FLOAT4:
            nvfp4 = self.group_size == 16 and self.scale_dtype is ScaleDtype.FLOAT8 and self.global_scale
            mxfp4 = self.group_size == 32 and self.scale_dtype is ScaleDtype.E8M0 and not self.global_scale
            if self.granularity is not Granularity.GROUP or not (nvfp4 or mxfp4):
                raise SchemeError("activations", "float4_e2m1fn activations are dynamic per group: group_size 16 with scale_dtype "
                                  "float8_e4m3fn and global_scale: true (NVFP4), or group_size 32 with scale_dtype float8_e8m0fnu (MXFP4)")
        elif self.scale_dtype not in (None, ScaleDtype.E8M0) or self.global_scale:
            raise SchemeError("activations.scale_dtype", "float8_e4m3fn scales and global scales are for float4_e2m1fn activations (NVFP4)")
        elif self.scale_dtype is ScaleDtype.E8M0 and not (self.dtype is QDtype.FLOAT8 and self.group_size == 32):
            raise SchemeError("activations.scale_dtype", "float8_e8m0fnu scales are for float activations in groups of 32 (MX)")
        if not self.dynamic and not self.symmetric:
            raise SchemeError("activations.symmetric", "static activation scales are symmetric (per tensor)")
        if self.dtype.is_float and not self.symmetric:
            raise SchemeError("activations.symmetric", "float activations are symmetric")

    def label(self) -> str:
        """The grid in a table cell (`recipes list`): NVFP4 and MX grids by their names, any other as `describe`."""
        return _label(self, self.describe(), False)

    @property
    def calibrated(self) -> bool:
        """Whether calibration data sets a scale: static scales, or NVFP4's global scale."""
        return not self.dynamic or self.global_scale

    def describe(self) -> str:
        grain = f"g{self.group_size}" if self.granularity is Granularity.GROUP else self.granularity.value
        scales = {ScaleDtype.FLOAT8: " fp8 scales + calibrated global", ScaleDtype.E8M0: " e8m0 scales"}.get(self.scale_dtype, "")
        return f"{_short(self.dtype)} {grain}{scales}{'' if self.symmetric else ' asym'}"


def _label(spec, described: str, mse: bool) -> str:
    family = {ScaleDtype.FLOAT8: "nv", ScaleDtype.E8M0: "mx"}.get(spec.scale_dtype)
    if family is None:
        return described
    element = described.split(" ", 1)[0]  # fp4 or fp8
    mlx = " mlx" if spec.scale_dtype is ScaleDtype.FLOAT8 and not spec.global_scale else ""  # MLX's nvfp4: no global scale
    return f"{family}{element}{mlx}{'' if spec.symmetric else ' asym'}{' mse' if mse else ''}"


@dataclass(frozen=True)
class QuantScheme:
    weights: WeightSpec
    activations: ActivationSpec | None = None

    def with_group_size(self, group_size: int) -> QuantScheme:
        return replace(self, weights=replace(self.weights, group_size=group_size))

    def describe(self) -> str:
        kind = "dynamic" if self.activations and self.activations.dynamic else "static"
        acts = f"{kind} {self.activations.describe()}" if self.activations else "16-bit"
        return f"weights {self.weights.describe()}, activations {acts}"


@dataclass(frozen=True)
class KVCacheSpec:
    """How the attention's key and value cache is quantized (vLLM's `--kv-cache-dtype fp8`): FP8 e4m3 with
    static scales measured on calibration data, one for all keys and one for all values of each attention
    (`tensor`) or one per key/value head (`head`), on the keys after RoPE as the cache holds them."""

    dtype: QDtype = QDtype.FLOAT8
    granularity: Granularity = Granularity.TENSOR
    observer: str = "static_minmax"  # static_minmax (min/max over all data) or minmax (mean of batch ranges)

    def __post_init__(self) -> None:
        if self.dtype is not QDtype.FLOAT8:
            raise SchemeError("kv_cache.dtype", "the KV cache is float8_e4m3fn (the FP8 cache vLLM serves)")
        if self.granularity not in (Granularity.TENSOR, Granularity.HEAD):
            raise SchemeError("kv_cache.granularity", "KV cache scales are per 'tensor' or per 'head'")
        if self.observer not in ("static_minmax", "minmax"):
            raise SchemeError("kv_cache.observer", f"'{self.observer}' is not allowed; allowed: static_minmax, minmax")

    def describe(self) -> str:
        return f"{_short(self.dtype)} per {self.granularity.value}"


def _short(dtype: QDtype) -> str:
    return {QDtype.FLOAT8: "fp8", QDtype.FLOAT4: "fp4"}.get(dtype, dtype.value)
