"""GGML types by name, as `--tensor-type` overrides and budget plans give them: each one's grid (the WeightSpec
quantkit rounds onto, the one `export.gguf.ggml_type` maps back to the type) and its size in bits per weight.

`float` is no GGML type: the tensor stays in full precision (the artifact's dtype), as a recipe's `ignore` leaves
it. Pure data: no torch, no gguf (tests/unit/quant/test_gguf_types.py checks the sizes against gguf's own table).
"""

from __future__ import annotations

from quantkit.grids.schemes import Granularity, QDtype, ScaleDtype, SchemeError, WeightSpec
from quantkit.quant.gguf_mixtures import k_spec

FLOAT = "float"

# name -> (weights per block, bytes per block): gguf's GGML_QUANT_SIZES for the types quantkit writes
BLOCK_BYTES = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "MXFP4": (32, 17),
    "IQ1_S": (256, 50), "IQ1_M": (256, 56), "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74), "IQ2_S": (256, 82),
    "IQ3_XXS": (256, 98), "IQ3_S": (256, 110),
}
# llama.cpp's codebook i-quants (`grids.iq_low`): their grids' sub-scales cover 16 weights here, 32 elsewhere
_CODEBOOKS = {"IQ1_S": 32, "IQ1_M": 16, "IQ2_XXS": 32, "IQ2_XS": 16, "IQ2_S": 16, "IQ3_XXS": 32, "IQ3_S": 32}
# MXFP4: FP4 e2m1 values in blocks of 32 under a power-of-two (E8M0) scale each, the grid of quantkit's MXFP4 recipes
MXFP4 = WeightSpec(QDtype.FLOAT4, Granularity.GROUP, 32, symmetric=True, scale_dtype=ScaleDtype.E8M0)

_BLOCKS_OF_32 = {"Q4_0": (QDtype.INT4, True), "Q4_1": (QDtype.INT4, False), "Q5_0": (QDtype.INT5, True),
                 "Q5_1": (QDtype.INT5, False), "Q8_0": (QDtype.INT8, True)}


def names() -> list[str]:
    """Every name `spec` takes, smallest bits per weight first (then by name), `float` last."""
    return sorted(BLOCK_BYTES, key=lambda name: (bits_per_weight(name), name)) + [FLOAT]


def canonical(name: str) -> str:
    """The type's name as llama.cpp spells it (`q6_k` -> `Q6_K`), or SchemeError naming the ones there are."""
    found = FLOAT if name.strip().lower() == FLOAT else name.strip().upper()
    if found not in BLOCK_BYTES and found != FLOAT:
        raise SchemeError("tensor type", f"'{name}' is not a GGML type quantkit writes; use one of {', '.join(names())}")
    return found


def spec(name: str) -> WeightSpec | None:
    """The grid of GGML type `name` (any case), or None for `float`."""
    name = canonical(name)
    if name == FLOAT:
        return None
    if name in _BLOCKS_OF_32:
        dtype, symmetric = _BLOCKS_OF_32[name]
        return WeightSpec(dtype, Granularity.GROUP, 32, symmetric=symmetric, scale_dtype=ScaleDtype.FLOAT16)
    if name == "MXFP4":
        return MXFP4
    if name in _CODEBOOKS:
        return WeightSpec(QDtype(name.lower()), Granularity.GROUP, _CODEBOOKS[name], symmetric=True, scale_dtype=ScaleDtype.K_QUANT)
    if name.startswith("IQ4"):
        scales = ScaleDtype.FLOAT16 if name == "IQ4_NL" else ScaleDtype.K_QUANT
        return WeightSpec(QDtype.IQ4_NL, Granularity.GROUP, 32, symmetric=True, scale_dtype=scales)
    return k_spec(name)


def bits_per_weight(name: str, float_bits: int = 16) -> float:
    """Bits a weight takes in type `name`, its block's scales included; `float`: `float_bits`."""
    name = canonical(name)
    if name == FLOAT:
        return float(float_bits)
    block, size = BLOCK_BYTES[name]
    return size * 8 / block


def tensor_bytes(name: str, rows: int, columns: int, float_bytes: int = 2) -> int:
    """Bytes of a [rows, columns] tensor in type `name` (its columns whole blocks), or in float."""
    name = canonical(name)
    if name == FLOAT:
        return rows * columns * float_bytes
    block, size = BLOCK_BYTES[name]
    return rows * (columns // block) * size


def fits(name: str, columns: int) -> bool:
    """Whether rows of `columns` weights are whole blocks of type `name`."""
    name = canonical(name)
    return name == FLOAT or columns % BLOCK_BYTES[name][0] == 0
